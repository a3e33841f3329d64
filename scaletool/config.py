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
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from scaletool.errors import RecipeError, echo, shorten, validation_lines
from scaletool.kinds import attention as attention_kinds
from scaletool.kinds.attention import attention_kind, position_kind
from scaletool.kinds.engines import DEFAULT_ENGINE, engine_names, engine_problems, layout_problems
from scaletool.kinds.float8 import float8_problems
from scaletool.kinds.pipeline import SCHEDULE_NAMES, pipeline_problems
from scaletool.resources import RECIPE, find_recipe
from scaletool.yaml_input import check_tree, parse_override, read_yaml, set_dotted
from scaletool.yaml_input import key_text as _key_text

SECTIONS = ("model", "train", "parallel", "data", "profile")
ATTENTION_NAMES = tuple(attention_kinds.ATTENTION_KINDS)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# data.source=text: 256 byte ids + <|endoftext|> (scaletool.train.data.ByteTokenizer; a test keeps them equal)
BYTE_VOCAB = 257

# Size limits. Each is far above any published model (widest d_model ~16k-25k, deepest ~1,000 layers,
# longest context ~10M tokens, most experts ~1M in PEER, ~2·10^12 weights) and low enough that no weight
# tensor's element count overflows int64 and that `count` builds the layers in seconds.
MAX_LAYERS = 4096
MAX_WIDTH = 2**20       # d_model, head dims, latent ranks, FFN widths, regression features
MAX_HEADS = 2**16
MAX_EXPERTS = 2**20
MAX_VOCAB = 2**32       # token ids are at most uint32
MAX_SEQ_LEN = 2**24     # the RoPE table holds max_seq_len rows
MAX_WEIGHTS = 10**15    # bound on the weights of one model (see weights_bound)
INT64 = 2**63

def _takes(annotation: Any, kind: type) -> bool:
    """Whether a field annotated ``annotation`` takes values of ``kind`` (bool, int, float) as such."""
    if annotation is Any or annotation is kind:
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return any(type(a) is kind for a in args)
    return any(_takes(a, kind) for a in args)  # unions, Annotated, Optional


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_kinds(cls, value: Any, info: ValidationInfo) -> Any:
        """Booleans are not numbers and numbers are not booleans: YAML reads yes/no/on/off as booleans,
        and pydantic would take ``n_layers: yes`` as 1 and ``enabled: 2`` as true."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None or isinstance(value, type) or not isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, bool) and not _takes(field.annotation, bool):
            raise ValueError("a boolean is not a number or text here (YAML reads true/false, yes/no and on/off as "
                             "booleans)")
        if not isinstance(value, bool) and _takes(field.annotation, bool) and not (
                _takes(field.annotation, int) or _takes(field.annotation, float)):
            raise ValueError("expected true or false, not a number")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _int64(cls, value: Any) -> Any:
        """Every integer fits int64 (torch's index type): a step count or seed of 10**30 fails here, not in torch."""
        if isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
            raise ValueError("must fit a 64-bit integer")
        return value


def _derive(cfg: BaseModel, key: str, value: Any) -> None:
    """Set a derived field without marking it as given: ``model_dump(exclude_unset=True)`` stays what
    the user wrote, so re-validating it with one key changed derives the others afresh."""
    cfg.__dict__[key] = value


def _width(default: int | None, description: str = "", zero_ok: bool = False) -> Any:
    """A width or rank field: positive (or >= 0), at most MAX_WIDTH."""
    bound = {"ge": 0} if zero_ok else {"gt": 0}
    return Field(default, le=MAX_WIDTH, description=description, **bound)


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


class TrainConfig(_Section):
    steps: int = Field(20, gt=0, description="optimizer steps")
    micro_batch_size: int = Field(4, gt=0, description="sequences per rank per micro-step")
    grad_accum_steps: int = Field(1, gt=0)
    seq_len: int | None = Field(None, gt=0, description="default model.max_seq_len")
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(2, ge=0, description="linear learning-rate warm-up steps")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = off")
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    selective_every: int = Field(2, gt=0, description="selective checkpointing: every n-th block")
    compile: bool = False
    compile_scope: Literal["auto", "model", "block"] = Field(
        "auto", description="torch.compile the whole model or each block; auto: model on engine=single, "
        "block on sharded engines (communication hooks stay between compiled regions)")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode, with train.compile: reduce-overhead wraps each compiled "
        "region in CUDA graphs (no per-kernel launch cost); max-autotune-no-cudagraphs autotunes matmuls")
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto", description="auto: cuDNN first when q/k and v head dims differ (MLA), else flash")
    float8: Literal["none", "tensorwise", "rowwise"] = Field(
        "none", description="FP8 GEMMs for the blocks' linear layers (torchao's float8 training; engines single, "
        "ddp, fsdp; model.dtype=bf16; CUDA capability >= 8.9): tensorwise (one scale per tensor; FSDP2 all-gathers "
        "fp8 weights) or rowwise (a scale per row, closer to bf16); wants train.compile for its speed")
    weight_cast: Literal["micro-batch", "step"] = Field(
        "micro-batch", description="when the linear layers' 16-bit weight copies are made under autocast: "
        "micro-batch (autocast casts at every forward) or step (engine=single: once per optimizer step, each "
        "micro-batch's 16-bit weight gradient added into the fp32 one in one kernel; the same numbers, fewer "
        "casts with train.grad_accum_steps > 1)")
    seed: int = 1234
    measure_warmup_steps: int = Field(2, ge=0, description="steps excluded from throughput and MFU")
    log_every: int = Field(1, gt=0)
    checkpoint_every: int = Field(0, ge=0, description="save every n steps; 0 = never")
    fused_optimizer: bool | None = Field(None, description="default: fused AdamW on CUDA")


