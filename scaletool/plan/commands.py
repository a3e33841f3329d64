"""Each planned layout as a ``scaletool launch torchrun`` command a shell runs as it is (shlex-quoted)."""
from __future__ import annotations

import shlex
from pathlib import Path

from scaletool.config import Recipe, RecipeError
from scaletool.kinds.engines import engine_kind, launch_problems
from scaletool.plan.space import variant

#: where the nodes of a multi-node layout meet, and the run directory they share: placeholders to edit
ENDPOINT_PLACEHOLDER = "NODE0:29500"
SHARED_OUT_PLACEHOLDER = "/shared/runs"


def layout_sets(base: Recipe, row: dict) -> dict[str, object]:
    """The recipe keys a layout sets, as dotted key -> value (only what differs from ``base``, plus the
    engine and batch keys, which are always stated)."""
    p, t = base.parallel, base.train
    sets: dict[str, object] = {"parallel.engine": row["engine"]}
    if engine_kind(row["engine"]).zero_stages:
        sets["parallel.zero_stage"] = row["zero_stage"]
    if row["tensor_parallel"] != p.tensor_parallel:
        sets["parallel.tensor_parallel"] = row["tensor_parallel"]
    if row.get("data_parallel_replicate", 1) != p.data_parallel_replicate:
        sets["parallel.data_parallel_replicate"] = row.get("data_parallel_replicate", 1)
    if row["expert_parallel"] != p.expert_parallel:
        sets["parallel.expert_parallel"] = row["expert_parallel"]
    if row.get("expert_parallel_degree", 0) != p.expert_parallel_degree:
        sets["parallel.expert_parallel_degree"] = row["expert_parallel_degree"]
    if row.get("pipeline_parallel", 1) != p.pipeline_parallel:
        sets["parallel.pipeline_parallel"] = row["pipeline_parallel"]
    if row.get("pipeline_parallel", 1) > 1:  # a pipeline layout states its schedule, chunks and micro-batches
        sets["parallel.pipeline_schedule"] = row["pipeline_schedule"]
        sets["parallel.pipeline_virtual_stages"] = row["pipeline_virtual_stages"]
        sets["parallel.pipeline_microbatches"] = row["pipeline_microbatches"]
    if row["attention"] != base.model.attention:
        sets["model.attention"] = row["attention"]
    sets["train.micro_batch_size"] = row["micro_batch_size"]
    sets["train.grad_accum_steps"] = row["grad_accum_steps"]
    sets["train.activation_checkpointing"] = row["activation_checkpointing"]
    if row["compiled"] != t.compile:
        sets["train.compile"] = row["compiled"]
    if row.get("reduce_scatter_every", "step") != p.reduce_scatter_every:
        sets["parallel.reduce_scatter_every"] = row.get("reduce_scatter_every", "step")
    if row.get("weight_cast", "micro-batch") != t.weight_cast:
        sets["train.weight_cast"] = row.get("weight_cast", "micro-batch")
    return sets


def _text(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def launch_argv(recipe_arg: str, overrides: tuple[str, ...], base: Recipe, row: dict, gpus: int,
                gpus_per_node: int) -> list[str]:
    """``scaletool launch torchrun RECIPE ... --set ...`` for one layout: the user's own ``--set`` first,
    then the layout's keys (a later ``--set`` of the same key wins)."""
    nnodes = gpus // gpus_per_node
    argv = ["scaletool", "launch", "torchrun", recipe_arg, "--nproc-per-node", str(gpus_per_node)]
    if nnodes > 1:
        stem = Path(recipe_arg).stem or "run"
        argv += ["--nnodes", str(nnodes), "--rdzv-endpoint", ENDPOINT_PLACEHOLDER,
                 "--out", f"{SHARED_OUT_PLACEHOLDER}/{stem}-plan{row['rank']}"]
    sets = layout_sets(base, row)
    given = base.parallel.model_fields_set
    if "nnodes" in given and base.parallel.nnodes != nnodes:
        sets["parallel.nnodes"] = nnodes
    if "nproc_per_node" in given and base.parallel.nproc_per_node != gpus_per_node:
        sets["parallel.nproc_per_node"] = gpus_per_node
    for item in overrides:
        argv += ["--set", item]
    for key, value in sets.items():
        argv += ["--set", f"{key}={_text(value)}"]
    return argv


def command_problems(base: Recipe, row: dict, gpus: int) -> list[str]:
    """What ``scaletool launch`` would refuse in the layout's recipe: the recipe rules with the layout's keys
    set, the engine's rules at this world size and the launch's own (``engines.check_recipe`` without torch)."""
    try:
        r = variant(base, layout_sets(base, row))
    except RecipeError as e:
        return [line.removeprefix("recipe: ") for line in e.problems]
    return r.engine_problems(gpus) + launch_problems(r, gpus)


def describe(row: dict) -> str:
    """``fsdp tp2 mb4×1 full compiled``: one layout in a few words."""
    engine = row["label"] + (f" tp{row['tensor_parallel']}" if row["tensor_parallel"] > 1 else "") + \
        (" ep" if row.get("expert_parallel") else "")
    return (f"{engine} mb{row['micro_batch_size']}×{row['grad_accum_steps']} {row['activation_checkpointing']}"
            + (" compiled" if row["compiled"] else ""))


def command_line(argv: list[str]) -> str:
    return shlex.join(argv)
