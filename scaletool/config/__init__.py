"""Recipes: one YAML file, five sections, validated once at the edge.

A recipe has the sections ``model``, ``train``, ``parallel``, ``data`` and ``profile``. Unknown keys
are errors (with a did-you-mean), missing keys take the defaults documented on each field, and
fields whose default depends on others (``n_kv_heads``, ``head_dim``, the MLA head dims) are
resolved once here so every later stage sees concrete numbers.

Keys that belong to another attention type, FFN type or position encoding than the one selected are
*inactive*, not errors (:data:`SWITCHES`; the attention kinds and position encodings themselves, with
their closed forms, are :mod:`scaletool.kinds.attention`): switching ``model.attention`` from mla to mha
needs no other change. An inactive key is reset to its default, listed by ``recipe show`` and left
out of :meth:`Recipe.digest`, so the MHA point of an MLA-based sweep has the key of a plain MHA recipe.

Every problem becomes one line in a :class:`RecipeError`; the CLI prints them and exits with 2.
Input is untrusted: YAML is read by :mod:`scaletool.yaml_input` (bounded, safe loader); sizes are bounded (every
integer to int64, widths and counts to the limits below, the weights to :data:`MAX_WEIGHTS`) so that
no later stage overflows or hangs; floats are finite; echoed values are cut (:func:`~scaletool.errors.echo`).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from scaletool.config.base import (  # noqa: F401 (the schema's names, importable from scaletool.config as before)
    ATTENTION_NAMES,
    BYTE_VOCAB,
    DTYPE_BYTES,
    INT64,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    MAX_WEIGHTS,
    MAX_WIDTH,
    SECTIONS,
    _derive,
    _Section,
    _takes,
    _width,
)
from scaletool.config.sections import (  # noqa: F401
    DataConfig,
    MonitorConfig,
    ParallelConfig,
    ProfileConfig,
    TrainConfig,
)
from scaletool.errors import RecipeError, echo, shorten, validation_lines
from scaletool.kinds import attention as attention_kinds
from scaletool.kinds.attention import attention_kind, position_kind
from scaletool.kinds.engines import engine_problems, layout_problems
from scaletool.kinds.float8 import float8_problems
from scaletool.kinds.pipeline import pipeline_problems
from scaletool.resources import RECIPE, find_recipe
from scaletool.yaml_input import check_tree, parse_override, read_yaml, set_dotted
from scaletool.yaml_input import key_text as _key_text

MOE_FIELDS = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
              "first_k_dense_replace", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "n_group",
              "topk_group", "aux_loss_alpha", "bias_update_speed", "moe_dispatch", "capacity_factor")


class ModelConfig(_Section):
    """The network. Names match DeepSeek-V2/V3 and Llama configs where they overlap."""

    attention: Literal[ATTENTION_NAMES] = "mha"
    d_model: int = _width(512)
    n_layers: int = Field(8, gt=0, le=MAX_LAYERS)
    n_heads: int = Field(8, gt=0, le=MAX_HEADS)
    n_kv_heads: int | None = Field(None, gt=0, le=MAX_HEADS, description="gqa: KV heads; mha, mla: n_heads, mqa: 1")
    head_dim: int | None = _width(None, "default d_model // n_heads")
    kv_lora_rank: int = _width(0, "mla: KV latent width (> 0)", zero_ok=True)
    q_lora_rank: int = _width(0, "mla: query latent width; 0 = full-rank query", zero_ok=True)
    qk_nope_head_dim: int | None = _width(None, "mla: no-RoPE part of q/k; default head_dim (0: mla_rope=per_head "
                                          "rotating whole heads)", zero_ok=True)
    qk_rope_head_dim: int | None = _width(
        None, "mla: the RoPE part of q/k (default head_dim // 2); others: derived, "
        "partial_rotary_factor · head_dim with position_encoding=rope, else 0", zero_ok=True)
    v_head_dim: int | None = _width(None, "mla: value head dim; default head_dim")
    mla_rope: Literal["shared", "per_head"] = Field(
        "shared", description="mla: the RoPE key, shared (DeepSeek: one decoupled key from the hidden state) or "
        "per_head (up-projected from the latent per head; decode cannot absorb W_UK)")
    partial_rotary_factor: float = Field(
        1.0, gt=0, le=1, description="mha/gqa/mqa: fraction of each q/k head RoPE rotates (HF's name)")
    position_encoding: Literal["rope", "learned", "sinusoidal", "alibi", "none"] = Field(
        "rope", description="rope (in attention), learned or sinusoidal (a max_seq_len × d_model table added to the "
        "embeddings), alibi (per-head linear score biases), none (NoPE); mla: rope only")
    norm_placement: Literal["pre", "post"] = Field(
        "pre", description="pre: x + f(norm(x)), final norm after the last block; post: norm(x + f(x)) (original "
        "Transformer, BERT), no separate final norm")
    qkv_bias: bool = Field(False, description="mha/gqa/mqa: bias on the q, k, v projections (Qwen2)")
    ffn: Literal["swiglu", "gelu", "relu", "moe"] = "swiglu"
    intermediate_size: int = _width(2048, "dense FFN width (moe: of the first_k_dense_replace layers)")
    # Mixture of experts (ffn=moe), DeepSeek-V2/V3 names; see scaletool/model/moe.py.
    n_routed_experts: int = Field(0, ge=0, le=MAX_EXPERTS, description="moe: routed experts per MoE layer")
    n_shared_experts: int = Field(0, ge=0, le=MAX_EXPERTS,
                                  description="moe: always-active experts, one SwiGLU of n·moe_intermediate_size")
    num_experts_per_tok: int = Field(0, ge=0, le=MAX_EXPERTS, description="moe: routed experts per token (top-k)")
    moe_intermediate_size: int = _width(0, "moe: width of one expert's SwiGLU", zero_ok=True)
    first_k_dense_replace: int = Field(0, ge=0, le=MAX_LAYERS, description="moe: leading layers with the dense FFN")
    scoring_func: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="moe: router scores; sigmoid adds V3's selection bias (a buffer, no gradient)")
    norm_topk_prob: bool = Field(False, description="moe: renormalise the top-k gate weights to sum to 1")
    routed_scaling_factor: float = Field(1.0, gt=0, description="moe: multiplies the routed experts' gate weights")
    n_group: int = Field(1, gt=0, le=MAX_EXPERTS, description="moe: expert groups for group-limited routing (1 = off)")
    topk_group: int = Field(1, gt=0, le=MAX_EXPERTS, description="moe: groups a token may route to")
    aux_loss_alpha: float = Field(0.0, ge=0, description="moe: weight of the sequence-wise expert balance loss")
    bias_update_speed: float = Field(0.0, ge=0, description="moe, sigmoid: aux-loss-free bias step per optimizer step")
    moe_dispatch: Literal["dropless", "capacity"] = Field(
        "dropless", description="moe: dropless (tokens sorted by expert, one grouped GEMM per projection, as DeepSeek-V3 "
        "trains) or capacity (a fixed [E, C, d] buffer, drops past capacity); expert parallelism moves either")
    capacity_factor: float = Field(
        1.25, gt=0, description="moe_dispatch=capacity: expert capacity = ceil(factor·tokens·top-k / experts); "
        ">= experts/top-k never drops")
    vocab_size: int = Field(32000, gt=0, le=MAX_VOCAB)
    max_seq_len: int = Field(2048, gt=0, le=MAX_SEQ_LEN, description="position table length and longest training "
                             "sequence")
    rope_theta: float = Field(10000.0, gt=0)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = Field(1e-6, gt=0)
    tie_embeddings: bool = False
    dropout: float = Field(0.0, ge=0, lt=1)
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    task: Literal["lm", "regression"] = "lm"
    n_features: int = _width(20, "regression: input features per time step")
    horizon: int = _width(10, "regression: future values predicted")
    feature_groups: list[int] | None = Field(
        None, description="regression: sizes of the feature groups embedded separately; default 4 near-equal groups")
    notes: list[str] = Field(default_factory=list, description="free text kept with the recipe (from-hf records "
                             "what it imported without modelling); not part of the result key")

    # given value of each inactive key (a key of another attention or FFN type), see resolve_kinds
    _inactive: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _resolve(self) -> ModelConfig:
        problems: list[str] = []
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                problems.append(f"model.d_model: {self.d_model} is not divisible by n_heads={self.n_heads} "
                                "(set model.head_dim to decouple them)")
            _derive(self, "head_dim", max(self.d_model // self.n_heads, 1))
        problems += resolve_kinds(self)
        if self.task == "regression":
            problems += self._regression_problems()
        if not problems and (bound := weights_bound(self)) > MAX_WEIGHTS:
            problems.append(f"model: up to {bound:.3g} weights (n_layers={self.n_layers}, d_model={self.d_model}, "
                            f"vocab_size={self.vocab_size}, ...), past the {MAX_WEIGHTS:.0e} that scaletool models "
                            "(the largest published models have ~2e12)")
        if problems:
            raise RecipeError(problems)
        return self

    def _regression_problems(self) -> list[str]:
        if self.feature_groups is None:
            n, g = self.n_features, min(4, self.n_features)
            _derive(self, "feature_groups", [n // g + (1 if i < n % g else 0) for i in range(g)])
        groups = self.feature_groups
        if any(s <= 0 for s in groups):
            return [f"model.feature_groups: sizes must be positive, got {echo(groups)}"]
        if sum(groups) != self.n_features:
            return [f"model.feature_groups: sizes sum to {sum(groups)}, not n_features={self.n_features}"]
        if len(groups) > self.d_model:
            return ["model.feature_groups: more groups than d_model channels"]
        return []

    @property
    def inactive(self) -> dict[str, Any]:
        """Keys given for another attention or FFN type, with the values given (the fields hold defaults)."""
        return dict(self._inactive)

    @property
    def n_moe_layers(self) -> int:
        """Layers with a mixture-of-experts FFN (the rest use the dense FFN)."""
        return self.n_layers - self.first_k_dense_replace if self.ffn == "moe" else 0

    # Derived sizes, computed from the resolved fields (never stored).
    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head that the softmax scale and SDPA see."""
        return attention_kind(self).qk_head_dim(self)

    @property
    def v_dim(self) -> int:
        """Value width per head."""
        return attention_kind(self).v_head_dim(self)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def group_widths(self) -> list[int]:
        """Regression: d_model split across the feature groups (the last takes the remainder)."""
        g = len(self.feature_groups)
        w = [self.d_model // g] * g
        w[-1] += self.d_model - sum(w)
        return w


# ---------------------------------------------------------------------------------------------
# Attention and FFN kinds: the keys each reads, and how it resolves them


@dataclass(frozen=True)
class Kind:
    """One value of a switch key (``model.attention``, ``model.ffn`` or ``model.position_encoding``).

    ``reads``: the switch-specific keys this kind uses; a key that another kind of the same switch reads
    is inactive under this one. ``resolve`` fills the kind's derived fields and returns its problems.
    Attention kinds and position encodings come from :mod:`scaletool.kinds.attention`, which holds their
    closed forms beside these rules.
    """

    reads: tuple[str, ...]
    resolve: Callable[[ModelConfig], list[str]]


def _moe(m: ModelConfig) -> list[str]:
    E, k, G = m.n_routed_experts, m.num_experts_per_tok, m.n_group
    problems = [f"model.{key}: must be > 0 for ffn=moe" for key in
                ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size") if not getattr(m, key)]
    if E and k > E:
        problems.append(f"model.num_experts_per_tok: top-{k} of {E} routed experts is impossible")
    if m.first_k_dense_replace >= m.n_layers:
        problems.append(f"model.first_k_dense_replace: {m.first_k_dense_replace} leaves no MoE layer "
                        f"(n_layers={m.n_layers}); a dense model is ffn=swiglu")
    if E and E % G:
        problems.append(f"model.n_group: {E} routed experts do not split into {G} groups")
    elif m.topk_group > G:
        problems.append(f"model.topk_group: {m.topk_group} is more than n_group={G}")
    elif E and k > m.topk_group * (E // G):
        problems.append(f"model.num_experts_per_tok: top-{k} does not fit in topk_group={m.topk_group} "
                        f"groups of {E // G} experts")
    elif G > 1 and m.scoring_func == "sigmoid" and E // G < 2:
        problems.append("model.n_group: sigmoid group scores sum each group's top-2 experts; groups need >= 2")
    # against the default, not "was it given": a resolved recipe dumped into a result carries every field
    if m.moe_dispatch == "dropless" and m.capacity_factor != type(m).model_fields["capacity_factor"].default:
        problems.append("model.capacity_factor: only used by moe_dispatch=capacity (dropless never drops a token)")
    if m.bias_update_speed and m.scoring_func != "sigmoid":
        problems.append("model.bias_update_speed: the aux-loss-free bias belongs to scoring_func=sigmoid (V3)")
    return problems


def _from_spec(spec: attention_kinds.AttentionKind | attention_kinds.PositionKind) -> Kind:
    """A switch entry for a kind of :mod:`scaletool.kinds.attention`: its derived fields set, then its rules."""
    def resolve(m: ModelConfig) -> list[str]:
        for key, value in spec.derived(m).items():
            _derive(m, key, value)
        return spec.problems(m)
    return Kind(spec.reads, resolve)


ATTENTION_KINDS: dict[str, Kind] = {name: _from_spec(k) for name, k in attention_kinds.ATTENTION_KINDS.items()}
POSITION_KINDS: dict[str, Kind] = {name: _from_spec(k) for name, k in attention_kinds.POSITION_KINDS.items()}
FFN_KINDS: dict[str, Kind] = {
    "swiglu": Kind((), lambda m: []),
    "gelu": Kind((), lambda m: []),
    "relu": Kind((), lambda m: []),
    "moe": Kind(MOE_FIELDS, _moe),
}
SWITCHES: dict[str, dict[str, Kind]] = {"attention": ATTENTION_KINDS, "ffn": FFN_KINDS,
                                        "position_encoding": POSITION_KINDS}


def resolve_kinds(m: ModelConfig) -> list[str]:
    """Deactivate the keys of the kinds not selected (reset to their defaults, given values kept in
    ``m.inactive``), then let the selected kinds derive their fields. A key given with its default or
    with the value the selected kind derives anyway (a resolved recipe read back) is not reported."""
    fields = type(m).model_fields
    given: dict[str, Any] = {}
    for switch, kinds in SWITCHES.items():
        kind = kinds[getattr(m, switch)]
        others = {key for k in kinds.values() for key in k.reads} - set(kind.reads)
        for key in sorted(others & m.model_fields_set):
            given[key] = getattr(m, key)
            _derive(m, key, copy.deepcopy(fields[key].default))
            m.model_fields_set.discard(key)
    problems = [p for switch, kinds in SWITCHES.items() for p in kinds[getattr(m, switch)].resolve(m)]
    m._inactive = {k: v for k, v in given.items() if v != fields[k].default and v != getattr(m, k)}
    return problems


def weights_bound(m: ModelConfig) -> int:
    """An upper bound on the model's weights (within ~2× of the exact count, which is
    ``analytic.param_counts``): cheap for any sizes, so absurd models are refused before anything
    builds or counts them. Per layer: the attention kind's exact projections, the widest FFN with its
    router, the norms; plus the vocabulary matrices (or the regression embedding and head) and a
    learned position table."""
    d = m.d_model
    attn = sum(attention_kind(m).params(m).values())
    experts = (m.n_routed_experts + m.n_shared_experts) * m.moe_intermediate_size + m.n_routed_experts
    ffn = 3 * d * (m.intermediate_size + experts)
    outer = 2 * m.vocab_size * d if m.task == "lm" else (m.n_features + m.horizon + 5) * d + m.horizon
    return outer + position_kind(m).params(m) + 2 * d + m.n_layers * (attn + ffn + 4 * d)


def expert_capacity(cfg: ModelConfig, tokens: int) -> int:
    """Slots per expert for one dispatch of ``tokens`` tokens: ceil(capacity_factor·tokens·k/E), at
    most ``tokens`` (an expert sees each token at most once). GShard §2.2 / Switch Transformer §2.2."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return min(tokens, math.ceil(cfg.capacity_factor * tokens * k / E))


class Recipe(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    @model_validator(mode="after")
    def _cross(self) -> Recipe:
        problems = []
        m, d = self.model, self.data
        if m.task == "lm" and d.source == "csv":
            problems.append("data.source: csv is for task=regression; lm takes synthetic, text or tokens")
        if m.task == "regression" and d.source in ("text", "tokens"):
            problems.append(f"data.source: {d.source} is for task=lm; regression takes synthetic or csv")
        if d.source in ("text", "tokens", "csv") and not d.path:
            problems.append(f"data.path: required for data.source={d.source}")
        if m.task == "lm" and d.source == "text" and m.vocab_size < BYTE_VOCAB:
            problems.append(f"model.vocab_size: {m.vocab_size} is too small for the byte-level tokenizer of "
                            f"data.source=text (needs >= {BYTE_VOCAB}: 256 bytes + specials)")
        if m.task == "lm" and d.source == "synthetic" and m.vocab_size < 4:
            problems.append(f"model.vocab_size: {m.vocab_size} is too small for synthetic tokens (need >= 4)")
        if self.seq_len > m.max_seq_len:
            problems.append(f"train.seq_len: {self.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        if self.train.compile_mode != "default" and not self.train.compile:
            problems.append(f"train.compile_mode: {self.train.compile_mode} is torch.compile's mode and needs "
                            "train.compile=true")
        pr = self.profile
        if pr.enabled and pr.wait + pr.warmup + pr.active > self.train.steps:
            problems.append(f"profile: the schedule needs wait + warmup + active = {pr.wait + pr.warmup + pr.active} "
                            f"steps, but train.steps is {self.train.steps}")
        if pr.ranks != "all" and (not pr.ranks or min(pr.ranks) < 0):
            problems.append(f"profile.ranks: 'all' or a non-empty list of ranks >= 0, got {echo(pr.ranks)}")
        problems += layout_problems(self, self.seq_len)
        problems += float8_problems(self)
        problems += pipeline_problems(self)  # parallel.pipeline_* (scaletool.kinds.pipeline)
        if problems:
            raise RecipeError(problems)
        return self

    def engine_problems(self, world_size: int | None = None) -> list[str]:
        """The engine rules train applies before it builds anything (:func:`scaletool.kinds.engines.engine_problems`):
        keys only another engine uses, and the engine's own rules. ``recipe check`` runs them without a world
        size; a launch passes it (DeepSpeed's train_batch_size) and adds its own (engines.check_recipe).
        Other commands (estimate, count, decode) do not use the engine and do not apply them."""
        return engine_problems(self, world_size)

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len

    @property
    def inactive(self) -> dict[str, Any]:
        """Dotted key -> given value of every inactive key (another attention or FFN type's)."""
        return {f"model.{k}": v for k, v in self.model.inactive.items()}

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def given(self) -> dict:
        """The keys the user set, as a raw recipe mapping, inactive ones with their given values: what to
        re-validate with a key changed (derived fields are derived again)."""
        raw = self.model_dump(mode="json", exclude_unset=True)
        for k, v in self.model.inactive.items():
            raw.setdefault("model", {})[k] = v
        return raw

    def digest(self, extra: str = "") -> str:
        """Stable short hash of the resolved recipe (plus ``extra``), for result keys.

        Fields equal to their defaults are left out, so adding a new field with a default to the
        recipe schema keeps the keys of earlier results (a sweep resumes instead of redoing them);
        inactive keys hold their defaults and ``model.notes`` is left out, so neither changes a key.
        One exception: a MoE recipe always hashes ``model.moe_dispatch``. Its default changed from the
        capacity dispatch to dropless, so results of the capacity era must not pass for dropless ones.
        """
        data = self.model_dump(mode="json", exclude_defaults=True, exclude={"model": {"notes"}})
        if self.model.ffn == "moe":
            data.setdefault("model", {})["moe_dispatch"] = self.model.moe_dispatch
        blob = json.dumps(data, sort_keys=True) + extra
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Loading


def _fields_of(model_cls: type[BaseModel], loc: tuple) -> list[str]:
    """Field names valid at ``loc`` (the parent of an offending key)."""
    cls = model_cls
    for part in loc:
        f = cls.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(f, "annotation", None) if f else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:
            return []
    return list(cls.model_fields)


def _problems_from(exc: ValidationError, source: str) -> list[str]:
    return validation_lines(exc, source, root="recipe", known=lambda parent: _fields_of(Recipe, parent),
                            many_keys=lambda parent: f"`scaletool recipe show` lists the keys of "
                                                     f"{'.'.join(map(str, parent)) or 'a recipe'}",
                            key_text=_key_text, show_input=lambda err: not isinstance(err.get("input"), dict))


def recipe_from_dict(raw: dict, source: str = "recipe") -> Recipe:
    """Validate a raw mapping; every problem becomes one line of the RecipeError."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: a recipe is a mapping of sections, got {type(raw).__name__}")
    check_tree(raw, source)
    if {"grid", "modes"} & raw.keys() and not set(SECTIONS) & raw.keys():
        raise RecipeError(f"{source}: this is a sweep file (it has grid/modes, no recipe sections); "
                          "run it with `scaletool sweep`")
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(_problems_from(e, source)) from None
    except RecipeError as e:  # raised outside pydantic's wrapping (should not happen, kept safe)
        raise RecipeError([f"{source}: {p}" for p in e.problems]) from None


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), *,
                extra: dict | None = None, raw: dict | None = None) -> Recipe:
    """Load a recipe file (or a shipped recipe by name, see :func:`scaletool.resources.find_recipe`), apply
    ``--set`` style overrides (and an ``extra`` {dotted: value}), validate. ``raw``: the recipe's mapping
    already read (a Hugging Face import: :func:`scaletool.hf.load_recipe` takes config.json files too)."""
    raw = read_yaml(find_recipe(path, RECIPE), SECTIONS) if raw is None else raw
    raw = apply_overrides(raw, [parse_override(o) for o in overrides] + list((extra or {}).items()))
    return recipe_from_dict(raw, shorten(path))


def apply_overrides(raw: dict, pairs: list[tuple[str, Any]]) -> dict:
    out = copy.deepcopy(raw)
    for k, v in pairs:
        set_dotted(out, k, v, SECTIONS)
    return out
