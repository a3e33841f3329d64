"""Attention of one new query per sequence over an MLA latent cache (the absorbed decode step).

Each head scores ``(q_lat·c_kv + q_pe·k_pe) · scale`` over ``t < length[b]`` and returns the
softmax-weighted sum of the latents, or, given ``w_uv`` (H, V, C), that sum mapped to each head's values
(``y_lat · W_UVᵀ``). ``lengths`` lives on the device, so a CUDA graph can replay the step over a static
``max_len`` cache while the sequence grows.

``kernel``: ``torch`` is the reference (two batched matmuls, fp32 softmax); ``triton`` a fused split-KV
kernel (flash-decoding) that reads the cache once per step, all heads of a sequence sharing each tile,
with a one-launch merge of the splits (:func:`merge_splits` is its reference); at a few sequences
(:data:`MERGE_UP_MAX_ROWS`) with ``w_uv`` the merge applies W_UV itself, one launch for two. ``auto`` takes Triton on
CUDA for 16-bit caches with power-of-two widths, else the reference. Configurations come from
:func:`choose_config` per shape, not an autotuner, which would keep its first shape's choice or
re-tune at every context (impossible under graph capture): the committed table of tuned
configurations (:mod:`.mla_tuning`) where it has this card and shape, else a heuristic.

The kernel is also the custom operator ``torch.ops.scaletool.mla_decode`` (with a fake
implementation for shapes), which :func:`latent_attention` calls while ``torch.compile`` traces, so
a compiled decode step keeps the kernel inside one graph instead of breaking around it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from scaletool.kernels import mla_tuning, pdl

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


def up_project(y_lat: torch.Tensor, w_uv: torch.Tensor | None) -> torch.Tensor:
    """y_lat (B, H, C) -> (B, H, V) through w_uv (H, V, C); y_lat itself without w_uv. One batched GEMM over
    the heads writing the (B, H, V) result in place (its output strides; no transposed copy after it)."""
    if w_uv is None:
        return y_lat
    if torch.compiler.is_compiling():  # the tracer's functional form
        return torch.einsum("bhc,hvc->bhv", y_lat, w_uv).contiguous()
    out = y_lat.new_empty(y_lat.shape[0], y_lat.shape[1], w_uv.shape[1])
    torch.bmm(y_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out


def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     scale: float, kernel: str = "auto", lengths: torch.Tensor | None = None,
                     w_uv: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch to the fused Triton kernel or the torch reference (see the module docstring)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    unsupported = kernel == "auto" and triton_supports(c_kv.device, c_kv.dtype, c_kv.shape[-1], k_pe.shape[-1])
    if kernel == "torch" or unsupported:
        return up_project(latent_attention_reference(q_lat, q_pe, c_kv, k_pe, scale, lengths), w_uv)
    if torch.compiler.is_compiling():  # an opaque operator to the tracer: no graph break around the kernel
        return torch.ops.scaletool.mla_decode(q_lat, q_pe, c_kv, k_pe, scale, lengths, w_uv)
    return latent_attention_triton(q_lat, q_pe, c_kv, k_pe, scale, lengths, w_uv=w_uv)


def _mla_decode_op(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, scale: float,
                   lengths: torch.Tensor | None, w_uv: torch.Tensor | None = None) -> torch.Tensor:
    if triton_supports(c_kv.device, c_kv.dtype, c_kv.shape[-1], k_pe.shape[-1]) is None:
        return latent_attention_triton(q_lat, q_pe, c_kv, k_pe, scale, lengths, w_uv=w_uv)
    return up_project(latent_attention_reference(q_lat, q_pe, c_kv, k_pe, scale, lengths), w_uv)  # CPUs


# The schema is spelled out: annotations are strings under ``from __future__ import annotations``.
mla_decode_op = torch.library.custom_op(
    "scaletool::mla_decode", _mla_decode_op, mutates_args=(),
    schema="(Tensor q_lat, Tensor q_pe, Tensor c_kv, Tensor k_pe, float scale, Tensor? lengths, "
           "Tensor? w_uv=None) -> Tensor")


@mla_decode_op.register_fake
def _(q_lat, q_pe, c_kv, k_pe, scale, lengths, w_uv=None):
    B, H, C = q_lat.shape
    return q_lat.new_empty((B, H, C if w_uv is None else w_uv.shape[1]))


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope (B, H, nope) through each head's W_UK (H, nope, C) -> q_lat (B, H, C): the query absorbed into
    the latent space. At up to :data:`MERGE_UP_MAX_ROWS` sequences on CUDA one Triton launch (each program
    loads its slice of W_UK before it waits for the query under :mod:`.pdl`), else one batched GEMM over the
    heads; inside ``torch.compile`` the operator ``scaletool::mla_absorb_q``. Either way the result is the
    (B, H, C) view of an (H, B, C) tensor, the batched GEMM's own layout: the attention kernel reads it
    through its strides, where a contiguous copy cost a read and a write of B·H·C values per layer."""
    if torch.compiler.is_compiling():
        return torch.ops.scaletool.mla_absorb_q(q_nope, w_uk).transpose(0, 1)
    return _absorb_q_op(q_nope, w_uk).transpose(0, 1)


