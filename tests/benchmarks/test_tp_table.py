"""benchmarks/scripts/tp_table.py reads the tensor-parallel studies' outputs: the committed 2-GPU results give
their ratios again, and a failed command of a study shows with its first error line."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

from scaletool import records

RESULTS = ROOT / "benchmarks" / "results" / "tp-2gpu" / "2xh200-2026-11-26"


def table(out) -> str:
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scripts" / "tp_table.py"), "table", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_the_committed_results_give_their_ratios_and_modes(tmp_path):
    out = tmp_path / "study"
    (out / "tp2").mkdir(parents=True)
    for p in records.glob(RESULTS, "m*.json"):  # loose or in the run folder's bundle
        (out / "tp2" / p.name).write_text(records.read_record(p))
    (out / "runs" / "x").mkdir(parents=True)  # a run's own summary is no result of the study
    (out / "runs" / "x" / "mha-tp2-eager.json").write_text(records.read_record(RESULTS / "mha-tp2-eager.json"))
    text = table(out)
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(("mha-", "mla-"))}
    assert len(rows) == 10
    assert "compiled async" in rows["mha-tp2-compiled-async"] and " eager " in rows["mla-tp2-eager"]
    assert rows["mha-tp2-compiled"].split()[-4] == "0.68" and rows["mla-tp2-eager"].split()[-4] == "0.29"
    assert "mha rank8 2 GPUs: mha-tp2-compiled 57,322 / mha-fsdp-x2-compiled 83,954 = 0.68" in text
    assert "mla rank8 2 GPUs: mla-tp2-compiled 45,933 / mla-fsdp-x2-compiled 82,304 = 0.56" in text


def test_a_failed_command_shows_its_first_error_line(tmp_path):
    (tmp_path / "logs").mkdir()
    lines = [{"command": "mha-1b-tp2-compiled-ro", "status": "failed"}, {"command": "table", "status": "ok"}]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "logs" / "mha-1b-tp2-compiled-ro.stderr").write_text(
        "step 1\nerror: rank 1 exited with status 1\nerror: CUDA graphs: a collective cannot be captured\n")
    text = table(tmp_path)
    assert "mha-1b-tp2-compiled-ro             failed: error: CUDA graphs: a collective cannot be captured" in text
    assert "table " not in text.split("failed or stopped")[1]


def test_a_peer_result_shows_both_sides_and_their_ratio(tmp_path):
    side = {"tokens_per_s_per_gpu": {"median": 50_000.0, "p10": 49_000.0, "p90": 51_000.0, "n": 10}}
    other = {"tokens_per_s_per_gpu": {"median": 40_000.0, "p10": 39_500.0, "p90": 40_500.0, "n": 10}}
    doc = {"settings": {"tensor_parallel": 2}, "results": {"torchtitan": other, "scaletool": side},
           "scaletool_over_torchtitan": {"tokens_per_s_ratio": 1.25}}
    (tmp_path / "peer-torchtitan-mha-1b-tp2.json").write_text(json.dumps(doc))
    (tmp_path / "peer-broken.json").write_text("{")  # unreadable: left out, not a crash
    text = table(tmp_path)
    line = next(x for x in text.splitlines() if x.startswith("peer-torchtitan-mha-1b-tp2"))
    assert "torchtitan 40,000 [39,500-40,500] 10" in line and "scaletool 50,000 [49,000-51,000] 10" in line
    assert line.endswith("scaletool/torchtitan 1.25") and "peer-broken" not in text


def test_a_run_without_per_step_timing_shows_its_window_rate(tmp_path):
    d = json.loads(records.read_record(RESULTS / "mha-tp2-compiled.json"))
    d["timing"]["tokens_per_s"], d["tokens_per_s"] = None, 120_000.0  # --no-measure: the window's rate only
    (tmp_path / "tp2").mkdir()
    (tmp_path / "tp2" / "mha-tp2-compiled-nomeasure.json").write_text(json.dumps(d))
    line = next(x for x in table(tmp_path).splitlines() if x.startswith("mha-tp2-compiled-nomeasure"))
    assert "60,000 [window]" in line
