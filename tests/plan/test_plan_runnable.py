"""Every layout ``plan`` offers is one ``launch`` accepts and the installed versions run; a refused one is left
out with its reason (in ``--json`` and a note); ``--verify`` reports a failed layout in one line and goes on."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from scaletool.cli import main
from scaletool.config import load_recipe
from scaletool.plan.commands import command_problems
from scaletool.plan.search import Family, family_problems, left_out_notes
from scaletool.plan.verify import failure_line


def _plan(*argv: str) -> dict:
    res = CliRunner().invoke(main, ["plan", *argv, "--json"], prog_name="scaletool")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_fp8_plan_offers_no_deepspeed_layout_and_says_why():
    """llama3-8b on 8 GPUs with FP8: the ZeRO engines refuse FP8, so none is listed; each family left out is in
    --json with launch's own reason, and the notes say it once for the three stages."""
    doc = _plan("llama3-8b", "--gpus", "8", "--set", "train.float8=tensorwise", "--top", "20")
    assert doc["layouts"] and {r["engine"] for r in doc["layouts"]} <= {"ddp", "fsdp"}
    for r in doc["layouts"]:
        assert r["command_problems"] == []
        sets = [r["argv"][i + 1] for i, a in enumerate(r["argv"]) if a == "--set"]
        assert load_recipe("llama3-8b", sets).engine_problems(8) == []
    refused = [row for row in doc["left_out"] if row["label"] in ("zero1", "zero2", "zero3")]
    assert {row["label"] for row in refused} == {"zero1", "zero2", "zero3"}
    assert all(row["reason"].startswith("train.float8: tensorwise is not supported with parallel.engine=deepspeed")
               for row in refused)
    notes = [n for n in doc["notes"] if n.startswith("not offered (zero1, zero2, zero3): launch would refuse them:")]
    assert len(notes) == 1 and "train.float8" in notes[0]


def test_without_fp8_the_same_plan_offers_deepspeed():
    doc = _plan("llama3-8b", "--gpus", "8", "--top", "40")
    assert doc["left_out"] == [] and any(r["engine"] == "deepspeed" for r in doc["layouts"])


def test_a_family_is_refused_for_the_reason_launch_gives():
    r = load_recipe("llama3-8b", ["train.float8=rowwise"])
    zero3 = Family("gqa", "zero3", "deepspeed", 3, 1, "full", True)
    fsdp = Family("gqa", "fsdp", "fsdp", 0, 1, "full", True)
    assert family_problems(r, fsdp, 8) == []
    (line,) = family_problems(r, zero3, 8)
    assert line.startswith("train.float8: rowwise is not supported with parallel.engine=deepspeed")
    row = {"label": "zero3", "engine": "deepspeed", "zero_stage": 3, "tensor_parallel": 1, "expert_parallel": False,
           "attention": "gqa", "micro_batch_size": 2, "grad_accum_steps": 1, "activation_checkpointing": "full",
           "compiled": True}
    assert command_problems(r, row, 8) == [line]


def test_a_micro_batch_the_passthrough_fixes_leaves_the_other_micro_batches_out():
    """A DeepSpeed passthrough that fixes the micro-batch: every listed ZeRO layout runs at that micro-batch
    (launch refuses the others, which are left out with DeepSpeed's conflict line)."""
    doc = _plan("mla-1b", "--gpus", "8", "--set", "parallel.engine=deepspeed", "--set", "train.micro_batch_size=2",
                "--set", "parallel.deepspeed.train_micro_batch_size_per_gpu=2", "--top", "30")
    zero = [r for r in doc["layouts"] if r["engine"] == "deepspeed"]
    assert zero and all(r["micro_batch_size"] == 2 for r in zero)
    assert [r["rank"] for r in doc["layouts"]] == list(range(1, len(doc["layouts"]) + 1))
    assert any("train_micro_batch_size_per_gpu" in row["reason"] for row in doc["left_out"])


