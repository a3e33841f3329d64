"""Attention: one module for MHA/GQA/MQA (by ``n_kv_heads``) and one for MLA, registered under their
kinds (:func:`attention_module`); rules and closed forms live in ``scaletool.kinds.attention``.

Training runs ``F.scaled_dot_product_attention``; ``probs()`` is a plain softmax reference that the
tests and the training-dynamics monitors read. ``decode(x, positions, cache, pos, mode)`` appends to a
preallocated cache (``scaletool.model.cache``) and attends over it; ``mode`` is the caller's algorithm
choice (a cache of the wrong kind is refused); ``pos`` is an int (the cached prefix) or a 0-dim device
tensor (static shapes, so a CUDA graph can replay the step). Tensor parallelism is applied from
outside (``scaletool.engines.tp``): head counts follow the projections' widths.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from scaletool.config import ModelConfig
from scaletool.kernels.mla_decode import KERNELS, absorb_query, latent_attention
from scaletool.kinds.attention import MLA_MODES, CacheLayout, attention_kind
from scaletool.model.layers import RMSNorm, join_linears
from scaletool.model.positions import Positions, apply_rope

_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def decode_backends(choice: str) -> list[SDPBackend]:
    """Backend priority for single-query (decode-step) SDPA over a cache.

    'auto' puts cuDNN first: measured on an H200 (bf16, 1B MHA, 32K context, batch 32), a decode
    step reads the cache at 3.15 TB/s through cuDNN against 2.69 TB/s through flash and 2.49 TB/s
    through the memory-efficient kernel. A chosen backend is tried first, the rest stay as fallbacks.
    Those steps were eager, where the key length grows every step; later measurements put a 42-54 ms
    floor under every eager cuDNN step on H100 and H200 (15.6 ms with flash first at batch 1), which
    the CUDA-graph decode (fixed shapes, the default on CUDA) does not have (benchmarks/decode.md).
    """
    order = ["cudnn", "flash", "efficient", "math"]
    first = "cudnn" if choice == "auto" else choice
    return [_BACKENDS[b] for b in [first] + [b for b in order if b != first]]


def sdpa_backends(choice: str, qk_dim: int, v_dim: int) -> list[SDPBackend] | None:
    """Backend priority for SDPA; None leaves PyTorch's default dispatch.

    'auto' matters for MLA: with q/k head dim != v head dim there is no flash kernel and the default
    dispatch falls to the memory-efficient kernel (~47 TFLOP/s on H100 for 192/128), while cuDNN's
    fused attention runs the same shapes at ~268 TFLOP/s. So auto puts cuDNN first there and keeps
    flash first when the dims match. A chosen backend is tried first, the rest stay as fallbacks.
    """
    order = ["flash", "cudnn", "efficient", "math"]
    if choice == "auto":
        if qk_dim == v_dim:
            return None
        choice = "cudnn"
    order.remove(choice)
    return [_BACKENDS[b] for b in [choice] + order]


def _sdpa(q, k, v, *, causal: bool, scale: float, dropout: float, enable_gqa: bool, backends, attn_mask=None):
    ctx = sdpa_kernel(backends, set_priority=True) if backends is not None and q.is_cuda else nullcontext()
    with ctx:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=causal,
                                              scale=scale, enable_gqa=enable_gqa)




@dataclass(frozen=True)
class DecodeMode:
    """How attention decodes, chosen by the caller (DeepSeek-V3's ``attn_impl``, passed as an argument
    instead of a module global, so two models in one process can decode differently).

    ``mla`` (``scaletool.kinds.attention.MLA_MODES``): ``absorbed`` attends over the latent cache with
    W_UK folded into the query and W_UV applied after (reads kv_lora_rank + rope numbers per cached
    token); ``expand`` keeps the latent cache and up-projects every cached latent to per-head K and V at
    each step; ``naive`` caches the up-projected per-head K and V and runs plain attention. None is
    the model's default (absorbed; expand for ``mla_rope=per_head``, which cannot absorb). MHA/GQA/MQA
    have one algorithm and take None. ``kernel``: how absorbed MLA's latent attention runs
    (``scaletool.kernels.mla_decode``: auto, triton, torch).
    """

    mla: str | None = None
    kernel: str = "auto"

    def __post_init__(self):
        if self.mla is not None and self.mla not in MLA_MODES:
            raise ValueError(f"mla mode must be one of {MLA_MODES}, got {self.mla!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")

    def resolved(self, cfg: ModelConfig) -> DecodeMode:
        """This mode for ``cfg``'s attention: the default filled in, or ValueError with the reason the kind
        refuses it (a mode given to MHA/GQA/MQA; absorbed for mla_rope=per_head)."""
        return DecodeMode(attention_kind(cfg).resolve_mode(cfg, self.mla), self.kernel)


def valid_length(pos: int | torch.Tensor) -> torch.Tensor | None:
    """Keys a one-token step at device position ``pos`` may see (pos + 1); None for an int position,
    whose cache views already end at the current token."""
    return pos + 1 if isinstance(pos, torch.Tensor) else None


def _expect_cache(cache, want: CacheLayout, mode: str | None) -> None:
    names = tuple(n for n, _ in want.tensors)
    if cache.layout != want.kind or cache.names != names:
        raise ValueError(f"decoding in mode {mode!r} needs a {want.kind!r} cache holding {', '.join(names)}, got a "
                         f"{cache.layout!r} one holding {', '.join(cache.names)} (make_caches(..., mla_mode={mode!r}) "
                         "builds the right one)")


def _cached_sdpa(q, k, v, *, scale: float, enable_gqa: bool, backends, length: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
    """T new queries (B,H,T,D) over S cached keys (B,KV,S,D) and values.

    Without ``length`` the cache views end at the newest token (S = start_pos + T): one query sees
    every cached key, so a decode step needs no mask. A prompt chunk after a cached prefix needs the
    causal mask aligned bottom-right (query t sees keys up to S - T + t); SDPA's ``is_causal`` aligns
    top-left, ``causal_lower_right`` keeps the fused kernels with the right mask. With ``length`` (a
    device tensor, one query) S is the whole static cache and keys from ``length`` on are masked.
    An ALiBi ``bias`` (1,H,T,S) has both masks folded in and replaces them.
    """
    T, S = q.shape[2], k.shape[2]
    if bias is not None:
        mask, causal = bias.to(q.dtype), False
    elif length is not None:
        mask, causal = (torch.arange(S, device=k.device) < length).view(1, 1, 1, S), False
    else:
        mask, causal = (causal_lower_right(T, S) if 1 < T < S else None), T == S and T > 1
    return _sdpa(q, k, v, causal=causal, scale=scale, dropout=0.0, enable_gqa=enable_gqa, backends=backends,
                 attn_mask=mask)


def _attend(q, k, v, positions: Positions, *, causal: bool, scale: float, dropout: float, enable_gqa: bool, backends):
    """Training attention of q (B,T,H,d) over k, v (B,T,KV,·) -> (B,T,H,d_v); the ALiBi bias replaces the
    causal flag (it carries the causal mask)."""
    bias = positions.bias
    y = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal and bias is None, scale=scale,
              dropout=dropout, enable_gqa=enable_gqa, backends=backends,
              attn_mask=None if bias is None else bias.to(q.dtype))
    return y.transpose(1, 2)


def _reference_probs(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale + bias) with the causal mask; q (B,H,T,D), k (B,H,S,D) -> (B,H,T,S) in fp32."""
    s = torch.einsum("bhtd,bhsd->bhts", q.float(), k.float()) * scale
    if bias is not None:
        return (s + bias.float()).softmax(-1)
    if causal:
        T, S = s.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=s.device).tril(S - T)
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1)


