"""A linear layer for the few rows of a decode step: y = x·Wᵀ with x (M ≤ 8 rows, K) and W (N, K).

At batch 1 a decode step's projections are matrix-vector products: each weight is read once for one
row, so the step is bound by how fast the weights stream from HBM. cuBLAS runs them as GEMMs with
tall thin tiles; the profile of mla-1b at batch 1 on an H100 has them reading the weights at about
1.6 TB/s, about half the card's copy rate. :func:`gemv_triton` gives each program ``BLOCK_N`` rows of W
(contiguous along K: coalesced 16-byte loads) and reduces along K in fp32: at one row in registers, at 2-8
rows on the tensor cores (the rows padded to 16; a broadcast product there ran at a third of cuBLAS's speed).
The launch grid is N / BLOCK_N programs, with the block and warp counts autotuned per (M, N, K) the first time
a shape runs (before any CUDA-graph capture).

:func:`install` swaps the ``forward`` of a model's bias-free ``nn.Linear`` modules for one that takes
this kernel where the input has at most :data:`MAX_ROWS` rows (decode steps) and ``F.linear`` above
(prefill). The kernel is the custom operator ``torch.ops.scaletool.gemv`` (with a fake implementation
for shapes), so a compiled decode step keeps it inside one graph.

At one row, each program loads its ``BLOCK_N`` whole rows of W into registers first and only then reads x:
under programmatic dependent launch (:mod:`.pdl`) the program is scheduled while the kernel before it (which
writes x) still runs, so the weights stream during that kernel's tail instead of after it.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletool.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: F.linear serves
    triton = None

#: the most rows (batch × new tokens) the kernel takes; above, F.linear (cuBLAS) is the better GEMM
MAX_ROWS = 8
#: the longest rows of W the one-row kernel holds whole in registers (padded to a power of two)
ROW_MAX_K = 8192


def supports(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None when :func:`gemv_triton` can compute ``F.linear(x, weight)``, else why not."""
    if triton is None:
        return "Triton is not installed"
    if x.device.type != "cuda" or weight.device != x.device:
        return "x and the weight are not on one CUDA device"
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return f"the kernel is written for 16-bit x and weight of one dtype, got {x.dtype} and {weight.dtype}"
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or not weight.is_contiguous():
        return "the weight must be a contiguous (N, K) matrix with K = x's last dimension"
    rows = x.numel() // max(1, x.shape[-1])
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows: the kernel takes 1 to {MAX_ROWS}"
    return None


def gemv_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for x (..., K) of at most :data:`MAX_ROWS` rows; fp32 accumulation."""
    if triton is None:
        raise RuntimeError("the Triton GEMV kernel needs the triton package")
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731 - Triton's launch-grid idiom
    if M == 1 and K <= ROW_MAX_K:  # whole rows of W in registers, loaded before waiting on x (module docstring)
        _gemv_row_kernel[grid](x2, weight, y, N, K, weight.stride(0), K_P2=triton.next_power_of_2(K),
                               **pdl.launch(x.device))
    elif M == 1:
        _gemv_kernel[grid](x2, weight, y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0),
                           BLOCK_M=1, **pdl.launch(x.device))
    else:  # 2-8 rows: the rows padded to the tensor cores' 16, W's tiles pipelined through shared memory
        _gemv_dot_kernel[grid](x2, weight, y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0),
                               **pdl.launch(x.device))
    return y.reshape(*x.shape[:-1], N)


def _gemv_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if supports(x, weight) is None:
        return gemv_triton(x, weight)
    return F.linear(x, weight)  # CPUs and other shapes: the same contract


# The schema is spelled out: annotations are strings under ``from __future__ import annotations``.
gemv_op = torch.library.custom_op("scaletool::gemv", _gemv_op, mutates_args=(),
                                  schema="(Tensor x, Tensor weight) -> Tensor")


@gemv_op.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``, through the kernel where :func:`supports` says it can (see the module
    docstring); inside ``torch.compile`` as the opaque operator."""
    if supports(x, weight) is not None:
        return F.linear(x, weight)
    if torch.compiler.is_compiling():
        return torch.ops.scaletool.gemv(x, weight)
    return gemv_triton(x, weight)


def install(model: nn.Module) -> int:
    """Route every bias-free ``nn.Linear`` of ``model`` through :func:`linear` (an instance ``forward``;
    idempotent). Returns how many modules take it. Inputs the kernel does not take still run F.linear."""
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear and mod.bias is None:
            if not getattr(mod, "_scaletool_gemv", False):
                mod.forward = types.MethodType(_forward, mod)
                mod._scaletool_gemv = True
            n += 1
    return n


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A bias-free Linear module's forward through :func:`linear` (bound to the module by :func:`install`)."""
    return linear(x, self.weight)


if triton is not None:
    _CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bn, bk, w, s in ((4, 512, 4, 3), (8, 256, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3),
                                     (16, 512, 8, 3), (32, 256, 8, 3), (8, 1024, 8, 2), (16, 128, 4, 4))]

    @triton.autotune(configs=_CONFIGS, key=["M", "N", "K"])
    @triton.jit
    def _gemv_kernel(x, w, y, M, N, K, s_xm, s_wn, s_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        pdl.start(USE_PDL)  # programmatic dependent launch: the input is the kernel before's
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            wt = tl.load(w + rn[:, None] * s_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            xt = tl.load(x + rm[:, None] * s_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            acc += tl.sum(xt[:, None, :].to(tl.float32) * wt[None, :, :].to(tl.float32), axis=2)
        out = y + rm[:, None] * s_ym + rn[None, :]
        tl.store(out, acc.to(y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    _DOT_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
                    for bn, bk, w, st in ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 6),
                                          (64, 128, 4, 4), (16, 128, 2, 6), (32, 512, 8, 3))]

    @triton.autotune(configs=_DOT_CONFIGS, key=["M", "N", "K"])
    @triton.jit
    def _gemv_dot_kernel(x, w, y, M, N, K, s_xm, s_wn, s_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_PDL: tl.constexpr):
        """2-8 rows of x: BLOCK_N rows of W per program, (16 × BLOCK_K)·(BLOCK_K × BLOCK_N) on the tensor
        cores per step along K (rows past M masked to zero), fp32 accumulation."""
        pdl.start(USE_PDL)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, 16)
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            wt = tl.load(w + rn[:, None] * s_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            xt = tl.load(x + rm[:, None] * s_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            acc = tl.dot(xt, tl.trans(wt), acc)
        tl.store(y + rm[:, None] * s_ym + rn[None, :], acc.to(y.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    _ROW_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w) for bn, w in ((1, 4), (2, 4), (4, 4), (2, 8), (4, 8),
                                                                               (8, 8))]

    @triton.autotune(configs=_ROW_CONFIGS, key=["N", "K"])
    @triton.jit
    def _gemv_row_kernel(x, w, y, N, K, s_wn, K_P2: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
        """One row of x: BLOCK_N whole rows of W per program, loaded before the wait for x."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, K_P2)
        wt = tl.load(w + rn[:, None] * s_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        pdl.start(USE_PDL)  # the weights are no kernel's output: only x waits for the kernel before
        xt = tl.load(x + rk, mask=rk < K, other=0.0)
        acc = tl.sum(wt.to(tl.float32) * xt[None, :].to(tl.float32), axis=1)
        tl.store(y + rn, acc.to(y.dtype.element_ty), mask=rn < N)
