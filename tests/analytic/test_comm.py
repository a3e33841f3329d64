"""The analytic Communication section on exact small cases: ring volumes, one tensor-parallel rank's model,
tensor parallelism's and the data-parallel engines' collectives (the TP=2 and 2×2 numbers here are the
ones tests/engines/test_tensor_parallel.py measures on gloo), ZeRO's published ratios, and per-GPU memory
under FSDP2 × tensor parallelism."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletool.analytic.collectives import wire_bytes
from scaletool.analytic.comm import (
    communication,
    data_parallel_communication,
    tensor_parallel_communication,
    tensor_parallel_config,
    tensor_parallel_replicated,
)
from scaletool.analytic.memory import tensor_parallel_memory, training_memory
from scaletool.analytic.params import moe_params, param_counts
from scaletool.analytic.timeline import MemoryInputs
from scaletool.config import load_recipe, recipe_from_dict

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = str(RECIPES / "tiny.yaml")  # MLA: d_model 64, 2 layers, 4 heads, kv_lora_rank 32, rope 8, FFN 192, vocab 256, fp32


def model(**kw):
    base = {"attention": "mha", "d_model": 64, "n_layers": 1, "n_heads": 8, "intermediate_size": 128,
            "vocab_size": 256, "max_seq_len": 64}
    return recipe_from_dict({"model": {**base, **kw}}).model


def rows(collectives: list[dict]) -> dict[tuple[str, str, str], tuple]:
    return {(r["group"], r["op"], r["what"]): (r["count"], r["message_bytes"], r["wire_bytes"]) for r in collectives}


def test_ring_volumes():
    assert wire_bytes("all_reduce", 1000, 4) == 1500  # 2(n-1)/n
    assert wire_bytes("all_gather", 1000, 4) == wire_bytes("reduce_scatter", 1000, 4) == 750
    assert wire_bytes("all_to_all", 1000, 2) == 500
    assert wire_bytes("all_reduce", 1000, 1) == 0


def test_one_tensor_parallel_rank_holds_its_share_of_the_split_weights_and_all_of_the_replicated():
    # MHA, d 64, 8 heads of 8, FFN 128, vocab 256, one layer, TP=2: wq, wk, wv, wo 64·4·8 each, two norms
    # 64 each (replicated), FFN 3·64·64, embedding and head 128·64 each, final norm 64
    local = tensor_parallel_config(model(), 2)
    assert param_counts(local)["total"] == 4 * 64 * 4 * 8 + 2 * 64 + 3 * 64 * 64 + 2 * 128 * 64 + 64
    for cfg in (model(), model(attention="gqa", n_kv_heads=4, qkv_bias=True), model(attention="mqa", qkv_bias=True),
                model(attention="mla", kv_lora_rank=32, q_lora_rank=24, norm="layernorm"), load_recipe(TINY).model):
        total, replicated = param_counts(cfg)["total"], sum(tensor_parallel_replicated(cfg))
        for tp in (2, 4):
            local = param_counts(tensor_parallel_config(cfg, tp))["total"]
            assert local == (total - replicated) // tp + replicated, (cfg.attention, tp)
    mqa = tensor_parallel_config(model(attention="mqa"), 4)
    assert (mqa.n_heads, mqa.n_kv_heads) == (2, 1)  # the one K/V head is not split


def test_tensor_parallel_collectives_of_the_tiny_model():
    # TP=2 of the tiny MLA, 2 sequences of 64 per rank: each activation message is 2·64·64 fp32 numbers
    cfg, act = load_recipe(TINY).model, 2 * 64 * 64 * 4
    got = rows(tensor_parallel_communication(cfg, 2, MemoryInputs(2, 64)))
    # per block 2 sub-layers × (forward + backward), plus the embedding and the final norm: 4·2 + 2
    assert got["tp", "all_gather", "sub-layer inputs, final norm; embedding (backward)"] == (10, 10 * act, 10 * act // 2)
    assert got["tp", "reduce_scatter", "sub-layer outputs, embedding; final norm (backward)"] == (10, 10 * act, 10 * act // 2)
    assert got["tp", "all_reduce", "loss parallelism (max, sum of exp, target logit)"] == (3, 3 * 128 * 4, 3 * 128 * 4)
    # per block: attn_norm 64, wkv_a 64·(32+8), kv_norm 32, ffn_norm 64; then the final norm 64
    replicated = 2 * (64 + 64 * 40 + 32 + 64) + 64
    assert got["tp", "all_reduce", "replicated weights' gradients"] == (9, replicated * 4, replicated * 4)
    # activation checkpointing repeats each recomputed block's forward pair; accumulation repeats per micro-batch
    full = rows(tensor_parallel_communication(cfg, 2, MemoryInputs(2, 64, "full"), grad_accum_steps=3))
    assert full["tp", "all_gather", "sub-layer inputs, final norm; embedding (backward)"][0] == 3 * (10 + 2 * 2)
    assert full["tp", "all_reduce", "replicated weights' gradients"][0] == 9  # once per step
    assert tensor_parallel_communication(cfg, 1, MemoryInputs(2, 64)) == []


def test_replicated_gradients_go_in_the_parameter_dtype_or_fp32_when_accumulated():
    cfg = model(attention="mqa", dtype="bf16")  # norms 64 + 64, wk, wv 64·8 each; final norm 64
    n = 2 * 64 + 2 * 64 * 8 + 64
    what = ("tp", "all_reduce", "replicated weights' gradients")
    assert rows(tensor_parallel_communication(cfg, 4, MemoryInputs(1, 64)))[what][1] == 2 * n
    assert rows(tensor_parallel_communication(cfg, 4, MemoryInputs(1, 64), grad_accum_steps=2))[what][1] == 4 * n


@pytest.mark.parametrize("cfg", [model(), model(attention="mla", kv_lora_rank=32, dtype="bf16", n_layers=3)])
def test_sequence_parallelism_moves_the_bytes_of_megatrons_all_reduces(cfg):
    """Korthikanti et al. 2022, §4.2.2: an all-gather plus a reduce-scatter move what one all-reduce
    does, so per micro-batch the activations cost Megatron-LM's 4 all-reduces per layer (Shoeybi et al.
    2019, §3: forward and backward, attention and MLP) plus two for the embedding and the head."""
    tp, inputs = 4, MemoryInputs(2, 64)
    got = tensor_parallel_communication(cfg, tp, inputs)
    activation_wire = sum(r["wire_bytes"] for r in got if r["op"] in ("all_gather", "reduce_scatter"))
    message = 2 * 64 * cfg.d_model * cfg.dtype_bytes
    assert activation_wire == (4 * cfg.n_layers + 2) * wire_bytes("all_reduce", message, tp)


def test_fsdp2_collectives_of_one_tensor_parallel_rank():
    # 2×2: FSDP2 over 2 data-parallel ranks of one TP rank's tiny MLA (fp32). Per block: wq 64·2·24, wkv_a
    # 64·40, kv_norm 32, wkv_b 32·2·32, wo 2·16·64, norms 2·64, FFN 3·64·96; root: embedding and head
    # 128·64 each, final norm 64
    local = tensor_parallel_config(load_recipe(TINY).model, 2)
    block = 64 * 2 * 24 + 64 * 40 + 32 + 32 * 2 * 32 + 2 * 16 * 64 + 2 * 64 + 3 * 64 * 96
    root = 2 * 128 * 64 + 64
    got = rows(data_parallel_communication(local, "fsdp", 2))
    # forward: root and both blocks; backward: both blocks again (resharded after the forward)
    assert got["dp", "all_gather", "parameters (blocks and root)"] == (5, 4 * (root + 4 * block), 2 * (root + 4 * block))
    assert got["dp", "reduce_scatter", "gradients (fp32)"] == (3, 4 * (root + 2 * block), 2 * (root + 2 * block))
    kept = rows(data_parallel_communication(local, "fsdp", 2, reshard_after_forward=False, grad_accum_steps=2))
    assert kept["dp", "all_gather", "parameters (blocks and root)"][:2] == (2 * 3, 2 * 4 * (root + 2 * block))
    assert kept["dp", "reduce_scatter", "gradients (fp32)"][0] == 3  # once per step
    assert data_parallel_communication(local, "fsdp", 1) == []


def test_zero_volumes_follow_the_zero_paper():
    """Rajbhandari et al. 2020, §7.2: ZeRO-1/2 move what data parallelism's all-reduce does (2Ψ per rank),
    ZeRO-3 1.5× that; DDP's gradients are fp32 here (torch-native mixed precision)."""
    cfg = model(dtype="bf16", n_layers=2)
    psi, N = param_counts(cfg)["total"], 8

    def wire(engine, stage=0, gas=1):
        return sum(r["wire_bytes"] for r in data_parallel_communication(cfg, engine, N, zero_stage=stage,
                                                                                 grad_accum_steps=gas))

    dp_all_reduce = wire_bytes("all_reduce", 2 * psi, N)
    assert wire("deepspeed", 0) == wire("deepspeed", 1) == wire("deepspeed", 2) == pytest.approx(dp_all_reduce, abs=1)
    assert wire("deepspeed", 3) == pytest.approx(1.5 * dp_all_reduce, abs=1)
    assert wire("ddp") == pytest.approx(2 * dp_all_reduce, abs=1)
    # accumulating over 4 micro-batches: ZeRO-1 still reduces once, ZeRO-2 every micro-batch, ZeRO-3 all of it
    grads = wire_bytes("reduce_scatter", 2 * psi, N)
    assert wire("deepspeed", 1, gas=4) == wire("deepspeed", 1)
    assert wire("deepspeed", 2, gas=4) == pytest.approx(wire("deepspeed", 2) + 3 * grads, abs=2)
    assert wire("deepspeed", 3, gas=4) == pytest.approx(4 * wire("deepspeed", 3), abs=4)
    # how many (each pays NCCL's fixed cost): 5e8-element buckets; ZeRO-3 a gather per block, embedding and head
    counts = {s: [r["count"] for r in data_parallel_communication(cfg, "deepspeed", N, zero_stage=s, grad_accum_steps=4)]
              for s in (1, 2, 3)}
    assert counts == {1: [1, 1], 2: [4, 1], 3: [2 * 4 * 3, 4 * 2]}


