"""Attention kinds and position encodings as data: one object per kind, torch-free.

Each attention kind (``model.attention``: mha, gqa, mqa, mla) holds in one place the recipe keys it
reads, how it derives and checks them, its closed forms (parameters by projection, attention FLOPs
per decoded token, what its decode cache holds per token) and its decode modes with the rules that
refuse a mode. ``scaletool.config`` builds the recipe's switch tables from :data:`ATTENTION_KINDS` and
:data:`POSITION_KINDS`, ``scaletool.analytic`` takes its closed forms from here, and the torch side
finds its parts through the kind's name: the module class (``scaletool.model.attention``, registered
per kind), the cache (``scaletool.model.cache``, built from :class:`CacheLayout`) and the
tensor-parallel plan (``scaletool.engines.tp.ATTENTION_PLANS``). Nothing here imports torch, so
``estimate`` stays fast. Adding a kind is a new object here, its module class registered under the
name and, for tensor parallelism, its plan (docs/extending.md).

Conventions: FLOPs count a multiply-add as 2; "per decoded token" is one query of a batch-1 decode
step over ``keys`` cached positions (the new token included), all projections of one layer counted.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

#: How MLA decodes (DeepSeek-V3's ``attn_impl`` plus the re-expanding form), in preference order.
#: ``absorbed``: latent cache, W_UK folded into the query and W_UV applied after attention;
#: ``expand``: latent cache, keys and values up-projected from every cached latent at every step;
#: ``naive``: up-projected per-head keys and values cached.
MLA_MODES = ("absorbed", "expand", "naive")

#: The algorithm a decode step runs: attention over cached K/V, the absorbed latent attention, or
#: attention over K/V re-expanded from the latent cache.
DecodePath = Literal["kv", "absorbed", "expand"]


@dataclass(frozen=True)
class CacheLayout:
    """What a decode cache holds per token and layer: ``kv`` = per-head tensors (heads, width) read by
    SDPA, ``latent`` = per-token vectors (width,) shared by every head."""

    kind: Literal["kv", "latent"]
    tensors: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def elements(self) -> int:
        """Numbers cached per token and layer."""
        return sum(math.prod(shape) for _, shape in self.tensors)


def _rope_dims_problem(m: Any) -> list[str]:
    if m.qk_rope_head_dim % 2:
        return [f"model.qk_rope_head_dim: {m.qk_rope_head_dim} is odd; RoPE rotates pairs of dims"]
    return []


def _q_params(m: Any, qk: int) -> dict[str, int]:
    """Query projection: full rank d·H·qk, or DeepSeek's low rank wq_a d·q_lora, q_norm q_lora, wq_b q_lora·H·qk."""
    d, H = m.d_model, m.n_heads
    if not m.q_lora_rank:
        return {"wq": d * H * qk}
    q = m.q_lora_rank
    return {"wq_a": d * q, "q_norm": q, "wq_b": q * H * qk}


def matmul_params(params: dict[str, int]) -> int:
    """The weights of a kind's ``params`` that take part in a matmul (norms and biases are element-wise)."""
    return sum(v for k, v in params.items() if not k.endswith(("norm", "bias")))


