"""Engines as data: one object per ``parallel.engine``, torch-free.

Each engine kind holds in one place the ``parallel.*`` keys only it uses, the rules a recipe must meet
under it, how results and tables label it, and where its parts live: the memory closed form
(:mod:`scaletool.analytic.engine_memory`), the data-parallel collectives (:mod:`scaletool.analytic.comm`)
and the torch engine class (:mod:`scaletool.engines`). Parts are named as ``"module:attribute"`` and
imported on first use, so this module (and ``scaletool.config``, which builds ``parallel.engine`` and
its checks from :data:`ENGINES`) stays torch-free. Tensor and expert parallelism are layouts of an
engine (:attr:`EngineKind.layouts`), not engines of their own.

Adding an engine: a new object in :data:`ENGINES`, its torch class in ``scaletool/engines/`` and its
memory closed form (and collectives) in ``scaletool/analytic/``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletool.errors import echo
from scaletool.kinds.attention import attention_kind
from scaletool.yaml_input import flatten_dotted


def resolve(ref: str) -> Any:
    """``"package.module:attribute"`` -> the attribute, its module imported now."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _or_list(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True)
class EngineKind:
    """One value of ``parallel.engine``.

    ``keys``: ``parallel.*`` keys only this engine reads (set under another engine, they are errors).
    ``distributed``: runs in a process group (False: one process). ``autocast``: computes in 16 bits by
    autocast over fp32 weights (else the engine holds or gathers 16-bit weights itself). ``layouts``:
    the parallel layouts it composes with (``tensor_parallel``, ``expert_parallel``). ``zero_stages``:
    the ZeRO stages it takes (``parallel.zero_stage``), ``table_stages`` those the engine table shows.
    ``memory``/``communication``/``engine``: the closed forms and the torch class, as references.
    ``float8``: composes with ``train.float8`` (torchao's Float8Linear under this engine's wrapping).
    ``weight_cast_step``: takes ``train.weight_cast=step`` (one process, gradients accumulated by the
    engine itself, no hooks of a wrapper on the parameters).
    ``package``: the library whose version a training result records, ``config_record`` what it records of
    the library's configuration. ``rules``: the engine's own
    recipe rules, ``rules(recipe, world_size)`` -> problem lines (world size None: not known yet).
    """

    name: str
    memory: str
    communication: str
    engine: str
    keys: tuple[str, ...] = ()
    distributed: bool = True
    autocast: bool = False
    layouts: tuple[str, ...] = ()
    zero_stages: tuple[int, ...] = ()
    table_stages: tuple[int, ...] = ()
    float8: bool = False
    #: what ``train.compile`` compiles under ``train.compile_scope: auto``: ``model`` (one graph, the loss in it)
    #: or ``block`` (each block; communication hooks stay between compiled regions); ``compiles_module``: the
    #: engine compiles the whole module itself whatever ``compile_scope`` says (DeepSpeed's ``engine.compile``)
    compile_scope: str = "block"
    compiles_module: bool = False
    weight_cast_step: bool = False
    package: str | None = None
    startup_notes: str | None = None
    #: ``"module:function"``, ``function(recipe, world_size)`` -> what a training result records of the
    #: engine's own configuration (merged into its ``environment``)
    config_record: str | None = None
    rules: Callable[[Any, int | None], list[str]] | None = None

    def label(self, zero_stage: int | None = None) -> str:
        """Short name in results and tables: ``zero2`` for a ZeRO engine at stage 2, else the name."""
        return f"zero{zero_stage}" if self.zero_stages and zero_stage is not None else self.name

    def title(self, zero_stage: int | None = None) -> str:
        """Name in prose: ``ZeRO-2``, else the name."""
        return f"ZeRO-{zero_stage}" if self.zero_stages and zero_stage is not None else self.name

    def table_rows(self) -> list[tuple[str, int]]:
        """(label, ZeRO stage) of each row this engine has in the memory table."""
        return [(self.label(s), s) for s in self.table_stages] or [(self.name, 0)]

    def memory_form(self) -> Callable:
        """``form(cfg, world_size, units, loss_temp, settings)`` -> phases and states (analytic.engine_memory)."""
        return resolve(self.memory)

    def communication_form(self) -> Callable:
        """``form(cfg, ranks, *, zero_stage, grad_accum_steps, reshard_after_forward, expert_parallel, inputs)``
        -> the collectives per optimizer step (analytic.comm)."""
        return resolve(self.communication)

    def engine_class(self) -> type:
        """The torch engine (imports torch)."""
        return resolve(self.engine)

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


