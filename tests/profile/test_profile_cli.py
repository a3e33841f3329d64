"""``scaletool profile`` end to end: real runs, real traces, the real TensorBoard plugin parser."""
from __future__ import annotations

import gzip
import json
import re
import time
import types

import pytest
from conftest import RECIPES, run_cli

from scaletool import api
from scaletool.config import load_recipe
from scaletool.profile.monitors import DynamicsMonitor

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

TINY = str(RECIPES / "tiny.yaml")


def _check_sums(report: dict) -> None:
    for key in ("categories", "modules"):
        total = sum(v["time_s"] for v in report[key].values())
        assert total == pytest.approx(report["step_time_s"], rel=1e-9)
        assert sum(v["share"] for v in report[key].values()) == pytest.approx(1.0, rel=1e-9)


def test_profile_writes_plugin_traces_and_a_breakdown_that_adds_up(tmp_path):
    tb = pytest.importorskip("torch_tb_profiler", reason="the test extra installs torch-tb-profiler")
    from torch_tb_profiler import consts
    from torch_tb_profiler.profiler.data import RunProfileData

    out = tmp_path / "run"
    res = run_cli("profile", TINY, "--out", str(out), "--json", "--monitors", "--set", "profile.monitors.every=5",
                  "--set", "profile.record_shapes=true", "--set", "profile.memory_snapshot=true")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["schema"] == "scaletool.profile.breakdown" and report["ranks"] == [0]
    assert report["kind"] == "profile" and report["step_s"]["n"] == 2  # the 2 active steps, with their spread
    assert report["step_s"]["p10"] <= report["step_s"]["median"] <= report["step_s"]["p90"]

    # the files as the plugin finds them: a run directory of <worker>[.<span>].pt.trace.json[.gz]
    traces = sorted((out / "profile" / "traces").iterdir())
    assert len(traces) == 1 and tb.utils.is_chrome_trace_file(traces[0].name)
    worker, span = consts.WORKER_PATTERN.match(traces[0].name).groups()
    assert worker == "rank0"
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    for expected in ("aten::mm", "aten::scaled_dot_product_attention", "Optimizer.step#AdamW.step",
                     "ProfilerStep#2", "ProfilerStep#3", "scaletool::attention", "scaletool::ffn", "scaletool::norm"):
        assert expected in names, expected
    assert not any(n.startswith("ProfilerStep#") and n not in ("ProfilerStep#2", "ProfilerStep#3") for n in names)
    assert all("Input Dims" in e["args"] for e in events if e.get("name") == "aten::mm")  # record_shapes
    assert any("memory_snapshot: CUDA only" in n for n in report["notes"])

    # the plugin's own parser loads it and times the same steps
    prof = RunProfileData.parse(worker, span[1:], str(traces[0]), str(tmp_path))
    assert prof.steps_names == ["2", "3"]
    assert prof.avg_costs.costs[-1] / 1e6 == pytest.approx(report["step_time_s"], rel=0.02)

    _check_sums(report)
    # the loop's own clock for the profiled steps: the mean of those steps' times in metrics.jsonl
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = {r["step"]: r["time/step_s"] for r in rows if "time/step_s" in r}
    assert report["loop_step_time_s"] == pytest.approx((step_s[2] + step_s[3]) / 2, rel=1e-9), step_s
    cats = report["categories"]
    for c in ("attention", "ffn_matmul", "other_matmul", "norm", "optimizer"):
        assert cats[c]["time_s"] > 0, c
    assert cats["communication"]["time_s"] == 0 and report["device"] == "cpu"
    assert report["recipe"]["attention"] == "mla"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["profile"]["breakdown"] == str(out / "profile" / "breakdown.json")
    assert "profile: " in (out / "train.log").read_text()
    assert summary["dynamics"]["steps"] == [4, 9]
    assert "dynamics/update_to_weight_ratio/block_01" in summary["dynamics"]["history"][0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("dynamics/grad_norm/block_00" in r for r in rows)  # through the metrics writer


def test_monitors_leave_step_times_unchanged(tmp_path, monkeypatch):
    """Monitors after every step must not show in the step times.

    Each monitor call moves the training clock forward by 10⁶ s (the wall clock plus an offset that only
    the monitor moves): a monitor leaking into a step would put the whole offset into that step's time.
    """
    from scaletool.measure import timing
    from scaletool.train import clock as train_clock

    offset = {"s": 0.0, "calls": 0}
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset["s"])
    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(train_clock, "time", clock)
    measure = DynamicsMonitor.measure

    def slow_measure(self, step, weights):
        offset["s"] += 1e6
        offset["calls"] += 1
        return measure(self, step, weights)

    monkeypatch.setattr(DynamicsMonitor, "measure", slow_measure)
    r = load_recipe(TINY, ["train.steps=8", "profile.monitors.enabled=true", "profile.monitors.every=1"])
    s = api.train(r, out=tmp_path / "on", quiet=True)
    assert s.dynamics["steps"] == list(range(8)) and offset["calls"] == 8
    times = s.history.step_time_s
    assert len(times) == 8 and all(0 < t < 1e6 for t in times), times


@pytest.mark.distributed
def test_two_process_fsdp_profile_shows_gloo_communication(tmp_path):
    out = tmp_path / "fsdp"
    res = run_cli("profile", TINY, "--out", str(out), "--json", "--nproc-per-node", "2",
                  "--set", "parallel.engine=fsdp", "--monitors", "--set", "profile.monitors.every=5")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["ranks"] == [0, 1] and len(report["per_rank"]) == 2
    _check_sums(report)
    for b in report["per_rank"]:  # each rank's own trace, with gloo's collectives as communication
        assert f"rank{b['rank']}." in b["trace"]
        assert b["communication_overlap"]["communication_s"] > 0 and b["categories"]["communication"]["time_s"] > 0
        assert any(re.match(r"gloo:all_gather", op["name"]) and op["category"] == "communication"
                   for op in b["top_ops"])
    assert {p.name.split(".")[0] for p in (out / "profile" / "traces").iterdir()} == {"rank0", "rank1"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dynamics"]["steps"] == [4, 9]  # FSDP: weights gathered to rank 0
    assert summary["dynamics"]["history"][-1]["dynamics/grad_norm/block_01"] > 0


def test_bad_options_fail_with_one_line():
    res = run_cli("profile", TINY, "--ranks", "3")
    assert res.returncode == 2 and res.stderr.strip() == \
        "error: profile.ranks: [3] names ranks beyond the world size 1"
    res = run_cli("profile", TINY, "--set", "profile.active=20")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"error: {TINY}: profile: the schedule needs wait + warmup + active = 22 steps, but train.steps is 10"]


def test_profile_prints_the_breakdown_and_what_the_monitors_found(tmp_path):
    """In this process through click: the command calls api.profile (no re-invoked train, no fd juggling)."""
    from click.testing import CliRunner

    from scaletool.cli import main

    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["profile", TINY, "--out", str(out), "--monitors",
                                    "--set", "profile.monitors.every=5"])
    assert res.exit_code == 0, res.output
    assert "monitors: measured after steps 4, 9; no collapse warnings" in res.stdout
    assert "By operator (ms per step)" in res.stdout and f"saved {out / 'profile' / 'breakdown.json'}" in res.stdout
