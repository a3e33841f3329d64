"""The report's training-dynamics section: outcomes, curves and the training-dynamics claims on both sides.

Synthetic train results (the schema the trainer and :class:`~scaletool.profile.monitors.DynamicsMonitor`
write: ``history`` per step, ``dynamics`` per monitored step) with chosen losses and monitor values put
each claim on each side of its line; one test trains a real run with the monitors on, so the keys the
report reads are the keys the monitor writes.
"""
from __future__ import annotations

import json
import math

import pytest
import report_synth as synth
from report_md import md_row, md_section
from report_synth import EVERY
from report_synth import DynamicsStudy as Study
from report_synth import dynamics_result as result
from report_synth import loss_curve as losses

from scaletool import api
from scaletool.report import data, dynamics, findings, tables
from scaletool.report.dynamics import ENTROPY, RANK, Run, study
from scaletool.report.dynamics_findings import dynamics_findings


def claim(rs: data.ResultsSet, start: str) -> str:
    got = [f for f in dynamics_findings(rs) if f.startswith(f"Claim “{start}")]
    assert len(got) == 1, dynamics_findings(rs)
    return got[0]


# --- events -----------------------------------------------------------------------------------------


def test_a_spike_is_the_smoothed_loss_rising_past_its_low_and_one_noisy_batch_is_not():
    def run(loss):
        return Run(data.read_result("train", result(loss, monitored=False), "run"))
    assert run(losses(2.5)).spike_at is None and run(losses(2.5)).spike_rise is None
    spiked = run(losses(2.5, spike=20))
    assert spiked.spike_at == 21  # the 3-step median is past the low from the spike's second step
    low = sorted(losses(2.5)[17:20])[1]  # the lowest 3-step median before it
    assert spiked.spike_rise == pytest.approx(sorted(losses(2.5, spike=20)[20:23])[1] / low - 1)
    one_bad = losses(2.5)
    one_bad[25] *= 1.6  # a single bad batch
    assert run(one_bad).spike_at is None
    r = run(losses(2.5, diverge=12))
    assert (r.diverged_at, r.spike_at, r.unstable_at) == (12, 10, 10)  # the blow-up is a spike before the NaN
    assert r.final == []  # a diverged run has no final loss
    assert run(losses(2.5)).final == pytest.approx(losses(2.5)[-10:])


def test_collapse_counts_only_monitored_steps_before_the_divergence():
    r = Run(data.read_result("train", result(losses(2.5, diverge=14), collapse=8), "run"))
    assert r.monitor_steps == [3, 7, 11] and r.diverged_at == 14
    assert r.collapse_at(ENTROPY) == 11 and r.collapse_at(RANK) == 11
    assert r.lowest(ENTROPY) == [2.9, 2.9, 0.2]
    late = Run(data.read_result("train", result(losses(2.5, diverge=14), collapse=12), "run"))
    assert late.collapse_at(ENTROPY) is None  # measured at step 15 or later: after the divergence
    hostile = result(losses(2.5))
    hostile["dynamics"]["history"] += [{"step": "soon", ENTROPY + "00": 0.0}, {"step": 41, ENTROPY + "00": "low"}]
    h = Run(data.read_result("train", hostile, "run"))
    # a record without a numeric step cannot be placed; a value that is no number is not measured
    assert h.monitor_steps[-2:] == [39, 41] and len(h.monitor_steps) == 11
    assert h.lowest(ENTROPY)[-2:] == [pytest.approx(2.9), None] and h.collapse_at(ENTROPY) is None


# --- the claims, each on both sides ----------------------------------------------------------------------


def test_post_ln_diverging_without_warmup_supports_the_claim_and_shows_everywhere(tmp_path):
    s = Study(tmp_path).add(result(losses(2.5)), "pre").add(result(losses(2.5, diverge=12), collapse=4), "post")
    rs = s.load()
    text = claim(rs, "Post-LN without warm-up")
    assert "supported by the data" in text
    assert "clipping 1, lr 0.03: Post-LN diverged at step 12, Pre-LN did not diverge (supports)" in text
    t = dynamics.dynamics_table(rs)
    outcome = dict(zip(t.column("point"), t.column("outcome")))
    assert outcome["norm_placement=post warmup_steps=0 grad_clip=1.0 lr=0.03"] == "diverged at step 12 (loss spike at step 10)"
    assert outcome["norm_placement=pre warmup_steps=0 grad_clip=1.0 lr=0.03"] == "stable"
    assert t.column("norm_placement") == ["pre", "post"]
    # the failures table names the divergence, and the findings count it apart from broken runs
    fail = tables.failures_table(rs)
    assert fail.column("status") == ["diverged"] and "loss is nan at step 12" in fail.column("reason")[0]
    every = findings.all_findings(rs)
    assert "1 train run(s) diverged (a non-finite loss stopped them); see the last table." in every
    assert not any("failed (error" in f for f in every)


