"""``train.compile_mode``: validated with ``train.compile``, handed to ``torch.compile`` for each block (or the
whole model), and recorded with the recipe in the run's result."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from scaletool.cli import main
from scaletool.config import RecipeError, load_recipe

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")


def invoke(tmp_path, *sets, cmd="train"):
    args = [cmd, TINY, "--out", str(tmp_path / "run"), "--json"] if cmd == "train" else [cmd, TINY]
    for s in ("train.steps=2", "train.measure_warmup_steps=1", *sets):
        args += ["--set", s]
    return CliRunner().invoke(main, args)


@pytest.mark.parametrize("sets, line", [
    (["train.compile_mode=reduce-overhead"],
     "train.compile_mode: reduce-overhead is torch.compile's mode and needs train.compile=true"),
    (["train.compile=true", "train.compile_mode=fast"], "train.compile_mode: "),
])
def test_a_bad_compile_mode_is_one_error_line_and_writes_nothing(tmp_path, sets, line):
    r = invoke(tmp_path, *sets)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and line in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_the_modes_validate_and_default_changes_no_result_key():
    base = load_recipe(TINY, [])
    assert base.train.compile_mode == "default"
    assert load_recipe(TINY, ["train.compile_mode=default"]).digest() == base.digest()
    for mode in ("reduce-overhead", "max-autotune-no-cudagraphs"):
        r = load_recipe(TINY, ["train.compile=true", f"train.compile_mode={mode}"])
        assert r.train.compile_mode == mode and r.digest() != base.digest()
    with pytest.raises(RecipeError):
        load_recipe(TINY, ["train.compile_mode=max-autotune-no-cudagraphs"])


@pytest.mark.parametrize("scope, mode, expected", [
    ("block", "reduce-overhead", {"mode": "reduce-overhead"}),
    ("block", "max-autotune-no-cudagraphs", {"mode": "max-autotune-no-cudagraphs"}),
    ("block", "default", {}),
    ("model", "reduce-overhead", {"mode": "reduce-overhead"}),
])
def test_the_mode_reaches_torch_compile_and_the_result(tmp_path, monkeypatch, scope, mode, expected):
    """A real one-process CPU run; torch.compile is replaced by a recorder that returns the module as it is
    (the mode is torch's to honour: this checks that scaletool hands it over, per block or for the model, and
    that under reduce-overhead each step marks its start for CUDA graph trees)."""
    calls = []

    def record(target=None, **kwargs):
        calls.append((type(target).__name__, kwargs))
        return target

    monkeypatch.setattr(torch, "compile", record)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append((type(self).__name__, kw)))
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    r = invoke(tmp_path, "train.compile=true", f"train.compile_scope={scope}", f"train.compile_mode={mode}")
    assert r.exit_code == 0, r.stderr
    n_layers = load_recipe(TINY, []).model.n_layers
    assert len(calls) == (n_layers if scope == "block" else 1)
    assert all(kw == expected for _, kw in calls)
    assert len(marks) == (2 if mode == "reduce-overhead" else 0)  # each step tells CUDA graph trees it began
    result = json.loads(r.stdout)
    assert result["status"] == "completed" and result["recipe"]["train"]["compile_mode"] == mode
