"""benchmarks/scripts/memory_phases.py, the GPU memory-validation driver: its plan of processes, its table
of the committed H200 result, and a real run in smoke mode (CPU, gloo: two one-rank workers at once, then
a two-rank torchrun job) with the engines' optimizer hooks and DeepSpeed's wrapped step firing."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import ROOT

from scaletool.records import read_record

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

DRIVER = ROOT / "benchmarks" / "scripts" / "memory_phases.py"
RESULT = ROOT / "benchmarks" / "results" / "memory-phases" / "2xh200-2026-11-26" / "memory-phases.json"


@pytest.fixture(scope="module")
def driver():
    spec = importlib.util.spec_from_file_location("memory_phases", DRIVER)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def test_plan_gives_engines_that_outlive_themselves_a_process_per_cell(driver):
    cells = driver.grid(["mha-1b", "mla-1b"], list(driver.ENGINES), [1, 8], ["none", "full"], [1, 2])
    assert len(cells) == 2 * 2 * 2 * (6 + 5)  # single runs on one GPU only
    assert [c.activation_checkpointing for c in cells[:11]] == ["full"] * 11 and cells[0].micro_batch_size == 1
    jobs = driver.jobs(cells)
    assert sorted(c.name for job in jobs for c in job) == sorted(c.name for c in cells)
    for job in jobs:
        assert len({(c.label, c.world_size) for c in job}) == 1
        if job[0].label in ("ddp", "zero3"):
            assert len(job) == 1
    assert sum(1 for job in jobs if job[0].label == "zero1" and job[0].world_size == 2) == 1


def test_table_of_the_committed_result(driver, tmp_path):
    (tmp_path / RESULT.name).write_text(read_record(RESULT))  # from its run folder's bundle, as unpack gives it
    recs = driver.load_records(tmp_path / RESULT.name)
    views, md = driver.render_table(recs)
    assert len(views) == 88 and md.count("\n| m") == 88
    assert "Peak within ±10% in 79 of 81 valid cells" in md
    contaminated = [v for v in views if v["status"] == "contaminated"]
    assert len(contaminated) == 7 and all(v["label"] == "ddp" and v["world_size"] == 1 for v in contaminated)
    row = next(v for v in views if v["name"] == "mha-1b-zero1-n1-mb1-full")
    assert row["estimate_phase"] == "optimizer_step" and abs(row["peak_rel_error"]) < 0.01


@pytest.mark.distributed
def test_smoke_run_end_to_end(tmp_path):
    out = tmp_path / "mp"
    p = subprocess.run([sys.executable, str(DRIVER), "run", str(out), "--smoke", "--engines", "single", "zero2",
                        "--micro-batches", "1", "--checkpointing", "full", "--steps", "1"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    cells = {f.stem: json.loads(f.read_text()) for f in (out / "cells").glob("*.json")}
    assert set(cells) == {"tiny-single-n1-mb1-full", "tiny-zero2-n1-mb1-full", "tiny-zero2-n2-mb1-full"}
    for rec in cells.values():
        assert rec["status"] == "ok", rec["message"]
        assert rec["environment"]["backend"] == "gloo" and rec["environment"]["world_size"] == rec["cell"]["world_size"]
        assert len(rec["per_rank"]) == rec["cell"]["world_size"]
        for r in rec["per_rank"]:
            assert r["marks"] == ["backward", "optimizer_step"]  # the phase hooks fired (DeepSpeed: its wrapped step)
            assert r["phases"] == {"backward": None, "optimizer_step": None}  # CPU: no allocator figures
            assert len(r["per_step"]) == 2  # the warm-up step and one measured
            est = r["estimate"]
            assert est["total_bytes"] == sum(est["phases"][est["phase"]].values())
    assert "[2gpu] 1/1 tiny-zero2-n2-mb1-full" in p.stderr
    table = (out / "table.md").read_text()
    assert table.count("| tiny |") == 3 and "gloo" not in table
    assert len(json.loads((out / "summary.json").read_text())) == 3
