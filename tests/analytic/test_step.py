"""The step-time model's structure: terms that add up, layouts that move the terms they should, the
calibration files' loading and their errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from scaletool.analytic.calibration import Calibration, default_calibration, load_calibration
from scaletool.analytic.step import fits, predict_step
from scaletool.config import load_recipe
from scaletool.errors import RecipeError
from scaletool.measure.hardware import load_profiles

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def recipe(name="mha-1b", *sets):
    return load_recipe(str(RECIPES / f"{name}.yaml"), list(sets))


@pytest.fixture(scope="module")
def h100() -> Calibration:
    return load_calibration("h100-sxm")


def test_terms_add_up_to_the_step(h100):
    out = predict_step(recipe("mha-1b", "train.compile=false"), h100)
    terms = out["terms"]
    # the device's terms add up; the host's issue time (eager blocks, TP dispatch) is the other bound of the step
    issue = ("eager_dispatch_s", "tp_dispatch_s")
    parts = [v for k, v in terms.items() if not k.endswith("_total_s") and k not in issue]
    assert terms["eager_dispatch_s"] > 0  # the H100 calibration has a measured eager issue time
    assert out["step_s"] == pytest.approx(max(sum(parts), sum(terms[k] for k in issue) + terms["host_overhead_s"]))
    assert out["tokens_per_s"] == pytest.approx(8 * 2048 / out["step_s"])
    assert out["tokens_per_s_per_gpu"] == out["tokens_per_s"]
    assert terms["gemm_backward_s"] == pytest.approx(2 * terms["gemm_forward_s"])
    assert out["bound"] in ("compute", "memory bandwidth", "exposed communication")
    assert out["calibration"] == h100.source and out["assumptions"]
    assert 0 < out["mfu"] <= out["hfu"] < 1


def test_compiled_moves_only_the_elementwise_term(h100):
    eager = predict_step(recipe("mha-1b"), h100, compiled=False)
    comp = predict_step(recipe("mha-1b"), h100, compiled=True)
    assert comp["terms"]["elementwise_s"] < eager["terms"]["elementwise_s"]
    assert comp["terms"]["gemm_forward_s"] == eager["terms"]["gemm_forward_s"]
    assert predict_step(recipe("mha-1b"), h100)["compiled"] is True  # the recipe says compile: true


def test_checkpointing_recomputes_and_raises_hfu_only(h100):
    none = predict_step(recipe("mha-1b"), h100)
    full = predict_step(recipe("mha-1b", "train.activation_checkpointing=full"), h100)
    sel = predict_step(recipe("mha-1b", "train.activation_checkpointing=selective"), h100)
    assert none["terms"]["recompute_s"] == 0
    assert 0 < sel["terms"]["recompute_s"] < full["terms"]["recompute_s"]
    assert full["hfu"] > full["mfu"] and none["hfu"] == pytest.approx(none["mfu"])


def test_engines_layouts_and_communication(h100):
    base = ["train.compile=false"]
    ddp = predict_step(recipe("mha-1b", *base, "parallel.engine=ddp"), h100, world_size=4)
    fsdp = predict_step(recipe("mha-1b", *base, "parallel.engine=fsdp"), h100, world_size=4)
    tp = predict_step(recipe("mha-1b", *base, "parallel.engine=fsdp", "parallel.tensor_parallel=2"), h100, world_size=4)
    assert ddp["terms"]["comm/dp.all_reduce_total_s"] > 0
    assert fsdp["terms"]["optimizer_s"] == pytest.approx(ddp["terms"]["optimizer_s"] / 4)  # sharded states
    assert tp["terms"]["comm/tp_exposed_s"] > 0 and tp["data_parallel"] == 2
    assert tp["tokens_per_step"] == 2 * 8 * 2048
    single = predict_step(recipe("mha-1b", *base), h100, world_size=4)
    assert single["world_size"] == 1  # single runs one process whatever the world size asked
    # inter-node data parallelism is slower than the same layout inside one node
    one = predict_step(recipe("mha-1b", *base, "parallel.engine=ddp"), h100, world_size=16, gpus_per_node=16)
    many = predict_step(recipe("mha-1b", *base, "parallel.engine=ddp"), h100, world_size=16, gpus_per_node=8)
    assert many["step_s"] > one["step_s"] and any("collectives across nodes" in a for a in many["assumptions"])


def test_moe_and_mla_predict(h100):
    for name in ("mla-1b", "deepseek-v2-lite", "llama3-8b"):
        out = predict_step(recipe(name), h100)
        assert out["step_s"] > 0 and 0 < out["mfu"] < 1, name


def test_shipped_calibrations_and_unknown_names():
    assert load_calibration("H100 SXM").name == load_calibration("h100-sxm").name
    assert load_calibration("h200").hbm_gb_s > load_calibration("h100-sxm").hbm_gb_s
    with pytest.raises(RecipeError, match="known ones are .*h100-sxm.*h200"):
        load_calibration("b200")
    with pytest.raises(RecipeError, match="no such file"):
        load_calibration("/nonexistent/cal.yaml")


def test_bad_calibration_file_is_one_line_per_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsource: y\ngemm_tflops: {max_tflops: -1, half_dim: 300}\nattention_tflops: {default: 100}\n"
                   "hbm_gb_s: 0\ncollectives: {intra_node_gb_s: {all_reduce: {1: 10}}, inter_node_gb_s: 5}\n"
                   "overheads: {}\nbogus: 1\n")
    with pytest.raises(RecipeError) as e:
        load_calibration(str(bad))
    assert any("bogus" in p for p in e.value.problems)
    bad.write_text(bad.read_text().replace("bogus: 1\n", ""))
    with pytest.raises(RecipeError) as e:
        load_calibration(str(bad))
    text = "\n".join(e.value.problems)
    assert "max_tflops" in text and "hbm_gb_s" in text and "group size 1" in text


def test_default_calibration_from_a_datasheet_profile():
    a100 = next(p for p in load_profiles(environ={}) if p.name.startswith("A100"))
    cal = default_calibration(a100)
    assert cal.source.startswith("datasheet default")
    assert cal.peak_tflops == a100.peak_tflops["bf16"]
    out = predict_step(recipe("mha-1b"), cal)
    assert out["step_s"] > predict_step(recipe("mha-1b"), load_calibration("h100-sxm"))["step_s"]
    cpu = next(p for p in load_profiles(environ={}) if p.device == "cpu")
    with pytest.raises(RecipeError, match="no bf16 peak"):
        default_calibration(cpu)


def test_fits_keeps_the_allocator_reserve():
    gib = 2**30
    ok, margin = fits(74.8 * gib, 79.2 * gib)  # mha-1b micro-batch 20, eager: ran out of memory on an H100
    assert not ok and margin < 0
    ok, margin = fits(60 * gib, 79.2 * gib)
    assert ok and margin > 0


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_zero12_step_work_scales_with_the_partitions_elements(h100, ranks):
    """DeepSpeed ZeRO-1/2's step work (flatten to fp32, norm and unscale, the fp32 partition copied to 16 bits) is
    per element of the rank's partition: ``zero12_step_s`` at mha-1b's parameters on one rank (where it was
    fitted), twice the elements twice the time, N ranks 1/N of it (Llama-3-8B's 32 blocks: 8.4x mha-1b's)."""
    from scaletool.analytic.engine_step import ZERO12_REFERENCE_PARAMS, StepContext, zero_step
    from scaletool.analytic.params import param_counts

    def host(name):
        r = recipe(name, "parallel.engine=deepspeed", "parallel.zero_stage=1", f"parallel.world_size={ranks}")
        ctx = StepContext(r, r.model, ranks, 1, [], [], 0.0, 0.0, h100)
        return zero_step(ctx).host_s, param_counts(r.model)["total"]
    small, psi_small = host("mha-1b")
    big, psi_big = host("llama3-8b")
    assert psi_small == ZERO12_REFERENCE_PARAMS
    assert small == pytest.approx(h100.overheads["zero12_step_s"] / ranks)
    assert big / small == pytest.approx(psi_big / psi_small) and big / small > 8
