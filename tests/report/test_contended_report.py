"""A run beside a CPU hog is flagged contended, and the report calls no difference that rests on it.

The hog test asserts only that contention is detected where it certainly happened (busy loops on every
core, twice over, for the whole run): it never asserts that a real run was quiet (a CI machine may be
busy) and never asserts a time. The report's refusal is checked on the real flagged result and on
synthetic results (report_synth), where the same pair without the flag is called.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import report_synth as synth
from conftest import RECIPES

from scaletool import api, threads
from scaletool.config import load_recipe
from scaletool.measure import contention
from scaletool.report import data, findings, tables
from scaletool.train.callbacks import Callback


def _pair(path, mla_result: dict, mha_step_s: float = 0.010):
    s = synth.Sweep(path)
    s.add("attention=mha", {"model.attention": "mha"}, synth.mha(), "train",
          synth.train_result(synth.steps(mha_step_s, 20)), index=0)
    s.add("attention=mla kv_lora_rank=8", {"model.attention": "mla", "model.kv_lora_rank": 8}, synth.mla(8), "train",
          mla_result, index=1)
    return data.load([path])


def _throughput(rs) -> str:
    (text,) = [f for f in findings.throughput_crossover(rs) if f.startswith("Training throughput")]
    return text


def _flagged(result: dict, contended: bool) -> dict:
    return {**result, "contention": {"contended": contended, "contended_steps": 12 if contended else 0,
                                     "sampled_steps": 20, "rule": contention.RULE}}


def test_a_difference_is_called_on_quiet_runs_and_not_on_contended_ones(tmp_path):
    slower = synth.train_result(synth.steps(0.0125, 20))
    quiet = _throughput(_pair(tmp_path / "quiet", _flagged(slower, False)))
    assert "-20.0% (slower)" in quiet and "contended" not in quiet
    busy = _pair(tmp_path / "busy", _flagged(slower, True))
    text = _throughput(busy)
    assert "not called: 1 of 2 runs contended" in text and "slower" not in text and "faster" not in text
    assert "rests on contended runs (1 of 2" in text
    (table,) = [t for t in [tables.train_table(busy)] if t is not None]
    # the MHA run recorded no contention (a run from before it was recorded): '-', not a count of 0
    assert [row[[c.name for c in table.columns].index("contended")] for row in table.rows] == [None, "1 of 1"]


def _hogs(n: int) -> list[subprocess.Popen]:
    """``n`` busy loops, returned once every one is spinning: each says so on stdout as its loop starts (a tiny
    run's ten steps can end before n interpreters have started on a loaded machine). Each ends by itself after
    15 minutes should the test be killed before it stops them."""
    code = "import time\nend = time.monotonic() + 900\nprint('spinning', flush=True)\nwhile time.monotonic() < end: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for h in hogs:
        assert h.stdout.readline().strip() == "spinning"
    return hogs


@pytest.mark.slow
def test_a_run_beside_a_cpu_hog_is_flagged_and_its_difference_not_called(tmp_path, monkeypatch):
    probe = contention.snapshot()
    if probe.run_delay_ns is None and probe.psi_us is None:
        pytest.skip("neither /proc/self/task/*/schedstat nor /proc/pressure/cpu: contention cannot be seen here")
    cores = len(os.sched_getaffinity(0))
    # one training thread: several threads meeting at barriers while a hog holds their cores slow every step
    # a hundredfold, which the rule would flag just the same but the test would wait for
    monkeypatch.setenv(threads.SHARE_ENV, "1")
    hogs: list[subprocess.Popen] = []

    class Hog(Callback):
        """Every core oversubscribed twice over from the first step to the end (setup is not what is timed)."""

        def on_step_start(self, step: int) -> None:
            if not hogs:
                hogs.extend(_hogs(2 * cores))

    try:
        r = load_recipe(RECIPES / "tiny.yaml", ["train.steps=10"])
        res = api.train(r, out=tmp_path / "run", quiet=True, callbacks=[Hog()])
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
    c = res.contention
    assert c is not None and c["contended"], (c, {k: v for k, v in res.metrics.items() if k.startswith("contention/")})
    assert res.metrics["contention/contended"] == 1.0 and res.metrics["contention/contended_steps"] >= 1
    assert any(res.history.contended)
    # the real contended run against a quiet synthetic MHA run 5× faster: the report calls no difference
    text = _throughput(_pair(tmp_path / "report", res.model_dump(mode="json"),
                             mha_step_s=res.timing.step_s.median / 5))
    assert "not called: 1 of 2 runs contended" in text and "slower" not in text and "faster" not in text


def test_a_contended_figure_is_marked_on_its_cell_and_the_quiet_ones_are_not(tmp_path):
    """The mark sits on the contended point's timed cells (markdown and HTML render Table.formatted), the runs
    column beside `runs` says how many, and the note says what the mark means."""
    busy = _pair(tmp_path / "busy", _flagged(synth.train_result(synth.steps(0.0125, 20)), True))
    table = tables.train_table(busy)
    names = [c.full for c in table.columns]
    assert names.index("runs contended") == names.index("runs") + 1 < names.index("tokens/s median")
    cells = table.formatted()
    mha_row, mla_row = cells
    for col in ("tokens/s median", "tokens/s p10–p90"):
        i = names.index(col)
        assert mla_row[i].endswith(tables.CONTENDED_MARK) and not mha_row[i].endswith(tables.CONTENDED_MARK)
    assert table.rows[1][names.index("tokens/s median")] == table.column("tokens/s median")[1] > 0  # still a number
    assert table.note.startswith(f"{tables.CONTENDED_MARK}: a contended figure")
    quiet = tables.train_table(_pair(tmp_path / "quiet", _flagged(synth.train_result(synth.steps(0.0125, 20)), False)))
    assert not quiet.marked and tables.CONTENDED_MARK not in quiet.note
    assert [row[names.index("runs contended")] for row in quiet.formatted()] == ["-", "none"]


def test_the_report_files_show_the_mark_and_the_plots_ring_the_point(tmp_path):
    from scaletool.report import plots
    from scaletool.report.render import build_report

    busy = tmp_path / "busy"
    _pair(busy, _flagged(synth.train_result(synth.steps(0.0125, 20)), True))
    res = build_report([busy], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    html = (tmp_path / "report" / "report.html").read_text()
    assert tables.CONTENDED_MARK in md and tables.CONTENDED_MARK in html
    ringed = [p for p in plots.train_plots(data.load([busy])) if p is not None and plots.CONTENDED_CAPTION in p.caption]
    assert "tokens_per_s_vs_compression" in {p.key for p in ringed}  # MFU has no CPU peak: no MFU plot here
    assert res.findings and any("not called: 1 of 2 runs contended" in f for f in res.findings)


def test_the_tokens_per_s_plot_draws_mha_as_a_reference_line(tmp_path):
    from scaletool.report import plots

    rs = _pair(tmp_path / "quiet", _flagged(synth.train_result(synth.steps(0.0125, 20)), False))
    (plot,) = [p for p in plots.train_plots(rs) if p is not None and p.key == "tokens_per_s_vs_compression"]
    assert "Dashed: MHA's tokens/s." in plot.caption and plots.CONTENDED_CAPTION not in plot.caption


def test_prediction_findings_leave_contended_points_out_and_say_so(tmp_path):
    from scaletool.report import prediction

    s = synth.Sweep(tmp_path / "gpu")
    quiet = synth.train_result(synth.steps(0.010, 20), device="cuda")
    quiet["metrics"]["predict/tokens_per_s"] = 26_000.0
    busy = _flagged({**quiet, "metrics": {**quiet["metrics"], "predict/tokens_per_s": 150_000.0}}, True)
    s.add("attention=mha", {"model.attention": "mha"}, synth.mha(), "train", quiet, index=0)
    s.add("attention=mla kv_lora_rank=8", {"model.attention": "mla"}, synth.mla(8), "train", busy, index=1)
    rs = data.load([tmp_path / "gpu"])
    (text, *_) = prediction.prediction_findings(rs)
    assert text.startswith("Step-time model against 1 GPU point(s)")
    assert "1 contended point(s) left out (attention=mla kv_lora_rank=8)" in text
    table = prediction.prediction_table(rs)
    err = [c.full for c in table.columns].index("predicted vs measured")
    assert table.formatted()[1][err].endswith(tables.CONTENDED_MARK) and not table.formatted()[0][err].endswith("⚠")


def test_gqa_points_are_judged_against_mha_too(tmp_path):
    s = synth.Sweep(tmp_path / "kinds")
    s.add("attention=mha", {"model.attention": "mha"}, synth.mha(), "train",
          synth.train_result(synth.steps(0.010, 20)), index=0)
    gqa = synth.recipe(**{**synth.AS_MHA, "model.attention": "gqa", "model.n_kv_heads": 2})
    s.add("attention=gqa", {"model.attention": "gqa"}, gqa, "train", synth.train_result(synth.steps(0.008, 20)), index=1)
    texts = [f for f in findings.throughput_crossover(data.load([tmp_path / "kinds"])) if "GQA" in f]
    assert len(texts) == 1 and texts[0].startswith("Training throughput, GQA against MHA (")
    assert "GQA with 2 KV heads (2.00× less KV cache): +25.0% (faster)" in texts[0]


def test_gqa_decode_points_are_judged_against_mha_too(tmp_path):
    s = synth.Sweep(tmp_path / "dec")
    mha = synth.decode_result([synth.decode_point("mha", 64, synth.steps(0.010, 20), synth.steps(0.05, 5))])
    gqa = synth.decode_result([synth.decode_point("gqa", 64, synth.steps(0.008, 20), synth.steps(0.05, 5))])
    s.add("attention=mha", {"model.attention": "mha"}, synth.mha(), "decode", mha, index=0)
    s.add("attention=gqa", {"model.attention": "gqa"},
          synth.recipe(**{**synth.AS_MHA, "model.attention": "gqa", "model.n_kv_heads": 2}), "decode", gqa, index=1)
    (text,) = findings.decode_speed(data.load([tmp_path / "dec"]))
    assert text.startswith("Decode throughput, GQA against MHA (intermediate_size 192): context 64 (MHA batch 1: ")
    assert "GQA with 2 KV heads: +25.0% (faster)" in text
