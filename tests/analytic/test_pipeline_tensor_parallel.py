"""Tensor parallelism within pipeline stages (torchtitan's pp × dp × tp mesh): each stage rank holds what one rank
of its tensor-parallel group holds (heads, FFN width and vocabulary split), the residual stream is sequence-sharded
between sub-layers and across the stage boundary, and every TP collective sits on the critical path. Closed forms
checked against the terms and the stage memory the model reports; plan offers such layouts with commands the
recipe rules accept, and estimate gives the plan's figures for them."""
from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner

from scaletool import api
from scaletool.analytic.calibration import shipped_calibration
from scaletool.analytic.comm import tensor_parallel_config, tensor_parallel_replicated
from scaletool.analytic.network import group_seconds
from scaletool.analytic.pipeline import layer_activation_bytes, layer_params, rank_layers, stage_memory, stage_split
from scaletool.analytic.pipeline_time import pipeline_step
from scaletool.cli import main
from scaletool.config import load_recipe

CAL = shipped_calibration("h200")


def _recipe(tp: int, *extra: str):
    return load_recipe("mha-1b", ["parallel.engine=fsdp", "parallel.pipeline_parallel=2", f"parallel.tensor_parallel={tp}",
                                  "train.micro_batch_size=8", "parallel.pipeline_microbatches=4", "train.compile=false",
                                  *extra])


def test_a_stage_rank_holds_its_tensor_parallel_share():
    one, two = _recipe(1), _recipe(2)
    split = stage_split(one, 8)
    assert stage_split(two, 8) == split  # the cut balances work per layer, which TP divides evenly
    local, a = tensor_parallel_config(two.model, 2), 2
    tokens = 2 * two.seq_len  # 8 sequences in 4 pipeline micro-batches
    for x1, x2, layers in zip(stage_memory(one, 8, split), stage_memory(two, 8, split), rank_layers(two, split)):
        assert x2["params"] < x1["params"] and x2["params"] == sum(layer_params(local, i) for i in layers) + (
            local.vocab_size * local.d_model if x2["first"] else 0) + (
            local.vocab_size * local.d_model + local.d_model if x2["last"] else 0)
        assert x2["p2p_buffers_bytes"] * 2 == x1["p2p_buffers_bytes"]  # each rank's sequence shard
        # per micro-batch in flight: the split sub-layers' activations, less the sequence-parallel shards of each
        # block's two norm inputs (and the final norm's on the last stage)
        kept = 2 * len(layers) + (1 if x2["last"] else 0)
        per_mb = tokens * (sum(layer_activation_bytes(local, i) for i in layers) - a * local.d_model * kept / 2)
        embed_out = a * tokens * local.d_model / 2 * x2["in_flight_micro_batches"] if x2["first"] else 0  # seq-sharded
        logits = (a + 4 + 8) * tokens * local.vocab_size if x2["last"] else 0  # vocabulary-sharded (1F1B: one held)
        assert x2["activations_bytes"] == int(x2["in_flight_micro_batches"] * per_mb + embed_out + logits)
        assert x2["activations_bytes"] < x1["activations_bytes"] and x2["total_bytes"] < x1["total_bytes"]


def test_tp_collectives_are_on_each_micro_batchs_critical_path():
    r = _recipe(2)
    p = pipeline_step(r, CAL, world_size=8)
    assert (p["tensor_parallel"], p["data_parallel"]) == (2, 2)
    tokens, m = 2 * r.seq_len, 4
    message = tokens * r.model.d_model * 2
    for x, layers in zip(p["ranks"], rank_layers(r, stage_split(r, 8))):
        first, last = x["rank"] == 0, x["rank"] == 1
        per_op = 4 * len(layers) + (1 if first else 0) + (1 if last else 0)  # no checkpointing: no recompute pairs
        mb = per_op * sum(group_seconds(CAL, op, message, 2, 2, 1)["seconds"] for op in ("all_gather", "reduce_scatter"))
        if last:
            mb += 3 * group_seconds(CAL, "all_reduce", tokens * 4, 2, 2, 1)["seconds"]
        local = tensor_parallel_config(r.model, 2).model_copy(update={"n_layers": len(layers)})
        step = sum(group_seconds(CAL, "all_reduce", n * 2, 2, 2, 1)["seconds"] for n in tensor_parallel_replicated(local))
        assert x["tp_exposed_s"] == pytest.approx(m * mb + step)
    bound = p["ranks"][p["bounding_rank"]]
    assert p["terms"]["comm/tp_exposed_s"] == bound["tp_exposed_s"] > 0
    terms = p["terms"]
    assert p["step_s"] == pytest.approx(terms["pipeline/busy_s"] + terms["pipeline/bubble_s"]
                                        + terms["pipeline/p2p_exposed_s"] + terms["comm/dp_final_reduce_scatter_s"])
    # the boundary carries each rank's sequence shard: half the bytes of the same layout without TP, at 4 ranks
    assert p["terms"]["pipeline/p2p_exposed_s"] * 2 == pytest.approx(
        pipeline_step(_recipe(1), CAL, world_size=4)["terms"]["pipeline/p2p_exposed_s"])
    assert any("tensor parallelism over 2 consecutive ranks" in a for a in p["assumptions"])


