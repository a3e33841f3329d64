"""Position encodings (``model.position_encoding``; the kinds themselves are ``scaletool.kinds.attention``).

- rope: :class:`RotaryEmbedding` tables, applied to q and k inside attention (:func:`apply_rope`);
- learned, sinusoidal: a max_seq_len × d_model table added to the embeddings (:class:`SinusoidalTable`
  for the fixed one, an ``nn.Embedding`` for the learned one);
- alibi: per-head slopes (:class:`ALiBi`, :func:`alibi_slopes`) turned into an additive score bias
  (:func:`alibi_bias`);
- none: nothing.

A forward pass or decode step builds one :class:`Positions` for all its layers: what attention needs
to know about where its queries and keys sit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


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
        if start + length > self.max_seq_len:
            raise ValueError(f"positions up to {start + length} exceed the RoPE table ({self.max_seq_len}); "
                             "call extend_positions first")
        return self.cos[start:start + length], self.sin[start:start + length]

    def at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (1, dim) at a 0-dim device position (no host read)."""
        at = pos.reshape(1)
        return self.cos.index_select(0, at), self.sin.index_select(0, at)

    def grown(self, max_len: int) -> RotaryEmbedding:
        with torch.device(self.cos.device):
            return RotaryEmbedding(self.dim, max_len, self.theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of ``x`` (B, T, H, r) by position; cos/sin are (T, r).

    Only the rotated part is passed in: callers split off the no-RoPE channels first.
    """
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class SinusoidalTable(nn.Module):
    """The fixed encoding of Vaswani et al. 2017 §3.5: PE(p, 2i) = sin(p / 10000^(2i/d)),
    PE(p, 2i+1) = cos(p / 10000^(2i/d)); a non-persistent (max_seq_len, d) buffer, no parameters."""

    def __init__(self, dim: int, max_seq_len: int):
        super().__init__()
        self.dim, self.max_seq_len = dim, max_seq_len
        self.register_buffer("table", torch.empty(max_seq_len, dim), persistent=False)
        if self.table.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        dev = self.table.device
        p = torch.arange(self.max_seq_len, device=dev, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, self.dim, 2, device=dev, dtype=torch.float32) * (-math.log(10000.0) / self.dim))
        self.table[:, 0::2] = torch.sin(p * freq)
        self.table[:, 1::2] = torch.cos(p * freq[: self.dim // 2])

    def grown(self, max_len: int) -> SinusoidalTable:
        with torch.device(self.table.device):
            return SinusoidalTable(self.dim, max_len)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head-specific slopes (Press et al. 2022, §3 and its reference code): the geometric sequence
    2^(-8/n), 2^(-16/n), ... for a power of two n; otherwise those of the largest power of two below n,
    then every other slope of twice that many."""
    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(closest) + powers(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, n_keys: int, causal: bool) -> torch.Tensor:
    """Additive score bias (1, H, T, S) in fp32 for queries at ``q_pos`` (T,) over keys 0..S-1.

    Causal (the paper's decoder): -slope·(q - k) for k <= q, -inf for the future (the causal mask folded
    in). Not causal (the regression encoder): the symmetric -slope·|q - k|.
    """
    k = torch.arange(n_keys, device=q_pos.device)
    dist = (q_pos[:, None] - k[None, :]).float()  # (T, S)
    bias = -slopes.to(q_pos.device)[:, None, None] * (dist if causal else dist.abs())  # (H, T, S)
    if causal:
        bias = bias.masked_fill(dist < 0, float("-inf"))
    return bias[None]


class ALiBi(nn.Module):
    """The per-head slopes as a non-persistent buffer, and the bias they give (:func:`alibi_bias`)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.register_buffer("slopes", torch.empty(n_heads), persistent=False)
        if self.slopes.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.slopes.copy_(alibi_slopes(self.slopes.numel()))

    def bias(self, q_pos: torch.Tensor, n_keys: int, causal: bool) -> torch.Tensor:
        return alibi_bias(self.slopes, q_pos, n_keys, causal)


@dataclass(frozen=True, eq=False)
class Positions:
    """Where one call's T query tokens sit, as attention needs it (built once per forward or decode step).

    ``cos``, ``sin``: RoPE tables (T, r) at the query positions (None without RoPE). ``bias``: the
    ALiBi score bias (1, H, T, S) over the S keys the call attends to, causal and cache-length masks
    folded in, in the compute dtype (one tensor shared by every layer; None without ALiBi). ``rope``:
    the RoPE module itself, for keys rotated at their own positions (per-head RoPE MLA re-expanding a
    latent cache).
    """

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    rope: RotaryEmbedding | None = None

    def key_rotation(self, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (S, r) for keys at positions 0..S-1."""
        return self.rope(0, n_keys)