def _engine_enum(schema: dict) -> None:
    schema["enum"] = list(engine_names())  # the registry as it is when the schema is written


def _quoted_or(names: tuple[str, ...]) -> str:
    quoted = [f"'{n}'" for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class ParallelConfig(_Section):
    engine: str = Field(DEFAULT_ENGINE, json_schema_extra=_engine_enum,
                        description="the training engine (scaletool.kinds.engines)")
    zero_stage: int = Field(1, ge=0, le=3, description="deepspeed ZeRO stage")
    reshard_after_forward: bool = True
    cpu_offload: bool = Field(False, description="fsdp: CPUOffloadPolicy for params, grads and optimizer")
    reduce_scatter_every: Literal["step", "micro-batch"] = Field(
        "step", description="fsdp with train.grad_accum_steps > 1: reduce-scatter the gradients once per optimizer "
        "step (gradient sync off until the last micro-batch; FSDP2 holds every gradient unsharded in fp32 between "
        "micro-batches) or after every micro-batch (sharded gradients only; that many times the traffic)")
    offload_optimizer: bool = Field(False, description="deepspeed: optimizer state on the CPU")
    offload_params: bool = Field(False, description="deepspeed ZeRO-3: parameters on the CPU")
    world_size: int = Field(1, gt=0, description="ranks assumed by `estimate` (train uses the real one)")
    nnodes: int = Field(1, gt=0)
    nproc_per_node: int = Field(1, gt=0)
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="passed through as DeepSpeed config")
    collective_timeout_s: int = Field(600, gt=0, description="process-group init and every collective: a rank "
                                      "that waits longer for its peers fails with an error naming it")
    expert_parallel: bool = Field(False, description="fsdp, ffn=moe: split the routed experts over the data-parallel "
                                  "ranks (each keeps n_routed_experts / expert_parallel_degree of them); tokens move "
                                  "by all-to-all, a variable number per expert with moe_dispatch=dropless")
    expert_parallel_degree: int = Field(0, ge=0, description="expert_parallel: ranks in each expert-parallel group "
                                        "(consecutive ranks; it divides the data-parallel ranks and n_routed_experts), "
                                        "experts replicated across the groups; 0 = every data-parallel rank")
    tensor_parallel: int = Field(1, gt=0, le=MAX_HEADS, description="fsdp: ranks that split every layer's heads and FFN "
                                 "width (Megatron-style, with sequence parallelism); FSDP2 shards over the "
                                 "world_size / tensor_parallel data-parallel ranks")
    async_tp: bool = Field(False, description="tensor_parallel > 1 with train.compile on CUDA: inductor fuses each "
                           "all-gather with the matmul it feeds and each matmul with its reduce-scatter, overlapping "
                           "them chunk by chunk over symmetric memory")
    tp_local_ops: bool = Field(False, description="tensor_parallel > 1: the same split with every op inside a block "
                               "on local tensors (parameters stay DTensors), saving DTensor's per-op host dispatch")
    data_parallel_replicate: int = Field(1, gt=0, description="fsdp: HSDP, FSDP2 on a 2-D (replicate, shard) mesh: "
                                         "states sharded over world_size / data_parallel_replicate ranks (a node), "
                                         "replicated across this many groups (nodes); gradient shards all-reduced "
                                         "across them")
    fsdp_on_one_rank: bool = Field(False, description="fsdp with tensor_parallel = world size (pure tensor parallelism): "
                                   "wrap FSDP2 anyway, over its one-rank data mesh, where it shards nothing and costs "
                                   "host time per block; off, the split model trains directly under autocast")
    pipeline_parallel: int = Field(1, gt=0, le=MAX_LAYERS, description="fsdp: pipeline ranks (torch.distributed."
                                   "pipelining); FSDP2 shards each stage over world_size / pipeline_parallel ranks")
    pipeline_schedule: Literal[SCHEDULE_NAMES] = Field(
        "1f1b", description="pipeline_parallel > 1: gpipe, 1f1b, interleaved-1f1b (pipeline_virtual_stages >= 2), "
        "interleaved-zb or zbv (zero bubble; where the installed torch has them)")
    pipeline_virtual_stages: int = Field(1, gt=0, le=MAX_LAYERS, description="model chunks per pipeline rank "
                                         "(interleaved schedules: >= 2; zbv: 2)")
    pipeline_microbatches: int | None = Field(None, gt=0, description="pipeline micro-batches that "
                                              "train.micro_batch_size splits into; default one sequence each")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        """One of the registered engines (a registry, not a Literal: an engine registered later is accepted)."""
        names = engine_names()
        if value not in names:
            raise ValueError(f"Input should be {_quoted_or(names)}")
        return value

    @field_validator("deepspeed")
    @classmethod
    def _plain_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        """The passthrough becomes DeepSpeed's JSON config: string keys, finite numbers, no YAML dates or sets."""
        stack: list[tuple[str, Any]] = [("", value)]
        while stack:
            where, v = stack.pop()
            if isinstance(v, dict):
                for k, sub in v.items():
                    if not isinstance(k, str):
                        raise ValueError(f"{where + ': ' if where else ''}key {echo(k)} is not a string")
                    stack.append((f"{where}.{_key_text(k)}" if where else _key_text(k), sub))
            elif isinstance(v, list):
                stack.extend((f"{where}[{i}]", sub) for i, sub in enumerate(v))
            elif isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{where}: {v} is not a finite number")
            elif not isinstance(v, (str, int, float, bool, type(None))):
                raise ValueError(f"{where}: a {type(v).__name__} is not a JSON value")
        return value

    def pure_tensor_parallel(self, world_size: int, tensor_parallel: int | None = None) -> bool:
        """Tensor parallelism (``tensor_parallel``, default this section's) over all ``world_size`` ranks, one
        data-parallel rank: engines.fsdp trains it without FSDP2 unless ``fsdp_on_one_rank``, and the
        estimates follow the same rule."""
        tp = self.tensor_parallel if tensor_parallel is None else tensor_parallel
        return 1 < tp == world_size and not self.fsdp_on_one_rank