def test_runs_that_failed_are_counted_and_judge_nothing(tmp_path):
    crashed = result(losses(2.5, steps=8))
    crashed.update(status="failed", message="RuntimeError: boom after 8 of 40 steps")
    rs = (Study(tmp_path).add(result(losses(2.5)), "pre").add(crashed, "post", status="error", error="boom")
          .add(result(losses(2.5)), "pre", lr=0.1).add(None, "post", lr=0.1, status="timeout", error="exceeded").load())
    t = dynamics.dynamics_table(rs)
    assert t.column("outcome") == ["stable", "failed", "stable", "failed"] and t.column("runs") == [1, 1, 1, 1]
    text = claim(rs, "Post-LN without warm-up")
    assert text.endswith("cannot tell — no pair could be judged; clipping 1, lr 0.03: a run without a result; "
                         "clipping 1, lr 0.1: a run without a result.")
    assert "2 run(s) failed (error, oom or timeout); see the last table." in findings.all_findings(rs)


def test_pre_ln_diverging_too_contradicts_it(tmp_path):
    rs = Study(tmp_path).add(result(losses(2.5, diverge=20)), "pre").add(result(losses(2.5, diverge=9)), "post").load()
    text = claim(rs, "Post-LN without warm-up")
    assert "contradicted by the data" in text and "Pre-LN diverged at step 20, Post-LN diverged at step 9" in text


def test_final_losses_decide_it_by_the_noise_rule_when_nothing_diverges(tmp_path):
    worse = Study(tmp_path / "worse").add(result(losses(2.5)), "pre").add(result(losses(3.2)), "post").load()
    text = claim(worse, "Post-LN without warm-up")
    assert "supported by the data" in text and "Post-LN trained worse" in text
    assert "final loss Post-LN 3.211 (p10–p90 3.179–3.239, n=10) vs Pre-LN 2.513" in text and "(higher)" in text
    same = Study(tmp_path / "same").add(result(losses(2.5)), "pre").add(result(losses(2.51)), "post").load()
    text = claim(same, "Post-LN without warm-up")
    assert "contradicted by the data" in text and "within noise (±" in text


def test_too_few_losses_to_judge_cannot_tell(tmp_path):
    def two_steps(final: float) -> dict:
        r = result(losses(final, steps=2))
        r["dynamics"]["history"] = [{**m, "step": 1} for m in synth.monitor_history(EVERY)]  # one, after step 1
        return r
    rs = Study(tmp_path).add(two_steps(2.5)).add(two_steps(3.5), "post").load()
    assert claim(rs, "Post-LN without warm-up") == (
        "Claim “Post-LN without warm-up diverges or trains worse, Pre-LN does not”: cannot tell — no pair could be "
        "judged; clipping 1, lr 0.03: final loss Post-LN 5.419 (p10–p90 5.314–5.524, n=2) vs Pre-LN 5.341 (p10–p90 "
        "5.174–5.508, n=2), not compared: n=2 < 3 samples, no spread to judge by.")


def test_points_with_warmup_are_not_the_claims_and_missing_pairs_cannot_tell(tmp_path):
    rs = (Study(tmp_path).add(result(losses(2.5)), "pre", warmup=10)
          .add(result(losses(2.5, diverge=12)), "post", warmup=10).load())
    text = claim(rs, "Post-LN without warm-up")
    assert text.startswith("Claim “Post-LN without warm-up diverges or trains worse, Pre-LN does not”: cannot tell")
    assert "no Pre-LN and Post-LN points without warm-up" in text


def test_clipping_that_removes_the_instability_supports_the_remedy_claim(tmp_path):
    rs = (Study(tmp_path).add(result(losses(2.5, spike=6), clip=0), clip=0.0)
          .add(result(losses(2.5)), clip=1.0).load())
    text = claim(rs, "gradient clipping and warm-up prevent early instability (gradient clipping)")
    assert "supported by the data" in text and "without it loss spike at step 7 (+18%), with it stable (supports)" in text
    assert "(clipping 1 against none)" in text


