"""Building blocks shared by every attention type: norms, rotary embeddings, feed-forward nets.

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


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """RMSNorm (weight only, ``dim`` params) or LayerNorm (weight and bias, ``2*dim`` params)."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE over ``dim`` channels, preallocated to ``max_seq_len``.

    Real-valued tables rather than complex multiplication: the same rotation, and it fuses under
    torch.compile. Kept as non-persistent buffers so checkpoints carry only weights.
    """

    def __init__(self, dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.dim, self.max_seq_len, self.theta = dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        dev = self.cos.device
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, device=dev, dtype=torch.float32) / self.dim))
        t = torch.arange(self.max_seq_len, device=dev, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (T, dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (T, dim)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[start:start + length], self.sin[start:start + length]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of ``x`` (B, T, H, r) by position; cos/sin are (T, r).

    Only the rotated part is passed in: callers split off the no-RoPE channels first.
    """
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x), 3·d·i params) or the classic GELU/ReLU MLP (2·d·i params).

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        act = F.gelu if self.kind == "gelu" else F.relu
        return self.w2(act(self.w1(x)))
