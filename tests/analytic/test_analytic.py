"""Closed forms against the built model and against published figures."""
from __future__ import annotations

import json
import random

import pytest
import yaml
from conftest import RECIPES, ROOT

from scaletool.analytic.estimate import estimate
from scaletool.analytic.flops import decode_flops_per_token, flops_per_token
from scaletool.analytic.kv import cache_bytes_per_token, kv_cache
from scaletool.analytic.memory import engine_settings, memory_table, recipe_memory, training_memory
from scaletool.analytic.params import attention_params, matmul_params, param_counts
from scaletool.analytic.timeline import COMPONENTS, PHASES, ZERO_REDUCE_BUCKET, MemoryInputs, _group_sizes, _units
from scaletool.analytic.zero3 import DEEPSPEED_DEFAULTS, block_params
from scaletool.config import RecipeError, load_recipe, recipe_from_dict
from scaletool.kinds.attention import attention_kind
from scaletool.model import build_model


def yaml_recipe(name: str) -> dict:
    return yaml.safe_load((RECIPES / name).read_text())


def random_model(rng: random.Random) -> dict:
    attention = rng.choice(["mha", "gqa", "mqa", "mla"])
    n_heads = rng.choice([1, 2, 4, 6, 8])
    head_dim = rng.choice([8, 16, 24, 32])
    m = {"attention": attention, "n_heads": n_heads, "head_dim": head_dim,
         "d_model": rng.choice([32, 48, 64, 96, 130]), "n_layers": rng.randint(1, 4),
         "intermediate_size": rng.randint(1, 300), "vocab_size": rng.randint(2, 500),
         "ffn": rng.choice(["swiglu", "gelu", "relu"]), "norm": rng.choice(["rmsnorm", "layernorm"]),
         "tie_embeddings": rng.random() < 0.3, "max_seq_len": 16}
    if attention == "gqa":
        m["n_kv_heads"] = rng.choice([d for d in range(1, n_heads + 1) if n_heads % d == 0])
    if attention in ("mha", "gqa", "mqa"):
        m["qkv_bias"] = rng.random() < 0.3
    if attention == "mla":
        per_head = rng.random() < 0.5
        m.update(kv_lora_rank=rng.randint(1, 64), q_lora_rank=rng.choice([0, 0, rng.randint(1, 48)]),
                 qk_nope_head_dim=rng.randint(0 if per_head else 1, 40), qk_rope_head_dim=2 * rng.randint(1, 16),
                 v_head_dim=rng.randint(1, 40), mla_rope="per_head" if per_head else "shared")
    else:
        m["position_encoding"] = rng.choice(["rope", "learned", "sinusoidal", "alibi", "none"])
    m["norm_placement"] = rng.choice(["pre", "post"])
    if rng.random() < 0.25:
        m.update(task="regression", n_features=rng.randint(1, 30), horizon=rng.randint(1, 12))
        m["max_seq_len"] = 16
    return m


@pytest.mark.parametrize("seed", range(60))
def test_param_count_equals_closed_form(seed):
    cfg = recipe_from_dict({"model": random_model(random.Random(seed))}).model
    model = build_model(cfg, "meta")
    counts = param_counts(cfg)
    assert model.num_params() == counts["total"]
    attn = model.layers[0].attn
    by_proj = counts["per_layer"]["attention_by_projection"]
    assert sum(p.numel() for p in attn.parameters()) == sum(by_proj.values())
    for name, n in by_proj.items():
        if name == "qkv_bias":
            assert sum(getattr(attn, w).bias.numel() for w in ("wq", "wk", "wv")) == n
        else:
            own = getattr(attn, name).parameters(recurse=False)
            assert sum(p.numel() for p in own if p.ndim > 1 or name.endswith("norm")) == n
    assert sum(p.numel() for p in model.layers[0].ffn.parameters()) == counts["per_layer"]["ffn"]


