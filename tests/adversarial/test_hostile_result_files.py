"""Result files given to `calibrate --validate`: each figure a re-prediction reads must be a finite number of its
type in a range no real run leaves (a rate of Infinity or a median step of 1e-320 s once became a -100% row
counted in the summary; a 400-digit count or a `tensor_parallel` of "2" a traceback). A run with such a figure
is skipped with the reason and counted nowhere (a figure that is no number at all is not used: the run's
own throughput is, test_hostile_validation.py); a file that cannot be a result (a FIFO, /dev/zero, NaN, which
is not JSON) is one `error:` line; nothing waits and nothing is written."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hostile import files_under, invoke
from test_hostile_validation import RUN

from scaletool.cli import main
from scaletool.records import read_record


def _with(change):
    def make(d: Path) -> Path:
        data = json.loads(read_record(RUN))
        change(data)
        path = d / "r.json"
        path.write_text(json.dumps(data))
        return path
    return make


def _metric(key, value):
    return _with(lambda d: d["metrics"].update({key: value}))


def _parallel(key, value):
    return _with(lambda d: d["recipe"]["parallel"].update({key: value}))


SKIPPED = {
    "tokens_per_step 400 digits": (_with(lambda d: d.update(tokens_per_step=10**400)), "tokens_per_step"),
    "tokens_per_step negative": (_with(lambda d: d.update(tokens_per_step=-1)), "tokens_per_step"),
    "world_size 400 digits": (_with(lambda d: d["environment"].update(world_size=10**400)), "world_size"),
    "world_size a float": (_with(lambda d: d["environment"].update(world_size=2.0)), "world_size"),
    "world_size a list": (_with(lambda d: d["environment"].update(world_size=[2])), "world_size"),
    "median 1e-320": (_metric("time/step_s_median", 1e-320), "time/step_s_median"),
    "median 0": (_metric("time/step_s_median", 0), "time/step_s_median"),
    "rate 1e308": (_metric("throughput/tokens_per_s_per_gpu", 1e308), "tokens_per_s_per_gpu"),
    "tensor_parallel a string": (_parallel("tensor_parallel", "2"), "option"),
    "tensor_parallel a list": (_parallel("tensor_parallel", [2]), "option"),
    "deepspeed a string": (_with(lambda d: d["recipe"]["parallel"].update(engine="deepspeed", deepspeed="x")),
                           "option"),
    "zero_optimization a list": (_with(lambda d: d["recipe"]["parallel"].update(
        engine="deepspeed", deepspeed={"zero_optimization": [1]})), "option"),
}


@pytest.mark.parametrize("name", SKIPPED)
def test_a_run_whose_figures_are_not_a_runs_is_skipped_with_the_reason(tmp_path, name):
    make, key = SKIPPED[name]
    path = make(tmp_path)
    before = files_under(tmp_path)
    res = CliRunner().invoke(main, ["calibrate", "--validate", str(path), "--json"])
    assert res.exit_code == 0 and res.exception is None, (res.output[-2000:], res.exception)
    out = json.loads(res.stdout)
    assert out["runs"] == [] and out["summary"]["all"]["n"] == 0
    assert len(out["skipped"]) == 1 and key in out["skipped"][0], out["skipped"]
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("make, expected", [
    (lambda d: (os.mkfifo(d / "f.json"), d / "f.json")[1], "not a regular file"),
    (lambda d: Path("/dev/zero"), "not a regular file"),
    (_metric("throughput/tokens_per_s_per_gpu", float("inf")), "Infinity is not a JSON number"),
    (_metric("time/step_s_median", float("nan")), "NaN is not a JSON number"),
    (lambda d: (d / "deep.json").write_text("[" * 20_000 + "]" * 20_000) and d / "deep.json", "deep.json"),
])
def test_a_file_that_cannot_be_a_result_is_one_line_and_no_wait(tmp_path, make, expected):
    path = make(tmp_path)
    lines, _ = invoke(["calibrate", "--validate", str(path)])
    assert len(lines) == 1 and expected in lines[0], lines


def test_the_same_run_with_sound_figures_is_counted(tmp_path):
    path = _with(lambda d: None)(tmp_path)
    res = CliRunner().invoke(main, ["calibrate", "--validate", str(path), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["summary"]["all"]["n"] == 1


def test_text_from_a_result_file_is_printed_escaped(tmp_path):
    """A GPU name or label holding an escape sequence is shown, not run by the terminal."""
    path = _with(lambda d: d["environment"].update(gpu_names=["\x1b]0;pwned\x07\x1b[2J GPU"]))(tmp_path)
    res = CliRunner().invoke(main, ["calibrate", "--validate", str(path)])
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.output and "\\x1b" in res.output


def test_a_fifo_among_the_committed_results_is_a_skipped_line_not_a_wait(tmp_path, monkeypatch):
    import scaletool.predict.validation as validation

    fifo = tmp_path / "planted.json"
    os.mkfifo(fifo)
    monkeypatch.setattr(validation, "committed_paths", lambda: [fifo, RUN])
    res = CliRunner().invoke(main, ["calibrate", "--validate", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["summary"]["all"]["n"] == 1 and any("not a regular file" in s for s in out["skipped"]), out["skipped"]