@dataclass(frozen=True)
class AttentionKind(ABC):
    """One value of ``model.attention``. Subclasses give the closed forms (the abstract methods); ``m``
    is a ``ModelConfig`` (duck-typed: this module sits below ``scaletool.config``)."""

    name: str
    reads: tuple[str, ...]  # the attention-specific recipe keys this kind uses (others' are inactive)

    @abstractmethod
    def derived(self, m: Any) -> dict[str, Any]:
        """Values of the fields this kind derives (set on the config without marking them given)."""

    @abstractmethod
    def problems(self, m: Any) -> list[str]:
        """One line per rule the resolved config breaks."""

    @abstractmethod
    def qk_head_dim(self, m: Any) -> int:
        """Query/key width per head that the softmax scale and SDPA see."""

    @abstractmethod
    def v_head_dim(self, m: Any) -> int:
        ...

    @abstractmethod
    def params(self, m: Any) -> dict[str, int]:
        """Parameters of one layer's attention by projection, named as the module's attributes."""

    def score_flops(self, m: Any, keys: int) -> int:
        """QKᵀ plus AV for one query over ``keys`` keys, all heads: 2·H·keys·(d_qk + d_v)."""
        return 2 * m.n_heads * keys * (self.qk_head_dim(m) + self.v_head_dim(m))

    # -- decoding ------------------------------------------------------------------------------

    def decode_modes(self, m: Any) -> tuple[str, ...]:
        """The decode modes this model accepts, the default first; () when it has one algorithm."""
        return ()

    def default_decode_mode(self, m: Any) -> str | None:
        modes = self.decode_modes(m)
        return modes[0] if modes else None

    def decode_problem(self, m: Any, mode: str | None) -> str | None:
        """Why ``mode`` cannot decode this model (None: it can; None as the mode means the default)."""
        if mode is None:
            return None
        if mode not in MLA_MODES:
            return f"mla_mode: expected one of {', '.join(MLA_MODES)}, got {str(mode)[:40]!r}"
        if not self.decode_modes(m):
            return f"mla_mode {mode} is for attention=mla recipes; this one is {self.name}"
        return None

    def resolve_mode(self, m: Any, mode: str | None) -> str | None:
        """``mode`` checked (ValueError with the reason), or the default when None."""
        problem = self.decode_problem(m, mode)
        if problem:
            raise ValueError(problem)
        return self.default_decode_mode(m) if mode is None else mode

    @abstractmethod
    def cache_layout(self, m: Any, mode: str | None) -> CacheLayout:
        ...

    def decode_path(self, m: Any, mode: str | None) -> DecodePath:
        return "kv"

    def decode_label(self, m: Any, mode: str | None) -> str:
        """The attention type as decode results report it (a mode other than the default is named)."""
        return self.name

    @abstractmethod
    def decode_flops_per_layer(self, m: Any, keys: int, mode: str | None) -> int:
        """FLOPs of one layer's attention for one decoded token over ``keys`` cached positions."""

    def tp_problems(self, m: Any, degree: int) -> list[str]:
        """Why this kind's K/V heads do not split over ``degree`` tensor-parallel ranks (the query heads'
        rule is the same for every kind and lives with the engine's layout rules)."""
        return []

    def tp_kv_heads(self, m: Any, degree: int) -> int:
        """K/V heads one of ``degree`` tensor-parallel ranks holds."""
        return m.n_kv_heads // degree

    def tp_replicated(self, m: Any) -> list[int]:
        """Sizes of this kind's weight tensors every tensor-parallel rank holds whole (engines.tp's plan)."""
        return []

    @abstractmethod
    def activation_elements(self, m: Any) -> int:
        """Elements autograd keeps per token in one layer's attention (fused SDPA, eager mode): its saved
        inputs and outputs, no T×T scores and not the fp32 log-sum-exp."""


