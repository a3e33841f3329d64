"""`report` on results that are corrupt or hostile in ways a reader must survive: metadata and breakdown
files that are not UTF-8 or not the expected shape, labels that are lists or mappings, numbers that
overflow a float or are zero where they divide. Each writes the report (or refuses in one line), never a
traceback; what was left out is a warning."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import unpacked_fixture

from scaletool.cli import main

FIXTURE = unpacked_fixture("tiny")
BREAKDOWN = next(FIXTURE.rglob("breakdown.json")).relative_to(FIXTURE)


def _meta(change):
    def apply(d: Path):
        meta = json.loads((d / "sweep.json").read_text())
        change(meta)
        (d / "sweep.json").write_text(json.dumps(meta))
    return apply


def _numbers(fragment: str, value):
    """Every number under a key containing ``fragment`` in every record becomes ``value``."""
    def walk(o):
        if isinstance(o, dict):
            for k in list(o):
                if fragment in k and isinstance(o[k], (int, float)) and not isinstance(o[k], bool):
                    o[k] = value
                else:
                    walk(o[k])
        elif isinstance(o, list):
            for x in o:
                walk(x)

    def apply(d: Path):
        recs = [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines() if line.strip()]
        walk(recs)
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return apply


CASES = {
    "sweep.json not UTF-8": lambda d: (d / "sweep.json").write_bytes(b'{"label": "\xff\xfe"}'),
    "sweep.json a list": lambda d: (d / "sweep.json").write_text("[1]"),
    "sweep.json nested too deep": lambda d: (d / "sweep.json").write_text("[" * 100_000 + "]" * 100_000),
    "label a list": _meta(lambda m: m.update(label=[1, 2])),
    "label a mapping": _meta(lambda m: m.update(label={"a": 1})),
    "name a list": _meta(lambda m: m.update(name=[1])),
    "description a number": _meta(lambda m: m.update(description=1e400)),
    "breakdown not UTF-8": lambda d: (d / BREAKDOWN).write_bytes(b'{"categories": "\xff"}'),
    "breakdown a list": lambda d: (d / BREAKDOWN).write_text("[1, 2]"),
    "breakdown shares huge": lambda d: (d / BREAKDOWN).write_text('{"categories": {"a": {"share": 1e400}}}'),
    "breakdown shares true": lambda d: (d / BREAKDOWN).write_text('{"categories": {"a": {"share": true}}}'),
    **{f"{frag} = {name}": _numbers(frag, value)
       for frag in ("tokens_per_s", "params", "flops", "bytes", "step_s", "mfu", "median", "p10", "p90", "loss", "total")
       for name, value in (("0", 0), ("10^400", 10**400), ("1e308", 1e308), ("-1", -1))},
}


@pytest.mark.parametrize("name", CASES)
def test_a_hostile_results_directory_reports_without_a_traceback(tmp_path, name):
    d = tmp_path / "res"
    shutil.copytree(FIXTURE, d)
    CASES[name](d)
    res = CliRunner().invoke(main, ["report", str(d), "-o", str(tmp_path / "rep"), "--json"])
    assert res.exit_code in (0, 2), (res.exit_code, repr(res.exception), res.stderr[-2000:])
    assert isinstance(res.exception, (SystemExit, type(None))) and "Traceback" not in res.stderr
    if res.exit_code == 0:
        out = json.loads(res.stdout)
        assert Path(out["report_html"]).is_file()
    else:
        assert all(ln.startswith("error: ") for ln in res.stderr.strip().splitlines())


def test_numbers_out_of_range_are_left_out_with_a_warning(tmp_path):
    d = tmp_path / "res"
    shutil.copytree(FIXTURE, d)
    _numbers("bytes", 10**400)(d)
    res = CliRunner().invoke(main, ["report", str(d), "-o", str(tmp_path / "rep"), "--json"])
    assert res.exit_code == 0, res.output
    assert any("number(s) out of range" in w for w in json.loads(res.stdout)["warnings"])
