"""Fused attention's rate against sequence length: a calibration may key a head-dims entry by T (the rate
climbs from 164 to 452 TFLOP/s between T = 512 and 16,384 on an H200 at 128/128,
benchmarks/results/attention-seq/h200-2026-11-28); the step model reads it at the run's T, interpolated in
log T, and a single-rate entry keeps meaning every T."""
from __future__ import annotations

import math

import pytest
import yaml

from scaletool.analytic.calibration import ATTENTION_REFERENCE_SEQ, attention_at, load_calibration, shipped_calibration
from scaletool.analytic.step import predict_step
from scaletool.config import load_recipe

CURVE = {1024: 200.0, 2048: 300.0, 8192: 420.0}


def test_a_single_rate_holds_at_every_length():
    assert attention_at(298, 128) == attention_at(298, 65536) == attention_at(298) == 298.0


def test_a_curve_is_exact_at_its_points_log_linear_between_and_held_beyond():
    assert [attention_at(CURVE, t) for t in (1024, 2048, 8192)] == [200.0, 300.0, 420.0]
    assert attention_at(CURVE, 4096) == pytest.approx(360.0)  # halfway in log2 between 2048 and 8192
    assert attention_at(CURVE, 3000) == pytest.approx(300 + 120 * math.log2(3000 / 2048) / 2)
    assert attention_at(CURVE, 64) == 200.0 and attention_at(CURVE, 1 << 20) == 420.0
    assert attention_at(CURVE) == attention_at(CURVE, ATTENTION_REFERENCE_SEQ) == 300.0


def test_lengths_as_json_strings_read_as_the_same_curve():
    assert attention_at({str(k): v for k, v in CURVE.items()}, 4096) == attention_at(CURVE, 4096)


def _with_curve(tmp_path, curve):
    data = yaml.safe_load(open(shipped_calibration("h100-sxm").file).read())
    data["attention_tflops"] = {"128/128": curve, "default": curve}
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_calibration(str(path))


@pytest.mark.parametrize("T", [1024, 4096, 8192])
def test_the_step_model_charges_attention_at_the_runs_length(tmp_path, T):
    recipe = load_recipe("recipes/mha-1b.yaml", [f"model.max_seq_len={T}", f"train.seq_len={T}", "train.micro_batch_size=1"])
    flat = predict_step(recipe, _with_curve(tmp_path, 300.0), world_size=1)
    curve = predict_step(recipe, _with_curve(tmp_path, CURVE), world_size=1)
    ratio = attention_at(CURVE, T) / 300.0
    assert curve["terms"]["attention_s"] == pytest.approx(flat["terms"]["attention_s"] / ratio, rel=1e-9)
    assert f"{attention_at(CURVE, T):.0f} TFLOP/s" in " ".join(curve["assumptions"])
    assert f"T={T:,}" in " ".join(curve["assumptions"])


def test_the_shipped_h200_curve_climbs_with_length():
    cal = shipped_calibration("h200")
    rates = [cal.attention_rate(128, 128, t) for t in (512, 2048, 8192, 16384)]
    assert rates == sorted(rates) and rates[-1] / rates[0] > 2
