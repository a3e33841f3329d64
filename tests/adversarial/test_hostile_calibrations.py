"""Calibration files, as `--calibration PATH` and as files that would shadow a calibration's name: every figure
the step-time model reads must be a finite number of its kind in its range (a NaN step overhead made NaN
predictions, -1 made negative tokens/s, an overlap of 5 moved an error by 57 points); a string, list or
mapping where a number belongs, a group size '²', a missing factor, 1e308, 20,000-deep nesting, a FIFO or
/dev/zero is one `error:` line each, never a traceback, a hang or a wrong prediction. A name is not a path:
a file called `cpu` (or `h100-sxm`) in the working directory is never read as a calibration."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hostile import ROOT, invoke
from test_hostile_validation import RUN

from scaletool.analytic.calibration import load_calibration
from scaletool.cli import main
from scaletool.records import read_record

SHIPPED = ROOT / "profiles" / "calibrations" / "h100-sxm.yaml"


def _calibration(tmp_path: Path, change) -> Path:
    data = yaml.safe_load(SHIPPED.read_text())
    change(data)
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _set(dotted: str, value):
    def change(d):
        *parents, last = dotted.split(".")
        for p in parents:
            d = d[p]
        d[last] = value
    return change


def _drop(dotted: str):
    def change(d):
        *parents, last = dotted.split(".")
        for p in parents:
            d = d[p]
        del d[last]
    return change


BAD = {
    "step overhead NaN": (_set("overheads.step_s", float("nan")), "overheads.step_s"),
    "step overhead -1": (_set("overheads.step_s", -1), "overheads.step_s"),
    "step overhead inf": (_set("overheads.step_s", float("inf")), "overheads.step_s"),
    "step overhead a string": (_set("overheads.step_s", "0.1"), "overheads.step_s"),
    "step overhead a list": (_set("overheads.step_s", [0.1]), "overheads.step_s"),
    "step overhead a mapping": (_set("overheads.step_s", {"a": 1}), "overheads.step_s"),
    "step overhead true": (_set("overheads.step_s", True), "overheads.step_s"),
    "unaligned GEMM share NaN": (_set("gemm_unaligned", {"eager": float("nan"), "compiled": 0.9}),
                                 "gemm_unaligned.eager"),
    "unaligned GEMM share above 1": (_set("gemm_unaligned", {"eager": 0.2, "compiled": 3}), "gemm_unaligned.compiled"),
    "unaligned GEMM shares a list": (_set("gemm_unaligned", [0.2, 0.9]), "gemm_unaligned"),
    "unaligned GEMM share missing": (_set("gemm_unaligned", {"eager": 0.2}), "gemm_unaligned"),
    "TP step part negative": (_set("overheads.tp_eager_step_block_s", -0.01), "overheads.tp_eager_step_block_s"),
    "overlap 5": (_set("overheads.fsdp_overlap", 5), "overheads.fsdp_overlap"),
    "overlap -0.1": (_set("overheads.ddp_overlap", -0.1), "overheads.ddp_overlap"),
    "elementwise NaN": (_set("elementwise.eager_bytes_factor", float("nan")), "elementwise.eager_bytes_factor"),
    "elementwise factor missing": (_drop("elementwise.compiled_bytes_factor"), "elementwise.compiled_bytes_factor"),
    "elementwise a list": (_set("elementwise", [1, 2]), "elementwise"),
    "GEMM rate 1e308": (_set("gemm_tflops.max_tflops", 1e308), "gemm_tflops.max_tflops"),
    "GEMM rate a string": (_set("gemm_tflops.max_tflops", "fast"), "gemm_tflops.max_tflops"),
    "GEMM half_dim 0": (_set("gemm_tflops.half_dim", 0), "gemm_tflops.half_dim"),
    "GEMM a 400-digit int": (_set("gemm_tflops.half_dim", 10**400), "gemm_tflops.half_dim"),
    "HBM 1e308": (_set("hbm_gb_s", 1e308), "hbm_gb_s"),
    "HBM 1e-300": (_set("hbm_gb_s", 1e-300), "hbm_gb_s"),
    "bus 0": (_set("collectives.intra_node_gb_s.all_gather", {2: 0}), "all_gather.2"),
    "peak -1": (_set("peak_tflops", -1), "peak_tflops"),
    "memory 1e300": (_set("memory_gib", 1e300), "memory_gib"),
    "attention head dims not numbers": (_set("attention_tflops", {"abc": 300}), "attention_tflops"),
    "attention an int key": (_set("attention_tflops", {128: 300}), "attention_tflops"),
    "attention a rate of inf": (_set("attention_tflops.default", float("inf")), "attention_tflops.default"),
    "attention a T of 0": (_set("attention_tflops.default", {0: 300}), "attention_tflops.default"),
    "attention a T not a number": (_set("attention_tflops.default", {"long": 300}), "attention_tflops.default"),
    "attention a T of 400 digits": (_set("attention_tflops.default", {10**400: 300}), "attention_tflops.default"),
    "attention a T-rate of NaN": (_set("attention_tflops.default", {2048: float("nan")}), "attention_tflops.default.2048"),
    "attention a T-rate a list": (_set("attention_tflops.default", {2048: [300]}), "attention_tflops.default.2048"),
    "attention an empty T mapping": (_set("attention_tflops.default", {}), "attention_tflops.default"),
    "ALiBi rate NaN": (_set("attention_tflops.alibi", float("nan")), "attention_tflops.alibi"),
    "only an ALiBi rate": (_set("attention_tflops", {"alibi": 120}), "attention_tflops"),
    "group size superscript two": (_set("collectives.intra_node_gb_s.all_reduce", {"\u00b2": 100}), "group size"),
    "group size 1": (_set("collectives.intra_node_gb_s.all_reduce", {1: 100}), "group size"),
    "group size 400 digits": (_set("collectives.intra_node_gb_s.all_reduce", {10**400: 100}), "group size"),
    "bus 1e308": (_set("collectives.intra_node_gb_s.all_gather", {2: 1e308}), "all_gather.2"),
    "inter-node NaN": (_set("collectives.inter_node_gb_s", float("nan")), "inter_node_gb_s"),
    "name a list": (_set("name", ["H100"]), "name"),
    "name with an escape sequence": (_set("name", "H100\x1b]0;pwned\x07"), "name"),
    "source with a newline": (_set("source", "measured\nforged line"), "source"),
    "overheads a list": (_set("overheads", [1]), "overheads"),
    "measured a string": (_set("measured", "x"), "measured"),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The committed result as a file of its own (``unpack`` writes it out of its run folder's bundle): PATHS take files."""
    path = tmp_path_factory.mktemp("result") / RUN.name
    path.write_text(read_record(RUN))
    return path


