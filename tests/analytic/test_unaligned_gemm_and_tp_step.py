"""A GEMM off 16-byte alignment (GPT-2's 50,257-token head) at its measured share of the curve; a tensor-parallel
step from the parts `scaletool calibrate` measures on its host."""
from __future__ import annotations

import pytest

from scaletool.analytic.calibration import UNALIGNED_GEMM, calibration_from_dict, shipped_calibration
from scaletool.analytic.flops import gemm_shapes
from scaletool.analytic.host import TP_STEP_PARTS, tp_step_dispatch_s, tp_step_key
from scaletool.analytic.step import predict_step
from scaletool.config import RecipeError, load_recipe
from scaletool.predict.calibrate_tp import _solve, overheads_from, step_parts, unresolved


def _head_s(cal, recipe, tokens: int) -> float:
    (_, m, n, k, c), = [s for s in gemm_shapes(recipe.model, tokens) if s[0] == "lm_head"]
    return 2 * m * n * k * c / cal.gemm_rate(m, n, k)


@pytest.mark.parametrize("compiled, engine, factor", [(False, "single", UNALIGNED_GEMM["eager"]),
                                                      (True, "single", UNALIGNED_GEMM["compiled"]),
                                                      (True, "ddp", UNALIGNED_GEMM["eager"])])  # DDP: head eager
def test_an_unaligned_head_runs_at_its_measured_share(compiled, engine, factor):
    cal = shipped_calibration("h200")
    sets = [f"train.compile={str(compiled).lower()}", f"parallel.engine={engine}"]
    odd, even = (load_recipe("recipes/mha-1b.yaml", [f"model.vocab_size={v}", *sets]) for v in (50257, 50264))
    p_odd, p_even = (predict_step(r, cal, world_size=1)["terms"] for r in (odd, even))
    tokens = odd.train.micro_batch_size * odd.train.seq_len
    extra = _head_s(cal, odd, tokens) / factor - _head_s(cal, even, tokens)  # vocabularies 7 apart
    assert p_odd["gemm_forward_s"] - p_even["gemm_forward_s"] == pytest.approx(extra, rel=1e-3)
    assert p_odd["gemm_backward_s"] == pytest.approx(2 * p_odd["gemm_forward_s"])
    assert cal.unaligned_factor(4096, 50264, 2048, compiled) == 1.0
    assert cal.unaligned_factor(4096, 50258, 2048, False, element_bytes=4) == UNALIGNED_GEMM["eager"]


@pytest.mark.parametrize("value", [{"eager": 0}, {"eager": 0.2, "compiled": 1.5}, {"eager": "x", "compiled": 1},
                                   [0.2, 0.9]])
def test_a_bad_unaligned_figure_is_refused(value):
    raw = {k: v for k, v in vars(shipped_calibration("h200")).items() if k != "file"}
    with pytest.raises(RecipeError, match="gemm_unaligned"):
        calibration_from_dict(raw | {"gemm_unaligned": value}, "cal.yaml")


def test_the_step_parts_are_solved_from_four_cells():
    b, h, u, c = 0.02, 0.05, 0.003, 0.04
    t = {(L, g): [g * (L * b + h) + L * u + c + e for e in (-1e-4, 0.0, 1e-4)] for L in (1, 3) for g in (1, 2)}
    assert _solve(*(t[k][1] for k in ((1, 1), (3, 1), (1, 2), (3, 2)))) == pytest.approx(
        {"block": b, "head": h, "update_block": u, "update": c})
    parts = step_parts(t)
    assert parts["block"]["value"] == pytest.approx(b) and parts["block"]["n"] == 3
    assert parts["block"]["p10"] <= b <= parts["block"]["p90"]


def test_measured_step_parts_replace_the_fitted_tp_figure():
    cal = shipped_calibration("h200")
    parts = dict(zip(TP_STEP_PARTS, (0.010, 0.030, 0.002, 0.050)))
    ov = cal.overheads | {tp_step_key(p, "eager", "mla"): v for p, v in parts.items()}
    measured = type(cal)(**{**vars(cal), "overheads": ov})
    sets = ["parallel.engine=fsdp", "parallel.tensor_parallel=2", "train.compile=false", "train.grad_accum_steps=2"]
    r = load_recipe("recipes/mla-1b.yaml", sets)
    L = r.model.n_layers
    pure = predict_step(r, measured, world_size=2)["terms"]["tp_dispatch_s"]  # TP over every rank: no FSDP2 hooks
    assert pure == pytest.approx(2 * (L * 0.010 + 0.030) + L * 0.002 + 0.050)
    sharded = predict_step(r, measured, world_size=4)["terms"]["tp_dispatch_s"]  # FSDP2 x TP: its hooks added
    assert sharded == pytest.approx(pure + 2 * L * cal.overheads["tp_fsdp1_hooks_block_s"])
    assert predict_step(r, cal, world_size=2)["terms"]["tp_dispatch_s"] != pytest.approx(pure)  # the fitted figure
    partial = type(cal)(**{**vars(cal), "overheads": cal.overheads | {tp_step_key("block", "eager", "mla"): 0.01}})
    assert tp_step_dispatch_s(L, 2, "eager", "mla", partial) is None


def test_step_parts_not_told_apart_from_the_noise_are_recorded_not_written():
    """A part whose lower decile is below zero (on 2 H200s, each mode had one) leaves the fitted figures standing."""
    b, h, u, c = 0.02, 0.05, 0.003, 0.04
    clean = {(L, g): [g * (L * b + h) + L * u + c + e for e in (-1e-5, 0.0, 1e-5)] for L in (1, 3) for g in (1, 2)}
    noisy = {k: [v[0] - 0.1, v[1], v[2] + 0.1] for k, v in clean.items()}  # update's p10 far below zero
    assert unresolved(step_parts(clean)) is None
    why = unresolved(step_parts(noisy))
    assert why.startswith("not resolved from the noise: ") and "update" in why

    def measured(t):
        parts = {p: v | {"key": tp_step_key(p, "eager", "mla")} for p, v in step_parts(t).items()}
        why = unresolved(parts)
        return {"eager": {"key": "tp_eager_microbatch_block_mla_s", "block_s": {"median": 0.01},
                          "step": parts | ({"unresolved": why} if why else {})}}

    written = overheads_from(measured(clean))
    assert written["tp_eager_step_head_mla_s"] == pytest.approx(h, abs=1e-6)
    assert overheads_from(measured(noisy)) == {"tp_eager_microbatch_block_mla_s": 0.01}