@dataclass(frozen=True)
class MHAFamily(AttentionKind):
    """MHA (``n_kv_heads`` = ``n_heads``), GQA (groups of query heads share a KV head, Ainslie et al. 2023)
    and MQA (one KV head, Shazeer 2019), in the Llama layout: wq d·H·hd, wk and wv d·KV·hd each, wo H·hd·d,
    no biases unless ``qkv_bias`` (Qwen2: on wq, wk, wv). RoPE, when it is the position encoding,
    rotates the first int(head_dim · partial_rotary_factor) channels of every q/k head (Hugging Face's rule).
    """

    kv_heads: Literal["n_heads", "one", "given"] = "n_heads"

    def derived(self, m: Any) -> dict[str, Any]:
        rotated = int(m.head_dim * m.partial_rotary_factor) if POSITION_KINDS[m.position_encoding].rotary else 0
        out = {"qk_rope_head_dim": rotated}
        if self.kv_heads != "given":
            out["n_kv_heads"] = m.n_heads if self.kv_heads == "n_heads" else 1
        return out

    def problems(self, m: Any) -> list[str]:
        out = []
        if self.kv_heads == "given":
            if m.n_kv_heads is None:
                out.append(f"model.n_kv_heads: required for attention={self.name}")
            elif m.n_heads % m.n_kv_heads:
                out.append(f"model.n_heads: {m.n_heads} is not divisible by n_kv_heads={m.n_kv_heads}")
        r = m.qk_rope_head_dim
        if POSITION_KINDS[m.position_encoding].rotary and (r < 2 or r % 2):
            out.insert(0, f"model.partial_rotary_factor: {m.partial_rotary_factor} of head_dim={m.head_dim} rotates "
                          f"{r} channels; RoPE rotates pairs, so it needs an even number >= 2")
        return out

    def qk_head_dim(self, m: Any) -> int:
        return m.head_dim

    def v_head_dim(self, m: Any) -> int:
        return m.head_dim

    def params(self, m: Any) -> dict[str, int]:
        d, H, KV, hd = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
        out = {"wq": d * H * hd, "wk": d * KV * hd, "wv": d * KV * hd, "wo": H * hd * d}
        if m.qkv_bias:
            out["qkv_bias"] = (H + 2 * KV) * hd
        return out

    def cache_layout(self, m: Any, mode: str | None) -> CacheLayout:
        """K and V per KV head: 2·n_kv_heads·head_dim per token and layer (DeepSeek-V2, Table 1)."""
        return CacheLayout("kv", (("k", (m.n_kv_heads, m.head_dim)), ("v", (m.n_kv_heads, m.head_dim))))

    def decode_flops_per_layer(self, m: Any, keys: int, mode: str | None) -> int:
        """Every projection once for the new token, then one query over ``keys`` cached K/V."""
        return 2 * matmul_params(self.params(m)) + self.score_flops(m, keys)

    def tp_problems(self, m: Any, degree: int) -> list[str]:
        """GQA's K/V heads split like the query heads; MHA's are the query heads, MQA replicates its one."""
        if self.kv_heads == "given" and m.n_kv_heads % degree:
            return [f"model.n_kv_heads: {m.n_kv_heads} K/V heads do not split over parallel.tensor_parallel="
                    f"{degree} ranks (attention=mqa replicates its single K/V head instead)"]
        return []

    def tp_kv_heads(self, m: Any, degree: int) -> int:
        return m.n_kv_heads if self.kv_heads == "one" else m.n_kv_heads // degree

    def tp_replicated(self, m: Any) -> list[int]:
        """MQA's K/V projections (and their biases): its one K/V head is not split."""
        if self.kv_heads != "one":
            return []
        d, hd = m.d_model, m.head_dim
        return [d * hd, d * hd] + ([hd, hd] if m.qkv_bias else [])

    def activation_elements(self, m: Any) -> int:
        """q and the output (H·hd each), k and v (KV·hd each)."""
        H, hd, KV = m.n_heads, m.head_dim, m.n_kv_heads
        return 2 * H * hd + 2 * KV * hd


ABSORB_REFUSED = ("mla_rope=per_head cannot absorb W_UK into the query: each cached key's RoPE part is RoPE_t(W_UR·c_t), "
                  "rotated at its own position t, so the rotation sits between W_UR and the query and no product can "
                  "be precomputed; decode re-expands the keys from the latent every step (mla_mode expand) or caches "
                  "them expanded (naive)")


