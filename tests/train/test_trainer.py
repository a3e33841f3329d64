"""The trainer through ``scaletool.api.train`` in this process: failures keep their partial result,
CPU threads reach the summary, W&B gets what metrics.jsonl gets, messages come once, progress is plain
when piped, the library speaks no CLI flags."""
from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import run_cli
from rich.console import Console

from scaletool import api
from scaletool.cli import main
from scaletool.config import load_recipe
from scaletool.engines.deepspeed import build_notes
from scaletool.errors import RecipeError
from scaletool.threads import SHARE_ENV
from scaletool.train.callbacks import Callback
from scaletool.train.progress import StepProgress
from scaletool.train.resume import Resume
from scaletool.train.trainer import TrainFailed

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
FAST = ["train.steps=6", "train.measure_warmup_steps=1"]


class Boom(Callback):
    def on_step_end(self, step, state):
        if step == 3:
            raise RuntimeError("boom")


def test_a_failure_raises_with_the_partial_result_written(tmp_path):
    with pytest.raises(TrainFailed) as err:
        api.train(TINY, overrides=FAST, out=tmp_path, quiet=True, callbacks=[Boom()])
    result = err.value.result
    assert result.status == "failed" and result.message == "RuntimeError: boom" == err.value.lines[0]
    assert result.history.step == [0, 1, 2] and isinstance(err.value.__cause__, RuntimeError)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "failed" and saved["history"]["step"] == [0, 1, 2]
    assert "error: RuntimeError: boom" in (tmp_path / "train.log").read_text()


class FreezeSeen(Callback):
    def __init__(self):
        self.frozen: dict[int, int] = {}

    def on_step_end(self, step, state):
        import gc
        self.frozen[step] = gc.get_freeze_count()


@pytest.mark.parametrize("boom", [False, True])
def test_the_warm_up_is_out_of_the_collectors_reach_while_measured_and_back_after(tmp_path, boom):
    """gc.freeze() when the measured window opens (step 2 here): what the warm-up built is not walked by the
    collector during the measured steps; the run unfreezes at its end, failed or not."""
    import gc
    seen = FreezeSeen()
    before = gc.get_freeze_count()
    overrides = ["train.steps=5", "train.measure_warmup_steps=2"]
    if boom:
        with pytest.raises(TrainFailed):
            api.train(TINY, overrides=overrides, out=tmp_path, quiet=True, callbacks=[seen, Boom()])
    else:
        api.train(TINY, overrides=overrides, out=tmp_path, quiet=True, callbacks=[seen])
    assert seen.frozen[0] == seen.frozen[1] == before and all(seen.frozen[s] > before for s in (2, 3))
    assert gc.get_freeze_count() == before


def test_a_diverged_run_prints_its_error_once(tmp_path):
    r = CliRunner().invoke(main, ["train", TINY, "--out", str(tmp_path / "nan"), "--set", "train.lr=1.0e+12",
                                  "--set", "train.grad_clip=0", "--set", "train.warmup_steps=0"])
    assert r.exit_code == 1
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("error: loss is ")
    assert api.train(TINY, overrides=["train.lr=1.0e+12", "train.grad_clip=0", "train.warmup_steps=0"],
                     out=tmp_path / "lib", quiet=True).status == "diverged"


@pytest.fixture
def restore_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


class ThreadProbe(Callback):
    def __init__(self):
        self.seen = set()

    def on_step_end(self, step, state):
        self.seen.add(torch.get_num_threads())