class DataConfig(_Section):
    source: Literal["synthetic", "text", "tokens", "csv"] = Field(
        "synthetic", description="lm: synthetic | text | tokens; regression: synthetic | csv")
    path: str | None = None
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    num_samples: int = Field(4096, gt=0, description="synthetic regression series")


class MonitorConfig(_Section):
    enabled: bool = False
    every: int = Field(10, gt=0, description="measure after every n-th step (and after the last)")
    batch_size: int = Field(2, gt=0, description="sequences in the probe micro-batch (at most train.micro_batch_size)")
    entropy_threshold: float = Field(0.5, ge=0, description="warn when a layer's mean attention entropy (nats) falls below")
    rank_threshold: float = Field(0.1, ge=0, le=1, description="warn when a layer's effective rank / min(seq_len, "
                                  "d_model) falls below")


class ProfileConfig(_Section):
    enabled: bool = Field(False, description="run torch.profiler and write traces and the operator breakdown")
    wait: int = Field(1, ge=0, description="schedule: steps skipped first")
    warmup: int = Field(1, ge=0, description="schedule: steps traced but discarded")
    active: int = Field(2, gt=0, description="schedule: steps recorded per cycle")
    repeat: int = Field(1, ge=0, description="schedule: cycles (0 = until training ends)")
    ranks: list[int] | Literal["all"] = Field("all", description="ranks that profile")
    record_shapes: bool = False
    with_stack: bool = False
    with_flops: bool = False
    profile_memory: bool = Field(False, description="allocation events in the trace")
    memory_snapshot: bool = Field(False, description="CUDA: a memory snapshot for pytorch.org/memory_viz")
    monitors: MonitorConfig = Field(default_factory=MonitorConfig)


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