@dataclass(frozen=True)
class MLAKind(AttentionKind):
    """Multi-head Latent Attention. Every head reads one normalised latent c_kv (``kv_lora_rank``) through
    ``wkv_a`` d·kv_lora → ``kv_norm`` → ``wkv_b``, which up-projects per-head no-RoPE keys and values; the
    query is full rank (``wq``) or low rank (``wq_a``, ``q_norm``, ``wq_b``); ``wo`` H·v·d. The RoPE part
    of the keys (``model.mla_rope``):

    - ``shared`` (DeepSeek-V2 §2.1.3, V3's inference code): one decoupled RoPE key of qk_rope_head_dim,
      taken from the hidden state by ``wkv_a`` (d·(kv_lora + rope)) and shared by all heads. The cache
      holds c_kv and k_pe; decode absorbs W_UK into the query.
    - ``per_head``: each head's RoPE key is up-projected from the
      latent with the rest (``wkv_b`` kv_lora·H·(nope + rope + v)) and rotated after. The cache holds
      c_kv only, but W_UK cannot be absorbed (:data:`ABSORB_REFUSED`). ``qk_nope_head_dim: 0`` rotates
      whole heads (the price transformer's MLA).

    Defaults: qk_nope_head_dim and v_head_dim = head_dim, qk_rope_head_dim = head_dim/2 (even).
    """

    def derived(self, m: Any) -> dict[str, Any]:
        hd = m.head_dim
        defaults = {"qk_nope_head_dim": hd, "v_head_dim": hd, "qk_rope_head_dim": max(2, hd // 4 * 2)}
        return {"n_kv_heads": m.n_heads, **{k: v for k, v in defaults.items() if getattr(m, k) is None}}

    def problems(self, m: Any) -> list[str]:
        out = []
        if m.kv_lora_rank == 0:
            out.append("model.kv_lora_rank: must be > 0 for attention=mla (the KV latent width)")
        out += _rope_dims_problem(m)
        if m.qk_nope_head_dim == 0 and m.mla_rope == "shared":
            out.append("model.qk_nope_head_dim: 0 leaves mla_rope=shared one key for every head (the shared RoPE "
                       "key); a no-RoPE part is needed (0 is for mla_rope=per_head)")
        if not POSITION_KINDS[m.position_encoding].rotary:
            out.append(f"model.position_encoding: attention=mla defines only rope (its decoupled key is the RoPE part "
                       f"of q and k), got {m.position_encoding}")
        return out

    def qk_head_dim(self, m: Any) -> int:
        return m.qk_nope_head_dim + m.qk_rope_head_dim

    def v_head_dim(self, m: Any) -> int:
        return m.v_head_dim

    def _up_width(self, m: Any) -> int:
        """Per-head width wkv_b up-projects: no-RoPE key and value (+ the RoPE key for per_head)."""
        return m.qk_nope_head_dim + m.v_head_dim + (m.qk_rope_head_dim if m.mla_rope == "per_head" else 0)

    def params(self, m: Any) -> dict[str, int]:
        d, H, c, r = m.d_model, m.n_heads, m.kv_lora_rank, m.qk_rope_head_dim
        out = _q_params(m, self.qk_head_dim(m))
        out.update(wkv_a=d * (c + (r if m.mla_rope == "shared" else 0)), kv_norm=c, wkv_b=c * H * self._up_width(m),
                   wo=H * m.v_head_dim * d)
        return out

    def tp_replicated(self, m: Any) -> list[int]:
        """The latent path: wkv_a and kv_norm (and wq_a, q_norm with a low-rank query)."""
        d = m.d_model
        out = [d * (m.kv_lora_rank + m.qk_rope_head_dim), m.kv_lora_rank]
        return out + ([d * m.q_lora_rank, m.q_lora_rank] if m.q_lora_rank else [])

    def activation_elements(self, m: Any) -> int:
        """q, k and the output; v is a view into wkv_b's output, so SDPA's saved v keeps the no-RoPE keys
        alive with it (H·(nope + v)); the latent split and kv_norm's output (2·kv_lora + rope); a
        low-rank query's latent and its norm (2·q_lora)."""
        H, c, r, qk, v = m.n_heads, m.kv_lora_rank, m.qk_rope_head_dim, self.qk_head_dim(m), m.v_head_dim
        out = H * qk + H * qk + H * (m.qk_nope_head_dim + v) + H * v + (2 * c + r)
        return out + (2 * m.q_lora_rank if m.q_lora_rank else 0)

    def decode_modes(self, m: Any) -> tuple[str, ...]:
        return MLA_MODES if m.mla_rope == "shared" else ("expand", "naive")

    def decode_problem(self, m: Any, mode: str | None) -> str | None:
        if mode == "absorbed" and m.mla_rope == "per_head":
            return f"mla_mode absorbed: {ABSORB_REFUSED}"
        return super().decode_problem(m, mode)

    def cache_layout(self, m: Any, mode: str | None) -> CacheLayout:
        """Latent modes: c_kv (+ the shared rotated k_pe): kv_lora_rank (+ qk_rope_head_dim) per token and layer
        (DeepSeek-V2 Table 1). naive: up-projected keys and values, n_heads·(qk_head_dim + v_head_dim)."""
        mode = self.resolve_mode(m, mode)
        if mode == "naive":
            return CacheLayout("kv", (("k", (m.n_heads, self.qk_head_dim(m))), ("v", (m.n_heads, m.v_head_dim))))
        tensors = (("c_kv", (m.kv_lora_rank,)),)
        if m.mla_rope == "shared":
            tensors += (("k_pe", (m.qk_rope_head_dim,)),)
        return CacheLayout("latent", tensors)

    def decode_path(self, m: Any, mode: str | None) -> DecodePath:
        mode = self.resolve_mode(m, mode)
        return "kv" if mode == "naive" else mode

    def decode_label(self, m: Any, mode: str | None) -> str:
        mode = self.resolve_mode(m, mode)
        label = "mla" if m.mla_rope == "shared" else "mla-per_head"
        return label if mode == self.default_decode_mode(m) else f"{label}-{mode}"

    def decode_flops_per_layer(self, m: Any, keys: int, mode: str | None) -> int:
        """Per decoded token, one layer (DeepSeek-V3 inference code's naive and absorb paths, and expand):

        - projections of the new token: the query, wkv_a, wo;
        - naive: wkv_b on the new token, then one query over ``keys`` cached K/V: 2·H·keys·(qk + v);
        - expand: wkv_b on every cached latent (2·keys·kv_lora·H·up-width), then the same attention;
        - absorbed: q_nope·W_UK (2·H·nope·kv_lora), scores over the latent and the RoPE key
          (2·H·keys·(kv_lora + rope)), the weighted sum of latents (2·H·keys·kv_lora), W_UV (2·H·kv_lora·v).
        """
        mode = self.resolve_mode(m, mode)
        p = self.params(m)
        H, c = m.n_heads, m.kv_lora_rank
        base = 2 * (matmul_params(p) - p["wkv_b"])  # query, wkv_a, wo
        if mode == "naive":
            return base + 2 * p["wkv_b"] + self.score_flops(m, keys)
        if mode == "expand":
            return base + 2 * keys * p["wkv_b"] + self.score_flops(m, keys)
        return base + 2 * H * (m.qk_nope_head_dim * c + keys * (2 * c + m.qk_rope_head_dim) + c * m.v_head_dim)


#: model.attention -> its kind
ATTENTION_KINDS: dict[str, AttentionKind] = {
    k.name: k for k in (
        MHAFamily("mha", ("qkv_bias", "partial_rotary_factor"), "n_heads"),
        MHAFamily("gqa", ("n_kv_heads", "qkv_bias", "partial_rotary_factor"), "given"),
        MHAFamily("mqa", ("qkv_bias", "partial_rotary_factor"), "one"),
        MLAKind("mla", ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                        "mla_rope")),
    )
}


def attention_kind(m: Any) -> AttentionKind:
    return ATTENTION_KINDS[m.attention]


# ---------------------------------------------------------------------------------------------
# Position encodings


@dataclass(frozen=True)
class PositionKind:
    """One value of ``model.position_encoding``: how the model sees token order.

    ``rotary``: q and k rotated inside attention (RoPE, Su et al. 2021). ``bias``: per-head linear biases
    added to the attention scores (ALiBi, Press et al. 2022). ``table``: a max_seq_len × d_model table
    added to the embeddings, ``learned`` (parameters: GPT-2, BERT) or ``fixed`` (sinusoids, Vaswani et
    al. 2017 §3.5, no parameters). None of them: NoPE (Kazemnejad et al. 2023), order from the causal
    mask alone.
    """

    name: str
    reads: tuple[str, ...] = ()
    rotary: bool = False
    bias: bool = False
    table: Literal["learned", "fixed"] | None = None

    def params(self, m: Any) -> int:
        return m.max_seq_len * m.d_model if self.table == "learned" else 0

    @property
    def extrapolates(self) -> bool:
        """Whether positions past max_seq_len can be decoded (a learned table has max_seq_len rows)."""
        return self.table != "learned"

    def derived(self, m: Any) -> dict[str, Any]:
        return {}

    def problems(self, m: Any) -> list[str]:
        return []


POSITION_KINDS: dict[str, PositionKind] = {
    k.name: k for k in (
        PositionKind("rope", ("rope_theta", "partial_rotary_factor"), rotary=True),
        PositionKind("learned", table="learned"),
        PositionKind("sinusoidal", table="fixed"),
        PositionKind("alibi", bias=True),
        PositionKind("none"),
    )
}


def position_kind(m: Any) -> PositionKind:
    return POSITION_KINDS[m.position_encoding]