def test_warmup_that_leaves_the_instability_contradicts_it(tmp_path):
    rs = (Study(tmp_path).add(result(losses(2.5, diverge=10)), "post", warmup=0)
          .add(result(losses(2.5, spike=20)), "post", warmup=10)
          .add(result(losses(2.5, spike=5)), "pre", warmup=0)
          .add(result(losses(2.5)), "pre", warmup=10).load())
    text = claim(rs, "gradient clipping and warm-up prevent early instability (warm-up)")
    assert "mixed: supported in 1 of 2 comparisons, contradicted in 1" in text
    assert "Post-LN, clipping 1, lr 0.03 (warm-up 10 against none): with it loss spike at step 21 (+38%), without it " \
           "diverged at step 10" in text
    assert "Pre-LN, clipping 1, lr 0.03 (warm-up 10 against none): without it loss spike at step 6 (+17%), with it stable" in text


def test_collapse_before_divergence_supports_the_claim_and_collapse_without_one_is_counted(tmp_path):
    rs = (Study(tmp_path).add(result(losses(2.5, diverge=14), collapse=6), "post")
          .add(result(losses(2.5), collapse=20), "pre").load())
    text = claim(rs, "attention entropy collapse and rank collapse precede divergence")
    assert "supported by the data" in text
    assert "a run diverging at step 14: entropy collapse at step 7, rank collapse at step 7 before it" in text
    assert text.endswith("Of the 1 monitored run(s) that did not diverge, 1 collapsed (entropy or rank below its "
                         "threshold) all the same.")


def test_a_divergence_before_the_first_monitored_step_cannot_tell(tmp_path):
    rs = Study(tmp_path).add(result(losses(2.5, diverge=3)), "post").load()  # monitored at step 3: too late
    assert claim(rs, "attention entropy collapse").startswith(
        "Claim “attention entropy collapse and rank collapse precede divergence”: cannot tell — no monitored step "
        "came before any divergence; a run diverging at step 3: no monitored step before it.")


def test_divergence_without_collapse_contradicts_it(tmp_path):
    rs = (Study(tmp_path).add(result(losses(2.5, diverge=14)), "post")
          .add(result(losses(2.5, diverge=18), collapse=6, only="entropy"), "post", lr=0.1).load())
    text = claim(rs, "attention entropy collapse and rank collapse precede divergence")
    assert "contradicted by the data" in text
    assert "a run diverging at step 14: no entropy collapse, no rank collapse before it (contradicts)" in text
    assert "entropy collapse at step 7, no rank collapse before it (only one of the two) (contradicts)" in text


def test_without_a_divergence_the_collapse_claim_cannot_tell_but_says_what_came_before_the_spikes(tmp_path):
    rs = (Study(tmp_path).add(result(losses(2.5, spike=14), collapse=8), lr=0.01)  # collapse at 11, spike at 15
          .add(result(losses(2.5, spike=10), collapse=20), lr=0.03)  # spike at 11, collapse at 23
          .add(result(losses(2.5, spike=1)), lr=0.1)  # spike at 2: before the first monitored step (3)
          .add(result(losses(2.5)), lr=0.3).load())
    assert [p.runs[0].spike_at for p in study(rs)] == [15, 11, 2, None]
    assert claim(rs, "attention entropy collapse") == (
        "Claim “attention entropy collapse and rank collapse precede divergence”: cannot tell — no monitored run "
        "diverged. Against the loss spikes instead, the nearest instability in these runs: of the 2 spiking run(s) "
        "with a monitored step before the spike, entropy collapse came first in 1 and rank collapse in 1; 1 collapsed "
        "only after the spike, 0 not at all; 1 spiked before their first monitored step. Of the 4 monitored run(s) "
        "that did not diverge, 2 collapsed (entropy or rank below its threshold) all the same.")
    # per layer: with no divergence, the run with the largest loss spike
    titles = [p.title for p in dynamics.dynamics_plots(rs)]
    assert titles[-1] == "Effective rank / max per layer: norm_placement=pre warmup_steps=0 grad_clip=1.0 lr=0.01"


