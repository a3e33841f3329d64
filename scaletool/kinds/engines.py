"""Engines as data: one object per ``parallel.engine``, torch-free.

Each engine kind holds in one place the ``parallel.*`` keys only it uses, the rules a recipe must meet
under it, how results and tables label it, which ranks it shards its states over, and its parts: the
memory closed form, the collectives per step and the step-time terms (registered by
:mod:`scaletool.analytic.engines`) and the torch engine class (registered by :mod:`scaletool.engines`).
The floors above hand their callables to the kind with :meth:`EngineKind.provide`, so this module (and
``scaletool.config``, which builds ``parallel.engine`` and its checks from :data:`ENGINES`) stays
torch-free and imports nothing above it. Tensor and expert parallelism are layouts of an engine
(:attr:`EngineKind.layouts`), not engines of their own.

Adding an engine (docs/extending.md has a worked example): :func:`register_engine` of a new kind (here, in
:data:`ENGINES`, or from any module), its analytic parts provided in :mod:`scaletool.analytic.engines`
and its torch class in ``scaletool/engines/``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scaletool.errors import echo
from scaletool.kinds.attention import attention_kind
from scaletool.yaml_input import flatten_dotted

#: the parts a kind is given by the floors above it: name -> what the callable is
PARTS = {
    "memory": "analytic: form(cfg, world_size, units, loss_temp, settings) -> phases and states",
    "communication": "analytic: form(cfg, ranks, *, zero_stage, grad_accum_steps, reshard_after_forward, "
                     "expert_parallel, inputs, reduce_scatter_every) -> collectives per optimizer step",
    "step": "analytic: form(ctx: scaletool.analytic.engine_step.StepContext) -> EngineStepTerms",
    "constructor": "torch: cls(model, recipe, env) -> scaletool.engines.base.Engine",
    "pipeline_constructor": "torch: cls(model, recipe, env) -> the Engine running pipeline stages over this engine "
                            "(parallel.pipeline_parallel > 1; scaletool.engines.pipeline)",
    "startup_notes": "torch: notes(recipe, device_type) -> lines said before the engine is built",
    "config_record": "torch: record(recipe, world_size) -> what a training result records of the engine's "
                     "library configuration",
}
#: where each part is registered for the shipped engines (for the message when one is missing)
_PROVIDED_BY = {"memory": "scaletool.analytic.engines", "communication": "scaletool.analytic.engines",
                "step": "scaletool.analytic.engines", "constructor": "scaletool.engines",
                "pipeline_constructor": "scaletool.engines",
                "startup_notes": "scaletool.engines", "config_record": "scaletool.engines"}


def _or_list(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True)
class EngineKind:
    """One value of ``parallel.engine``.

    ``keys``: ``parallel.*`` keys only this engine reads. ``distributed``: runs in a process group (False: one
    process, only at world size 1: :meth:`runs_on`). ``autocast``: computes by autocast over fp32 weights;
    ``casts_weights``: each micro-batch makes 16-bit copies of fp32 weights (not DeepSpeed's 16-bit weights).
    ``auto_compile_scope``: what ``train.compile_scope=auto`` compiles (``model``: one graph with the loss;
    ``block``: each block); ``compiles_module``: the engine compiles the whole module itself (DeepSpeed).
    ``layouts``: the layouts it composes with (``tensor_parallel``, ``expert_parallel``, ``pipeline_parallel``,
    ``data_parallel_replicate``). ``zero_stages``: the ZeRO stages it takes, ``table_stages`` those the tables
    and the plan show. ``optimizer_sharded_from`` / ``gradients_sharded_from``: the least stage at which the
    optimizer states and the gradients are sharded (None: never; 0: always). ``float8``: composes with
    ``train.float8``; ``float8_all_gather``: gathers Float8Linear weights in FP8 (FSDP2). ``weight_cast_step``:
    takes ``train.weight_cast=step``. ``package``: the library a training result records the version of.
    ``quick_on_cpu``: starts in seconds on the CPU over gloo (``plan --verify`` tries it there). ``rules``:
    ``rules(recipe, world_size)`` -> problem lines. ``parts``: the callables of :data:`PARTS` the floors above
    provide (:meth:`provide`, :meth:`part`).
    """

    name: str
    keys: tuple[str, ...] = ()
    distributed: bool = True
    autocast: bool = False
    casts_weights: bool = True
    auto_compile_scope: str = "block"
    layouts: tuple[str, ...] = ()
    zero_stages: tuple[int, ...] = ()
    table_stages: tuple[int, ...] = ()
    optimizer_sharded_from: int | None = None
    gradients_sharded_from: int | None = None
    float8: bool = False
    float8_all_gather: bool = False
    compiles_module: bool = False
    weight_cast_step: bool = False
    package: str | None = None
    quick_on_cpu: bool = True
    rules: Callable[[Any, int | None], list[str]] | None = None
    parts: dict[str, Callable] = field(default_factory=dict, compare=False, repr=False)

    def label(self, zero_stage: int | None = None) -> str:
        """Short name in results and tables: ``zero2`` for a ZeRO engine at stage 2, else the name."""
        return f"zero{zero_stage}" if self.zero_stages and zero_stage is not None else self.name

    def title(self, zero_stage: int | None = None) -> str:
        """Name in prose: ``ZeRO-2``, else the name."""
        return f"ZeRO-{zero_stage}" if self.zero_stages and zero_stage is not None else self.name

    def table_rows(self) -> list[tuple[str, int]]:
        """(label, ZeRO stage) of each row this engine has in the memory table."""
        return [(self.label(s), s) for s in self.table_stages] or [(self.name, 0)]

    def runs_on(self, world_size: int) -> bool:
        """Whether it can run on ``world_size`` ranks: a one-process engine only on one (the one place
        this rule is written)."""
        return self.distributed or world_size == 1

    def ranks(self, world_size: int) -> int:
        """The ranks it runs on when ``world_size`` are asked for: one for a one-process engine."""
        return world_size if self.distributed else 1

    def stage(self, zero_stage: int) -> int | None:
        """The ZeRO stage it runs at under ``parallel.zero_stage`` (None: it has no stages)."""
        return zero_stage if self.zero_stages else None

    def shards_optimizer(self, zero_stage: int = 0) -> bool:
        """Whether the optimizer states are sharded over the data-parallel ranks at ``zero_stage``."""
        return self.optimizer_sharded_from is not None and (self.stage(zero_stage) or 0) >= self.optimizer_sharded_from

    def shards_gradients(self, zero_stage: int = 0) -> bool:
        """Whether the gradients are sharded over the data-parallel ranks at ``zero_stage``."""
        return self.gradients_sharded_from is not None and (self.stage(zero_stage) or 0) >= self.gradients_sharded_from

    def provide(self, **parts: Callable) -> None:
        """Give the kind its parts (:data:`PARTS`), once each: the floors above call this when imported."""
        for name, value in parts.items():
            if name not in PARTS:
                raise ValueError(f"engine {self.name}: no part named {name!r} (parts: {', '.join(PARTS)})")
            if name in self.parts and self.parts[name] is not value:
                raise ValueError(f"engine {self.name}: its {name} part is already provided")
            self.parts[name] = value

    def part(self, name: str) -> Callable:
        """The provided part ``name``; LookupError naming what provides it when nothing has."""
        if name not in self.parts:
            raise LookupError(f"engine {self.name}: no {name} part provided ({PARTS[name]}); importing "
                              f"{_PROVIDED_BY[name]} provides the shipped engines' parts")
        return self.parts[name]

    def has(self, name: str) -> bool:
        """Whether the part ``name`` is provided (optional parts: startup_notes, config_record)."""
        return name in self.parts

    def problems(self, recipe: Any, world_size: int | None = None) -> list[str]:
        return self.rules(recipe, world_size) if self.rules else []


# ---------------------------------------------------------------------------------------------
# DeepSpeed: the keys a recipe decides, and the passthrough rules


def deepspeed_settings(recipe: Any, world_size: int | None = None) -> dict[str, tuple[Any, str]]:
    """The DeepSpeed config keys the recipe decides: dotted key -> (value, the recipe field it comes from).
    ``train_batch_size`` depends on the world size and is left out without one."""
    t, p, m = recipe.train, recipe.parallel, recipe.model
    derived: dict[str, tuple[Any, str]] = {
        "train_micro_batch_size_per_gpu": (t.micro_batch_size, "train.micro_batch_size"),
        "gradient_accumulation_steps": (t.grad_accum_steps, "train.grad_accum_steps"),
        "gradient_clipping": (t.grad_clip, "train.grad_clip"),
        "bf16.enabled": (m.dtype == "bf16", "model.dtype"),
        "fp16.enabled": (m.dtype == "fp16", "model.dtype"),
        "zero_optimization.stage": (p.zero_stage, "parallel.zero_stage"),
        "zero_optimization.offload_optimizer.device": ("cpu" if p.offload_optimizer else "none",
                                                       "parallel.offload_optimizer"),
    }
    if world_size is not None:
        derived["train_batch_size"] = (t.micro_batch_size * t.grad_accum_steps * world_size,
                                       "train.micro_batch_size × train.grad_accum_steps × world size")
    if p.zero_stage == 3:
        derived["zero_optimization.offload_param.device"] = ("cpu" if p.offload_params else "none",
                                                             "parallel.offload_params")
    if p.offload_optimizer:
        derived.update({
            "optimizer.type": ("AdamW", "the AdamW of train.*"),
            "optimizer.params.lr": (t.lr, "train.lr"),
            "optimizer.params.betas": ([t.beta1, t.beta2], "train.beta1/beta2"),
            "optimizer.params.weight_decay": (t.weight_decay, "train.weight_decay"),
        })
    return derived


#: zero_optimization keys that are element counts (DeepSpeed reads them as integers): key -> least value
ZERO_COUNTS = {"reduce_bucket_size": 1, "allgather_bucket_size": 0, "stage3_prefetch_bucket_size": 0,
               "stage3_param_persistence_threshold": 0, "stage3_model_persistence_threshold": 0,
               "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_module_granularity_threshold": 0,
               "sub_group_size": 0, "zero_hpz_partition_size": 1}
#: zero_optimization keys that are switches
ZERO_FLAGS = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "stage3_use_all_reduce_for_fetch_params",
              "zero_quantized_weights", "zero_quantized_gradients")
_LEAF_KEYS = ("classes", "names", "name_suffixes")


def zero_option_problems(zero: Any, stage: int) -> list[str]:
    """One line per malformed ``parallel.deepspeed.zero_optimization`` knob scaletool documents (counts,
    switches, ``leaf_module``), and per ZeRO-3 knob set at another stage (DeepSpeed ignores it silently)."""
    where = "parallel.deepspeed.zero_optimization"
    if not isinstance(zero, dict):
        return [f"{where}: a mapping of DeepSpeed's ZeRO keys, got {echo(zero)}"]
    problems = []
    for key, least in ZERO_COUNTS.items():
        v = zero.get(key)
        if key not in zero or (type(v) is int or (type(v) is float and v.is_integer())) and v >= least:
            continue
        hint = " (YAML reads 5e7 as text: write 50000000 or 5.0e+7)" if isinstance(v, str) else ""
        problems.append(f"{where}.{key}: a whole number of elements >= {least}, got {echo(v)}{hint}")
    problems += [f"{where}.{key}: expected true or false, got {echo(zero[key])}"
                 for key in ZERO_FLAGS if key in zero and not isinstance(zero[key], bool)]
    leaf = zero.get("leaf_module", {})
    if not isinstance(leaf, dict) or set(leaf) - set(_LEAF_KEYS) or not all(
            isinstance(v, list) and all(isinstance(x, str) for x in v) for v in leaf.values()):
        problems.append(f"{where}.leaf_module: a mapping of {', '.join(_LEAF_KEYS)} to lists of names "
                        f"(e.g. {{classes: [scaletool.model.transformer.Block]}}), got {echo(leaf)}")
    if stage != 3:
        problems += [f"{where}.{key}: only ZeRO-3 reads it, but parallel.zero_stage={stage}"
                     for key in zero if key.startswith("stage3_") or key == "leaf_module"]
    return problems


def deepspeed_problems(recipe: Any, world_size: int | None = None) -> list[str]:
    """One line per ``parallel.deepspeed`` passthrough key that contradicts the recipe, and per offload
    setting ZeRO cannot do; without a world size, all but the train_batch_size conflict."""
    p = recipe.parallel
    problems = []
    if p.offload_params and p.zero_stage != 3:
        problems.append(f"parallel.offload_params: needs parallel.zero_stage=3 (got {p.zero_stage})")
    if p.offload_optimizer and p.zero_stage == 0:
        problems.append("parallel.offload_optimizer: needs parallel.zero_stage >= 1")
    passthrough = dict(p.deepspeed)
    if passthrough.pop("scheduler", None) is not None:
        problems.append("parallel.deepspeed.scheduler: the learning-rate schedule comes from train.lr, "
                        "train.warmup_steps and train.min_lr_ratio; remove it")
    if passthrough.get("optimizer") is not None and not p.offload_optimizer:
        passthrough.pop("optimizer")
        problems.append("parallel.deepspeed.optimizer: the optimizer is the AdamW of train.*; remove it "
                        "(set parallel.offload_optimizer for DeepSpeed's CPU Adam)")
    if "zero_optimization" in passthrough:
        problems += zero_option_problems(passthrough["zero_optimization"], p.zero_stage)
    derived = deepspeed_settings(recipe, world_size)
    for key, value in flatten_dotted(passthrough).items():
        if key in derived and derived[key][0] != value:
            problems.append(f"parallel.deepspeed.{key}={echo(value)} conflicts with {derived[key][1]} "
                            f"(= {derived[key][0]!r}); set it in one place")
    return problems


#: parallel.engine -> its kind (:func:`register_engine` adds one)
ENGINES: dict[str, EngineKind] = {}
#: parallel.* keys only one engine uses -> that engine
ENGINE_KEYS: dict[str, str] = {}


def register_engine(kind: EngineKind) -> EngineKind:
    """Add ``kind`` to :data:`ENGINES`: ``parallel.engine`` accepts its name from now on (a name taken is a
    ValueError). Its parts come through :meth:`EngineKind.provide`."""
    if kind.name in ENGINES:
        raise ValueError(f"engine {kind.name!r} is already registered")
    taken = [k for k in kind.keys if k in ENGINE_KEYS]
    if taken:
        raise ValueError(f"engine {kind.name}: parallel.{taken[0]} is already the key of engine {ENGINE_KEYS[taken[0]]}")
    ENGINES[kind.name] = kind
    ENGINE_KEYS.update({key: kind.name for key in kind.keys})
    return kind


def unregister_engine(name: str) -> None:
    """Take an engine registered by :func:`register_engine` out again (tests of a toy engine)."""
    kind = ENGINES.pop(name)
    for key in kind.keys:
        ENGINE_KEYS.pop(key, None)


SINGLE = register_engine(EngineKind("single", distributed=False, autocast=True, auto_compile_scope="model", float8=True,
                                    weight_cast_step=True))
DDP = register_engine(EngineKind("ddp", autocast=True, float8=True))
FSDP = register_engine(EngineKind("fsdp", keys=("cpu_offload", "reduce_scatter_every", "data_parallel_replicate"),
                                  layouts=("tensor_parallel", "expert_parallel", "pipeline_parallel",
                                           "data_parallel_replicate"), float8=True,
                                  float8_all_gather=True,
                                  optimizer_sharded_from=0, gradients_sharded_from=0))
DEEPSPEED = register_engine(EngineKind("deepspeed", keys=("zero_stage", "offload_optimizer", "offload_params", "deepspeed"),
                                       casts_weights=False, zero_stages=(0, 1, 2, 3), table_stages=(1, 2, 3),
                                       optimizer_sharded_from=1, gradients_sharded_from=2, package="deepspeed",
                                       auto_compile_scope="model", compiles_module=True,
                                       quick_on_cpu=False,
                                       rules=deepspeed_problems))
#: the engine a recipe runs when it names none
DEFAULT_ENGINE = SINGLE.name


def engine_names() -> tuple[str, ...]:
    """The names ``parallel.engine`` accepts now."""
    return tuple(ENGINES)


def engine_kind(engine: str) -> EngineKind:
    """The kind of ``parallel.engine`` (a recipe's engine or a result's); KeyError for an unknown name."""
    return ENGINES[engine]


def table_engines() -> list[tuple[str, str, int]]:
    """(label, engine, ZeRO stage) of every row of the engine table and the plan: one per engine, one per
    shown stage of an engine with stages."""
    return [(label, e.name, stage) for e in ENGINES.values() for label, stage in e.table_rows()]


def engines_for(world_size: int) -> list[tuple[str, str, int]]:
    """The rows of :func:`table_engines` that run on ``world_size`` ranks (:meth:`EngineKind.runs_on`)."""
    return [row for row in table_engines() if ENGINES[row[1]].runs_on(world_size)]


def tensor_parallel_engine() -> str:
    """The engine tensor parallelism is a layout of (the first that composes with it)."""
    return engines_with("tensor_parallel")[0]


# ---------------------------------------------------------------------------------------------
# Rules of a recipe's engine and layout (``recipe`` is a config.Recipe, duck-typed: config sits above)


def engines_with(layout: str) -> list[str]:
    """The engines that compose with ``layout`` (``tensor_parallel``, ``expert_parallel``, ``pipeline_parallel``,
    ``data_parallel_replicate``: HSDP)."""
    return [e.name for e in ENGINES.values() if layout in e.layouts]


def tensor_parallel_problems(recipe: Any, seq_len: int) -> list[str]:
    """What ``parallel.tensor_parallel`` > 1 needs of the engine and the model (engines.tp splits heads,
    FFN width and vocabulary; sequence parallelism splits positions)."""
    p, m = recipe.parallel, recipe.model
    N = p.tensor_parallel
    if "tensor_parallel" not in engine_kind(p.engine).layouts:
        return [f"parallel.tensor_parallel: {N} needs parallel.engine={_or_list(engines_with('tensor_parallel'))} "
                f"(FSDP2 over the data-parallel ranks, tensor parallelism within each group of {N}), "
                f"not engine={p.engine}"]
    if m.task != "lm":
        return ["parallel.tensor_parallel: supported for task=lm (the regression model's feature embedding and "
                "head are not split)"]
    if m.ffn == "moe":
        return ["parallel.tensor_parallel: not supported with model.ffn=moe; parallel.expert_parallel splits "
                "the experts instead"]
    problems = []
    if m.position_encoding not in ("rope", "none"):
        problems.append(f"model.position_encoding: {m.position_encoding} is not split by tensor parallelism "
                        "(a position table would add to sequence-sharded states, ALiBi biases every head); "
                        "use rope or none with parallel.tensor_parallel > 1")
    if m.n_heads % N:
        problems.append(f"model.n_heads: {m.n_heads} heads do not split over parallel.tensor_parallel={N} ranks")
    problems += attention_kind(m).tp_problems(m, N)
    for key, size in (("model.intermediate_size", m.intermediate_size), ("model.vocab_size", m.vocab_size),
                      ("train.seq_len", seq_len)):
        if size % N:
            what = "positions (sequence parallelism)" if key == "train.seq_len" else "columns"
            problems.append(f"{key}: {size} {what} do not split evenly over parallel.tensor_parallel={N} ranks")
    return problems


def hsdp_problems(recipe: Any, world_size: int | None = None) -> list[str]:
    """HSDP (``parallel.data_parallel_replicate`` R > 1): FSDP2 on a 2-D (replicate, shard) mesh, with tensor
    parallelism inside each shard group's ranks (a (replicate, shard, tp) mesh) but not expert parallelism or pipeline
    stages; with a world size, R × the tensor-parallel degree divides it."""
    p = recipe.parallel
    R = p.data_parallel_replicate
    if R == 1:
        return []
    if "data_parallel_replicate" not in engine_kind(p.engine).layouts:
        hsdp = " or ".join(engines_with("data_parallel_replicate"))
        return [f"parallel.data_parallel_replicate: {R} (HSDP) needs parallel.engine={hsdp}, not engine={p.engine}"]
    if p.expert_parallel or p.pipeline_parallel > 1:
        other = "expert_parallel" if p.expert_parallel else "pipeline_parallel"
        return [f"parallel.data_parallel_replicate: HSDP does not compose with parallel.{other} here; use one or the "
                "other"]
    tp = p.tensor_parallel
    if world_size is not None and world_size % (R * tp):
        what = f"{R} replicas × parallel.tensor_parallel={tp}" if tp > 1 else f"{R} replicas"
        return [f"parallel.data_parallel_replicate: {what} do not divide the world size {world_size} "
                "(each replica is a shard group of world_size / data_parallel_replicate ranks)"]
    return []


def layout_problems(recipe: Any, seq_len: int) -> list[str]:
    """The parallel layout's rules (tensor and expert parallelism), checked on every recipe."""
    p, m = recipe.parallel, recipe.model
    if p.async_tp and (p.tensor_parallel == 1 or not recipe.train.compile):
        return ["parallel.async_tp: needs parallel.tensor_parallel > 1 and train.compile=true (the fused "
                "collective matmuls are an inductor pass over the compiled blocks)"]
    if p.tp_local_ops and p.tensor_parallel == 1:
        return ["parallel.tp_local_ops: needs parallel.tensor_parallel > 1 (it is a form of the tensor-parallel plan)"]
    if p.fsdp_on_one_rank and p.tensor_parallel == 1:
        return ["parallel.fsdp_on_one_rank: needs parallel.tensor_parallel > 1 (it keeps FSDP2 under pure tensor "
                "parallelism)"]
    if p.tensor_parallel > 1:
        problems = tensor_parallel_problems(recipe, seq_len)
        if problems:
            return problems
    if p.data_parallel_replicate > 1:
        problems = hsdp_problems(recipe)
        if problems:
            return problems
    if p.expert_parallel and m.ffn != "moe":
        return ["parallel.expert_parallel: needs model.ffn=moe (there are no experts to distribute)"]
    if p.expert_parallel_degree and not p.expert_parallel:
        return ["parallel.expert_parallel_degree: needs parallel.expert_parallel=true"]
    if p.expert_parallel_degree and m.n_routed_experts % p.expert_parallel_degree:
        return [f"parallel.expert_parallel_degree: {m.n_routed_experts} routed experts do not split over "
                f"{p.expert_parallel_degree} ranks"]
    if recipe.train.weight_cast == "step":
        problems = weight_cast_problems(recipe)
        if problems:
            return problems
    if p.expert_parallel and "expert_parallel" not in engine_kind(p.engine).layouts:
        return [f"parallel.expert_parallel: supported with engine={_or_list(engines_with('expert_parallel'))} (the expert "
                f"shards are DTensors beside FSDP2's), not engine={p.engine}"]
    return []


def casts_once(engine: str, dtype: str, float8: str) -> bool:
    """Whether ``train.weight_cast=step`` can apply: an engine that takes it, a 16-bit ``model.dtype`` (autocast)
    and no ``train.float8`` (the rules :func:`weight_cast_problems` states, as one test for the estimates)."""
    return engine_kind(engine).weight_cast_step and dtype != "fp32" and float8 == "none"


def weight_cast_problems(recipe: Any) -> list[str]:
    """What ``train.weight_cast=step`` needs: an engine that takes it, autocast (a 16-bit model.dtype),
    and the linear layers as ``nn.Linear`` (not FP8's Float8Linear)."""
    t, p, m = recipe.train, recipe.parallel, recipe.model
    takes = [e.name for e in ENGINES.values() if e.weight_cast_step]
    if not engine_kind(p.engine).weight_cast_step:
        return [f"train.weight_cast: step needs parallel.engine={_or_list(takes)}, not {p.engine} (its wrapper casts "
                "the weights or hooks their gradients itself); use train.weight_cast=micro-batch"]
    if m.dtype == "fp32":
        return ["train.weight_cast: step casts the fp32 weights to model.dtype once per optimizer step; with "
                "model.dtype=fp32 there is nothing to cast (use bf16 or fp16, or train.weight_cast=micro-batch)"]
    if t.float8 != "none":
        return [f"train.weight_cast: step does not compose with train.float8={t.float8} (Float8Linear casts its "
                "own weights); use one of them"]
    return []


def engine_problems(recipe: Any, world_size: int | None = None) -> list[str]:
    """The engine rules train applies before it builds anything: keys only another engine uses, and the
    engine's own rules (DeepSpeed's offload and passthrough); with a world size, that tensor parallelism
    divides it."""
    p = recipe.parallel
    defaults = type(p).model_fields
    problems = [f"parallel.{key}: only used by engine={engine}, but parallel.engine={p.engine}"
                for key, engine in ENGINE_KEYS.items()
                if p.engine != engine and getattr(p, key) != defaults[key].get_default(call_default_factory=True)]
    problems += engine_kind(p.engine).problems(recipe, world_size)
    if world_size is not None and "data_parallel_replicate" in engine_kind(p.engine).layouts:
        problems += hsdp_problems(recipe, world_size)
    if world_size is not None and world_size % p.tensor_parallel:
        problems.append(f"parallel.tensor_parallel: {p.tensor_parallel} does not divide the world size "
                        f"{world_size} (data-parallel ranks × tensor-parallel ranks)")
    return problems


def launch_problems(recipe: Any, world_size: int) -> list[str]:
    """The engine's rule on the job itself: a one-process engine on more than one rank."""
    p = recipe.parallel
    if not engine_kind(p.engine).runs_on(world_size):
        others = [e.name for e in ENGINES.values() if e.distributed]
        return [f"parallel.engine: {p.engine} runs one process, but this job has {world_size} ranks; "
                f"use {_or_list(others)}"]
    return []