def _absorb_q_op(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_lat as a contiguous (H, B, C) tensor."""
    B, H, N = q_nope.shape
    if (triton_available() and q_nope.is_cuda and B <= MERGE_UP_MAX_ROWS and q_nope.dtype == w_uk.dtype
            and q_nope.dtype in (torch.bfloat16, torch.float16) and w_uk.stride(-1) == 1 and q_nope.stride(-1) == 1):
        return absorb_query_triton(q_nope, w_uk).transpose(0, 1)
    return torch.bmm(q_nope.transpose(0, 1), w_uk)  # (H, B, C)


mla_absorb_q_op = torch.library.custom_op("scaletool::mla_absorb_q", _absorb_q_op, mutates_args=(),
                                          schema="(Tensor q_nope, Tensor w_uk) -> Tensor")  # (H, B, C)


@mla_absorb_q_op.register_fake
def _(q_nope, w_uk):
    return q_nope.new_empty((q_nope.shape[1], q_nope.shape[0], w_uk.shape[-1]))


_ABSORB_BLOCK_C = 64  # latent channels per program: H·C/64 programs (128 for 16 heads of 512)


def absorb_query_triton(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """:func:`absorb_query` in one launch: programs over (head, 64 latent channels), each holding its
    (nope, 64) slice of W_UK and looping over the sequences."""
    B, H, N = q_nope.shape
    C = w_uk.shape[-1]
    out = torch.empty(H, B, C, device=q_nope.device, dtype=q_nope.dtype).transpose(0, 1)  # absorb_query's layout
    block_c = min(_ABSORB_BLOCK_C, triton.next_power_of_2(C))
    _absorb_q_kernel[(H, triton.cdiv(C, block_c))](
        q_nope, w_uk, out, B, N, C, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1),
        out.stride(0), out.stride(1), N_P2=triton.next_power_of_2(N), BLOCK_C=block_c, num_warps=4,
        **pdl.launch(q_nope.device))
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the fused kernel for one call.

    ``block_s``: cached positions per loop iteration (one tile of block_s × (C + R) is loaded per
    iteration); ``num_warps``, ``num_stages``: Triton's warps per program and software-pipelining
    depth (tiles in flight); ``programs_per_sm``: the split-KV target, the sequence is split into
    as many pieces as fit B · splits · head_blocks within this many programs per SM (never past it:
    a second, mostly empty wave costs more than the splits gain); ``n_splits``: a fixed split count
    instead (what a benchmark sweeps); ``min_split``, ``max_splits``: no split shorter than
    ``min_split`` positions and no more than ``max_splits`` of them (each split costs a query load
    and an (H, C) fp32 partial written and merged: 32 KB at H = 16, C = 512, against 73 KB of cache
    in a 64-position split, so short splits pay only where the batch is too small to fill the card
    and latency, not bytes, sets the time). Split lengths are rounded up to whole tiles.
    ``direct``: where a call ends up with one split, the kernel writes the output itself in the
    cache's dtype, with no fp32 partial and no merge launch (large batches at short contexts).
    ``max_registers``: a cap on each thread's registers (Triton's ``maxnreg``), so more programs fit an SM
    (the kernel otherwise takes 255, two 4-warp programs per SM) at the cost of spills.
    """

    block_s: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: float = 2.0
    min_split: int = 64
    max_splits: int = 128
    n_splits: int | None = None
    direct: bool = False
    max_registers: int | None = None

    def splits(self, B: int, H: int, S: int, sms: int) -> tuple[int, int]:
        """(number of splits, positions per split) for a (B, H, S) call on a card with ``sms`` SMs.

        Split lengths are whole tiles, so no split but the last is ragged and none is empty. Where the
        merge applies W_UV (at most :data:`MERGE_UP_MAX_ROWS` sequences), whose cost hardly grows with the
        split count, a sequence a few positions past n whole-tile splits (a static decode cache: 4,131
        positions for a 4,096 context) keeps the n splits' length and adds one short split, instead of
        rounding every split up by a tile (n = 64: 65 one-tile splits, not 33 of two tiles)."""
        want = self.n_splits or int(self.programs_per_sm * sms) // (B * _cdiv(H, _BLOCK_H))
        n = max(1, min(want, self.max_splits, S // self.min_split))
        split_len = _cdiv(_cdiv(S, n), self.block_s) * self.block_s
        tight = S // n // self.block_s * self.block_s
        if 1 < n and B <= MERGE_UP_MAX_ROWS and tight and _cdiv(S, tight) <= n + 1:
            split_len = tight
        return _cdiv(S, split_len), split_len


def choose_config(B: int, H: int, S: int, device: torch.device, C: int = 512, R: int = 64,
                  dtype: torch.dtype = torch.bfloat16) -> KernelConfig:
    """The launch shape for a (B, H, S) call on ``device``: the tuned table's entry for this card and
    shape (:func:`.mla_tuning.lookup`, nearest context then batch) when it has one, else one fixed
    shape (4 warps, 64-position tiles, 2 stages) whose split count follows (B, S) through
    :meth:`KernelConfig.splits`; no autotuner, whose first-shape pick was the slow case."""
    return _choose_config(B, H, S, torch.device(device), C, R, dtype)


@functools.cache
def _choose_config(B: int, H: int, S: int, device: torch.device, C: int, R: int, dtype: torch.dtype) -> KernelConfig:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tuned = mla_tuning.lookup(name, H, C, R, str(dtype).removeprefix("torch."), B, S)
        if tuned is not None:
            return KernelConfig(**tuned)
    return KernelConfig()


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def latent_attention_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                            scale: float, lengths: torch.Tensor | None = None,
                            config: KernelConfig | None = None, w_uv: torch.Tensor | None = None) -> torch.Tensor:
    """The fused split-KV kernel; same contract as :func:`latent_attention_reference` (then
    :func:`up_project` by ``w_uv``, in the merge's launch where the call is split and has at most
    :data:`MERGE_UP_MAX_ROWS` sequences).

    With ``lengths`` the grid is sized for the full S (static under a CUDA graph) and programs
    whose split starts past a sequence's length read no cache. No host synchronisation.
    """
    if triton is None:
        raise RuntimeError("the Triton MLA decode kernel needs the triton package")
    B, H, C = q_lat.shape
    S, R = c_kv.shape[1], k_pe.shape[-1]
    q_lat, q_pe = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_lat, q_pe))  # any (B, H) strides
    cfg = config or choose_config(B, H, S, c_kv.device, C, R, c_kv.dtype)
    n_splits, split_len = cfg.splits(B, H, S, _sm_count(c_kv.device))
    direct = cfg.direct and n_splits == 1
    out = torch.empty(B, H, C, device=c_kv.device, dtype=q_lat.dtype) if direct else None
    o_part = out[:, None] if direct else torch.empty(B, n_splits, H, C, device=c_kv.device, dtype=torch.float32)
    lse_part = torch.empty(B, n_splits, H, device=c_kv.device, dtype=torch.float32)
    merge_up = w_uv is not None and B <= MERGE_UP_MAX_ROWS and not direct
    # the merge-up's per-head arrival counters, zeroed by this kernel (no memset between the two launches)
    counters = torch.empty(B * H, device=c_kv.device, dtype=torch.int32) if merge_up else lse_part
    if lengths is None:
        len_ptr, len_stride = lse_part, 0  # unused: HAS_LENGTHS is off
    else:
        len_ptr = lengths.reshape(-1)
        len_stride = 0 if len_ptr.numel() == 1 else 1
    regs = {} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}
    _latent_decode_kernel[(B, n_splits, triton.cdiv(H, _BLOCK_H))](
        q_lat, q_pe, c_kv, k_pe, o_part, lse_part, counters, len_ptr, len_stride, H, S, split_len, scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        c_kv.stride(0), c_kv.stride(1), k_pe.stride(0), k_pe.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        C=C, R=R, BLOCK_H=_BLOCK_H, BLOCK_S=cfg.block_s, HAS_LENGTHS=lengths is not None, ZERO_COUNTERS=merge_up,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **regs, **pdl.launch(c_kv.device))
    if direct:
        return up_project(out, w_uv)
    if merge_up:
        return merge_up_triton(o_part, lse_part, w_uv, q_lat.dtype, counters=counters)
    return up_project(merge_splits_triton(o_part, lse_part, q_lat.dtype), w_uv)