@pytest.mark.parametrize("name", BAD)
def test_a_calibration_figure_out_of_kind_or_range_is_one_line_naming_it(tmp_path, run, name):
    change, key = BAD[name]
    path = _calibration(tmp_path, change)
    lines, _ = invoke(["calibrate", "--validate", "--calibration", str(path), str(run)], within=tmp_path)
    assert len(lines) == 1 and str(path) in lines[0] and key in lines[0], lines


def _file(name: str, content: str | bytes):
    def make(d: Path) -> Path:
        path = d / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path
    return make


BOMB = "a: &a [1,1,1,1,1,1,1,1,1]\n" + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n"
                                               for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("make, expected", [
    (lambda d: (os.mkfifo(d / "fifo.yaml"), d / "fifo.yaml")[1], "not a regular file"),
    (lambda d: Path("/dev/zero"), "not a regular file"),
    (lambda d: d, "not a regular file"),
    (lambda d: d / "missing.yaml", "no such file"),
    (_file("big.yaml", "#" * (2 << 20)), "larger than 1 MiB"),
    (_file("deep.yaml", "[" * 20_000 + "]" * 20_000), "deep"),
    (_file("bomb.yaml", BOMB), "aliases"),
    (_file("bin.yaml", b"\xff\xfe\x00"), "UTF-8"),
    (_file("list.yaml", "- 1\n"), "a calibration is a mapping"),
])
def test_a_calibration_file_that_is_not_one_is_refused_without_waiting(tmp_path, run, make, expected):
    path = make(tmp_path)
    lines, _ = invoke(["calibrate", "--validate", "--calibration", str(path), str(run)])
    assert expected in " ".join(lines), lines


def test_a_valid_calibration_path_is_read_and_named(tmp_path, run):
    path = _calibration(tmp_path, lambda d: None)
    path.write_text(path.read_text() + "# an exponent float without a dot is a number, as YAML 1.2 reads it\n")
    path.write_text(path.read_text().replace("\n  step_s: 0.0\n", "\n  step_s: 1e-3\n"))
    assert load_calibration(str(path)).overheads["step_s"] == 1e-3
    res = CliRunner().invoke(main, ["calibrate", "--validate", "--calibration", str(path), str(run), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["runs"]
    assert len(rows) == 1 and rows[0]["calibration"] == "H100 SXM"
    assert load_calibration(str(path)).file == str(path)


@pytest.mark.parametrize("content", ["name: [1]\n", "not: a calibration\n"])
def test_a_file_called_cpu_here_is_not_the_cpu_calibration(tmp_path, run, monkeypatch, content):
    """`scaletool calibrate --device cpu --out cpu` once made ./cpu the CPU calibration of every later
    command run here (and a broken one a traceback): names are looked up among the shipped files only."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu").write_text(content)
    (tmp_path / "h100-sxm").write_text(content)
    from scaletool.predict.prediction import CPU_NOTE, cpu_calibration

    assert cpu_calibration().source == CPU_NOTE
    assert load_calibration("h100-sxm").file.endswith(str(Path("profiles", "calibrations", "h100-sxm.yaml")))
    for args in (["estimate", "tiny", "--hardware", "cpu", "--json"], ["plan", "tiny", "--gpus", "2", "--hardware",
                                                                        "cpu", "--json"]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code in (0, 2) and "Traceback" not in res.output, res.output
        assert res.exit_code == 0 or all(ln.startswith("error: ") for ln in res.stderr.splitlines()), res.stderr
    res = CliRunner().invoke(main, ["calibrate", "--validate", "--calibration", "cpu", str(run)])
    assert res.exit_code == 2 and re.match(r"error: unknown calibration 'cpu'", res.stderr), res.stderr


def test_a_finished_run_keeps_its_summary_when_the_prediction_fails(tmp_path, monkeypatch):
    """Whatever the prediction hits (here a TypeError from inside the model), the trained steps are recorded
    and the prediction's error is in the summary."""
    import scaletool.predict.prediction as prediction

    def broken(*a, **k):
        raise TypeError("unsupported operand type(s) for *: 'str' and 'float'")

    monkeypatch.setattr(prediction, "predict", broken)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "tiny", "--out", str(out), "--set", "train.steps=2", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    assert "TypeError" in summary["prediction"]["unavailable"]
    assert "warning: no step-time prediction for this run: " in (out / "train.log").read_text()
