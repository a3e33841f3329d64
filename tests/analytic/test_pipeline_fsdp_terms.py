"""What FSDP2 within a pipeline stage costs, as torch's schedule runs it: the reduce-scatter once after a stage's
last backward (``perform_reduce_grad``), exposed where the drain does not cover it; every block gathered by the
end of a backward (resharding after the backward is off until the last micro-batch); the last stage's kept
logits and log_softmax output at the loss. And DDP's per-block compile under autocast keeping SwiGLU's fourth
tensor. Closed forms checked against the terms the model reports."""
from __future__ import annotations

import pytest

from scaletool.analytic.calibration import shipped_calibration
from scaletool.analytic.memory import recipe_memory
from scaletool.analytic.params import param_counts
from scaletool.analytic.pipeline import layer_params, rank_layers, stage_memory, stage_split
from scaletool.analytic.pipeline_time import pipeline_step
from scaletool.analytic.timeline import _activation_bytes_per_token_per_layer
from scaletool.config import load_recipe

CAL = shipped_calibration("h200")


def _recipe(pp: int, *extra: str):
    return load_recipe("mla-1b", ["parallel.engine=fsdp", f"parallel.pipeline_parallel={pp}", "train.micro_batch_size=8",
                                  "parallel.pipeline_microbatches=4", "train.compile=false", "train.seq_len=2048", *extra])


def test_final_reduce_scatter_is_charged_once_beyond_the_drain():
    shared = pipeline_step(_recipe(2), CAL, world_size=4)  # PP 2 x FSDP2 2
    alone = pipeline_step(_recipe(4), CAL, world_size=4)  # PP 4: no data-parallel ranks to reduce over
    assert alone["terms"]["comm/dp_final_reduce_scatter_s"] == 0
    ranks = shared["ranks"]
    assert all(r["fsdp_final_reduce_scatter_s"] > 0 for r in ranks)
    slot = max(r["micro_batch_s"] for r in ranks)
    want = max(r["fsdp_final_reduce_scatter_s"] - r["rank"] * 2 / 3 * slot for r in ranks)
    assert shared["terms"]["comm/dp_final_reduce_scatter_s"] == pytest.approx(max(0.0, want))
    # the first stage's reduce-scatter ends the schedule: nothing covers it
    assert shared["terms"]["comm/dp_final_reduce_scatter_s"] >= ranks[0]["fsdp_final_reduce_scatter_s"]
    terms = shared["terms"]
    assert shared["step_s"] == pytest.approx(terms["pipeline/busy_s"] + terms["pipeline/bubble_s"]
                                             + terms["pipeline/p2p_exposed_s"] + terms["comm/dp_final_reduce_scatter_s"])
    assert any("reduce-scatter after the stage's last backward" in a for a in shared["assumptions"])


def test_a_stage_holds_every_block_gathered_and_the_loss_its_logits():
    for extra in ((), ("parallel.reshard_after_forward=false",)):
        r = _recipe(2, *extra)
        cfg, a = r.model, 2
        split = stage_split(r, 4)
        pc = param_counts(cfg)
        for row, layers in zip(stage_memory(r, 4, split), rank_layers(r, split)):
            ends = (pc["embedding"] + pc["position_embedding"] if row["first"] else 0) \
                + (pc["head"] + pc["final_norm"] if row["last"] else 0)
            assert row["gathered_bytes"] == int(a * (sum(layer_params(cfg, i) for i in layers) + ends))
    # at the loss the last stage holds, per token and vocabulary entry: the 16-bit logits the schedule keeps,
    # log_softmax's fp32 output, NLL's and log_softmax's fp32 gradients (2 + 4 + 8 bytes); GPipe keeps every
    # micro-batch's logits and saved output
    tokens = 2 * 2048  # 8 sequences in 4 micro-batches
    for schedule, held in (("1f1b", 1), ("gpipe", 4)):
        small, large = (stage_memory(_recipe(2, f"parallel.pipeline_schedule={schedule}", f"model.vocab_size={v}"), 4)
                        for v in (32000, 64000))
        # the head's own states and gathered copy grow with the vocabulary too: take them out
        head = lambda rows: rows[-1]["activations_bytes"]  # noqa: E731
        assert head(large) - head(small) == pytest.approx(((2 + 4) * held + 8) * tokens * 32000, rel=1e-9)
        assert large[0]["activations_bytes"] == small[0]["activations_bytes"]  # the first stage has no logits


def test_ddp_per_block_compile_under_autocast_keeps_swiglus_fourth_tensor():
    r = load_recipe("mha-1b", ["train.seq_len=2048"])
    cfg = r.model
    three = _activation_bytes_per_token_per_layer(cfg, res=2, compiled=True)
    four = _activation_bytes_per_token_per_layer(cfg, res=2, compiled=True, autocast_block=True)
    assert four - three == 2 * cfg.intermediate_size
    assert _activation_bytes_per_token_per_layer(cfg, res=2) == four  # the eager count

    def slope(engine: str) -> float:  # activation bytes per token at the backward's peak (both peak at the loss)
        def act(mb: int) -> float:
            rec = load_recipe("mha-1b", ["train.seq_len=2048", f"parallel.engine={engine}", f"train.micro_batch_size={mb}",
                                         "train.compile=true"])
            m = recipe_memory(rec, 2)
            assert m["backward_peak_at"] == "loss"
            return m["phases"]["backward"]["activations"]
        return (act(8) - act(4)) / (4 * 2048)

    # DDP compiles each block alone under autocast: SwiGLU's four tensors a layer; FSDP2 (16-bit weights, no
    # autocast, the same per-block compile and eager loss) three
    assert slope("ddp") - slope("fsdp") == pytest.approx(cfg.n_layers * 2 * cfg.intermediate_size)


def test_each_micro_batch_pays_fsdp2s_copies_on_the_stage_parameters():
    """FSDP2's copies per micro-batch on a stage (engine_step.fsdp_copy_bytes: the unsharded fp32 accumulation
    torch's schedule leaves it, the gradient's fp32 cast, the gathered copy-out): one gather a micro-batch under
    reshard_after_forward, one a schedule step without; the difference is the copy-out of the others."""
    from scaletool.analytic.engine_step import FSDP_GATHER_COPY_BYTES, fsdp_copy_bytes

    assert fsdp_copy_bytes(1, 2) == 26 and fsdp_copy_bytes(4, 1) == 4 + 6 + 3
    m, hbm = 4, CAL.hbm_gb_s * 1e9
    on = pipeline_step(_recipe(2, "train.compile=true"), CAL, world_size=2)
    off = pipeline_step(_recipe(2, "train.compile=true", "parallel.reshard_after_forward=false"), CAL, world_size=2)
    rows = stage_memory(_recipe(2, "train.compile=true"), 2)
    for a, b, row in zip(on["ranks"], off["ranks"], rows):
        assert a["micro_batch_s"] - b["micro_batch_s"] == pytest.approx(
            FSDP_GATHER_COPY_BYTES * (1 - 1 / m) * row["params"] / hbm, rel=1e-6)
        assert b["micro_batch_s"] > fsdp_copy_bytes(1, 1 / m) * row["params"] / hbm > 0
