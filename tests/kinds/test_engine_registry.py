"""Engines as kinds: a toy engine registered from this file alone gets a recipe key, memory, collectives,
step time, a plan and a training run, with no other file edited (docs/extending.md's worked example); and
the kinds' parts are what the floors above provide, never module paths."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from scaletool import api
from scaletool.analytic.calibration import load_calibration
from scaletool.analytic.engine_memory import single_memory
from scaletool.analytic.engine_step import EngineStepTerms, StepContext
from scaletool.analytic.memory import memory_table, recipe_memory
from scaletool.analytic.step import predict_step
from scaletool.config import RecipeError
from scaletool.engines.single import SingleEngine
from scaletool.hf import load_recipe
from scaletool.kinds.engines import ENGINES, EngineKind, engine_kind, engines_for, register_engine, unregister_engine

PKG = Path(__file__).resolve().parents[2] / "scaletool"
TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
TOY_BUFFER = 3 * 2**20  # the toy engine's own buffer, so its memory is told apart from single's
TOY_HOST_S = 0.25  # its host seconds per micro-batch, so its step time is told apart too


def toy_memory(cfg, N, units, loss_temp, s):
    out = single_memory(cfg, N, units, loss_temp, s)
    for phase in out["phases"].values():
        phase["buffers"] += TOY_BUFFER
    return out


def toy_step(ctx: StepContext) -> EngineStepTerms:
    return EngineStepTerms(host_s=ctx.gas * TOY_HOST_S, notes=["toy: a quarter second of host work per micro-batch"])


class ToyEngine(SingleEngine):
    name = "toy"


@pytest.fixture
def toy():
    kind = register_engine(EngineKind("toy", distributed=False, autocast=True, auto_compile_scope="model"))
    kind.provide(memory=toy_memory, communication=lambda cfg, ranks, **_: [], step=toy_step, constructor=ToyEngine)
    try:
        yield kind
    finally:
        unregister_engine("toy")


def test_a_registered_engine_gets_memory_step_time_plan_and_train(toy, tmp_path):
    r = load_recipe(TINY, ["parallel.engine=toy", "train.steps=3", "train.log_every=1"])
    single = load_recipe(TINY, ["train.steps=3"])
    assert recipe_memory(r, 1)["total_bytes"] == recipe_memory(single, 1)["total_bytes"] + TOY_BUFFER
    assert [row["label"] for row in memory_table(r, 1)].count("toy") == 2  # without and with checkpointing
    calib = load_calibration("h100-sxm")
    step, base = predict_step(r, calib), predict_step(single, calib)
    assert step["terms"]["host_overhead_s"] == pytest.approx(base["terms"]["host_overhead_s"] + TOY_HOST_S)
    assert "toy: a quarter second of host work per micro-batch" in step["assumptions"]
    plan = api.plan(TINY, gpus=1, hardware="H100 SXM", top=1000)
    toy_rows = [row for row in plan.layouts if row.label == "toy"]
    assert toy_rows and all("parallel.engine=toy" in " ".join(row.argv or []) for row in toy_rows)
    assert ("toy", "toy", 0) in engines_for(1) and ("toy", "toy", 0) not in engines_for(2)  # one process
    result = api.train(r, out=tmp_path / "run", quiet=True, measure=False)
    assert result.steps_completed == 3 and result.recipe["parallel"]["engine"] == "toy"


def test_an_unregistered_engine_is_a_recipe_error_and_parts_are_checked(toy):
    unregister_engine("toy")
    with pytest.raises(RecipeError, match=r"parallel.engine: Input should be .*'deepspeed' \(got 'toy'\)"):
        load_recipe(TINY, ["parallel.engine=toy"])
    register_engine(toy)
    with pytest.raises(ValueError, match="already registered"):
        register_engine(EngineKind("toy"))
    with pytest.raises(ValueError, match="no part named 'memroy'"):
        toy.provide(memroy=toy_memory)
    with pytest.raises(ValueError, match="already provided"):
        toy.provide(memory=single_memory)
    bare = EngineKind("bare")
    with pytest.raises(LookupError, match="engine bare: no step part provided"):
        bare.part("step")


def test_shipped_engines_have_every_part_and_no_module_path_strings():
    import scaletool.analytic.engines  # noqa: F401  (provides the analytic parts)
    import scaletool.engines  # noqa: F401  (provides the constructors)

    for kind in ENGINES.values():
        assert {"memory", "communication", "step", "constructor"} <= set(kind.parts), kind.name
    assert engine_kind("deepspeed").has("config_record") and not engine_kind("fsdp").has("config_record")
    text = (PKG / "kinds" / "engines.py").read_text()
    assert not re.search(r'"scaletool\.[\w.]+:\w+"', text) and "importlib" not in text


def test_an_engines_module_is_found_by_the_engines_name(monkeypatch):
    """A new engine's torch module needs no import line in scaletool/engines/__init__.py: its parts are provided
    when scaletool/engines/<name>.py is imported by name, the first time the engine's parts are asked for."""
    import sys

    from scaletool.engines import base

    ddp = engine_kind("ddp")
    # as if scaletool.engines.ddp had never been imported: no constructor, the module not loaded
    monkeypatch.delitem(ddp.parts, "constructor")
    monkeypatch.delitem(sys.modules, "scaletool.engines.ddp")
    assert not ddp.has("constructor")
    got = base.engine_kind("ddp")
    assert got is ddp and ddp.has("constructor") and ddp.part("constructor").__module__ == "scaletool.engines.ddp"
    # an engine without a module of its name (registered with its parts elsewhere) is left as it is
    bare = register_engine(EngineKind("bare_engine_without_module"))
    try:
        assert base.engine_kind("bare_engine_without_module") is bare and not bare.has("constructor")
    finally:
        unregister_engine("bare_engine_without_module")


def test_no_engine_name_is_compared_outside_the_kinds():
    """Engines are told apart by their kinds' attributes: no ``== "fsdp"`` or ``!= "single"`` in the package
    outside scaletool/kinds (launchers are not engines: ``launcher == "deepspeed"`` names DeepSpeed's
    launcher)."""
    names = "|".join(ENGINES)
    compare = re.compile(rf'(==|!=|\bin\b)\s*\(?\s*"({names})"|"({names})"\s*(==|!=|\bin\b)')
    found = []
    for path in PKG.rglob("*.py"):
        if path.parts[-2] == "kinds":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if compare.search(line) and "launcher" not in line:
                found.append(f"{path.relative_to(PKG.parent)}:{i}: {line.strip()}")
    assert found == []