def test_cpu_threads_are_pinned_to_the_share_and_recorded(tmp_path, monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(SHARE_ENV, "3")
    probe = ThreadProbe()
    s = api.train(TINY, overrides=FAST, out=tmp_path / "share", quiet=True, callbacks=[probe])
    assert s.threads == 3 and probe.seen == {3} and s.environment["threads_per_rank"] == [3]
    assert s.segments[0].threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's explicit choice wins
    assert api.train(TINY, overrides=FAST, out=tmp_path / "omp", quiet=True).threads == 2


class FakeRun:
    def __init__(self, **kw):
        self.kw, self.logged, self.summary, self.finished = kw, [], {}, False

    def log(self, values, step):
        self.logged.append({"step": step, **values})

    def finish(self):
        self.finished = True


def test_wandb_gets_what_metrics_jsonl_gets(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    s = api.train(TINY, overrides=FAST, out=out, quiet=True, wandb="offline:myproject")
    (run,) = runs
    assert run.kw["mode"] == "offline" and run.kw["project"] == "myproject" and run.kw["dir"] == str(out)
    assert run.kw["resume"] == "allow" and run.kw["config"]["train"]["steps"] == 6 and run.finished
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert run.logged == [{k: v for k, v in row.items() if v is not None} for row in rows]
    assert run.summary["throughput/tokens_per_s"] == s.tokens_per_s
    again = api.train(TINY, overrides=["train.steps=8", "train.measure_warmup_steps=1", "train.checkpoint_every=2"],
                      out=tmp_path / "b", quiet=True, wandb="offline")
    assert again.status == "completed" and runs[1].kw["project"] == "scaletool"


def test_wandb_missing_or_misnamed_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    r = CliRunner().invoke(main, ["train", TINY, "--out", str(tmp_path / "a"), "--wandb", "offline"])
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        "error: wandb logging needs the wandb package: pip install 'scaletool[wandb]'"]
    assert not (tmp_path / "a").exists()
    with pytest.raises(RecipeError, match="expected offline or online"):
        api.train(TINY, out=tmp_path / "b", wandb="sometimes")


def test_wandb_for_real_offline(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    out = tmp_path / "run"
    s = api.train(TINY, overrides=FAST, out=out, quiet=True, wandb="offline")
    assert s.status == "completed"
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_progress_is_plain_lines_when_piped():
    buf = io.StringIO()
    p = StepProgress(Console(file=buf, force_terminal=False, width=200), total=20, done=0, enabled=True,
                     min_interval_s=0)
    with p:
        for _ in range(20):
            p.advance()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("progress: 2/20 steps (10%), ") and "left" in lines[0]
    assert lines[-1].startswith("progress: 20/20 steps (100%)") and "\x1b" not in buf.getvalue()


def test_deepspeed_says_when_it_will_compile_an_op(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    r = load_recipe(TINY, ["parallel.engine=deepspeed", "parallel.zero_stage=2", "parallel.offload_optimizer=true"])
    (note,) = build_notes(r, "cpu")
    assert "compiling its cpu_adam op (first run only" in note
    built = tmp_path / "cpu_adam"
    built.mkdir(exist_ok=True)  # asking for the directory creates it
    (built / "cpu_adam.so").write_bytes(b"")
    assert build_notes(r, "cpu") == [] and build_notes(r, "cuda") == []
    # without offload nothing is built: the inference-only shm all-reduce is skipped on the CPU
    assert build_notes(load_recipe(TINY, ["parallel.engine=deepspeed"]), "cpu") == []


def test_deepspeed_on_cpu_builds_no_inference_all_reduce_op(tmp_path, monkeypatch):
    """A fresh machine compiled DeepSpeed's shared-memory all-reduce for ~75 s before every first CPU run;
    training never uses it (inference_all_reduce does), so the engine skips it: nothing lands in a fresh
    extensions directory and the run trains."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    res = run_cli("train", str(TINY), "--out", str(tmp_path / "run"), "--set", "parallel.engine=deepspeed",
                  "--set", "train.steps=2", "--json", env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["status"] == "completed"
    assert not any((tmp_path / "ext").glob("deepspeed_shm_comm*"))


def test_resume_is_an_explicit_choice():
    assert [Resume.parse(v) for v in ("never", "auto", "required", True, False)] == [
        Resume.NEVER, Resume.AUTO, Resume.REQUIRED, Resume.REQUIRED, Resume.NEVER]
    with pytest.raises(RecipeError, match="expected one of never, auto, required"):
        Resume.parse("sometimes")


def test_library_messages_name_no_cli_flags(tmp_path):
    with pytest.raises(RecipeError) as err:
        api.train(TINY, out=tmp_path / "x", resume="required")
    assert "--" not in str(err.value) and not (tmp_path / "x").exists()


def test_a_run_directory_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = CliRunner().invoke(main, ["train", TINY, "--out", str(blocker / "run"), "--json"])
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        f"error: {blocker / 'run'}: cannot write the run directory (Not a directory)"]
