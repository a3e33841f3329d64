"""A power limit's clock (scaletool.analytic.power): the curve's constants are what the committed power/clock
records give (benchmarks/scripts/power_fit.py), the ratio's arithmetic and its bounds, and a datasheet-default
calibration of a 500 W profile taking its GEMM and attention rates at that clock while a 700 W one keeps them."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest

from scaletool.analytic.calibration import default_calibration
from scaletool.analytic.power import GH100, clock_ratio, profile_clock_ratio
from scaletool.measure.hardware import profile_named

ROOT = Path(__file__).resolve().parents[2]


def _fit_module():
    spec = importlib.util.spec_from_file_location("power_fit", ROOT / "benchmarks" / "scripts" / "power_fit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_shipped_curve_is_the_fit_of_the_committed_records():
    out = _fit_module().fit(sorted(p for p in (ROOT / "benchmarks" / "results" / "power").iterdir() if p.is_dir()))
    assert out["points"] == 30 and out["f_max_mhz"] == 1980
    assert out["k"] == pytest.approx(GH100["exponent"]) and out["static_w"] == pytest.approx(GH100["static_w"])
    assert out["clock_ratio_500_of_700"] == pytest.approx(clock_ratio(500.0), abs=5e-4)
    lo, hi, n = out["clock_ratio_500_of_700_near_fits"]
    assert lo <= clock_ratio(500.0) <= hi and n > 1


def test_the_ratio_follows_the_dynamic_draw():
    p0, k, share = GH100["static_w"], GH100["exponent"], GH100["draw_share"]
    assert clock_ratio(500.0) == pytest.approx(((500 * share - p0) / (700 * share - p0)) ** (1 / k))
    assert clock_ratio(700.0) == 1.0 and clock_ratio(1000.0) == 1.0  # never above the reference clock
    assert 0 < clock_ratio(300.0) < clock_ratio(400.0) < clock_ratio(600.0) < 1.0


@pytest.mark.parametrize("bad", [0.0, -5.0, math.nan, math.inf, 50.0])
def test_a_limit_without_a_sustained_clock_is_refused(bad):
    with pytest.raises(ValueError):
        clock_ratio(bad)


def test_only_a_profile_with_a_limit_under_its_reference_is_slowed():
    teton, sxm, h200, a100 = (profile_named(n) for n in ("H100 96GB", "H100 SXM", "H200", "A100"))
    assert teton.power_limit_w == 500 and teton.power_curve == "gh100"
    assert profile_clock_ratio(teton) == pytest.approx(clock_ratio(500.0))
    assert profile_clock_ratio(sxm) == profile_clock_ratio(h200) == 1.0
    assert profile_clock_ratio(a100) == 1.0  # no curve measured for its die: its rates stay as they are


def test_the_500_w_default_calibration_takes_compute_at_that_clock_and_memory_as_it_was():
    teton = profile_named("H100 96GB")
    free = teton.model_copy(update={"power_limit_w": None})
    slow, fast = default_calibration(teton), default_calibration(free)
    r = clock_ratio(500.0)
    assert slow.gemm_tflops["max_tflops"] == pytest.approx(fast.gemm_tflops["max_tflops"] * r)
    assert slow.attention_tflops["default"] == pytest.approx(fast.attention_tflops["default"] * r)
    assert slow.hbm_gb_s == fast.hbm_gb_s and slow.collectives == fast.collectives
    assert "500 W limit" in slow.source and "limit" not in fast.source.split(")")[-1]
    assert slow.name == "H100 96GB (datasheet default, 500 W: 0.804 of the clock)"
    assert fast.name == "H100 96GB (datasheet default)"
    same = {f.name for f in dataclasses.fields(slow)} - {"gemm_tflops", "attention_tflops", "source", "name"}
    assert all(getattr(slow, f) == getattr(fast, f) for f in same)
