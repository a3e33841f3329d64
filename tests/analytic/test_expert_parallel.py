"""Expert parallelism's analytic terms (scaletool.analytic.expert_parallel): the all-to-all rows of each dispatch,
the busiest rank's routed rows in memory and in the step, replicated expert states, and plan offering EP for a
dropless MoE."""
from __future__ import annotations

import pytest

from scaletool.analytic import expert_parallel as ep
from scaletool.analytic.calibration import load_calibration
from scaletool.analytic.comm import data_parallel_communication
from scaletool.analytic.memory import recipe_memory
from scaletool.analytic.params import moe_params
from scaletool.analytic.step import predict_step
from scaletool.analytic.timeline import MemoryInputs
from scaletool.config import expert_capacity, recipe_from_dict

MODEL = {"attention": "mha", "d_model": 32, "n_layers": 3, "n_heads": 4, "intermediate_size": 64, "vocab_size": 64,
         "max_seq_len": 16, "ffn": "moe", "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
         "first_k_dense_replace": 1, "dtype": "bf16"}


def recipe(dispatch="dropless", **parallel):
    return recipe_from_dict({"model": {**MODEL, "moe_dispatch": dispatch}, "train": {"micro_batch_size": 2},
                             "parallel": {"engine": "fsdp", "world_size": 4, **parallel}})


def rows(r, P, gas=1, ac="none"):
    inputs = MemoryInputs(2, 16, ac)
    got = data_parallel_communication(r.model, "fsdp", 4, expert_parallel=P, inputs=inputs,
                                               grad_accum_steps=gas)
    return {x["what"]: x for x in got if x["op"] == "all_to_all"}


def test_dropless_all_to_all_moves_each_routed_row_once_per_direction():
    r = recipe()
    got = rows(r, 4)
    tokens, k, d, L = 32, 2, 32, 2  # two MoE layers (the first block is dense)
    moved = got["expert dispatch and return (dropless, uneven pieces)"]
    assert moved["count"] == 4 * L  # dispatch and return, forward and backward
    assert moved["message_bytes"] == 4 * L * tokens * k * d * 2
    assert moved["wire_bytes"] == 3 * 4 * L * tokens * k * d * 2 // 4 and moved["ranks"] == 4
    counts = got["tokens per expert (dropless split sizes)"]
    assert (counts["count"], counts["message_bytes"]) == (L, L * 8 * 8)
    # groups of 2: the same messages, half of each stays on the rank
    assert rows(r, 2)["expert dispatch and return (dropless, uneven pieces)"]["wire_bytes"] == moved["message_bytes"] // 2
    # full checkpointing recomputes each MoE block's forward: two more all-to-alls per layer; accumulation repeats all
    assert rows(r, 4, ac="full")["expert dispatch and return (dropless, uneven pieces)"]["count"] == 6 * L
    assert rows(r, 4, gas=3)["expert dispatch and return (dropless, uneven pieces)"]["count"] == 3 * 4 * L


def test_capacity_all_to_all_is_the_whole_buffer():
    r = recipe("capacity")
    moved = rows(r, 4)["expert dispatch and return"]
    assert moved["message_bytes"] == 4 * 2 * 8 * expert_capacity(r.model, 32) * 32 * 2
    assert set(rows(r, 4)) == {"expert dispatch and return"}  # equal pieces: no sizes exchanged


def test_busiest_rank_in_memory_and_step():
    plain, on = recipe(), recipe(expert_parallel=True)
    a, b = recipe_memory(on, 4), recipe_memory(plain, 4)
    extra = 2 * ep.activation_extra_bytes(on.model, 32, 4, compiled=False)
    assert extra == pytest.approx(2 * 0.35 * 32 * 2 * 2 * (32 + 4 * 16))  # (rho-1) k T rows, d + 4 i each, bf16
    assert a["activations_bytes"] - b["activations_bytes"] == int(extra)
    # capacity: the slots are E*C with and without expert parallelism
    assert ep.activation_extra_bytes(recipe("capacity").model, 32, 4, compiled=False) == 0
    calib = load_calibration("h100-sxm")
    with_ep, without = predict_step(on, calib), predict_step(plain, calib)
    t = with_ep["terms"]
    assert t["ep/imbalance_s"] > 0 and t["ep/host_sync_s"] == pytest.approx(2 * ep.HOST_SYNC_S)
    assert "ep/imbalance_s" not in without["terms"]
    assert with_ep["step_s"] > without["step_s"] - without["terms"]["comm/dp_exposed_s"]
    assert any("expert parallelism over 4 ranks" in line for line in with_ep["assumptions"])


def test_groups_smaller_than_the_data_parallel_ranks_replicate_expert_states():
    r = recipe(expert_parallel=True, expert_parallel_degree=2)
    routed = moe_params(r.model)["routed"] * 2
    assert ep.replicated_state_bytes(r.model, 4, 2) == 16 * routed * (1 / 2 - 1 / 4)
    assert ep.replicated_state_bytes(r.model, 4, 4) == 0
    full = recipe_memory(recipe(expert_parallel=True), 4)
    half = recipe_memory(r, 4)
    assert half["total_bytes"] - full["total_bytes"] >= 16 * routed / 4
    assert ep.problems(8, 4, 3) == [
        "parallel.expert_parallel_degree: 3 does not divide the 4 data-parallel ranks (an expert-parallel group is that "
        "many consecutive ranks)", "parallel.expert_parallel: 8 routed experts do not split over 3 ranks"]


def test_plan_offers_expert_parallelism_for_a_dropless_moe():
    from scaletool.plan.search import Request, families

    req = Request(gpus=4, gpus_per_node=4, hardware="H100 SXM", card_bytes=80 * 2**30,
                  calibration=load_calibration("h100-sxm"))
    fams = [f for f in families(recipe(), req, "mha", []) if f.engine == "fsdp"]
    assert {f.expert_parallel for f in fams} == {False, True}
    # 8 experts do not split over 3 GPUs: not offered
    assert not any(f.expert_parallel for f in families(recipe(), Request(**{**req.__dict__, "gpus": 3}), "mha", []))
