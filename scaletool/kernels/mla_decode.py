"""Attention of one new query per sequence over an MLA latent cache (the absorbed decode step).

Each head h scores its absorbed query against the shared cache,
``s[b,h,t] = (q_lat[b,h]·c_kv[b,t] + q_pe[b,h]·k_pe[b,t]) · scale``, and returns the
softmax-weighted sum of the latents ``Σ_t p[b,h,t] · c_kv[b,t]`` (W_UV is applied by the caller).

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
"""
from __future__ import annotations

import functools

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


def latent_attention_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q_lat (B,H,c), q_pe (B,H,r) over c_kv (B,S,c), k_pe (B,S,r) -> (B,H,c); softmax in fp32."""
    s = torch.einsum("bhc,bsc->bhs", q_lat, c_kv).float() + torch.einsum("bhr,bsr->bhs", q_pe, k_pe).float()
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
                     scale: float, kernel: str = "auto") -> torch.Tensor:
    """Dispatch to the fused Triton kernel or the torch reference (see the module docstring)."""
    unsupported = kernel == "auto" and triton_supports(c_kv.device, c_kv.dtype, c_kv.shape[-1], k_pe.shape[-1])
    if kernel == "torch" or unsupported:
        return latent_attention_reference(q_lat, q_pe, c_kv, k_pe, scale)
    return latent_attention_triton(q_lat, q_pe, c_kv, k_pe, scale)


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Enough programs to fill the GPU a few times over (split-KV exists for small batches)."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def latent_attention_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """The fused split-KV kernel; same contract as :func:`latent_attention_reference`."""
    if triton is None:
        raise RuntimeError("the Triton MLA decode kernel needs the triton package")
    B, H, C = q_lat.shape
    S, R = c_kv.shape[1], k_pe.shape[-1]
    q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    head_blocks = triton.cdiv(H, _BLOCK_H)
    # Split the sequence so B·splits·head_blocks programs cover the GPU; splits are multiples of the
    # largest tile so no split is empty (an empty one would have no softmax mass to merge).
    n_splits = max(1, min(triton.cdiv(_target_programs(c_kv.device), B * head_blocks), triton.cdiv(S, 256)))
    split_len = triton.cdiv(triton.cdiv(S, n_splits), 64) * 64
    n_splits = triton.cdiv(S, split_len)
    o_part = torch.empty(B, n_splits, H, C, device=c_kv.device, dtype=torch.float32)
    lse_part = torch.empty(B, n_splits, H, device=c_kv.device, dtype=torch.float32)
    _latent_decode_kernel[(B, n_splits, head_blocks)](
        q_lat, q_pe, c_kv, k_pe, o_part, lse_part, H, S, split_len, scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        c_kv.stride(0), c_kv.stride(1), k_pe.stride(0), k_pe.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        C=C, R=R, BLOCK_H=_BLOCK_H)
    # Merge the splits: each holds a softmax normalised over its own keys and its log2-sum-exp.
    w = torch.exp2(lse_part - lse_part.amax(1, keepdim=True))  # (B, splits, H)
    out = (o_part * w[..., None]).sum(1) / w.sum(1)[..., None]  # (B, H, C)
    return out.to(q_lat.dtype)


if triton is not None:
    @triton.autotune(
        configs=[triton.Config({"BLOCK_S": bs}, num_warps=w, num_stages=st)
                 for bs, w, st in ((32, 4, 2), (64, 4, 2), (64, 8, 2), (32, 4, 3), (64, 4, 3))],
        key=["C", "R"])
    @triton.jit
    def _latent_decode_kernel(q_lat, q_pe, c_kv, k_pe, o_part, lse_part, H, S, split_len, sm_scale,
                              s_qb, s_qh, s_pb, s_ph, s_cb, s_cs, s_kb, s_ks, s_ob, s_os, s_oh, s_lb, s_ls,
                              C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)  # batch offsets pass 2^31 elements in large caches
        sp, hb = tl.program_id(1), tl.program_id(2)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_c = tl.arange(0, C)
        offs_r = tl.arange(0, R)
        h_ok = offs_h < H
        q = tl.load(q_lat + b * s_qb + offs_h[:, None] * s_qh + offs_c[None, :], mask=h_ok[:, None], other=0.0)
        qp = tl.load(q_pe + b * s_pb + offs_h[:, None] * s_ph + offs_r[None, :], mask=h_ok[:, None], other=0.0)
        start = sp * split_len
        end = tl.minimum(start + split_len, S)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, C], tl.float32)
        qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 is the hardware instruction
        for s0 in range(start, end, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_ok = offs_s < end
            kv = tl.load(c_kv + b * s_cb + offs_s[:, None] * s_cs + offs_c[None, :], mask=s_ok[:, None],
                         other=0.0)  # (BLOCK_S, C): read once, used for scores and for the output
            pe = tl.load(k_pe + b * s_kb + offs_s[:, None] * s_ks + offs_r[None, :], mask=s_ok[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(kv)) + tl.dot(qp, tl.trans(pe))  # (BLOCK_H, BLOCK_S) fp32
            scores = tl.where(s_ok[None, :], scores * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
            m_i = m_new
        out_ptr = o_part + b * s_ob + sp * s_os + offs_h[:, None] * s_oh + offs_c[None, :]
        tl.store(out_ptr, acc / l_i[:, None], mask=h_ok[:, None])
        tl.store(lse_part + b * s_lb + sp * s_ls + offs_h, m_i + tl.log2(l_i), mask=h_ok)