_MEMORY = "scaletool.analytic.engine_memory"
_COMM = "scaletool.analytic.comm"

#: parallel.engine -> its kind
ENGINES: dict[str, EngineKind] = {
    k.name: k for k in (
        EngineKind("single", f"{_MEMORY}:single_memory", f"{_COMM}:no_communication",
                   "scaletool.engines.single:SingleEngine", distributed=False, autocast=True, float8=True,
                   weight_cast_step=True, compile_scope="model"),
        EngineKind("ddp", f"{_MEMORY}:ddp_memory", f"{_COMM}:ddp_communication",
                   "scaletool.engines.ddp:DDPEngine", autocast=True, float8=True),
        EngineKind("fsdp", f"{_MEMORY}:fsdp_memory", f"{_COMM}:fsdp_communication",
                   "scaletool.engines.fsdp:FSDPEngine", keys=("cpu_offload", "reduce_scatter_every"),
                   layouts=("tensor_parallel", "expert_parallel"), float8=True),
        EngineKind("deepspeed", f"{_MEMORY}:zero_memory", f"{_COMM}:zero_communication",
                   "scaletool.engines.deepspeed:DeepSpeedEngine",
                   keys=("zero_stage", "offload_optimizer", "offload_params", "deepspeed"),
                   zero_stages=(0, 1, 2, 3), table_stages=(1, 2, 3), package="deepspeed",
                   startup_notes="scaletool.engines.deepspeed:build_notes", compile_scope="model", compiles_module=True,
                   config_record="scaletool.engines.deepspeed:config_record", rules=deepspeed_problems),
    )
}
ENGINE_NAMES = tuple(ENGINES)
#: parallel.* keys only one engine uses -> that engine
ENGINE_KEYS = {key: e.name for e in ENGINES.values() for key in e.keys}


def engine_kind(engine: str) -> EngineKind:
    """The kind of ``parallel.engine`` (a recipe's engine or a result's); KeyError for an unknown name."""
    return ENGINES[engine]


# ---------------------------------------------------------------------------------------------
# Rules of a recipe's engine and layout (``recipe`` is a config.Recipe, duck-typed: config sits above)


def engines_with(layout: str) -> list[str]:
    """The engines that compose with ``layout`` (``tensor_parallel``, ``expert_parallel``)."""
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
    if p.expert_parallel and m.ffn != "moe":
        return ["parallel.expert_parallel: needs model.ffn=moe (there are no experts to distribute)"]
    if p.expert_parallel and m.moe_dispatch != "capacity":
        return ["parallel.expert_parallel: needs model.moe_dispatch=capacity (the all-to-all moves the "
                "fixed [E, C, d] buffer)"]
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
    if world_size is not None and world_size % p.tensor_parallel:
        problems.append(f"parallel.tensor_parallel: {p.tensor_parallel} does not divide the world size "
                        f"{world_size} (data-parallel ranks × tensor-parallel ranks)")
    return problems


def launch_problems(recipe: Any, world_size: int) -> list[str]:
    """The engine's rule on the job itself: a one-process engine on more than one rank."""
    p = recipe.parallel
    if not engine_kind(p.engine).distributed and world_size > 1:
        others = [e.name for e in ENGINES.values() if e.distributed]
        return [f"parallel.engine: {p.engine} runs one process, but this job has {world_size} ranks; "
                f"use {_or_list(others)}"]
    return []
