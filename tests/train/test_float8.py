"""train.float8: the recipe rules, the refusals on machines without FP8 or without torchao (one ``error:``
line, exit 2, nothing written), which linear layers the swap takes, and a real FP8 training run on the CPU
(torch._scaled_mm has CPU kernels) next to bf16 from the same seed and data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from scaletool import api
from scaletool.analytic.memory import recipe_memory
from scaletool.config import load_recipe
from scaletool.engines import float8
from scaletool.errors import RecipeError
from scaletool.measure.hardware import Peak
from scaletool.model import build_model
from scaletool.train import trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny.yaml")
BF16 = ["model.dtype=bf16"]


@pytest.mark.parametrize("sets, says", [
    (["parallel.engine=deepspeed"], "not supported with parallel.engine=deepspeed"),
    (["parallel.engine=fsdp", "parallel.tensor_parallel=2"], "not supported with parallel.tensor_parallel=2"),
    (["model.dtype=fp32"], "needs model.dtype=bf16"),
])
def test_the_recipe_rules_refuse_what_float8_does_not_compose_with(sets, says):
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, [*BF16, "train.float8=tensorwise", *sets])
    assert len(err.value.problems) == 1 and says in err.value.problems[0]
    for engine in ("single", "ddp", "fsdp"):
        assert load_recipe(TINY, [*BF16, "train.float8=rowwise", f"parallel.engine={engine}"]).train.float8 == "rowwise"


def test_train_on_the_cpu_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", TINY, "--out", str(out), "--set", "model.dtype=bf16", "--set", "train.float8=tensorwise")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2, r.stderr
    assert len(errors) == 1 and "FP8 tensor cores" in errors[0] and "on the cpu" in errors[0]
    assert not out.exists()


def test_a_gpu_without_fp8_is_refused_and_one_with_it_is_not(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    line = float8.hardware_problem(torch.device("cuda", 0))
    assert "A100" in line and "compute capability 8.0" in line and ">= 8.9" in line
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8.hardware_problem(torch.device("cuda", 0)) is None


def test_a_missing_torchao_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(float8, "hardware_problem", lambda device=None: None)
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    r = load_recipe(TINY, [*BF16, "train.float8=tensorwise"])
    problems = float8.runtime_problems(r, torch.device("cpu"))
    assert len(problems) == 1 and "pip install 'scaletool[float8]'" in problems[0]
    assert float8.runtime_problems(load_recipe(TINY, BF16), torch.device("cpu")) == []


def test_the_swap_takes_the_block_linears_with_dims_divisible_by_16():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    r = load_recipe(TINY, [*BF16, "train.float8=rowwise"])
    model = build_model(r.model, torch.device("cpu"), seed=0)
    report = float8.convert(model, r)
    mods = dict(model.named_modules())
    # tiny's MLA: wkv_a is d_model -> kv_lora_rank + rope = 64 -> 40 (not a multiple of 16); the head stays bf16
    assert report["kept"] == ["layers.0.attn.wkv_a", "layers.1.attn.wkv_a", "output"]
    assert len(report["swapped"]) == 12 and "layers.0.ffn.w2" in report["swapped"]
    assert all(isinstance(mods[f], Float8Linear) for f in report["swapped"])
    assert not any(isinstance(mods[f], Float8Linear) for f in report["kept"])
    # the analytic estimate's FP8 parameters are the swapped modules' weights
    fp8 = recipe_memory(r, 1)["float8"]["fp8_params"]
    assert fp8 == sum(mods[f].weight.numel() for f in report["swapped"])


@pytest.mark.slow
def test_fp8_training_on_the_cpu_learns_like_bf16(tmp_path, monkeypatch):
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(float8, "hardware_problem", lambda device=None: None)  # the CPU runs _scaled_mm
    # a card's peaks for this CPU, so that both MFUs are computed: bf16 1 TFLOP/s, FP8 2 TFLOP/s
    peaks = {"bf16": 1.0, "fp8": 2.0}
    monkeypatch.setattr(trainer, "peak_for", lambda kind, name, dtype, override=None: Peak(peaks[dtype], "x", "test"))
    common = [*BF16, "train.steps=12", "train.measure_warmup_steps=1", "data.source=text",
              f"data.path={Path(TINY).parents[1] / 'README.md'}", "model.vocab_size=272"]
    runs = {mode: api.train(TINY, overrides=[*common, f"train.float8={mode}"], out=tmp_path / mode, quiet=True)
            for mode in ("none", "tensorwise", "rowwise")}
    base = runs["none"].history.loss
    for mode in ("tensorwise", "rowwise"):
        loss = runs[mode].history.loss
        assert runs[mode].status == "completed" and loss[-1] < loss[0] - 1.0
        assert max(abs(a - b) for a, b in zip(loss, base)) < 0.1, (mode, loss, base)
        assert loss != base  # the GEMMs really ran in FP8
        log = (tmp_path / mode / "train.log").read_text()
        assert f"float8 {mode}: 12 linear layers in FP8, 3 kept in bf16" in log
        assert "without train.compile" in log
        m = runs[mode].metrics
        assert m["flops/mfu_fp8_peak"] == pytest.approx(m["flops/mfu"] / 2) and m["flops/mfu"] > 0
    assert "flops/mfu_fp8_peak" not in runs["none"].metrics and runs["none"].metrics["flops/mfu"] > 0
    # the float8-1gpu study's table reads these results as its loss runs
    study = tmp_path / "study"
    study.mkdir()
    for mode, res in runs.items():
        (study / f"loss-{mode}.json").write_text(res.model_dump_json())
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scripts" / "float8_table.py"), str(study)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads((study / "float8.json").read_text())
    rows = {row["float8"]: row for row in doc["rows"]}
    assert set(rows) == {"none", "tensorwise", "rowwise"} and rows["none"]["speedup/over_bf16"] is None
    assert rows["tensorwise"]["speedup/over_bf16"] > 0 and rows["tensorwise"]["throughput/n_steps"] >= 5
    assert rows["tensorwise"]["flops/mfu_fp8_peak"] == pytest.approx(runs["tensorwise"].metrics["flops/mfu_fp8_peak"])
    curves = json.loads((study / "float8-loss.json").read_text())
    assert curves["tensorwise"]["loss"] == runs["tensorwise"].history.loss and (study / "float8-loss.png").stat().st_size
    assert "| loss | tensorwise |" in r.stdout and doc["environment"]["card"] == "cpu"


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_on_two_ranks_gathers_fp8_under_tensorwise_and_learns_like_bf16(tmp_path):
    pytest.importorskip("torchao.float8")
    worker = str(Path(__file__).with_name("float8_worker.py"))
    gathers = {}
    for mode in ("none", "tensorwise", "rowwise"):  # one job each: every process trains once
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            worker, TINY, str(tmp_path), mode], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:]
        gathers[mode] = json.loads((tmp_path / f"{mode}.gathers.json").read_text())
    assert gathers["none"] == {} and len(gathers["tensorwise"]) == len(gathers["rowwise"]) == 12
    assert all(gathers["tensorwise"].values()) and not any(gathers["rowwise"].values())
    loss = {m: json.loads((tmp_path / m / "summary.json").read_text())["history"]["loss"] for m in gathers}
    for mode in ("tensorwise", "rowwise"):
        assert max(abs(a - b) for a, b in zip(loss[mode], loss["none"])) < 0.05, (mode, loss)
