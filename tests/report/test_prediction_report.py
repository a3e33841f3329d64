"""The report's predicted-vs-measured throughput: recorded predictions, re-predicted older GPU runs,
the CPU placeholder marked and kept off the plot."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from report_md import md_section
from report_synth import Sweep, mha, recipe, steps, train_result

from scaletool.analytic.step import predict_step
from scaletool.cli import main
from scaletool.config import recipe_from_dict
from scaletool.measure.hardware import profile_named
from scaletool.predict.prediction import calibration_for_device
from scaletool.report import data
from scaletool.report.prediction import points, prediction_table


def _gpu(step_s: float, predicted: float | None, world: int = 1) -> dict:
    res = train_result(steps(step_s), device="cuda", mfu_at_1s=0.001)
    res["environment"] = {"world_size": world, "device_type": "cuda", "gpu_names": ["NVIDIA H100 80GB HBM3"] * world}
    res["hardware"] = {"profile": "H100 SXM", "peak_tflops": 989.0}
    if predicted is not None:
        res["metrics"]["predict/tokens_per_s"] = predicted
        res["prediction"] = {"calibration": "H100 SXM", "bound": "compute", "tokens_per_s": predicted}
    return res


@pytest.fixture
def results(tmp_path):
    cpu = train_result(steps(0.01))
    cpu["metrics"]["predict/tokens_per_s"] = 5000.0
    cpu["prediction"] = {"calibration": "CPU (placeholder)", "bound": "compute"}
    (Sweep(tmp_path / "res")
     .add("mla recorded", {}, recipe(), "train", _gpu(0.001, 300_000.0))
     .add("mha recorded", {}, mha(), "train", _gpu(0.002, 100_000.0))
     .add("mla older", {}, recipe(**{"train.compile": True}), "train", _gpu(0.001, None))
     .add("cpu", {}, mha(**{"model.d_model": 32}), "train", cpu))
    return tmp_path / "res"


def test_the_table_sets_each_prediction_beside_the_measurement(results):
    rs = data.load([results])
    t = prediction_table(rs)
    by_point = dict(zip(t.column("point"), zip(t.column("calibration"), t.column("tokens/s predicted"),
                                               t.column("measured tokens/s median"), t.column("predicted vs measured"))))
    calib, pred, measured, err = by_point["mla recorded"]
    assert calib == "H100 SXM" and pred == 300_000.0 and measured == pytest.approx(256 / 0.001, rel=0.02)
    assert err == pytest.approx(pred / measured - 1)
    # the older run is re-predicted from its recipe with its card's calibration
    calib, pred, _, _ = by_point["mla older"]
    older = recipe_from_dict(recipe(**{"train.compile": True}), "t")
    want = predict_step(older, calibration_for_device("cuda", profile_named("H100 SXM")), world_size=1)
    assert calib.endswith("(re-predicted)") and pred == pytest.approx(want["tokens_per_s"])
    assert by_point["cpu"][0] == "CPU (placeholder)"
    assert len(points(rs)) == 4


def test_the_report_has_the_table_and_the_scatter_plot(results, tmp_path):
    res = CliRunner().invoke(main, ["report", str(results), "-o", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert "prediction" in doc["tables"]
    plot = next(p for p in doc["plots"] if p.endswith("predicted_vs_measured.png"))
    assert (tmp_path / "out" / "plots" / "predicted_vs_measured.png").read_bytes()[:4] == b"\x89PNG" and plot
    md = (tmp_path / "out" / "report.md").read_text()
    assert "3 points; \\|error\\| median" in md  # the CPU placeholder is not plotted (markdown escapes the bars)
    assert "not meaningful" in md_section(md, "Predicted vs measured throughput")


def test_the_findings_state_the_error_and_name_what_the_model_misses(results):
    """mla recorded: predicted 300k against ~256k measured (+17%, inside ±20%); mha recorded: 100k against
    ~128k (-22%), beyond the band, named with its bound; so is the re-predicted synthetic point, far off;
    the CPU placeholder is left out."""
    from scaletool.report.findings import all_findings
    from scaletool.report.prediction import prediction_findings

    found = prediction_findings(data.load([results]))
    assert found[0].startswith("Step-time model against 3 GPU point(s): |error| median ")
    assert len(found) == 2 and found[1].startswith("Predicted beyond ±20% of measured: mla older (1 GPU) +")
    assert "mha recorded (1 GPU) -22%: bound: compute" in found[1]
    assert "mla recorded" not in found[1] and "cpu" not in found[1]
    assert found[0] in all_findings(data.load([results]))
