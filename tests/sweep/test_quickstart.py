"""`scaletool quickstart`, end to end on the CPU: the sweep in estimate, count and train, then the report."""
from __future__ import annotations

import json

import pytest
from conftest import run_cli

from scaletool import threads

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"



def test_quickstart_sweeps_trains_and_reports(tmp_path):
    out = tmp_path / "qs"
    res = run_cli("quickstart", "--out", str(out), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    modes = {m: [r for r in recs if r["mode"] == m] for m in ("estimate", "count", "train")}
    assert all(len(modes[m]) == n and {r["status"] for r in modes[m]} == {"ok"}
               for m, n in (("estimate", 8), ("count", 8), ("train", 24))), \
        [(r["label"], r["mode"], r["status"], r.get("error")) for r in recs if r["status"] != "ok"]
    # three runs of every train point, round the points: all first runs before any second run
    assert sorted(r["repeat"] for r in modes["train"]) == [0] * 8 + [1] * 8 + [2] * 8
    assert [r["repeat"] for r in sorted(modes["train"], key=lambda r: r["started_at"])][:8] == [0] * 8
    assert {r["recipe"]["model"]["attention"] for r in recs} == {"mha", "mla"}
    # untimed runs went several at once; every train run alone on all the cores, 20+ steps measured
    assert {r["threads"] for r in modes["train"]} == {threads.threads_per_process(1)}
    assert all(r["result"]["measured_steps"] >= 20 for r in modes["train"])
    assert res.stdout.strip().splitlines()[-2].strip() == f"report: {out / 'report' / 'report.html'}"
    md = (out / "report" / "report.md").read_text()
    assert "## Training" in md and "Training throughput, MLA against MHA" in md
    assert (out / "report" / "plots" / "tokens_per_s_vs_compression.png").is_file()
    # a second run resumes: nothing is redone
    again = run_cli("quickstart", "--out", str(out), timeout=300)
    assert again.returncode == 0 and len((out / "results.jsonl").read_text().splitlines()) == len(recs)