def test_when_nothing_diverges_the_claims_about_instability_cannot_tell(tmp_path):
    s = Study(tmp_path)
    for norm in ("pre", "post"):
        for warmup in (0, 10):
            for clip in (0.0, 1.0):
                s.add(result(losses(2.5 if norm == "pre" else 2.9), clip=clip), norm, warmup, clip)
    rs = s.load()
    assert "cannot tell — no monitored run diverged." in claim(rs, "attention entropy collapse")
    for name in ("gradient clipping", "warm-up"):
        text = claim(rs, f"gradient clipping and warm-up prevent early instability ({name})")
        assert f"cannot tell — no run without {name} was unstable (no divergence, no loss spike)" in text
    # Post-LN trained worse at both clipping settings: that half of the claim is still judged
    assert "supported by the data" in claim(rs, "Post-LN without warm-up")
    assert not any("run(s) diverged" in f or "run(s) failed" in f for f in findings.all_findings(rs))


def test_only_results_dirs_with_monitored_runs_make_the_study(tmp_path):
    Study(tmp_path / "plain").add(result(losses(2.5), monitored=False), lr=0.5)
    Study(tmp_path / "study").add(result(losses(2.5)), "pre").add(result(losses(2.5, diverge=12)), "post")
    rs = data.load([tmp_path / "plain", tmp_path / "study"])
    assert [(p.source, p.knobs.norm) for p in study(rs)] == [("study", "pre"), ("study", "post")]
    # several results dirs: a comparison names its own
    assert "study, clipping 1, lr 0.03: Post-LN diverged at step 12" in claim(rs, "Post-LN without warm-up")


def test_without_monitors_there_is_no_dynamics_section(tmp_path):
    rs = Study(tmp_path).add(result(losses(2.5), monitored=False)).add(result(losses(3.0), monitored=False), "post").load()
    assert study(rs) == [] and dynamics.dynamics_table(rs) is None and dynamics.dynamics_plots(rs) == []
    assert dynamics_findings(rs) == []


# --- the report ------------------------------------------------------------------------------------------


def test_the_report_draws_the_section(tmp_path):
    synth.dynamics_showcase(tmp_path / "res")
    res = api.report([tmp_path / "res"], out=tmp_path / "out")
    assert "dynamics" in res.tables
    keys = {p.rsplit("/", 1)[1] for p in res.plots}
    assert {"dynamics_loss.png", "dynamics_entropy.png", "dynamics_rank.png", "dynamics_entropy_layers.png",
            "dynamics_rank_layers.png"} <= keys
    assert all((tmp_path / "out" / "plots" / k).read_bytes()[:4] == b"\x89PNG" for k in keys)
    md = (tmp_path / "out" / "report.md").read_text()
    row = md_row(md_section(md, "Training dynamics"), point="norm_placement=post warmup_steps=0 grad_clip=1.0 lr=0.03")
    assert row["outcome"] == "diverged at step 12 (loss spike at step 10)"
    assert row["attention entropy, lowest layer (nats) collapse at step"] == "11"
    assert row["loss final median"] == "-" and row["runs"] == "1"
    stable = md_row(md_section(md, "Training dynamics"), point="norm_placement=pre warmup_steps=0 grad_clip=1.0 lr=0.01")
    assert stable["loss final n"] == "10" and stable["max grad norm"] == "1.5"
    plots = md_section(md, "Plots: Training dynamics")
    assert "### Training loss per step" in plots and "per layer: norm_placement=post" in plots
    assert "## Plots\n" not in md  # the general plots need two compression ratios or FFN widths: the study has one
    page = (tmp_path / "out" / "report.html").read_text()
    assert '<h2 id="plots-training-dynamics">Plots: Training dynamics</h2>' in page
    assert '<a href="#plots-training-dynamics">' in page and '<a href="#dynamics">Training dynamics</a>' in page
    assert sum(f.startswith("Claim “") for f in res.findings) == 4


@pytest.mark.slow  # among the slowest of the rest (tens of seconds on a busy 2-core machine)
def test_a_real_monitored_run_is_read(tmp_path):
    """The monitor's own keys and summary, from a real (tiny, CPU) run, reach the table."""
    out = tmp_path / "run"
    res = api.train("tiny", out=out, quiet=True, overrides=["train.steps=6", "profile.monitors.enabled=true",
                                                          "profile.monitors.every=2"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == res.status == "completed"
    rs = Study(tmp_path / "res").add(summary).load()
    (point,) = study(rs)
    (r,) = point.runs
    assert r.monitor_steps == [1, 3, 5] and len(r.layers(ENTROPY)) == len(r.layers(RANK)) == 2
    row = dynamics.dynamics_table(rs).rows[0]
    entropy_first, rank_first = row[12], row[15]
    assert 0 < entropy_first <= math.log(64) and 0 < rank_first <= 1