#: model.attention -> its module class (filled by :func:`attention_module`)
ATTENTION_MODULES: dict[str, type[nn.Module]] = {}


def attention_module(*kinds: str):
    """Register a module class as the torch side of these attention kinds."""
    def register(cls: type[nn.Module]) -> type[nn.Module]:
        for k in kinds:
            ATTENTION_MODULES[k] = cls
        return cls
    return register


@attention_module("mha", "gqa", "mqa")
class Attention(nn.Module):
    """MHA (n_kv_heads = n_heads), GQA (1 < n_kv_heads < n_heads) and MQA (n_kv_heads = 1).

    Parameters: wq d×(H·hd), wk and wv d×(KV·hd), wo (H·hd)×d, without bias (Llama layout) unless
    ``qkv_bias`` (Qwen2) adds biases to wq, wk, wv.
    RoPE (position_encoding=rope) rotates the first ``qk_rope_head_dim`` channels of every q and k head.
    """

    def __init__(self, cfg: ModelConfig, sdpa_backend: str = "auto"):
        super().__init__()
        d, H, KV, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cfg, self.head_dim = cfg, hd
        self.gqa = KV != H  # stays true of the local heads when tensor parallelism splits both by the same degree
        self.rope_dim = cfg.qk_rope_head_dim
        self.scale = 1.0 / math.sqrt(hd)
        self.dropout = cfg.dropout
        self.wq = nn.Linear(d, H * hd, bias=cfg.qkv_bias)
        self.wk = nn.Linear(d, KV * hd, bias=cfg.qkv_bias)
        self.wv = nn.Linear(d, KV * hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(H * hd, d, bias=False)
        self.wqkv: nn.Linear | None = None  # wq, wk, wv joined (join_projections), which then are gone
        self.backends = sdpa_backends(sdpa_backend, hd, hd)
        self.decode_backends = decode_backends(sdpa_backend)

    def join_projections(self) -> int:
        """Replace wq, wk, wv by one ``wqkv`` (``join_linears``): one GEMM per step instead of three."""
        if self.wqkv is not None:
            return 0
        self._qkv_widths = [self.wq.out_features, self.wk.out_features, self.wv.out_features]
        self.wqkv = join_linears([self.wq, self.wk, self.wv])
        del self.wq, self.wk, self.wv
        return 1

    def _rope(self, x, positions: Positions):
        r = self.rope_dim
        if positions.cos is None:
            return x
        if r == self.head_dim:
            return apply_rope(x, positions.cos, positions.sin)
        return torch.cat([apply_rope(x[..., :r], positions.cos, positions.sin), x[..., r:]], dim=-1)

    def qkv(self, x: torch.Tensor, positions: Positions):
        """Projected, rotated q (B,T,H,hd), k and v (B,T,KV,hd)."""
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split(self._qkv_widths, -1) if self.wqkv is not None else (
            self.wq(x), self.wk(x), self.wv(x))
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        return self._rope(q, positions), self._rope(k, positions), v

    def forward(self, x: torch.Tensor, positions: Positions, causal: bool = True) -> torch.Tensor:
        B, T, _ = x.shape
        y = _attend(*self.qkv(x, positions), positions, causal=causal, scale=self.scale, enable_gqa=self.gqa,
                    dropout=self.dropout if self.training else 0.0, backends=self.backends)  # (B, T, H, hd)
        return self.wo(y.reshape(B, T, -1))

    def decode(self, x: torch.Tensor, positions: Positions, cache, pos: int | torch.Tensor,
               mode: DecodeMode = DecodeMode()) -> torch.Tensor:
        """Causal attention of x (B,T,d) at positions pos.. over the cache, after appending its k, v.

        One algorithm: a mode (an MLA choice) is refused."""
        mla = mode.resolved(self.cfg).mla
        _expect_cache(cache, attention_kind(self.cfg).cache_layout(self.cfg, mla), mla)
        B, T, _ = x.shape
        q, k, v = self.qkv(x, positions)
        k, v = cache.update(pos, k, v)  # (B, KV, S, hd): S = pos + T, or the static length
        y = _cached_sdpa(q.transpose(1, 2), k, v, scale=self.scale, enable_gqa=self.gqa,
                         backends=self.decode_backends if T == 1 else self.backends,
                         length=valid_length(pos), bias=positions.bias)  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    @torch.no_grad()
    def probs(self, x: torch.Tensor, positions: Positions, causal: bool = True) -> torch.Tensor:
        """Attention weights (B, H, T, T), computed the plain way."""
        q, k, _ = self.qkv(x, positions)
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        return _reference_probs(q.transpose(1, 2), k.transpose(1, 2), self.scale, causal, positions.bias)


@attention_module("mla")
class MLA(nn.Module):
    """Multi-head Latent Attention (parameter layout and names of DeepSeek-V3's inference code).

    q: full rank ``wq`` d×H·(nope+rope), or low rank ``wq_a`` d×q_lora → RMSNorm ``q_norm`` → ``wq_b``.
    kv: ``wkv_a`` gives the latent c_kv (``kv_norm``, RMSNorm, on it) and, with ``mla_rope=shared``, one
    RoPE key k_pe shared by all heads (DeepSeek-V2/V3: d×(kv_lora_rank + rope)); ``wkv_b``
    kv_lora_rank×H·(nope+v) up-projects per-head no-RoPE keys and values, with ``mla_rope=per_head``
    also each head's RoPE key (kv_lora_rank×H·(nope+rope+v)), rotated after the up-projection; ``wo``
    H·v×d. Softmax scale 1/sqrt(nope + rope). What a latent decoder caches: c_kv and k_pe
    (kv_lora_rank + qk_rope_head_dim numbers per token and layer), or c_kv alone for per_head.
    """

    def __init__(self, cfg: ModelConfig, sdpa_backend: str = "auto"):
        super().__init__()
        d, H = cfg.d_model, cfg.n_heads
        self.cfg, self.per_head = cfg, cfg.mla_rope == "per_head"
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope + self.rope_dim
        self.up = [self.nope, self.rope_dim, self.v_dim] if self.per_head else [self.nope, self.v_dim]
        self.scale = 1.0 / math.sqrt(self.qk_dim)
        self.dropout = cfg.dropout
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(d, H * self.qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, H * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_lora_rank + (0 if self.per_head else self.rope_dim), bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, H * sum(self.up), bias=False)
        self.wo = nn.Linear(H * self.v_dim, d, bias=False)
        self.w_in: nn.Linear | None = None  # wq (or wq_a) and wkv_a joined (join_projections), which then are gone
        self.backends = sdpa_backends(sdpa_backend, self.qk_dim, self.v_dim)
        self.decode_backends = decode_backends(sdpa_backend)

    def join_projections(self) -> int:
        """Replace the two projections of the block's input, wq (wq_a with a low-rank query) and wkv_a, by
        one ``w_in`` (``join_linears``): one GEMM per step instead of two."""
        if self.w_in is not None:
            return 0
        name = "wq" if self.q_lora_rank == 0 else "wq_a"
        first = getattr(self, name)
        self._in_widths = [first.out_features, self.wkv_a.out_features]
        self.w_in = join_linears([first, self.wkv_a])
        delattr(self, name)
        del self.wkv_a
        return 1

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two projections of x: the query's (wq, or wq_a) and the latent's (wkv_a), by one GEMM when joined."""
        if self.w_in is not None:
            return self.w_in(x).split(self._in_widths, -1)
        return (self.wq if self.q_lora_rank == 0 else self.wq_a)(x), self.wkv_a(x)

    def query(self, q: torch.Tensor, positions: Positions):
        """q_nope (B,T,H,nope) and rotated q_pe (B,T,H,rope) from the query projection ``q`` (:meth:`inputs`)."""
        B, T, _ = q.shape
        q = q if self.q_lora_rank == 0 else self.wq_b(self.q_norm(q))
        q_nope, q_pe = q.view(B, T, -1, self.qk_dim).split([self.nope, self.rope_dim], dim=-1)
        return q_nope, apply_rope(q_pe, positions.cos, positions.sin)

    def latent(self, kv: torch.Tensor, positions: Positions) -> tuple[torch.Tensor, ...]:
        """What a latent cache holds, from the latent projection ``kv`` (:meth:`inputs`): normalised c_kv
        (B,T,kv_lora_rank), and for mla_rope=shared the rotated k_pe (B,T,rope)."""
        if self.per_head:
            return (self.kv_norm(kv),)
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), positions.cos, positions.sin).squeeze(2)
        return self.kv_norm(c_kv), k_pe

    def expand(self, latent: tuple[torch.Tensor, ...], key_rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Up-project latents (c_kv (B,S,c)[, k_pe (B,S,rope)]) to per-head k (B,S,H,nope+rope), v (B,S,H,v).

        per_head: the RoPE keys come out of wkv_b and are rotated with ``key_rope`` (cos, sin (S, rope))."""
        c_kv = latent[0]
        B, S, _ = c_kv.shape
        parts = self.wkv_b(c_kv).view(B, S, -1, sum(self.up)).split(self.up, dim=-1)
        if self.per_head:
            k_nope, k_pe, v = parts
            k_pe = apply_rope(k_pe, *key_rope)
        else:
            (k_nope, v), k_pe = parts, latent[1][:, :, None, :].expand(-1, -1, parts[0].shape[2], -1)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def qkv(self, x: torch.Tensor, positions: Positions):
        """Full per-head q, k (B,T,H,nope+rope) and v (B,T,H,v): the naive (uncompressed) form."""
        q, kv = self.inputs(x)
        q_nope, q_pe = self.query(q, positions)
        k, v = self.expand(self.latent(kv, positions), (positions.cos, positions.sin))
        return torch.cat([q_nope, q_pe], dim=-1), k, v

    def forward(self, x: torch.Tensor, positions: Positions, causal: bool = True) -> torch.Tensor:
        B, T, _ = x.shape
        y = _attend(*self.qkv(x, positions), positions, causal=causal, scale=self.scale, enable_gqa=False,
                    dropout=self.dropout if self.training else 0.0, backends=self.backends)  # (B, T, H, v)
        return self.wo(y.reshape(B, T, -1))

    def decode(self, x: torch.Tensor, positions: Positions, cache, pos: int | torch.Tensor,
               mode: DecodeMode = DecodeMode()) -> torch.Tensor:
        """Causal attention of x (B,T,d) at positions pos.. over the cache, after appending to it.

        ``naive``: the cache holds up-projected per-head k and v; plain cached SDPA.
        ``absorbed``: the cache holds c_kv and k_pe only. Decode steps (T = 1) then run as
        DeepSeek-V3's ``absorb`` mode: W_UK (wkv_b's key rows) folds into the query, q_nope·W_UK
        scores against c_kv directly, and W_UV maps the latent-weighted sum to values afterwards,
        so the step reads (kv_lora_rank + rope) numbers per cached token instead of
        H·(nope+rope+v). Prompt chunks (T > 1) are compute-bound, where absorption costs FLOPs
        (scores over kv_lora_rank instead of nope per head), so they up-project the cached latents
        and run fused SDPA, as DeepSeek's serving stacks prefill.
        ``expand``: the latent cache, every step up-projected like a prompt chunk (the only latent
        form per-head RoPE keys allow, each rotated at its own position).
        """
        mla = mode.resolved(self.cfg).mla
        _expect_cache(cache, attention_kind(self.cfg).cache_layout(self.cfg, mla), mla)
        B, T, _ = x.shape
        q, kv = self.inputs(x)
        q_nope, q_pe = self.query(q, positions)  # (B,T,H,nope), (B,T,H,rope)
        latent = self.latent(kv, positions)  # c_kv (B,T,c)[, k_pe (B,T,rope)]
        if mla == "naive":
            k, v = cache.update(pos, *self.expand(latent, (positions.cos, positions.sin)))  # (B,H,S,qk), (B,H,S,v)
        else:
            cached = cache.update(pos, *latent)  # (B,S,c)[, (B,S,rope)]
            if mla == "absorbed" and T == 1:
                return self._absorbed_step(q_nope[:, 0], q_pe[:, 0], *cached, valid_length(pos), mode.kernel)
            S = cached[0].shape[1]
            k, v = (t.transpose(1, 2) for t in self.expand(cached, positions.key_rotation(S) if self.per_head else None))
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # (B,H,T,qk)
        y = _cached_sdpa(q, k, v, scale=self.scale, enable_gqa=False, length=valid_length(pos), bias=positions.bias,
                         backends=self.decode_backends if T == 1 else self.backends).transpose(1, 2)  # (B,T,H,v)
        return self.wo(y.reshape(B, T, -1))

    def _absorbed_step(self, q_nope, q_pe, c_kv, k_pe, length, kernel: str) -> torch.Tensor:
        """One query per sequence, q_nope (B,H,nope), q_pe (B,H,rope), over the latent cache -> (B,1,d)."""
        B = q_nope.shape[0]
        w_uk, w_uv = self.wkv_b.weight.view(-1, self.nope + self.v_dim, self.kv_lora_rank).split(
            [self.nope, self.v_dim], dim=1)  # (H,nope,c), (H,v,c)
        q_lat = absorb_query(q_nope, w_uk)  # (B,H,c): at a few sequences one Triton launch on CUDA
        # (B,H,v): the latent-weighted sum through W_UV (at a few sequences in the kernel's merge launch)
        y = latent_attention(q_lat, q_pe, c_kv, k_pe, self.scale, kernel=kernel, lengths=length, w_uv=w_uv)
        return self.wo(y.reshape(B, 1, -1))

    @torch.no_grad()
    def probs(self, x: torch.Tensor, positions: Positions, causal: bool = True) -> torch.Tensor:
        q, k, _ = self.qkv(x, positions)
        return _reference_probs(q.transpose(1, 2), k.transpose(1, 2), self.scale, causal, positions.bias)


def make_attention(cfg: ModelConfig, sdpa_backend: str = "auto") -> nn.Module:
    """The module registered for ``cfg.attention``."""
    return ATTENTION_MODULES[cfg.attention](cfg, sdpa_backend)

