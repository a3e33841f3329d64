"""Preallocated static KV caches, one small module per layer (gpt-fast's layout).

Buffers are allocated once to ``max_batch × max_len`` and registered non-persistent, so they follow
``.to()`` but never enter a checkpoint. ``update(pos, ...)`` writes the new tokens' entries in
place; with an int ``pos`` it returns views of everything cached up to them, with a 0-dim device
tensor (one token, the CUDA-graph path) it writes with ``index_copy_`` and returns the whole static
buffers (the attention masks the positions past ``pos``). Rows ``[:b]`` are used when a call brings
``b <= max_batch`` sequences.

A cache only stores: how attention reads it is the caller's ``DecodeMode``
(``scaletool.model.attention``); ``layout`` and ``names`` say what it holds, so a mode given the wrong
cache is refused rather than silently read another way. What each attention kind caches in each
mode is data (``scaletool.kinds.attention.CacheLayout``); :func:`make_caches` builds it:

- :class:`KVCache` (``layout = "kv"``): k (B, KV, S, d_k) and v (B, KV, S, d_v) per KV head, for
  MHA/GQA/MQA and for MLA's naive mode (H heads of up-projected nope+rope keys and v values).
- :class:`LatentCache` (``layout = "latent"``): per-token vectors shared by all heads: MLA's
  normalised latent c_kv (B, S, kv_lora_rank) and, for the shared RoPE key, the rotated k_pe
  (B, S, qk_rope_head_dim).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from scaletool.config import ModelConfig
from scaletool.kinds.attention import CacheLayout, attention_kind


def _write(buf: torch.Tensor, dim: int, pos: int | torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Write ``new`` into rows ``[:b]`` of ``buf`` at positions pos.. along ``dim``; return the rows
    up to the last written position (int ``pos``) or whole (tensor ``pos``)."""
    rows, new = buf[:new.shape[0]], new.to(buf.dtype)
    if isinstance(pos, torch.Tensor):
        return rows.index_copy_(dim, pos.reshape(1), new)
    end = pos + new.shape[dim]
    rows.narrow(dim, pos, new.shape[dim]).copy_(new)
    return rows.narrow(dim, 0, end)


class KVCache(nn.Module):
    layout, names = "kv", ("k", "v")

    def __init__(self, max_batch: int, max_len: int, n_kv_heads: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.max_len = max_len
        self.register_buffer("k", torch.zeros(max_batch, n_kv_heads, max_len, k_dim, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v", torch.zeros(max_batch, n_kv_heads, max_len, v_dim, dtype=dtype, device=device),
                             persistent=False)

    def update(self, pos: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k (b,T,KV,d_k), v (b,T,KV,d_v) at positions pos..; return (b,KV,S,·) views (module docstring)."""
        return _write(self.k, 2, pos, k.transpose(1, 2)), _write(self.v, 2, pos, v.transpose(1, 2))


class LatentCache(nn.Module):
    """Per-token vectors every head reads (MLA's c_kv and shared k_pe), one (B, S, width) buffer per name."""

    layout = "latent"

    def __init__(self, max_batch: int, max_len: int, widths: dict[str, int], dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.max_len, self.names = max_len, tuple(widths)
        for name, width in widths.items():
            self.register_buffer(name, torch.zeros(max_batch, max_len, width, dtype=dtype, device=device),
                                 persistent=False)

    def update(self, pos: int | torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write one (b,T,width) tensor per name at positions pos..; return (b,S,·) views (module docstring)."""
        return tuple(_write(getattr(self, n), 1, pos, t) for n, t in zip(self.names, tensors, strict=True))


def make_cache(layout: CacheLayout, max_batch: int, max_len: int, dtype: torch.dtype,
               device: torch.device | str) -> nn.Module:
    """One layer's cache holding ``layout``."""
    shapes = dict(layout.tensors)
    if layout.kind == "kv":
        (kv, k_dim), (_, v_dim) = shapes["k"], shapes["v"]
        return KVCache(max_batch, max_len, kv, k_dim, v_dim, dtype, device)
    return LatentCache(max_batch, max_len, {n: s[0] for n, s in layout.tensors}, dtype, device)


def make_caches(cfg: ModelConfig, max_batch: int, max_len: int, *, dtype: torch.dtype,
                device: torch.device | str, mla_mode: str | None = None) -> nn.ModuleList:
    """One cache per layer for ``cfg``'s attention in decode mode ``mla_mode`` (None: the kind's default;
    ValueError for a mode the kind refuses)."""
    kind = attention_kind(cfg)
    layout = kind.cache_layout(cfg, kind.resolve_mode(cfg, mla_mode))
    return nn.ModuleList(make_cache(layout, max_batch, max_len, dtype, device) for _ in range(cfg.n_layers))


def cache_rows(caches: nn.ModuleList, start: int, stop: int) -> nn.ModuleList:
    """Caches over sequences ``[start, stop)`` of ``caches``: new cache modules whose buffers are views of
    those rows (writes land in the original buffers), for steps that decode part of a batch."""
    out = nn.ModuleList()
    for cache in caches:
        part = cache.__class__.__new__(cache.__class__)
        nn.Module.__init__(part)
        part.max_len, part.names = cache.max_len, cache.names
        for name, buf in cache.named_buffers(recurse=False):
            part.register_buffer(name, buf[start:stop], persistent=False)
        out.append(part)
    return out


def cache_bytes(caches: nn.Module) -> int:
    """Bytes held by the cache tensors themselves."""
    return sum(b.numel() * b.element_size() for b in caches.buffers())


def replicate_first_row(caches: nn.Module, length: int, batch: int) -> None:
    """Copy sequence 0's first ``length`` cached positions to rows 1..batch-1 (identical prompts).

    Lets a benchmark prefill one prompt and decode a full batch from it: the decode step reads the
    same bytes as after a full-batch prefill, without its minutes of compute at long context.
    """
    for buf in caches.buffers():
        seq_dim = 2 if buf.dim() == 4 else 1  # kv: (B, KV, S, d); latent: (B, S, c)
        dst = buf[1:batch].narrow(seq_dim, 0, length)
        dst.copy_(buf[:1].narrow(seq_dim, 0, length).expand_as(dst))
