"""results.jsonl: every line validated as a sweep record on read; torn, hand-edited and foreign lines are
skipped with one warning each; old lines load; concurrent writers never interleave."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
from click.testing import CliRunner
from conftest import ROOT, unpacked_fixture
from sweep_helpers import AS_MHA, write_sweep

from scaletool import api, records
from scaletool.cli import main
from scaletool.results import base, registered
from scaletool.results.sweep import SweepRecord, load_record
from scaletool.sweep.store import RESULTS_FILE, append_record, load_records, read_records

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

GOOD = {"key": "k1", "point_id": "p1", "mode": "estimate", "sweep": "s", "index": 0, "label": "base",
        "status": "ok", "result": json.loads(api.estimate(ROOT / "recipes" / "tiny.yaml").to_json())}


@pytest.fixture
def estimate_kind(monkeypatch):
    """The estimate result model, or a stand-in with its ``params`` mapping until that model is registered."""
    if "estimate" in registered():
        return

    class Estimate(base.Result):
        kind: Literal["estimate"] = "estimate"
        params: dict[str, Any]

    monkeypatch.setitem(base._KINDS, "estimate", Estimate)


def _write_lines(path: Path, items: list) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items))


def test_foreign_and_hand_edited_lines_are_skipped_with_one_warning_each(tmp_path, estimate_kind):
    bad = [
        {**GOOD, "key": "k2", "label": ["<b>x</b>"]},            # a list where a string belongs
        {k: v for k, v in GOOD.items() if k != "label"},          # no label
        {k: v for k, v in GOOD.items() if k != "mode"},           # no mode
        {**GOOD, "key": "k3", "result": {**GOOD["result"], "params": "<i>"}},  # result.params a string
        {**GOOD, "key": "k4", "status": "great"},                # not a status
        {**GOOD, "key": "k5", "result": [1, 2]},                 # a result that is not an object
        {**GOOD, "key": "k6", "kind": "train"},                  # another kind of document
        [1, 2, 3], "42", '{"key": "k7", "sta',                   # not records; a torn line
    ]
    _write_lines(tmp_path / RESULTS_FILE, [GOOD, *bad, {**GOOD, "key": "k8"}])
    recs, warnings = load_records(tmp_path)
    assert [r.key for r in recs] == ["k1", "k8"]
    assert len(warnings) == len(bad)
    assert all(f":{n}:" in w for n, w in zip(range(2, 2 + len(bad)), warnings))
    text = "\n".join(warnings)
    for needle in ("label", "mode", "result: params", "status", "unreadable line"):
        assert needle in text
    assert "<b>" not in text and "<i>" not in text  # never the hostile input itself


def test_the_cli_warns_and_goes_on(tmp_path, estimate_kind):
    sweep = write_sweep(tmp_path / "s.yaml", {"set": AS_MHA, "modes": ["estimate"]})
    out = tmp_path / "out"
    out.mkdir()
    _write_lines(out / RESULTS_FILE, [{**GOOD, "label": 7}, {**GOOD, "result": {"params": "x"}}])
    res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert res.output.count("warning:") == 2 and "Traceback" not in res.output
    assert "1 run(s) to do" in res.output  # the foreign lines recorded nothing


def test_old_lines_load_as_the_first_of_one_repeat():
    old = 0
    for path in [unpacked_fixture("tiny") / "results.jsonl", unpacked_fixture("price") / "results.jsonl",
                 *records.glob(ROOT / "benchmarks" / "results", "*/*/*.results.jsonl")]:  # loose or bundled
        lines = [json.loads(x) for x in records.read_record(path).splitlines() if x.strip()]
        for n, raw in enumerate(lines, 1):
            rec = load_record(raw, f"{path}:{n}")
            old += "repeat" not in raw
            assert (rec.kind, rec.repeat, rec.repeats) == (("sweep_record", 0, 1) if "repeat" not in raw else
                                                           ("sweep_record", raw["repeat"], raw["repeats"]))
            assert rec.key == raw["key"] and rec.result == raw.get("result")
    assert old > 100  # the committed results from before repeats existed
    recs, warnings = read_records(unpacked_fixture("tiny"))
    assert recs and not warnings and all(r["schema_version"] == SweepRecord.SCHEMA_VERSION for r in recs)


def test_writers_in_parallel_never_interleave(tmp_path):
    """Several processes appending at once (Slurm array tasks on one file): every line whole."""
    code = ("import sys; from pathlib import Path; from scaletool.sweep.store import append_record\n"
            "for i in range(150):\n"
            "    append_record(Path(sys.argv[1]), {'key': f'{sys.argv[2]}-{i}', 'pad': 'x' * 5000})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(w)]) for w in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    keys = [json.loads(x)["key"] for x in (tmp_path / RESULTS_FILE).read_text().splitlines()]
    assert sorted(keys) == sorted(f"{w}-{i}" for w in range(3) for i in range(150))


def test_a_torn_last_line_is_skipped_and_the_next_write_starts_a_fresh_one(tmp_path):
    append_record(tmp_path, GOOD)
    with open(tmp_path / RESULTS_FILE, "ab") as f:
        f.write(b'{"key": "b", "sta')  # what a crash mid-write would leave
    recs, warnings = load_records(tmp_path)
    assert [r.key for r in recs] == ["k1"] and len(warnings) == 1 and ":2:" in warnings[0]
    append_record(tmp_path, {**GOOD, "key": "c"})
    recs, _ = load_records(tmp_path)
    assert [r.key for r in recs] == ["k1", "c"]