#: the most sequences whose split merge also applies W_UV; each (sequence, head, channel block) program reads its
#: slice of W_UV[h], so larger batches read W_UV once per sequence and the merge plus one batched GEMM is cheaper
MERGE_UP_MAX_ROWS = 8
_MERGE_UP_BLOCK_C = 64  # latent channels per program: B·H·C/64 programs (128 at batch 1, 16 heads of 512)
_MERGE_UP_WARPS = 4


def merge_up_triton(o_part: torch.Tensor, lse_part: torch.Tensor, w_uv: torch.Tensor, dtype: torch.dtype,
                    counters: torch.Tensor | None = None, block_c: int = _MERGE_UP_BLOCK_C,
                    num_warps: int = _MERGE_UP_WARPS) -> torch.Tensor:
    """:func:`up_project` of :func:`merge_splits` in one launch, written in ``dtype``. Programs over
    (B, H, C / block_c): each loads every split's partial of its ``block_c`` channels at once (one round trip,
    however many splits), merges them in fp32 and multiplies by W_UV[h]'s matching columns, a partial of the
    head's V values; the last of a head's programs to arrive (an int32 counter per (sequence, head),
    ``counters``: zeros, or None for fresh ones; left at zero again) sums the C / block_c partials in a fixed
    order and writes the output, so the result does not depend on the arrival order.
    ``benchmarks/scripts/merge_up_tune.py`` times the choices."""
    B, n_splits, H, C = o_part.shape
    V = w_uv.shape[1]
    if w_uv.shape != (H, V, C) or w_uv.stride(-1) != 1:
        raise ValueError(f"w_uv must be (H={H}, V, C={C}) with C contiguous, got {tuple(w_uv.shape)}")
    block_c = min(block_c, C)
    if C % block_c:
        raise ValueError(f"block_c {block_c} must divide C={C}")
    v_p2 = triton.next_power_of_2(V)
    if counters is None:
        counters = torch.zeros(B * H, device=o_part.device, dtype=torch.int32)
    scratch = torch.empty(B * H, C // block_c, v_p2, device=o_part.device, dtype=torch.float32)
    out = torch.empty(B, H, V, device=o_part.device, dtype=dtype)
    _merge_up_kernel[(B, H, C // block_c)](
        o_part, lse_part, w_uv, out, scratch, counters, n_splits, H, V, o_part.stride(0), o_part.stride(1),
        o_part.stride(2), lse_part.stride(0), lse_part.stride(1), w_uv.stride(0), w_uv.stride(1), out.stride(0),
        out.stride(1), C=C, V_P2=v_p2, BLOCK_C=block_c, BLOCK_SPLITS=triton.next_power_of_2(n_splits),
        num_warps=num_warps, **pdl.launch(o_part.device))
    return out


def merge_splits_triton(o_part: torch.Tensor, lse_part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`merge_splits` in one launch, written in ``dtype``: programs over (B, H, C / 128)."""
    B, n_splits, H, C = o_part.shape
    out = torch.empty(B, H, C, device=o_part.device, dtype=dtype)
    block_c = min(_MERGE_BLOCK_C, C)
    _merge_kernel[(B, H, C // block_c)](
        o_part, lse_part, out, n_splits, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        BLOCK_C=block_c, BLOCK_SPLITS=triton.next_power_of_2(n_splits), SPLIT_CHUNK=8, num_warps=4,
        **pdl.launch(o_part.device))
    return out


_MERGE_BLOCK_C = 128  # latent channels per merge program: B·H·C/128 programs, enough at batch 1


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor) -> torch.Tensor:
    """Combine per-split outputs (B, splits, H, C), each softmax-normalised over its own keys, by
    their log2-sum-exp (B, splits, H); an empty split carries lse = -inf and weighs nothing.
    The reference for the fused merge kernel."""
    w = torch.exp2(lse_part - lse_part.amax(1, keepdim=True))  # (B, splits, H); split 0 is never empty
    return (o_part * w[..., None]).sum(1) / w.sum(1)[..., None]  # (B, H, C)


if triton is not None:
    from scaletool.kernels.pdl import start as _pdl_start

    @triton.jit
    def _latent_decode_kernel(q_lat, q_pe, c_kv, k_pe, o_part, lse_part, counters, lengths, s_len, H, S, split_len,
                              sm_scale, s_qb, s_qh, s_pb, s_ph, s_cb, s_cs, s_kb, s_ks, s_ob, s_os, s_oh, s_lb, s_ls,
                              C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                              HAS_LENGTHS: tl.constexpr, ZERO_COUNTERS: tl.constexpr, USE_PDL: tl.constexpr):
        _pdl_start(USE_PDL)
        b = tl.program_id(0).to(tl.int64)  # batch offsets pass 2^31 elements in large caches
        sp, hb = tl.program_id(1), tl.program_id(2)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_c = tl.arange(0, C)
        offs_r = tl.arange(0, R)
        h_ok = offs_h < H
        if ZERO_COUNTERS:  # the merge-up's arrival counters for these heads (it runs after this kernel ends)
            tl.store(counters + b * H + offs_h, tl.zeros([BLOCK_H], tl.int32), mask=h_ok & (sp == 0))
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
        o = acc / tl.where(filled, l_i, 1.0)[:, None]  # the output itself (dtype) with one split and `direct`
        tl.store(out_ptr, o.to(o_part.dtype.element_ty), mask=h_ok[:, None])
        lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
        tl.store(lse_part + b * s_lb + sp * s_ls + offs_h, lse, mask=h_ok)

    @triton.jit
    def _merged(o_part, lse_part, b, h, offs_c, n_splits, s_ob, s_os, s_oh, s_lb, s_ls, BLOCK_C: tl.constexpr,
                BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
        """Head ``h`` of sequence ``b``: its splits' partial outputs at channels ``offs_c`` (BLOCK_C of them)
        weighted by their log2-sum-exps, in fp32 (:func:`merge_splits` is the reference)."""
        all_s = tl.arange(0, BLOCK_SPLITS)
        lse = tl.load(lse_part + b * s_lb + all_s * s_ls + h, mask=all_s < n_splits, other=float("-inf"))
        m = tl.max(lse, 0)  # finite: split 0 holds position 0
        denom = tl.sum(tl.exp2(lse - m), 0)
        acc = tl.zeros([BLOCK_C], tl.float32)
        for s0 in range(0, n_splits, SPLIT_CHUNK):
            offs_s = s0 + tl.arange(0, SPLIT_CHUNK)
            ok = offs_s < n_splits
            w = tl.exp2(tl.load(lse_part + b * s_lb + offs_s * s_ls + h, mask=ok, other=float("-inf")) - m)
            o = tl.load(o_part + b * s_ob + offs_s[:, None] * s_os + h * s_oh + offs_c[None, :], mask=ok[:, None],
                        other=0.0)
            acc += tl.sum(o * w[:, None], 0)
        return acc / denom

    @triton.jit
    def _merge_kernel(o_part, lse_part, out, n_splits, s_ob, s_os, s_oh, s_lb, s_ls, s_yb, s_yh,
                      BLOCK_C: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
                      USE_PDL: tl.constexpr):
        _pdl_start(USE_PDL)
        b = tl.program_id(0).to(tl.int64)
        h, cb = tl.program_id(1), tl.program_id(2)
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        merged = _merged(o_part, lse_part, b, h, offs_c, n_splits, s_ob, s_os, s_oh, s_lb, s_ls,
                         BLOCK_C, BLOCK_SPLITS, SPLIT_CHUNK)
        tl.store(out + b * s_yb + h * s_yh + offs_c, merged.to(out.dtype.element_ty))

    @triton.jit
    def _merge_up_kernel(o_part, lse_part, w_uv, out, scratch, counters, n_splits, H, V, s_ob, s_os, s_oh, s_lb, s_ls,
                         s_wh, s_wv, s_yb, s_yh, C: tl.constexpr, V_P2: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_SPLITS: tl.constexpr, USE_PDL: tl.constexpr):
        """Head h of sequence b, channels cb·BLOCK_C..: every split's partial at once, merged, times W_UV[h]'s
        columns; the head's last program to arrive sums the parts (merge_up_triton)."""
        b = tl.program_id(0).to(tl.int64)
        h, cb = tl.program_id(1), tl.program_id(2)
        NC: tl.constexpr = C // BLOCK_C
        offs_v = tl.arange(0, V_P2)
        v_ok = offs_v < V
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        # a weight: loaded before the wait for the splits (under PDL, during the attention kernel's tail)
        wt = tl.load(w_uv + h * s_wh + offs_v[:, None] * s_wv + offs_c[None, :], mask=v_ok[:, None], other=0.0)
        _pdl_start(USE_PDL)
        all_s = tl.arange(0, BLOCK_SPLITS)
        s_ok = all_s < n_splits
        lse = tl.load(lse_part + b * s_lb + all_s * s_ls + h, mask=s_ok, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))  # the max is finite: split 0 holds position 0
        o = tl.load(o_part + b * s_ob + all_s[:, None] * s_os + h * s_oh + offs_c[None, :], mask=s_ok[:, None],
                    other=0.0)
        merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)  # (BLOCK_C,) fp32
        part = tl.sum(wt.to(tl.float32) * merged[None, :], 1)  # (V_P2,): this block's share of the head's values
        row = b * H + h
        tl.store(scratch + (row * NC + cb) * V_P2 + offs_v, part)
        tl.debug_barrier()  # every thread's store issued before the arrival (release) below
        arrived = tl.atomic_add(counters + row, 1, sem="acq_rel", scope="gpu")
        if arrived == NC - 1:  # the last of the head's NC programs: the parts in a fixed order
            parts = tl.load(scratch + (row * NC + tl.arange(0, NC))[:, None] * V_P2 + offs_v[None, :],
                            cache_modifier=".cg")
            tl.store(out + b * s_yb + h * s_yh + offs_v, tl.sum(parts, 0).to(out.dtype.element_ty), mask=v_ok)
            tl.store(counters + row, 0)  # ready for the next call that passes the same counters

    @triton.jit
    def _absorb_q_kernel(q, w, out, B, N, C, s_qb, s_qh, s_wh, s_wn, s_ob, s_oh, N_P2: tl.constexpr,
                         BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
        h, cb = tl.program_id(0), tl.program_id(1)
        offs_n = tl.arange(0, N_P2)
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        wt = tl.load(w + h * s_wh + offs_n[:, None] * s_wn + offs_c[None, :], mask=(offs_n[:, None] < N) & c_ok[None, :],
                     other=0.0)  # (N_P2, BLOCK_C): a weight, loaded before waiting for the query
        _pdl_start(USE_PDL)
        for b in range(B):
            qv = tl.load(q + b * s_qb + h * s_qh + offs_n, mask=offs_n < N, other=0.0)
            y = tl.sum(wt.to(tl.float32) * qv[:, None].to(tl.float32), axis=0)
            tl.store(out + b * s_ob + h * s_oh + offs_c, y.to(out.dtype.element_ty), mask=c_ok)