def test_an_engine_whose_library_is_not_installed_is_not_offered(monkeypatch):
    """The import system says DeepSpeed cannot be imported here (a None entry in sys.modules): no ZeRO layout,
    each family left out with the install line."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    doc = _plan("mla-1b", "--gpus", "4", "--top", "40")
    assert doc["layouts"] and all(r["engine"] != "deepspeed" for r in doc["layouts"])
    reasons = {row["reason"] for row in doc["left_out"] if row["label"].startswith("zero")}
    assert reasons == {"parallel.engine: deepspeed needs the deepspeed package, which is not installed here "
                       "(pip install deepspeed)"}


def test_fp8_without_torchao_installed_is_one_error_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    res = CliRunner().invoke(main, ["plan", "llama3-8b", "--gpus", "8", "--set", "train.float8=tensorwise"])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no layout of 8 GPUs can run: ") and "torchao" in lines[0]


def test_left_out_notes_name_each_reason_once():
    rows = [{"label": "zero1", "reason": "a"}, {"label": "zero1", "reason": "a"}, {"label": "zero3", "reason": "a"},
            {"label": "ddp", "reason": "b"}]
    assert left_out_notes(rows) == ["not offered (zero1, zero3): launch would refuse them: a",
                                    "not offered (ddp): launch would refuse it: b"]


def _crash(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_failure_line_is_the_error_line_or_the_exception_a_traceback_ends_with():
    p = _crash("import sys; print('warming up', file=sys.stderr); print('error: rank 0/2: boom', file=sys.stderr); "
               "print('error: rank 1/2: boom', file=sys.stderr); sys.exit(1)")
    assert failure_line(p.stderr, p.returncode) == "rank 0/2: boom"
    p = _crash("import torch\ndef f():\n    raise torch._dynamo.exc.TorchRuntimeError('RuntimeError when making fake "
               "tensor call')\nf()")
    assert p.returncode == 1 and "Traceback" in p.stderr
    assert failure_line(p.stderr, p.returncode) == \
        "torch._dynamo.exc.TorchRuntimeError: RuntimeError when making fake tensor call"
    p = _crash("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert failure_line(p.stderr, p.returncode) == "killed by SIGKILL"
    assert failure_line("", 3) == "exit status 3"


@pytest.mark.slow
def test_verify_reports_a_failed_layout_in_one_line_and_goes_on(tmp_path, monkeypatch):
    """The first layout's run crashes (a real process ending in a traceback); the second runs for real. Both
    are reported, the failure with the exception's one line and no measurement."""
    from scaletool.plan import verify

    real = verify.train_argv
    crash = [sys.executable, "-c", "raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')"]

    def argv(name, overrides, recipe, row, ranks, out):
        return crash if row["rank"] == 1 else real(name, overrides, recipe, row, ranks, out)

    monkeypatch.setattr(verify, "train_argv", argv)
    rows, notes = verify.verify_locally(load_recipe("tiny", []), "tiny", (), 2)
    assert [v["rank"] for v in rows] == [1, 2] and notes
    failed, ran = rows
    assert failed["status"] == "failed" and failed["measured_tokens_per_s"] is None
    assert failed["message"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert ran["status"] == "completed" and ran["message"] is None and ran["measured_tokens_per_s"]["n"] >= 1


def test_zero3_compiled_is_not_listed_beside_its_eager_twin():
    """ZeRO-3 under engine.compile runs its gathering hooks eagerly: predicted and estimated as its eager layout,
    so the plan lists the eager one and says why (it searched both modes)."""
    from scaletool.config import load_recipe as load
    from scaletool.plan.search import Request, families
    notes: list[str] = []
    req = Request(gpus=4, gpus_per_node=4, hardware="H200", card_bytes=140 << 30, calibration=None)
    fams = families(load("recipes/mla-1b.yaml", []), req, "mla", notes)
    zero3 = [f for f in fams if f.engine == "deepspeed" and f.zero_stage == 3]
    assert zero3 and not any(f.compiled for f in zero3)
    assert any(f.compiled for f in fams if f.zero_stage in (1, 2)) and any("ZeRO-3 compiled" in n for n in notes)
