"""Building blocks shared by every attention type: norms and feed-forward nets (position encodings:
``scaletool.model.positions``).

Single-device code only: nothing here imports torch.distributed.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletool.config import ModelConfig

#: The recipe's dtype names as torch dtypes (the one map; everything that needs one imports it).
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` with its weight cast to the input's dtype.

    Under autocast the residual stream is 16-bit next to an fp32 weight, a mix PyTorch's fused
    rms_norm kernel rejects; its unfused fallback made eager norms ~60% slower on an H200. The
    fused kernel accumulates in fp32 either way.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


def join_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` computing ``parts`` (same input width, all with or all without bias) side by side:
    its output is theirs concatenated, its weight theirs stacked (the same parameter count). The joined
    layer reads the input once and runs one GEMM; at decode's few rows each GEMM launch costs a fixed
    ramp beside its bytes, so three joined projections pay it once (``Transformer.join_projections``)."""
    first = parts[0]
    if any(p.in_features != first.in_features or (p.bias is None) != (first.bias is None) for p in parts):
        raise ValueError("join_linears: the layers must share their input width and all have a bias or none")
    out = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None, device="meta")
    grad = first.weight.requires_grad
    out.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=grad)
    if first.bias is not None:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=grad)
    return out


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """RMSNorm (weight only, ``dim`` params) or LayerNorm (weight and bias, ``2*dim`` params)."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps)


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x), 3·d·i params) or the classic GELU/ReLU MLP (2·d·i params).
    ``join_projections`` puts w1 and w3 in one layer (decoding).

    ``intermediate_size`` overrides the recipe's width (MoE shared experts); ffn=moe models use
    SwiGLU for their dense layers and shared experts, as DeepSeek does.
    """

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        d, i = cfg.d_model, intermediate_size or cfg.intermediate_size
        self.kind = "swiglu" if cfg.ffn == "moe" else cfg.ffn
        self.w1 = nn.Linear(d, i, bias=False)
        self.w2 = nn.Linear(i, d, bias=False)
        self.w3 = nn.Linear(d, i, bias=False) if self.kind == "swiglu" else None
        self.w13: nn.Linear | None = None  # w1 and w3 joined (join_projections), which then are gone

    def join_projections(self) -> int:
        """Replace SwiGLU's w1 and w3 by one ``w13`` (:func:`join_linears`); 1 if joined, 0 if nothing to do."""
        if self.kind != "swiglu" or self.w13 is not None:
            return 0
        self.w13 = join_linears([self.w1, self.w3])
        del self.w1, self.w3
        return 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        if self.kind == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        act = F.gelu if self.kind == "gelu" else F.relu
        return self.w2(act(self.w1(x)))
