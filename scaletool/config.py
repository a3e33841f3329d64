"""Recipes: one YAML file, five sections, validated once at the edge.

A recipe has the sections ``model``, ``train``, ``parallel``, ``data`` and ``profile``. Unknown keys
are errors (with a did-you-mean), missing keys take the defaults documented on each field, and
fields whose default depends on others (``n_kv_heads``, ``head_dim``, the MLA head dims) are
resolved once here so every later stage sees concrete numbers.

Every problem becomes one line in a :class:`RecipeError`; the CLI prints them and exits with 2.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scaletool.errors import RecipeError

SECTIONS = ("model", "train", "parallel", "data", "profile")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False)


NonNeg = Field(ge=0)


MOE_FIELDS = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
              "first_k_dense_replace", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "n_group",
              "topk_group", "aux_loss_alpha", "bias_update_speed", "moe_dispatch", "capacity_factor")


class ModelConfig(_Section):
    """The network. Names match DeepSeek-V2/V3 and Llama configs where they overlap."""

    attention: Literal["mha", "gqa", "mqa", "mla"] = "mha"
    d_model: int = Field(512, gt=0)
    n_layers: int = Field(8, gt=0)
    n_heads: int = Field(8, gt=0)
    n_kv_heads: int | None = Field(None, gt=0, description="KV heads (gqa); mha: n_heads, mqa: 1")
    head_dim: int | None = Field(None, gt=0, description="default d_model // n_heads")
    kv_lora_rank: int = Field(0, ge=0, description="MLA latent width; must be > 0 for mla, 0 otherwise")
    q_lora_rank: int = Field(0, ge=0, description="MLA query latent width; 0 = full-rank query")
    qk_nope_head_dim: int | None = Field(None, gt=0, description="MLA: no-RoPE part of q/k; default head_dim")
    qk_rope_head_dim: int | None = Field(
        None, gt=0, description="rotary dims per head; mla: the shared RoPE key (default head_dim // 2), "
        "others: rotated part of each head (default head_dim)")
    v_head_dim: int | None = Field(None, gt=0, description="MLA: value head dim; default head_dim")
    qkv_bias: bool = Field(False, description="mha/gqa/mqa: bias on the q, k, v projections (Qwen2)")
    ffn: Literal["swiglu", "gelu", "relu", "moe"] = "swiglu"
    intermediate_size: int = Field(2048, gt=0, description="dense FFN width (moe: of the first_k_dense_replace layers)")
    # Mixture of experts (ffn=moe), DeepSeek-V2/V3 names; see scaletool/model/moe.py.
    n_routed_experts: int = Field(0, ge=0, description="moe: routed experts per MoE layer")
    n_shared_experts: int = Field(0, ge=0, description="moe: always-active experts, one SwiGLU of n·moe_intermediate_size")
    num_experts_per_tok: int = Field(0, ge=0, description="moe: routed experts per token (top-k)")
    moe_intermediate_size: int = Field(0, ge=0, description="moe: width of one expert's SwiGLU")
    first_k_dense_replace: int = Field(0, ge=0, description="moe: leading layers with the dense FFN instead")
    scoring_func: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="moe: router scores; sigmoid adds V3's selection bias (a buffer, no gradient)")
    norm_topk_prob: bool = Field(False, description="moe: renormalise the top-k gate weights to sum to 1")
    routed_scaling_factor: float = Field(1.0, gt=0, description="moe: multiplies the routed experts' gate weights")
    n_group: int = Field(1, gt=0, description="moe: expert groups for group-limited routing (1 = off)")
    topk_group: int = Field(1, gt=0, description="moe: groups a token may route to")
    aux_loss_alpha: float = Field(0.0, ge=0, description="moe: weight of the sequence-wise expert balance loss")
    bias_update_speed: float = Field(0.0, ge=0, description="moe, sigmoid: aux-loss-free bias step per optimizer step")
    moe_dispatch: Literal["dropless", "capacity"] = Field(
        "dropless", description="moe: dropless (tokens sorted by expert, one grouped GEMM per projection, as DeepSeek-V3 "
        "trains) or capacity (a fixed [E, C, d] buffer, drops past capacity; what expert parallelism moves)")
    capacity_factor: float = Field(
        1.25, gt=0, description="moe_dispatch=capacity: expert capacity = ceil(factor·tokens·top-k / experts); "
        ">= experts/top-k never drops")
    vocab_size: int = Field(32000, gt=0)
    max_seq_len: int = Field(2048, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = Field(1e-6, gt=0)
    tie_embeddings: bool = False
    dropout: float = Field(0.0, ge=0, lt=1)
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    task: Literal["lm", "regression"] = "lm"
    n_features: int = Field(20, gt=0, description="regression: input features per time step")
    horizon: int = Field(10, gt=0, description="regression: future values predicted")
    feature_groups: list[int] | None = Field(
        None, description="regression: sizes of the feature groups embedded separately; default 4 near-equal groups")

    @model_validator(mode="after")
    def _resolve(self) -> ModelConfig:
        problems: list[str] = []
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                problems.append(f"model.d_model: {self.d_model} is not divisible by n_heads={self.n_heads} "
                                "(set model.head_dim to decouple them)")
            self.head_dim = max(self.d_model // self.n_heads, 1)
        hd = self.head_dim
        a = self.attention
        if a == "mha":
            if self.n_kv_heads not in (None, self.n_heads):
                problems.append(f"model.n_kv_heads: {self.n_kv_heads} contradicts attention=mha "
                                f"(which has n_kv_heads = n_heads = {self.n_heads}); use attention=gqa")
            self.n_kv_heads = self.n_heads
        elif a == "mqa":
            if self.n_kv_heads not in (None, 1):
                problems.append(f"model.n_kv_heads: {self.n_kv_heads} contradicts attention=mqa (which has 1 KV head)")
            self.n_kv_heads = 1
        elif a == "gqa":
            if self.n_kv_heads is None:
                problems.append("model.n_kv_heads: required for attention=gqa")
                self.n_kv_heads = self.n_heads
            elif self.n_heads % self.n_kv_heads:
                problems.append(f"model.n_heads: {self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        else:  # mla
            if self.n_kv_heads not in (None, self.n_heads):
                problems.append("model.n_kv_heads: not used by attention=mla (every head reads the shared latent)")
            self.n_kv_heads = self.n_heads
            if self.kv_lora_rank == 0:
                problems.append("model.kv_lora_rank: must be > 0 for attention=mla (the KV latent width)")
        if a == "mla" and self.qkv_bias:
            problems.append("model.qkv_bias: not used by attention=mla (DeepSeek's projections have no bias)")
        if a != "mla":
            for key in ("kv_lora_rank", "q_lora_rank"):
                if getattr(self, key):
                    problems.append(f"model.{key}: only used by attention=mla, got {getattr(self, key)} with attention={a}")
            for key in ("qk_nope_head_dim", "v_head_dim"):
                if getattr(self, key) is not None:
                    problems.append(f"model.{key}: only used by attention=mla (attention={a} uses head_dim)")
            if self.qk_rope_head_dim is None:
                self.qk_rope_head_dim = hd
            elif self.qk_rope_head_dim > hd:
                problems.append(f"model.qk_rope_head_dim: {self.qk_rope_head_dim} is larger than the head "
                                f"(head_dim={hd})")
        else:
            if self.qk_nope_head_dim is None:
                self.qk_nope_head_dim = hd
            if self.v_head_dim is None:
                self.v_head_dim = hd
            if self.qk_rope_head_dim is None:
                self.qk_rope_head_dim = max(2, hd // 2 // 2 * 2)
        if self.qk_rope_head_dim % 2:
            problems.append(f"model.qk_rope_head_dim: {self.qk_rope_head_dim} is odd; RoPE rotates pairs of dims")
        problems += self._moe_problems()
        if self.task == "regression":
            if self.feature_groups is None:
                n, g = self.n_features, min(4, self.n_features)
                self.feature_groups = [n // g + (1 if i < n % g else 0) for i in range(g)]
            if any(s <= 0 for s in self.feature_groups):
                problems.append(f"model.feature_groups: sizes must be positive, got {self.feature_groups}")
            elif sum(self.feature_groups) != self.n_features:
                problems.append(f"model.feature_groups: sizes sum to {sum(self.feature_groups)}, "
                                f"not n_features={self.n_features}")
            if len(self.feature_groups) > self.d_model:
                problems.append("model.feature_groups: more groups than d_model channels")
        if problems:
            raise RecipeError(problems)
        return self

    def _moe_problems(self) -> list[str]:
        if self.ffn != "moe":
            defaults = type(self).model_fields
            return [f"model.{k}: only used by ffn=moe (ffn={self.ffn})" for k in MOE_FIELDS
                    if getattr(self, k) != defaults[k].default]
        E, k, G = self.n_routed_experts, self.num_experts_per_tok, self.n_group
        problems = [f"model.{key}: must be > 0 for ffn=moe" for key in
                    ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size") if not getattr(self, key)]
        if E and k > E:
            problems.append(f"model.num_experts_per_tok: top-{k} of {E} routed experts is impossible")
        if self.first_k_dense_replace >= self.n_layers:
            problems.append(f"model.first_k_dense_replace: {self.first_k_dense_replace} leaves no MoE layer "
                            f"(n_layers={self.n_layers})")
        if E and E % G:
            problems.append(f"model.n_group: {E} routed experts do not split into {G} groups")
        elif self.topk_group > G:
            problems.append(f"model.topk_group: {self.topk_group} is more than n_group={G}")
        elif E and k > self.topk_group * (E // G):
            problems.append(f"model.num_experts_per_tok: top-{k} does not fit in topk_group={self.topk_group} "
                            f"groups of {E // G} experts")
        elif G > 1 and self.scoring_func == "sigmoid" and E // G < 2:
            problems.append("model.n_group: sigmoid group scores sum each group's top-2 experts; groups need >= 2")
        # against the default, not "was it given": a resolved recipe dumped into a result carries every field
        if self.moe_dispatch == "dropless" and self.capacity_factor != type(self).model_fields["capacity_factor"].default:
            problems.append("model.capacity_factor: only used by moe_dispatch=capacity (dropless never drops a token)")
        if self.bias_update_speed and self.scoring_func != "sigmoid":
            problems.append("model.bias_update_speed: the aux-loss-free bias belongs to scoring_func=sigmoid (V3)")
        return problems

    @property
    def n_moe_layers(self) -> int:
        """Layers with a mixture-of-experts FFN (the rest use the dense FFN)."""
        return self.n_layers - self.first_k_dense_replace if self.ffn == "moe" else 0

    # Derived sizes, computed from the resolved fields (never stored).
    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head that the softmax scale and SDPA see."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def v_dim(self) -> int:
        """Value width per head."""
        return self.v_head_dim if self.attention == "mla" else self.head_dim

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
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto", description="auto: cuDNN first when q/k and v head dims differ (MLA), else flash")
    seed: int = 1234
    measure_warmup_steps: int = Field(2, ge=0, description="steps excluded from throughput and MFU")
    log_every: int = Field(1, gt=0)
    checkpoint_every: int = Field(0, ge=0, description="save every n steps; 0 = never")
    fused_optimizer: bool | None = Field(None, description="default: fused AdamW on CUDA")


class ParallelConfig(_Section):
    engine: Literal["single", "ddp", "fsdp", "deepspeed"] = "single"
    zero_stage: int = Field(1, ge=0, le=3, description="deepspeed ZeRO stage")
    reshard_after_forward: bool = True
    cpu_offload: bool = Field(False, description="fsdp: CPUOffloadPolicy for params, grads and optimizer")
    offload_optimizer: bool = Field(False, description="deepspeed: optimizer state on the CPU")
    offload_params: bool = Field(False, description="deepspeed ZeRO-3: parameters on the CPU")
    world_size: int = Field(1, gt=0, description="ranks assumed by `estimate` (train uses the real one)")
    nnodes: int = Field(1, gt=0)
    nproc_per_node: int = Field(1, gt=0)
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="passed through as DeepSpeed config")
    collective_timeout_s: int = Field(600, gt=0, description="process-group init and every collective: a rank "
                                      "that waits longer for its peers fails with an error naming it")
    expert_parallel: bool = Field(False, description="fsdp, ffn=moe: each rank keeps n_routed_experts / world_size "
                                  "experts; tokens move by all-to-all")


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
        if self.seq_len > m.max_seq_len:
            problems.append(f"train.seq_len: {self.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        if self.parallel.expert_parallel and m.ffn != "moe":
            problems.append("parallel.expert_parallel: needs model.ffn=moe (there are no experts to distribute)")
        elif self.parallel.expert_parallel and m.moe_dispatch != "capacity":
            problems.append("parallel.expert_parallel: needs model.moe_dispatch=capacity (the all-to-all moves the "
                            "fixed [E, C, d] buffer)")
        elif self.parallel.expert_parallel and self.parallel.engine != "fsdp":
            problems.append(f"parallel.expert_parallel: supported with engine=fsdp (the expert shards are DTensors "
                            f"beside FSDP2's), not engine={self.parallel.engine}")
        pr = self.profile
        if pr.enabled and pr.wait + pr.warmup + pr.active > self.train.steps:
            problems.append(f"profile: the schedule needs wait + warmup + active = {pr.wait + pr.warmup + pr.active} "
                            f"steps, but train.steps is {self.train.steps}")
        if pr.ranks != "all" and (not pr.ranks or min(pr.ranks) < 0):
            problems.append(f"profile.ranks: 'all' or a non-empty list of ranks >= 0, got {pr.ranks}")
        if problems:
            raise RecipeError(problems)
        return self

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def digest(self, extra: str = "") -> str:
        """Stable short hash of the resolved recipe (plus ``extra``), for result keys.

        Fields equal to their defaults are left out, so adding a new field with a default to the
        recipe schema keeps the keys of earlier results (a sweep resumes instead of redoing them).
        """
        blob = json.dumps(self.model_dump(mode="json", exclude_defaults=True), sort_keys=True) + extra
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


def _describe(err: dict, source: str) -> str:
    loc = tuple(err["loc"])
    where = ".".join(str(p) for p in loc) or "recipe"
    if err["type"] == "extra_forbidden":
        key = str(loc[-1])
        known = _fields_of(Recipe, loc[:-1])
        hint = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        tip = f"; did you mean '{hint[0]}'?" if hint else (f"; known keys: {', '.join(known)}" if known else "")
        return f"{source}: {where}: unknown key{tip}"
    if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), RecipeError):
        return None  # expanded by the caller
    got = err.get("input")
    got_s = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"{source}: {where}: {err['msg']}{got_s}"


def _problems_from(exc: ValidationError, source: str) -> list[str]:
    lines: list[str] = []
    for err in exc.errors():
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, RecipeError):
            lines.extend(f"{source}: {p}" for p in inner.problems)
        else:
            lines.append(_describe(err, source))
    return lines


def parse_override(item: str) -> tuple[str, Any]:
    """``model.kv_lora_rank=128`` -> (``model.kv_lora_rank``, 128); the value is read as YAML."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. model.kv_lora_rank=128")
    key, _, raw = item.partition("=")
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(raw: dict, key: str, value: Any) -> None:
    """Set ``raw['a']['b'] = value`` for ``key='a.b'``; unknown top-level sections are errors."""
    parts = key.split(".")
    if parts[0] not in SECTIONS:
        hint = difflib.get_close_matches(parts[0], SECTIONS, n=1)
        tip = f"; did you mean '{hint[0]}'?" if hint else f"; sections are {', '.join(SECTIONS)}"
        raise RecipeError(f"override {key}: unknown section '{parts[0]}'{tip}")
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise RecipeError(f"override {key}: '{p}' is not a mapping")
        node = nxt
    node[parts[-1]] = value


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping with the safe loader; problems become one-line RecipeErrors."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{p}: no such file" if not p.exists() else f"{p}: not a file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"{p}: malformed YAML{where}: {what}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{p}: not a text file") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{p}: a recipe is a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}")
    return data


def recipe_from_dict(raw: dict, source: str = "recipe") -> Recipe:
    """Validate a raw mapping; every problem becomes one line of the RecipeError."""
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
                extra: dict | None = None) -> Recipe:
    """Load a recipe file, apply ``--set`` style overrides (and an ``extra`` {dotted: value}), validate."""
    raw = read_yaml(path)
    raw = apply_overrides(raw, [parse_override(o) for o in overrides] + list((extra or {}).items()))
    return recipe_from_dict(raw, str(path))


def apply_overrides(raw: dict, pairs: list[tuple[str, Any]]) -> dict:
    out = copy.deepcopy(raw)
    for k, v in pairs:
        set_dotted(out, k, v)
    return out
