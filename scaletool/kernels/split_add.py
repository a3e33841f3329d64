"""One pass that adds a 16-bit gradient of two joined weights into their two fp32 gradients.

``train.weight_cast=step`` keeps a dropless MoE layer's experts' w1 and w3 as one 16-bit (E, d, 2i) tensor
(the fused gate/up grouped GEMM's operand); each micro-batch its gradient is split back into w1's and w3's
fp32 gradients. As two ``add_`` calls on the halves of the last dimension, each input is a strided view,
which PyTorch's element-wise kernels run without vector loads: on an H100 about half the copy rate, over
about 1 B parameters a micro-batch in the MoE of ``benchmarks/studies/moe-speed.yaml``.
:func:`split_add_` reads each row of the joined gradient once, contiguously, and adds (or, for the first
micro-batch, writes) both halves with 16-byte loads. :func:`supports` says where it applies; elsewhere the
caller keeps the two ``add_`` calls (the same numbers: each element is one fp32 += 16-bit conversion).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the caller's add_ serves
    triton = None


def supports(dsts: list[torch.Tensor | None], g: torch.Tensor) -> str | None:
    """None when :func:`split_add_` can add ``g`` (..., 2i) into ``dsts`` (two (..., i) fp32 gradients, both
    None on the first micro-batch), else why not."""
    if triton is None:
        return "Triton is not installed"
    if g.device.type != "cuda" or g.dtype not in (torch.bfloat16, torch.float16) or not g.is_contiguous():
        return "the joined gradient must be a contiguous 16-bit CUDA tensor"
    if len(dsts) != 2 or g.shape[-1] % 2:
        return "two equal halves of the last dimension"
    fresh = [d is None for d in dsts]
    if any(fresh) and not all(fresh):
        return "one gradient exists and the other does not"
    want = (*g.shape[:-1], g.shape[-1] // 2)
    for d in dsts:
        if d is not None and (d.dtype != torch.float32 or tuple(d.shape) != want or not d.is_contiguous()
                              or d.device != g.device):
            return "the gradients must be contiguous fp32 tensors of the halves' shape on g's device"
    return None


def split_add_(dsts: list[torch.Tensor | None], g: torch.Tensor) -> list[torch.Tensor]:
    """``dsts[k] += g[..., k·i:(k+1)·i]`` (fp32 += 16-bit) for k = 0, 1 in one kernel; with both ``dsts`` None,
    new fp32 tensors holding the halves. Returns the two gradients. :func:`supports` must say None."""
    why = supports(dsts, g)
    if why is not None:
        raise ValueError(f"split_add_: {why}")
    half = g.shape[-1] // 2
    rows = g.numel() // g.shape[-1]
    fresh = dsts[0] is None
    if fresh:
        dsts = [torch.empty(*g.shape[:-1], half, device=g.device, dtype=torch.float32) for _ in range(2)]
    block_c = min(1024, triton.next_power_of_2(half))
    grid = (triton.cdiv(rows, _BLOCK_R), triton.cdiv(half, block_c))
    _split_add_kernel[grid](g, dsts[0], dsts[1], rows, half, ACCUMULATE=not fresh, BLOCK_R=_BLOCK_R,
                            BLOCK_C=block_c, num_warps=4)
    return dsts


_BLOCK_R = 4  # rows per program: 4 × 1,024 columns × two halves, 16 fp32 loads in flight per thread

if triton is not None:
    @triton.jit
    def _split_add_kernel(g, d0, d1, rows, half, ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = (r[:, None] < rows) & (c[None, :] < half)
        src = g + r[:, None] * (2 * half) + c[None, :]
        dst = r[:, None] * half + c[None, :]
        a = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
        if ACCUMULATE:
            a += tl.load(d0 + dst, mask=ok, other=0.0)
            b += tl.load(d1 + dst, mask=ok, other=0.0)
        tl.store(d0 + dst, a, mask=ok)
        tl.store(d1 + dst, b, mask=ok)