@pytest.mark.parametrize("seed", range(12))
def test_decode_flops_and_cache_equal_what_the_model_does(seed):
    """Every kind, mode, position encoding and norm: FlopCounterMode on one decode step equals the closed
    form, and the caches allocated hold exactly the analytic bytes per token."""
    import torch

    from scaletool.measure.count import decode_flops
    from scaletool.model.cache import cache_bytes, make_caches

    m = random_model(random.Random(1000 + seed))
    m.update(task="lm", max_seq_len=16)
    cfg = recipe_from_dict({"model": m}).model
    model = build_model(cfg, "meta")
    counted = decode_flops(model, cfg, 13)
    assert counted and all(c["flop_counter"] == c["analytic"] for c in counted.values()), counted
    kind = attention_kind(cfg)
    for mode in kind.decode_modes(cfg) or (None,):
        caches = make_caches(cfg, 2, 5, dtype=torch.bfloat16, device="meta", mla_mode=mode)
        assert cache_bytes(caches) == cache_bytes_per_token(cfg, mode) // cfg.dtype_bytes * 2 * 2 * 5


def test_per_head_rope_mla_against_the_shared_key_in_closed_form():
    """mla-1b both ways: per_head drops wkv_a's RoPE rows (d·rope) and adds them per head to wkv_b
    (kv_lora·H·rope); it caches the latent alone (kv_lora vs kv_lora + rope), but re-expands keys and values
    from every cached latent at each step, so its FLOPs per decoded token grow with the context."""
    shared = recipe_from_dict({"model": {"attention": "mla", "d_model": 2048, "n_layers": 16, "n_heads": 16,
                                         "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                         "v_head_dim": 128}}).model
    per_head = shared.model_copy(update={"mla_rope": "per_head"})
    d, L, H, c, r = 2048, 16, 16, 512, 64
    diff = param_counts(per_head)["total"] - param_counts(shared)["total"]
    assert diff == L * (c * H * r - d * r)
    assert kv_cache(shared)["bytes_per_token"] == (c + r) * 2 * L
    assert kv_cache(per_head)["bytes_per_token"] == c * 2 * L
    assert kv_cache(per_head)["by_mode"] == {"expand": c * 2 * L, "naive": H * (192 + 128) * 2 * L}
    for ctx in (1024, 4096):
        absorbed = decode_flops_per_token(shared, ctx)["attention"]
        expand = decode_flops_per_token(per_head, ctx)["attention"]
        # absorbed: scores over kv_lora + rope and the weighted latents, 2·H·ctx·(2c + r) per layer
        assert absorbed == L * (2 * (d * H * 192 + d * (c + r) + H * 128 * d) + 2 * H * (128 * c + ctx * (2 * c + r)
                                                                                       + c * 128))
        # expand: wkv_b over every cached latent, then attention over ctx keys of 192 and values of 128
        assert expand == L * (2 * (d * H * 192 + d * c + H * 128 * d) + 2 * ctx * c * H * (128 + r + 128)
                              + 2 * H * ctx * (192 + 128))
    with pytest.raises(ValueError, match="mla_rope=per_head cannot absorb"):
        decode_flops_per_token(per_head, 1024, "absorbed")


def test_position_encodings_and_post_norm_in_the_parameter_count():
    """Only a learned table has parameters (max_seq_len·d, left out of the non-embedding count as Kaplan
    et al. do); post-norm has no final norm."""
    base = {"d_model": 128, "n_heads": 4, "n_layers": 2, "max_seq_len": 256, "norm": "layernorm"}
    rope = param_counts(recipe_from_dict({"model": base}).model)
    for enc in ("sinusoidal", "alibi", "none"):
        assert param_counts(recipe_from_dict({"model": {**base, "position_encoding": enc}}).model) == rope
    learned = param_counts(recipe_from_dict({"model": {**base, "position_encoding": "learned"}}).model)
    assert learned["total"] - rope["total"] == learned["position_embedding"] == 256 * 128
    assert learned["non_embedding"] == rope["non_embedding"]
    post = param_counts(recipe_from_dict({"model": {**base, "norm_placement": "post"}}).model)
    assert rope["total"] - post["total"] == rope["final_norm"] == 2 * 128 and post["final_norm"] == 0


def test_alibis_score_bias_is_held_through_the_backward():
    """ALiBi's (1, H, T, T) bias in the compute dtype is saved by every block's attention (one tensor): the estimate
    carries it once, at every engine, 2 GiB for MPT-1B's 16 heads at T = 8,192 (measured on one H200: 83.21 GiB
    against 81.13 without it, benchmarks/results/published-shape/h200-2026-11-29-alibi)."""
    from scaletool.analytic.memory import recipe_memory

    base = {"model": {"d_model": 256, "n_heads": 16, "n_layers": 2, "max_seq_len": 8192, "attention": "mha"},
            "train": {"seq_len": 8192, "micro_batch_size": 1}, "parallel": {"engine": "fsdp", "world_size": 2}}
    none = recipe_memory(recipe_from_dict({**base, "model": {**base["model"], "position_encoding": "none"}}), 2)
    alibi = recipe_memory(recipe_from_dict({**base, "model": {**base["model"], "position_encoding": "alibi"}}), 2)
    assert alibi["total_bytes"] - none["total_bytes"] == 2 * 16 * 8192**2


def test_deepseek_v3_attention_layout():
    """DeepSeek-V3's MLA (d 7168, 128 heads, q_lora 1536, kv_lora 512, 128/64/128): 187,107,328 per layer,
    projection by projection as in its inference code."""
    cfg = recipe_from_dict({"model": {"attention": "mla", "d_model": 7168, "n_heads": 128, "q_lora_rank": 1536,
                                      "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                      "v_head_dim": 128, "n_layers": 1}}).model
    p = attention_params(cfg)
    assert p == {"wq_a": 7168 * 1536, "q_norm": 1536, "wq_b": 1536 * 128 * 192, "wkv_a": 7168 * 576,
                 "kv_norm": 512, "wkv_b": 512 * 128 * 256, "wo": 128 * 128 * 7168}
    assert sum(p.values()) == 187_107_328
    names = {n for n, _ in build_model(cfg, "meta").layers[0].attn.named_parameters()}
    assert names == {"wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv_a.weight", "kv_norm.weight",
                     "wkv_b.weight", "wo.weight"}


def test_llama3_8b_total():
    cfg = recipe_from_dict({"model": {"attention": "gqa", "d_model": 4096, "n_layers": 32, "n_heads": 32,
                                      "n_kv_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}}).model
    assert param_counts(cfg)["total"] == 8_030_261_248  # Meta's published count


def test_rule_of_thumb_is_exact_for_the_classic_block():
    """12·d²·L is exact for MHA with a 4d two-matrix FFN and no norms; norms make it slightly low."""
    cfg = recipe_from_dict({"model": {"d_model": 256, "n_heads": 4, "ffn": "gelu", "intermediate_size": 1024,
                                      "n_layers": 3}}).model
    p = param_counts(cfg)
    assert p["rule_of_thumb_12d2L"] == 12 * 256 * 256 * 3
    assert p["non_embedding"] - p["rule_of_thumb_12d2L"] == p["norms"]
    assert build_model(cfg, "meta").num_params(non_embedding=True) == p["non_embedding"]


@pytest.mark.parametrize("model, per_layer_elems", [
    ({"attention": "mha", "d_model": 512, "n_heads": 8}, 2 * 8 * 64),
    ({"attention": "gqa", "d_model": 512, "n_heads": 8, "n_kv_heads": 2}, 2 * 2 * 64),
    ({"attention": "mqa", "d_model": 512, "n_heads": 8}, 2 * 64),
    ({"attention": "mla", "d_model": 512, "n_heads": 8, "kv_lora_rank": 256, "qk_rope_head_dim": 32}, 256 + 32),
])
def test_kv_cache_bytes(model, per_layer_elems):
    for dtype, b in (("bf16", 2), ("fp32", 4)):
        cfg = recipe_from_dict({"model": {**model, "n_layers": 8, "dtype": dtype}}).model
        kv = kv_cache(cfg)
        assert kv["bytes_per_token"] == per_layer_elems * 8 * b
        assert isinstance(kv["bytes_per_token"], int)


def test_mla_compression_against_the_same_heads():
    cfg = recipe_from_dict({"model": {"attention": "mla", "d_model": 2048, "n_heads": 16, "kv_lora_rank": 512,
                                      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}}).model
    kv = kv_cache(cfg)
    assert kv["naive_bytes_per_token"] == 16 * (192 + 128) * 2 * cfg.n_layers
    assert kv["compression_ratio"] == pytest.approx(16 * 320 / 576)


def test_flops_conventions():
    cfg = recipe_from_dict({"model": {"d_model": 128, "n_heads": 4, "n_layers": 2, "vocab_size": 1000}}).model
    T = 256
    f = flops_per_token(cfg, T)
    n = matmul_params(cfg)
    att_full = 2 * 2 * 4 * T * (32 + 32)
    assert f["forward_full"] == 2 * n + att_full
    assert f["train_causal"] == 6 * n + 3 * att_full / 2
    assert f["train"] == f["train_causal"] and f["dense_6N"] == 6 * n


def test_estimate_json_contract():
    r = recipe_from_dict({"model": {"attention": "mla", "kv_lora_rank": 64}})
    est = estimate(r)
    assert isinstance(est["params"]["total"], int)
    assert isinstance(est["flops"]["per_token"]["train"], float | int)
    assert isinstance(est["kv_cache"]["bytes_per_token"], int)


def test_invalid_config_never_reaches_the_formulas():
    with pytest.raises(RecipeError):
        recipe_from_dict({"model": {"attention": "mla"}})


# ---------------------------------------------------------------------------------------------
# Training memory in phases

ENGINES = [("single", 0), ("ddp", 0), ("fsdp", 0), ("deepspeed", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3)]


def mem(cfg, engine, N, mb=2, ac="none", T=64, **settings):
    return training_memory(cfg, engine, N, MemoryInputs(mb, T, ac), **settings)


@pytest.mark.parametrize("seed", range(12))
def test_every_phase_is_its_components_and_the_total_is_the_larger(seed):
    """Both phases carry the same six components summing to the phase; total = the larger phase, named."""
    rng = random.Random(seed)
    cfg = recipe_from_dict({"model": {**random_model(rng), "dtype": rng.choice(["bf16", "fp32"])}}).model
    for engine, stage in ENGINES:
        for N in ([1] if engine == "single" else [1, 2, 8]):
            m = mem(cfg, engine, N, mb=rng.randint(1, 4), ac=rng.choice(["none", "full", "selective"]), zero_stage=stage,
                    fused_optimizer=rng.random() < 0.5, reduce_bucket=rng.choice([1e3, 5e8]))
            assert set(m["phases"]) == set(PHASES)
            totals = {}
            for name, comp in m["phases"].items():
                assert tuple(comp) == COMPONENTS and all(v >= 0 for v in comp.values()), (engine, comp)
                totals[name] = sum(comp.values())
            assert m["total_bytes"] == max(totals.values()) == totals[m["phase"]]
            assert m["phases"]["optimizer_step"]["activations"] == 0
            assert m["transient_bytes"] == m["phases"][m["phase"]]["buffers"] + m["phases"][m["phase"]]["temporaries"]


def test_model_states_as_each_engine_stores_them():
    """ZeRO-1 with overlap_comm keeps only its gradient partition, as ZeRO-2 does; without it, the ZeRO
    paper's 4Ψ + 12Ψ/N (Rajbhandari et al. 2020, K = 12)."""
    cfg = recipe_from_dict({"model": {"d_model": 512, "n_heads": 8, "n_layers": 4}}).model
    psi = param_counts(cfg)["total"]

    def states(engine, stage=1, N=8, **kw):
        m = mem(cfg, engine, N, zero_stage=stage, **kw)
        return m["weights_bytes"] + m["gradients_bytes"] + m["optimizer_bytes"]

    assert states("deepspeed", 0) == pytest.approx(16 * psi, rel=1e-6)
    assert states("deepspeed", 1, overlap_comm=False) == pytest.approx(4 * psi + 12 * psi / 8, rel=1e-6)
    assert states("deepspeed", 1) == states("deepspeed", 2) == pytest.approx(2 * psi + 14 * psi / 8, rel=1e-6)
    # ZeRO-3: the norm weights (at most stage3_param_persistence_threshold elements) stay whole on every rank
    norms = param_counts(cfg)["norms"]
    assert states("deepspeed", 3) == 16 * psi / 8 + 2 * norms * 7 / 8
    assert states("deepspeed", 3, persistence_threshold=0) == pytest.approx(16 * psi / 8, rel=1e-6)
    assert states("fsdp") == pytest.approx(16 * psi / 8, rel=1e-6)
    assert states("ddp") == states("single", N=1) == 16 * psi


def test_zero12_step_is_deepspeeds_own_estimate_plus_the_flat_copy():
    """The step phase's model states plus fp32 gradient copy equal DeepSpeed's estimator
    (``estimate_zero2_model_states_mem_needs``, fixed for the step in PR #5099: 2Ψ + 18Ψ/N); the 16-bit
    flat copy made before the cast comes on top."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    cfg = recipe_from_dict({"model": {"d_model": 256, "n_heads": 4, "n_layers": 2, "vocab_size": 1000}}).model
    psi = param_counts(cfg)["total"]
    big, small = _group_sizes(cfg)
    assert big + small == psi
    for N in (1, 2, 4):
        step = mem(cfg, "deepspeed", N, zero_stage=2)["phases"]["optimizer_step"]
        _, gpu = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=N, cpu_offload=False)
        flat16 = 2 * big / N
        assert sum(step.values()) - flat16 == pytest.approx(gpu, rel=small / psi + 1e-6)


def test_the_optimizer_step_sets_deepspeeds_peak_when_activations_are_small():
    """mha-1b, micro-batch 1, full checkpointing (where the optimizer step sets the peak): ZeRO-1/2/3's peak is the step."""
    r = recipe_from_dict(yaml_recipe("mha-1b.yaml"))
    for stage in (1, 2, 3):
        m = mem(r.model, "deepspeed", 1, mb=1, ac="full", T=2048, zero_stage=stage)
        assert m["phase"] == "optimizer_step"
        step = m["phases"]["optimizer_step"]
        assert step["temporaries"] == pytest.approx(6 * max(_group_sizes(r.model)), abs=8)  # 2P + 4P
    assert mem(r.model, "deepspeed", 1, mb=8, T=2048, zero_stage=1)["phase"] == "backward"
    assert mem(r.model, "single", 1, mb=1, ac="full", T=2048)["phase"] == "backward"


def test_backward_peak_moves_from_the_loss_to_the_end_as_activations_shrink():
    """single: at the loss with many activations; with few, near the end, where all gradients exist."""
    r = recipe_from_dict(yaml_recipe("mha-1b.yaml"))
    big = mem(r.model, "single", 1, mb=8, T=2048)
    small = mem(r.model, "single", 1, mb=1, ac="full", T=2048)
    psi = param_counts(r.model)["total"]
    assert big["backward_peak_at"] == "loss" and big["phases"]["backward"]["gradients"] == 0
    assert small["backward_peak_at"] in ("block 0", "embedding")
    assert small["phases"]["backward"]["gradients"] >= 4 * (psi - r.model.vocab_size * r.model.d_model)


def test_engine_buffers_follow_their_sources():
    cfg = recipe_from_dict({"model": {"d_model": 256, "n_heads": 4, "n_layers": 4, "vocab_size": 1000}}).model
    psi = param_counts(cfg)["total"]
    big, _ = _group_sizes(cfg)
    # fused AdamW steps in place; foreach allocates one fp32 sqrt per parameter of the larger group
    assert mem(cfg, "single", 1)["phases"]["optimizer_step"]["temporaries"] == 0
    assert mem(cfg, "single", 1, fused_optimizer=False)["phases"]["optimizer_step"]["temporaries"] == 4 * big
    assert mem(cfg, "fsdp", 4, fused_optimizer=False)["phases"]["optimizer_step"]["temporaries"] == big  # 4 × big / 4
    # DDP: the second set of buckets (the second step's rebuild) through the backward
    assert mem(cfg, "ddp", 2)["phases"]["backward"]["buffers"] >= 4 * psi
    # ZeRO-1/2: two IPG buckets with overlap_comm, one without; none during the step
    z = mem(cfg, "deepspeed", 2, zero_stage=2, reduce_bucket=1e3)
    assert z["phases"]["backward"]["buffers"] == 2 * 1000 * 2 and z["phases"]["optimizer_step"]["buffers"] == 0
    assert mem(cfg, "deepspeed", 2, zero_stage=2, reduce_bucket=1e3, overlap_comm=False)["phases"]["backward"]["buffers"] == 2000
    # ZeRO-3: the bucket stays for good; one rank gathers nothing, two gather what is kept for reuse
    one = mem(cfg, "deepspeed", 1, zero_stage=3, reduce_bucket=1e3)
    two = mem(cfg, "deepspeed", 2, zero_stage=3, reduce_bucket=1e3, prefetch_bucket=0)
    assert one["phases"]["backward"]["buffers"] == one["phases"]["optimizer_step"]["buffers"] == 2000
    assert two["phases"]["backward"]["buffers"] > 2000
    none_kept = mem(cfg, "deepspeed", 2, zero_stage=3, reduce_bucket=1e3, max_reuse_distance=0, prefetch_bucket=0)
    assert none_kept["phases"]["backward"]["buffers"] < two["phases"]["backward"]["buffers"]
    # the prefetch gathers the next stops' parameters up to prefetch_bucket elements: more than one stop
    blocks = [u.gathered for u in _units(cfg, MemoryInputs(2, 64), autocast=False,
                                                 expert_parallel=False)[0][1:-1]]
    one_block = mem(cfg, "deepspeed", 2, zero_stage=3, reduce_bucket=1e3, max_reuse_distance=0, prefetch_bucket=blocks[0])
    two_blocks = mem(cfg, "deepspeed", 2, zero_stage=3, reduce_bucket=1e3, max_reuse_distance=0,
                     prefetch_bucket=2 * blocks[0])
    assert two_blocks["phases"]["backward"]["buffers"] - one_block["phases"]["backward"]["buffers"] == 2 * blocks[0]


def test_recipe_settings_reach_the_estimate():
    base = {"model": {"d_model": 256, "n_heads": 4, "n_layers": 4, "vocab_size": 1000, "dtype": "bf16"},
            "parallel": {"engine": "deepspeed", "zero_stage": 3}}
    default = recipe_memory(recipe_from_dict(base), 2)
    tuned = recipe_from_dict({**base, "parallel": {**base["parallel"], "deepspeed": {"zero_optimization": {
        "reduce_bucket_size": "5e6", "stage3_max_reuse_distance": 0}}}})
    s = engine_settings(tuned)
    assert (s.reduce_bucket, s.max_reuse_distance, s.zero_stage) == (5e6, 0, 3)
    assert recipe_memory(tuned, 2)["phases"]["optimizer_step"]["buffers"] == 2 * 5_000_000
    # ZeRO-3's own defaults are sized by the block: a reduce bucket and a prefetch of two blocks
    block = block_params(recipe_from_dict(base).model)
    assert default["phases"]["optimizer_step"]["buffers"] == 2 * 2 * block
    assert engine_settings(recipe_from_dict(base)).prefetch_bucket == 2 * block
    # ZeRO-1/2 keep scaletool's 5e8-element bucket, also in the table rows of a ZeRO-3 recipe
    assert engine_settings(recipe_from_dict(base), 2).reduce_bucket == ZERO_REDUCE_BUCKET
    rows = {r["label"]: r for r in memory_table(recipe_from_dict(base), 2) if r["activation_checkpointing"] == "none"}
    assert rows["zero3"]["phases"]["optimizer_step"]["buffers"] == 2 * 2 * block
    foreach = recipe_from_dict({**base, "parallel": {"engine": "fsdp"}, "train": {"fused_optimizer": False}})
    assert not engine_settings(foreach).fused_optimizer
    bad = recipe_from_dict({**base, "parallel": {**base["parallel"], "deepspeed": {"zero_optimization": {
        "reduce_bucket_size": "auto"}}}})
    assert engine_settings(bad).reduce_bucket == 2 * block


def test_estimate_matches_the_gpu_validation():
    """Every valid cell of the committed H200 validation (benchmarks/memory_phases.md) is within
    ±10% of the current estimate; the two that are not are over-estimates, for the reason given there."""
    from scaletool.records import read_record

    cells = json.loads(read_record(ROOT / "benchmarks/results/memory-phases/2xh200-2026-11-26/memory-phases.json"))
    known = {"mha-1b-ddp-n1-mb1-full", "mha-1b-ddp-n2-mb1-full"}  # DDP's old buckets partly released in time
    checked = 0
    for rec in cells:
        if rec["status"] != "ok":
            continue
        c = rec["cell"]
        engine = {"zero1": "deepspeed", "zero2": "deepspeed", "zero3": "deepspeed"}.get(c["label"], c["label"])
        r = load_recipe(ROOT / "recipes" / f"{c['recipe']}.yaml",
                        [f"parallel.engine={engine}", f"parallel.zero_stage={c['label'][-1] if engine == 'deepspeed' else 1}",
                         f"train.micro_batch_size={c['micro_batch_size']}",
                         f"train.activation_checkpointing={c['activation_checkpointing']}",
                         "train.compile=false"],  # measured eager (memory_phases.py sets it)
                        # measured under DeepSpeed's fixed ZeRO-3 defaults, before scaletool sized them by the block
                        extra={"parallel.deepspeed": {"zero_optimization": DEEPSPEED_DEFAULTS}}
                        if c["label"] == "zero3" else None)
        est = recipe_memory(r, c["world_size"])["total_bytes"]
        measured = max(p["peak_bytes"] for p in rec["per_rank"])
        err = (est - measured) / measured
        assert (err > 0) if rec["name"] in known else abs(err) <= 0.10, (rec["name"], err)
        checked += 1
    assert checked == 81
