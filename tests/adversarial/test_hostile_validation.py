"""`calibrate --validate PATHS` on result files that are not results, are hostile or come from another version:
a file it cannot read is one ``error:`` line and exit 2; a result recorded with an option this version does not
have is listed as skipped, not a traceback; a run given twice counts once; nothing is written anywhere."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hostile import ROOT, files_under, invoke

from scaletool.cli import main
from scaletool.records import read_record

RUN = ROOT / "benchmarks" / "results" / "mfu-cast-once" / "h100-2026-11-27-1" / "mha-1b-single-mb16-accum4-step.json"


def _result(tmp_path: Path, name: str, change=None) -> Path:
    data = json.loads(read_record(RUN))  # loose or in its run folder's bundle
    if change:
        change(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("content", [b"not json", b"\xff\xfe\x00garbage", b"[" * 5000, b""],
                         ids=["text", "not-utf8", "deep-nesting", "empty"])
def test_a_file_that_is_not_a_result_is_one_error_line(tmp_path, content):
    bad = tmp_path / "r.json"
    bad.write_bytes(content)
    lines, _ = invoke(["calibrate", "--validate", str(bad)], within=tmp_path)
    assert len(lines) == 1 and "r.json" in lines[0]


def test_a_result_with_an_option_this_version_lacks_is_skipped_and_said(tmp_path):
    old = _result(tmp_path, "old.json", lambda d: d["recipe"]["train"].update({"retired_option": "$(touch pwned)"}))
    before = files_under(tmp_path)
    res = CliRunner().invoke(main, ["calibrate", "--validate", str(old), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["runs"] == [] and len(out["skipped"]) == 1
    assert "train.retired_option" in out["skipped"][0] and "option this version does not have" in out["skipped"][0]
    assert files_under(tmp_path) == before and not (Path.cwd() / "pwned").exists()


def test_a_run_given_twice_counts_once_and_a_non_training_file_is_no_run(tmp_path):
    a = _result(tmp_path, "a.json")
    b = _result(tmp_path, "b.json")
    other = tmp_path / "decode.json"
    other.write_text(json.dumps({"points": [], "kind": "decode"}))
    res = CliRunner().invoke(main, ["calibrate", "--validate", str(a), str(b), str(other), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [r["run"] for r in out["runs"]] == [str(a)]
    assert out["duplicates"] == [f"{b}: the run of {a}"]
    assert out["runs"][0]["outside"] is None and out["summary"]["modelled"]["n"] == 1


@pytest.mark.parametrize("line", ['[1, 2]', '"text"', '{"mode": "train", "status": "ok", "result": []}',
                                  '{"mode": "train", "status": "ok", "result": {"environment": [], "metrics": {}}}'],
                         ids=["list", "string", "result-list", "environment-list"])
def test_sweep_records_of_the_wrong_shape_are_no_runs(tmp_path, line):
    path = tmp_path / "s.results.jsonl"
    path.write_text(line + "\n")
    res = CliRunner().invoke(main, ["calibrate", "--validate", str(path), "--json"])
    assert res.exit_code == 0 and res.exception is None, res.output
    assert json.loads(res.stdout)["runs"] == []


@pytest.mark.parametrize("change", [lambda d: d.update(environment=["cuda"]), lambda d: d.update(metrics=None),
                                    lambda d: d["environment"].update(gpu_names="H100"),
                                    lambda d: d["metrics"].update({"throughput/tokens_per_s_per_gpu": "fast"}),
                                    lambda d: d["metrics"].update({"throughput/tokens_per_s_per_gpu": -1.0}),
                                    lambda d: d.update(recipe="mha-1b")],
                         ids=["environment-list", "metrics-null", "gpu-names-text", "rate-text", "rate-negative",
                              "recipe-text"])
def test_a_result_of_the_wrong_shape_is_no_run(tmp_path, change):
    path = _result(tmp_path, "r.json", change)
    res = CliRunner().invoke(main, ["calibrate", "--validate", str(path), "--json"])
    assert res.exit_code == 0 and res.exception is None, res.output
    assert json.loads(res.stdout)["runs"] == []


@pytest.mark.parametrize("change, says", [
    (lambda d: d["environment"].update(world_size="2; rm -rf /"), "world_size"),
    (lambda d: d["environment"].update(world_size=0), "world_size"),
    (lambda d: d["recipe"].update(model=["mla"]), "model"),
    (lambda d: d["recipe"].update(parallel="fsdp"), "parallel"),
], ids=["world-text", "world-zero", "model-list", "parallel-text"])
def test_a_run_whose_recorded_settings_are_malformed_is_skipped_and_said(tmp_path, change, says):
    path = _result(tmp_path, "r.json", change)
    res = CliRunner().invoke(main, ["calibrate", "--validate", str(path), "--json"])
    assert res.exit_code == 0 and res.exception is None, res.output
    out = json.loads(res.stdout)
    assert out["runs"] == [] and len(out["skipped"]) == 1 and says in out["skipped"][0], out["skipped"]


def test_a_result_with_odd_step_metrics_falls_back_to_its_own_throughput(tmp_path):
    path = _result(tmp_path, "r.json", lambda d: d["metrics"].update({"time/step_s_median": "slow"}))
    res = CliRunner().invoke(main, ["calibrate", "--validate", str(path), "--json"])
    assert res.exit_code == 0, res.output
    (run,) = json.loads(res.stdout)["runs"]
    assert run["measured_tokens_per_s_per_gpu"] == json.loads(read_record(RUN))["metrics"]["throughput/tokens_per_s_per_gpu"]