def test_expert_parallel_dispatch_goes_by_all_to_all():
    cfg = recipe_from_dict({"model": {"attention": "mha", "d_model": 32, "n_layers": 2, "n_heads": 4,
                                      "intermediate_size": 64, "vocab_size": 64, "max_seq_len": 16, "ffn": "moe",
                                      "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                      "first_k_dense_replace": 1, "dtype": "bf16", "moe_dispatch": "capacity"}}).model
    inputs = MemoryInputs(2, 16)
    got = rows(data_parallel_communication(cfg, "fsdp", 2, expert_parallel=True, inputs=inputs))
    # one MoE layer; capacity ceil(1.25 · 32 tokens · top-2 / 4 experts) = 20 slots per expert, d 32, bf16;
    # dispatch and return, forward and backward
    assert got["dp", "all_to_all", "expert dispatch and return"] == (4, 4 * 4 * 20 * 32 * 2, 2 * 4 * 20 * 32 * 2)
    # the routed experts stay out of FSDP2's all-gathers (forward and backward, 16-bit)
    plain = rows(data_parallel_communication(cfg, "fsdp", 2, inputs=inputs))
    gathered = ("dp", "all_gather", "parameters (blocks and root)")
    assert plain[gathered][1] - got[gathered][1] == 2 * moe_params(cfg)["routed"] * 2
    assert ("dp", "all_to_all", "expert dispatch and return") not in plain


def test_communication_of_a_recipe_adds_both_groups():
    r = load_recipe(TINY, ["parallel.engine=fsdp", "parallel.tensor_parallel=2", "train.micro_batch_size=4"])
    c = communication(r, world_size=8)
    assert (c["tensor_parallel"], c["data_parallel"]) == (2, 4)
    assert c["tp_wire_bytes"] == sum(r["wire_bytes"] for r in c["collectives"] if r["group"] == "tp") > 0
    assert c["dp_wire_bytes"] == sum(r["wire_bytes"] for r in c["collectives"] if r["group"] == "dp") > 0
    assert c["wire_bytes"] == c["tp_wire_bytes"] + c["dp_wire_bytes"]
    assert communication(load_recipe(TINY), world_size=1)["collectives"] == []  # single
    with pytest.raises(ValueError, match="tensor_parallel=2 does not divide world_size=3"):
        communication(r, world_size=3)


def test_memory_under_fsdp2_and_tensor_parallelism():
    r = load_recipe(str(RECIPES / "mha-1b.yaml"), ["parallel.engine=fsdp", "train.micro_batch_size=2"])
    m, T = r.model, r.seq_len
    one = tensor_parallel_memory(r, 4, 1)
    assert one["sequence_parallel_saving_bytes"] == 0
    assert one["total_bytes"] == training_memory(m, "fsdp", 4, MemoryInputs(2, T))["total_bytes"]
    two = tensor_parallel_memory(r, 4, 2)
    assert (two["tensor_parallel"], two["data_parallel"]) == (2, 2)
    local = param_counts(tensor_parallel_config(m, 2))["total"]
    assert two["params_per_rank"] == local and two["weights_bytes"] == 4 * local // 2  # fp32, over 2 data ranks
    # sequence parallelism halves each block's two norm inputs and the final norm's: 16-bit, 2 × 2048 tokens
    assert two["sequence_parallel_saving_bytes"] == 2 * T * 2 * m.d_model * (2 * m.n_layers + 1) // 2
    # a checkpointed block keeps only its input: one residual tensor, also split
    full = tensor_parallel_memory(r.model_copy(update={"train": r.train.model_copy(
        update={"activation_checkpointing": "full"})}), 4, 2)
    assert full["sequence_parallel_saving_bytes"] == 2 * T * 2 * m.d_model * (m.n_layers + 1) // 2
    # per-GPU activations fall with the group size: at 2 sequences per rank, 4-way TP on 4 GPUs fits in less
    assert tensor_parallel_memory(r, 4, 4)["activations_bytes"] < two["activations_bytes"] < one["activations_bytes"]
    with pytest.raises(ValueError, match="does not divide"):
        tensor_parallel_memory(r, 6, 4)
    # the saving comes off the backward phase; the phases still add up to the peak they name
    plain = training_memory(tensor_parallel_config(m, 2), "fsdp", 2, MemoryInputs(2, T))
    assert two["phases"]["backward"]["activations"] == (plain["phases"]["backward"]["activations"]
                                                      - two["sequence_parallel_saving_bytes"])
    for row in (one, two, full):
        assert sum(row["phases"][row["phase"]].values()) == row["total_bytes"]
        assert row["total_bytes"] == max(sum(c.values()) for c in row["phases"].values())


def test_estimate_tensor_parallel_option():
    from click.testing import CliRunner

    from scaletool.cli import main

    mha = str(RECIPES / "mha-1b.yaml")
    r = CliRunner().invoke(main, ["estimate", mha, "--world-size", "8", "--tensor-parallel", "4", "--json"])
    assert r.exit_code == 0, r.output
    est = json.loads(r.stdout)
    c, mem = est["communication"], est["memory"]["recipe"]
    assert (c["engine"], c["tensor_parallel"], c["data_parallel"]) == ("fsdp", 4, 2)
    assert {(row["group"], row["op"]) for row in c["collectives"]} == {
        ("tp", "all_gather"), ("tp", "reduce_scatter"), ("tp", "all_reduce"), ("dp", "all_gather"), ("dp", "reduce_scatter")}
    assert mem["tensor_parallel"] == 4 and mem["sequence_parallel_saving_bytes"] > 0
    table = CliRunner().invoke(main, ["estimate", mha, "--world-size", "8", "--tensor-parallel", "4"])
    assert "Tensor parallelism: 2 data-parallel × 4 tensor-parallel ranks" in table.stdout
    assert "sequence parallelism saves" in table.stdout
    plain = CliRunner().invoke(main, ["estimate", mha])
    assert "Tensor parallelism" not in plain.stdout  # the table only where tensor parallelism is asked for
    bad = CliRunner().invoke(main, ["estimate", mha, "--tensor-parallel", "2"])
    assert bad.exit_code == 2 and bad.stderr.strip().splitlines() == [
        "error: parallel.world_size: 1 is not a multiple of parallel.tensor_parallel=2; set the ranks to assume "
        "(estimate --world-size)"]
    bad = CliRunner().invoke(main, ["estimate", mha, "--world-size", "6", "--tensor-parallel", "3"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 4
    assert "model.n_heads: 16 heads do not split over parallel.tensor_parallel=3 ranks" in bad.stderr
