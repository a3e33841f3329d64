"""Attention of one new query per sequence over an MLA latent cache (the absorbed decode step).

Each head h scores its absorbed query against the shared cache,
``s[b,h,t] = (q_lat[b,h]·c_kv[b,t] + q_pe[b,h]·k_pe[b,t]) · scale`` for ``t < length[b]``, and
returns the softmax-weighted sum of the latents ``Σ_t p[b,h,t] · c_kv[b,t]`` (W_UV is applied by
the caller). ``lengths`` (a device tensor, or None for "every cached position") is what lets a
CUDA graph run the step over a static ``max_len`` cache: the length lives on the device, so the
captured launch stays the same while the sequence grows.

Two implementations, selected by ``kernel``:

- ``torch``: the reference, two batched matmuls (scores, then the weighted sum) with an fp32
  softmax between them. Plain and exact, but it reads the whole cache twice per step.
- ``triton``: a fused split-KV kernel (flash-decoding, as FlashMLA does for DeepSeek): each program
  loads a tile of c_kv and k_pe once, scores all heads of one sequence against it (the heads share
  the latent, so one tile serves 16 of them), keeps an online softmax and accumulates the weighted
  latents; a small torch reduction then merges the splits by their log-sum-exp. The cache is read
  once per step, which is what makes the step run near HBM bandwidth.

``auto`` takes Triton on CUDA for 16-bit caches whose latent and RoPE widths are powers of two
(``tl.arange`` and ``tl.dot`` need them, ≥ 16), else the reference. Triton is imported lazily and
guarded: a CPU box without it uses the reference.

Tile shapes, warps, pipeline depth and the split count are chosen per shape by
:func:`choose_config` (see its docstring for the reasoning); there is no autotuner, because an
autotuner keyed on the latent width alone (as this kernel once was) keeps whatever config won at the
first shape it saw (a 4K-context warm-up) for every later one, and one keyed on the batch and
length re-tunes at every new context, which a CUDA graph capture cannot do.
``recipes/benchmarks/decode_bandwidth.py`` sweeps these choices on a card.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch reference serves
    triton = None

KERNELS = ("auto", "triton", "torch")
_BLOCK_H = 16  # heads per program: tl.dot needs M >= 16; smaller head counts are padded (masked)


def triton_available() -> bool:
    return triton is not None and torch.cuda.is_available()


def _key_mask(lengths: torch.Tensor | None, B: int, S: int, device: torch.device) -> torch.Tensor | None:
    """(B, S) True where position t < lengths[b]; None when every position counts."""
    if lengths is None:
        return None
    return torch.arange(S, device=device)[None, :] < lengths.reshape(-1, 1).expand(B, 1)


def latent_attention_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                               scale: float, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """q_lat (B,H,c), q_pe (B,H,r) over c_kv (B,S,c), k_pe (B,S,r) -> (B,H,c); softmax in fp32.

    ``lengths``: None, or an integer tensor of shape (B,), (1,) or () with the valid prefix length.
    """
    s = torch.einsum("bhc,bsc->bhs", q_lat, c_kv).float() + torch.einsum("bhr,bsr->bhs", q_pe, k_pe).float()
    mask = _key_mask(lengths, c_kv.shape[0], c_kv.shape[1], c_kv.device)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = (s * scale).softmax(-1).to(c_kv.dtype)  # (B, H, S)
    return torch.einsum("bhs,bsc->bhc", p, c_kv)


def triton_supports(device: torch.device, dtype: torch.dtype, kv_lora_rank: int, rope_dim: int) -> str | None:
    """None when the fused kernel can read such a latent cache, else the reason it cannot."""
    if not triton_available():
        return "Triton or CUDA is not available"
    if torch.device(device).type != "cuda":
        return "the cache is not on a CUDA device"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the kernel is written for 16-bit caches, got {dtype}"
    for name, n in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", rope_dim)):
        if n < 16 or n & (n - 1):
            return f"{name}={n} is not a power of two >= 16"
    return None


def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     scale: float, kernel: str = "auto", lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch to the fused Triton kernel or the torch reference (see the module docstring)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    unsupported = kernel == "auto" and triton_supports(c_kv.device, c_kv.dtype, c_kv.shape[-1], k_pe.shape[-1])
    if kernel == "torch" or unsupported:
        return latent_attention_reference(q_lat, q_pe, c_kv, k_pe, scale, lengths)
    return latent_attention_triton(q_lat, q_pe, c_kv, k_pe, scale, lengths)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the fused kernel for one call.

    ``block_s``: cached positions per loop iteration (one tile of block_s × (C + R) is loaded per
    iteration); ``num_warps``, ``num_stages``: Triton's warps per program and software-pipelining
    depth (tiles in flight); ``programs_per_sm``: the split-KV target, splits are added until
    B · splits · head_blocks reaches this many programs per SM; ``min_split``: no split shorter
    than this many positions (each split costs a query load and a (H, C) fp32 partial written and
    merged, about 5% of a 1,024-position split's cache bytes at C = 512).
    """

    block_s: int = 64
    num_warps: int = 8
    num_stages: int = 2
    programs_per_sm: float = 4.0
    min_split: int = 256

    def splits(self, B: int, H: int, S: int, sms: int) -> tuple[int, int]:
        """(number of splits, positions per split) for a (B, H, S) call on a card with ``sms`` SMs."""
        want = _cdiv(int(self.programs_per_sm * sms), B * _cdiv(H, _BLOCK_H))
        n = max(1, min(want, S // self.min_split))
        # split lengths are whole tiles so no split but the last is ragged and none is empty
        split_len = _cdiv(_cdiv(S, n), self.block_s) * self.block_s
        return _cdiv(S, split_len), split_len


def choose_config(B: int, H: int, S: int, device: torch.device) -> KernelConfig:
    """The launch shape for a (B, H, S) call on ``device``; the defaults' reasoning, for H100 and H200.

    Both cards have 132 SMs with 228 KB of shared memory each and differ in bandwidth (H100 SXM
    3.35 TB/s, H200 4.8 TB/s), so the same tiles serve both; the H200 needs about 1.4× more bytes in
    flight (Little's law at ~0.7 µs DRAM latency: ~2.3 MB on H100, ~3.4 MB on H200, i.e. 18-26 KB per
    SM), which a 64-position tile (64 × 576 × 2 B = 72 KB) covers with one program per SM already.
    The kernel is not purely memory-bound: per cached token it does 2 × 16 heads × 512 × 2 ≈ 33 kFLOP
    of mma.sync work (M = 16 rows: Triton uses wgmma only from M = 64) against 1,152 bytes, ~29 FLOP
    per byte, so at 4.8 TB/s it needs ~140 TFLOP/s of dense bf16 and the issue rate of the warps
    matters: 8 warps spread the (16 × 512) fp32 accumulator at 32 registers per thread and keep
    every SM sub-partition issuing, where 4 warps leave one per sub-partition. Two pipeline stages
    (2 × 72 KB) fit beside that; three would leave no room for a second program per SM.
    Short contexts at small batch give few programs, so the sequence is split until there are about
    4 programs per SM (the tail wave then costs < 25%), but no split shorter than 256 positions.
    ``recipes/benchmarks/decode_bandwidth.py`` measures these choices against the alternatives.
    """
    return KernelConfig()


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def latent_attention_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                            scale: float, lengths: torch.Tensor | None = None,
                            config: KernelConfig | None = None) -> torch.Tensor:
    """The fused split-KV kernel; same contract as :func:`latent_attention_reference`.

    With ``lengths`` the grid is sized for the full S (static under a CUDA graph) and programs
    whose split starts past a sequence's length return at once. No host synchronisation.
    """
    if triton is None:
        raise RuntimeError("the Triton MLA decode kernel needs the triton package")
    B, H, C = q_lat.shape
    S, R = c_kv.shape[1], k_pe.shape[-1]
    q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    cfg = config or choose_config(B, H, S, c_kv.device)
    n_splits, split_len = cfg.splits(B, H, S, _sm_count(c_kv.device))
    o_part = torch.empty(B, n_splits, H, C, device=c_kv.device, dtype=torch.float32)
    lse_part = torch.empty(B, n_splits, H, device=c_kv.device, dtype=torch.float32)
    if lengths is None:
        len_ptr, len_stride = lse_part, 0  # unused: HAS_LENGTHS is off
    else:
        len_ptr = lengths.reshape(-1)
        len_stride = 0 if len_ptr.numel() == 1 else 1
    _latent_decode_kernel[(B, n_splits, triton.cdiv(H, _BLOCK_H))](
        q_lat, q_pe, c_kv, k_pe, o_part, lse_part, len_ptr, len_stride, H, S, split_len, scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        c_kv.stride(0), c_kv.stride(1), k_pe.stride(0), k_pe.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        C=C, R=R, BLOCK_H=_BLOCK_H, BLOCK_S=cfg.block_s, HAS_LENGTHS=lengths is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return merge_splits(o_part, lse_part).to(q_lat.dtype)


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor) -> torch.Tensor:
    """Combine per-split outputs (B, splits, H, C), each softmax-normalised over its own keys, by
    their log2-sum-exp (B, splits, H); an empty split carries lse = -inf and weighs nothing."""
    w = torch.exp2(lse_part - lse_part.amax(1, keepdim=True))  # (B, splits, H); split 0 is never empty
    return (o_part * w[..., None]).sum(1) / w.sum(1)[..., None]  # (B, H, C)


if triton is not None:
    @triton.jit
    def _latent_decode_kernel(q_lat, q_pe, c_kv, k_pe, o_part, lse_part, lengths, s_len, H, S, split_len, sm_scale,
                              s_qb, s_qh, s_pb, s_ph, s_cb, s_cs, s_kb, s_ks, s_ob, s_os, s_oh, s_lb, s_ls,
                              C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                              HAS_LENGTHS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)  # batch offsets pass 2^31 elements in large caches
        sp, hb = tl.program_id(1), tl.program_id(2)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_c = tl.arange(0, C)
        offs_r = tl.arange(0, R)
        h_ok = offs_h < H
        if HAS_LENGTHS:
            length = tl.minimum(tl.load(lengths + b * s_len).to(tl.int32), S)
        else:
            length = S
        start = sp * split_len
        end = tl.minimum(start + split_len, length)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, C], tl.float32)
        q = tl.load(q_lat + b * s_qb + offs_h[:, None] * s_qh + offs_c[None, :], mask=h_ok[:, None], other=0.0)
        qp = tl.load(q_pe + b * s_pb + offs_h[:, None] * s_ph + offs_r[None, :], mask=h_ok[:, None], other=0.0)
        qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 is the hardware instruction
        for s0 in range(start, end, BLOCK_S):  # empty for a split past the sequence's length
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_ok = offs_s < end
            kv = tl.load(c_kv + b * s_cb + offs_s[:, None] * s_cs + offs_c[None, :], mask=s_ok[:, None],
                         other=0.0)  # (BLOCK_S, C): read once, used for scores and for the output
            pe = tl.load(k_pe + b * s_kb + offs_s[:, None] * s_ks + offs_r[None, :], mask=s_ok[:, None],
                         other=0.0)
            scores = tl.dot(q, tl.trans(kv)) + tl.dot(qp, tl.trans(pe))  # (BLOCK_H, BLOCK_S) fp32
            scores = tl.where(s_ok[None, :], scores * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
            m_i = m_new
        filled = l_i > 0
        out_ptr = o_part + b * s_ob + sp * s_os + offs_h[:, None] * s_oh + offs_c[None, :]
        tl.store(out_ptr, acc / tl.where(filled, l_i, 1.0)[:, None], mask=h_ok[:, None])
        lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
        tl.store(lse_part + b * s_lb + sp * s_ls + offs_h, lse, mask=h_ok)
