"""The float8-1gpu study's table (benchmarks/scripts/float8_table.py): one Llama-3-8B block's FP8 gain from
two depths, and the whole model's projected gain, on synthetic train results whose answer is known."""
from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import ROOT

spec = importlib.util.spec_from_file_location("float8_table", ROOT / "benchmarks" / "scripts" / "float8_table.py")
float8_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(float8_table)


def result(outside_s: float, block_s: float, layers: int, jitter: float = 0.01) -> dict:
    """A train result whose median step is outside_s + layers·block_s seconds per token, p10/p90 ±jitter."""
    rate = 1.0 / (outside_s + layers * block_s)
    return {"kind": "train", "status": "completed", "metrics": {}, "environment": {"gpu_names": ["test card"]},
            "timing": {"tokens_per_s": {"median": rate, "p10": rate * (1 - jitter), "p90": rate * (1 + jitter), "n": 10}}}


def test_one_blocks_gain_and_the_projection_come_from_two_depths(tmp_path):
    a, b, b8 = 1.0e-5, 2.0e-5, 1.5e-5  # FP8 leaves the head alone and runs a block 4/3 faster
    for layers in (4, 8):
        (tmp_path / f"llama{layers}l-none.json").write_text(json.dumps(result(a, b, layers)))
        (tmp_path / f"llama{layers}l-tensorwise.json").write_text(json.dumps(result(a, b8, layers)))
    doc = float8_table.table(tmp_path)
    (r,) = doc["per_block"]
    assert r["float8"] == "tensorwise" and r["gain/per_block"] == pytest.approx(4 / 3)
    assert r["outside_blocks_s_per_token"]["none"] == pytest.approx(a)
    assert r["gain/projected"] == pytest.approx((a + 32 * b) / (a + 32 * b8))
    lo, hi = r["gain/per_block_range"]
    assert lo < 4 / 3 < hi  # the p10/p90 steps widen it both ways
    assert r["blocks_share_of_bf16_step"]["8"] == pytest.approx(8 * b / (a + 8 * b))
    # the 8-layer run alone understates the block's gain: the head is a fifth of its step here
    rows = {(x["shape"], x["float8"]): x for x in doc["rows"]}
    assert rows[("llama8l", "tensorwise")]["speedup/over_bf16"] < r["gain/per_block"]
    md = (tmp_path / "float8.md").read_text()
    assert "## Per Llama-3-8B block" in md and "| tensorwise | 1.33x |" in md


def test_without_both_depths_there_is_no_per_block_row(tmp_path):
    (tmp_path / "llama8l-none.json").write_text(json.dumps(result(1e-5, 2e-5, 8)))
    (tmp_path / "llama8l-tensorwise.json").write_text(json.dumps(result(1e-5, 1.5e-5, 8)))
    doc = float8_table.table(tmp_path)
    assert doc["per_block"] == [] and "Per Llama-3-8B block" not in (tmp_path / "float8.md").read_text()
