"""train.float8 in the estimates: the memory components each layout gains or loses, the FP8 GEMM rate
(calibrated, or twice bf16's), and the engine table keeping bf16 for engines without FP8."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scaletool.analytic.calibration import calibration_from_dict, load_calibration
from scaletool.analytic.float8 import fp8_gemm, swapped_shapes
from scaletool.analytic.flops import gemm_shapes
from scaletool.analytic.memory import recipe_memory
from scaletool.analytic.step import predict_step
from scaletool.config import load_recipe
from scaletool.errors import RecipeError

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def recipe(*sets, name="mha-1b"):
    return load_recipe(str(RECIPES / f"{name}.yaml"), list(sets))


def test_which_gemms_run_in_fp8():
    assert fp8_gemm("attn.wq", 2048, 2048) and fp8_gemm("ffn", 5632, 2048)
    assert not fp8_gemm("lm_head", 32000, 2048) and not fp8_gemm("moe.router", 64, 2048)
    assert not fp8_gemm("moe.experts", 1408, 2048) and fp8_gemm("moe.shared", 2816, 2048)
    assert not fp8_gemm("attn.wkv_a", 40, 64)  # 40 is not a multiple of 16


@pytest.mark.parametrize("engine, autocast_saved, gather_saved", [("single", True, False), ("ddp", True, False),
                                                                  ("fsdp", False, True)])
def test_memory_components_by_engine(engine, autocast_saved, gather_saved):
    base = recipe(f"parallel.engine={engine}")
    f8 = recipe(f"parallel.engine={engine}", "train.float8=tensorwise")
    a, b = recipe_memory(base, 2), recipe_memory(f8, 2)
    assert "float8" not in a
    comp = b["float8"]
    params = sum(n * k * c for _, _, n, k, c in swapped_shapes(gemm_shapes(f8.model, 8 * 2048)))
    assert comp["fp8_params"] == params > 0
    assert comp["autocast_weight_copies_saved_bytes"] == (2 * params if autocast_saved else 0)
    assert (comp["fp8_all_gather_saved_bytes"] > 0) == gather_saved
    back_a, back_b = a["phases"]["backward"], b["phases"]["backward"]
    assert back_b["activations"] == back_a["activations"] - comp["autocast_weight_copies_saved_bytes"]
    assert back_b["buffers"] == back_a["buffers"] - comp["fp8_all_gather_saved_bytes"]
    assert back_b["temporaries"] == back_a["temporaries"] + comp["fp8_cast_temporaries_bytes"]
    assert b["total_bytes"] == max(sum(p.values()) for p in b["phases"].values())


def test_rowwise_gathers_bf16_and_casts_twice():
    tw = recipe_memory(recipe("parallel.engine=fsdp", "train.float8=tensorwise"), 2)["float8"]
    rw = recipe_memory(recipe("parallel.engine=fsdp", "train.float8=rowwise"), 2)["float8"]
    assert rw["fp8_all_gather_saved_bytes"] == 0
    assert rw["fp8_cast_temporaries_bytes"] == 2 * tw["fp8_cast_temporaries_bytes"]


def test_the_fp8_rate_is_twice_bf16_unless_calibrated():
    h100 = load_calibration("h100-sxm")
    assert h100.gemm_rate_fp8(4096, 4096, 4096) == pytest.approx(2 * h100.gemm_rate(4096, 4096, 4096))
    bf16 = predict_step(recipe(), h100)
    f8 = predict_step(recipe("train.float8=tensorwise"), h100)
    assert f8["terms"]["gemm_forward_s"] < bf16["terms"]["gemm_forward_s"]
    assert f8["terms"]["elementwise_s"] > bf16["terms"]["elementwise_s"]  # the casts' traffic
    assert any("2 x the bf16 curve" in a for a in f8["assumptions"])
    fitted = dataclasses.replace(h100, gemm_fp8_tflops={"max_tflops": 1000.0, "half_dim": 314.0})
    assert fitted.gemm_rate_fp8(8192, 8192, 8192) == pytest.approx(1000e12 * 8192 / (8192 + 314))
    f8c = predict_step(recipe("train.float8=tensorwise"), fitted)
    assert f8c["terms"]["gemm_forward_s"] > f8["terms"]["gemm_forward_s"]  # 1000 < 2 x 819 at the top
    assert any("calibrated, 1000 TFLOP/s" in a for a in f8c["assumptions"])


def test_a_malformed_fp8_calibration_is_one_line():
    raw = dataclasses.asdict(load_calibration("h100-sxm"))
    raw.pop("file")  # where it was read from, not a key of the file
    raw["gemm_fp8_tflops"] = {"max_tflops": -1, "half_dim": 300}
    with pytest.raises(RecipeError) as err:
        calibration_from_dict(raw, "cal.yaml")
    assert err.value.problems == ["cal.yaml: gemm_fp8_tflops.max_tflops: a number of at least 1e-06 (at most 1e+06), got -1"]