def test_a_micro_batch_slot_is_at_least_the_hosts_tp_issue_time():
    """One sequence per pipeline micro-batch: the DTensor dispatch of each block (fitted per block and micro-step)
    outlasts the device's work, and sets the slot."""
    r = _recipe(2, "train.micro_batch_size=4", "train.seq_len=256")
    p = pipeline_step(r, CAL, world_size=4)
    for x in p["ranks"]:
        per_block = CAL.overheads["tp_eager_block_s"]
        assert x["micro_batch_s"] == pytest.approx(per_block * x["layers"])
        assert x["tp_dispatch_s"] == pytest.approx(4 * per_block * x["layers"])


def test_a_measured_tp_issue_time_per_micro_batch_replaces_the_fitted_whole_step_figure():
    """Where the calibration holds the TP block issue time calibrate measured (the blocks alone, per micro-batch:
    the H200's MLA figures, eager and compiled), a stage's slot is that time its blocks; a calibration without it
    (here the MLA keys taken out) keeps the fitted whole-step figure per block."""
    import dataclasses

    for compiled, mode in ((False, "eager"), (True, "compiled")):
        r = load_recipe("mla-1b", ["parallel.engine=fsdp", "parallel.pipeline_parallel=2", "parallel.tensor_parallel=2",
                                   "train.micro_batch_size=4", "parallel.pipeline_microbatches=4", "train.seq_len=256",
                                   f"train.compile={str(compiled).lower()}"])
        measured = CAL.overheads[f"tp_{mode}_microbatch_block_mla_s"]
        fitted = CAL.overheads[f"tp_{mode}_block_mla_s"]
        assert measured < fitted  # the fitted figure holds a whole step's head, loss and optimizer too
        for x in pipeline_step(r, CAL, world_size=4, compiled=compiled)["ranks"]:
            assert x["tp_dispatch_s"] == pytest.approx(4 * measured * x["layers"])
        bare = dataclasses.replace(CAL, overheads={k: v for k, v in CAL.overheads.items() if "microbatch" not in k})
        for x in pipeline_step(r, bare, world_size=4, compiled=compiled)["ranks"]:
            assert x["tp_dispatch_s"] == pytest.approx(4 * fitted * x["layers"])


def test_plan_offers_pipeline_by_tensor_parallel_layouts_that_estimate_agrees_with():
    res = CliRunner().invoke(main, ["plan", "mha-1b", "--gpus", "8", "--gpus-per-node", "8", "--hardware", "h200",
                                    "--top", "400", "--json"], prog_name="scaletool")
    assert res.exit_code == 0, res.output
    rows = [r for r in json.loads(res.stdout)["layouts"] if r["pipeline_parallel"] > 1 and r["tensor_parallel"] > 1]
    assert rows and {r["tensor_parallel"] for r in rows} >= {2}
    for r in rows[:3]:
        sets = [a for i, a in enumerate(shlex.split(r["command"])[1:], 1) if shlex.split(r["command"])[i - 1] == "--set"]
        rec = load_recipe("mha-1b", sets)
        assert (rec.parallel.pipeline_parallel, rec.parallel.tensor_parallel) == (r["pipeline_parallel"],
                                                                                   r["tensor_parallel"])
        assert r["data_parallel"] * r["tensor_parallel"] * r["pipeline_parallel"] == 8
        est = api.estimate(rec, world_size=8, hardware="h200")
        assert est.memory.recipe.total_bytes == r["memory_bytes"]
        assert est.prediction.rows[0]["tokens_per_s"] == pytest.approx(r["prediction"]["tokens_per_s"])
