"""Closed forms against the built model and against published figures."""
from __future__ import annotations

import random

import pytest

from scaletool import analytic
from scaletool.attention_kinds import attention_kind
from scaletool.config import RecipeError, recipe_from_dict
from scaletool.model import build_model


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
    counts = analytic.param_counts(cfg)
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
        assert cache_bytes(caches) == analytic.cache_bytes_per_token(cfg, mode) // cfg.dtype_bytes * 2 * 2 * 5


def test_per_head_rope_mla_against_the_shared_key_in_closed_form():
    """mla-1b both ways: per_head drops wkv_a's RoPE rows (d·rope) and adds them per head to wkv_b
    (kv_lora·H·rope); it caches the latent alone (kv_lora vs kv_lora + rope), but re-expands keys and values
    from every cached latent at each step, so its FLOPs per decoded token grow with the context."""
    shared = recipe_from_dict({"model": {"attention": "mla", "d_model": 2048, "n_layers": 16, "n_heads": 16,
                                         "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                         "v_head_dim": 128}}).model
    per_head = shared.model_copy(update={"mla_rope": "per_head"})
    d, L, H, c, r = 2048, 16, 16, 512, 64
    diff = analytic.param_counts(per_head)["total"] - analytic.param_counts(shared)["total"]
    assert diff == L * (c * H * r - d * r)
    assert analytic.kv_cache(shared)["bytes_per_token"] == (c + r) * 2 * L
    assert analytic.kv_cache(per_head)["bytes_per_token"] == c * 2 * L
    assert analytic.kv_cache(per_head)["by_mode"] == {"expand": c * 2 * L, "naive": H * (192 + 128) * 2 * L}
    for ctx in (1024, 4096):
        absorbed = analytic.decode_flops_per_token(shared, ctx)["attention"]
        expand = analytic.decode_flops_per_token(per_head, ctx)["attention"]
        # absorbed: scores over kv_lora + rope and the weighted latents, 2·H·ctx·(2c + r) per layer
        assert absorbed == L * (2 * (d * H * 192 + d * (c + r) + H * 128 * d) + 2 * H * (128 * c + ctx * (2 * c + r)
                                                                                       + c * 128))
        # expand: wkv_b over every cached latent, then attention over ctx keys of 192 and values of 128
        assert expand == L * (2 * (d * H * 192 + d * c + H * 128 * d) + 2 * ctx * c * H * (128 + r + 128)
                              + 2 * H * ctx * (192 + 128))
    with pytest.raises(ValueError, match="mla_rope=per_head cannot absorb"):
        analytic.decode_flops_per_token(per_head, 1024, "absorbed")


def test_position_encodings_and_post_norm_in_the_parameter_count():
    """Only a learned table has parameters (max_seq_len·d, left out of the non-embedding count as Kaplan
    et al. do); post-norm has no final norm."""
    base = {"d_model": 128, "n_heads": 4, "n_layers": 2, "max_seq_len": 256, "norm": "layernorm"}
    rope = analytic.param_counts(recipe_from_dict({"model": base}).model)
    for enc in ("sinusoidal", "alibi", "none"):
        assert analytic.param_counts(recipe_from_dict({"model": {**base, "position_encoding": enc}}).model) == rope
    learned = analytic.param_counts(recipe_from_dict({"model": {**base, "position_encoding": "learned"}}).model)
    assert learned["total"] - rope["total"] == learned["position_embedding"] == 256 * 128
    assert learned["non_embedding"] == rope["non_embedding"]
    post = analytic.param_counts(recipe_from_dict({"model": {**base, "norm_placement": "post"}}).model)
    assert rope["total"] - post["total"] == rope["final_norm"] == 2 * 128 and post["final_norm"] == 0


def test_deepseek_v3_attention_layout():
    """DeepSeek-V3's MLA (d 7168, 128 heads, q_lora 1536, kv_lora 512, 128/64/128): 187,107,328 per layer,
    projection by projection as in its inference code."""
    cfg = recipe_from_dict({"model": {"attention": "mla", "d_model": 7168, "n_heads": 128, "q_lora_rank": 1536,
                                      "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                      "v_head_dim": 128, "n_layers": 1}}).model
    p = analytic.attention_params(cfg)
    assert p == {"wq_a": 7168 * 1536, "q_norm": 1536, "wq_b": 1536 * 128 * 192, "wkv_a": 7168 * 576,
                 "kv_norm": 512, "wkv_b": 512 * 128 * 256, "wo": 128 * 128 * 7168}
    assert sum(p.values()) == 187_107_328
    names = {n for n, _ in build_model(cfg, "meta").layers[0].attn.named_parameters()}
    assert names == {"wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv_a.weight", "kv_norm.weight",
                     "wkv_b.weight", "wo.weight"}


def test_llama3_8b_total():
    cfg = recipe_from_dict({"model": {"attention": "gqa", "d_model": 4096, "n_layers": 32, "n_heads": 32,
                                      "n_kv_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}}).model
    assert analytic.param_counts(cfg)["total"] == 8_030_261_248  # Meta's published count


def test_rule_of_thumb_is_exact_for_the_classic_block():
    """12·d²·L is exact for MHA with a 4d two-matrix FFN and no norms; norms make it slightly low."""
    cfg = recipe_from_dict({"model": {"d_model": 256, "n_heads": 4, "ffn": "gelu", "intermediate_size": 1024,
                                      "n_layers": 3}}).model
    p = analytic.param_counts(cfg)
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
        kv = analytic.kv_cache(cfg)
        assert kv["bytes_per_token"] == per_layer_elems * 8 * b
        assert isinstance(kv["bytes_per_token"], int)


def test_mla_compression_against_the_same_heads():
    cfg = recipe_from_dict({"model": {"attention": "mla", "d_model": 2048, "n_heads": 16, "kv_lora_rank": 512,
                                      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}}).model
    kv = analytic.kv_cache(cfg)
    assert kv["naive_bytes_per_token"] == 16 * (192 + 128) * 2 * cfg.n_layers
    assert kv["compression_ratio"] == pytest.approx(16 * 320 / 576)


def test_flops_conventions():
    cfg = recipe_from_dict({"model": {"d_model": 128, "n_heads": 4, "n_layers": 2, "vocab_size": 1000}}).model
    T = 256
    f = analytic.flops_per_token(cfg, T)
    n = analytic.matmul_params(cfg)
    att_full = 2 * 2 * 4 * T * (32 + 32)
    assert f["forward_full"] == 2 * n + att_full
    assert f["train_causal"] == 6 * n + 3 * att_full / 2
    assert f["train"] == f["train_causal"] and f["dense_6N"] == 6 * n


def test_training_memory_zero_stages_shrink():
    cfg = recipe_from_dict({"model": {"d_model": 512, "n_heads": 8, "n_layers": 4}}).model
    inp = analytic.MemoryInputs(2, 128)
    psi = analytic.param_counts(cfg)["total"]
    states = {}
    for stage in range(4):
        m = analytic.training_memory(cfg, "deepspeed", 8, inp, zero_stage=stage)
        states[stage] = m["weights_bytes"] + m["gradients_bytes"] + m["optimizer_bytes"]
    # ZeRO paper, K=12: 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N
    assert states[0] == pytest.approx(16 * psi, rel=1e-6)
    assert states[1] == pytest.approx(4 * psi + 12 * psi / 8, rel=1e-6)
    assert states[2] == pytest.approx(2 * psi + 14 * psi / 8, rel=1e-6)
    assert states[3] == pytest.approx(16 * psi / 8, rel=1e-6)
    full = analytic.training_memory(cfg, "single", 1, analytic.MemoryInputs(2, 128, "full"))
    none = analytic.training_memory(cfg, "single", 1, inp)
    assert full["activations_bytes"] < none["activations_bytes"]


def test_estimate_json_contract():
    r = recipe_from_dict({"model": {"attention": "mla", "kv_lora_rank": 64}})
    est = analytic.estimate(r)
    assert isinstance(est["params"]["total"], int)
    assert isinstance(est["flops"]["per_token"]["train"], float | int)
    assert isinstance(est["kv_cache"]["bytes_per_token"], int)


def test_invalid_config_never_reaches_the_formulas():
    with pytest.raises(RecipeError):
        recipe_from_dict({"model": {"attention": "mla"}})


def test_zero3_counts_deepspeeds_gradient_bucket_and_the_parameters_kept_for_reuse():
    """ZeRO-3's transient = reduce bucket + min(Ψ, max_reuse_distance/2) gathered 16-bit elements
    (+ two gathered blocks on several GPUs), with both settings read from the DeepSpeed passthrough."""
    base = {"model": {"d_model": 512, "n_heads": 8, "n_layers": 4, "dtype": "bf16"},
            "parallel": {"engine": "deepspeed", "zero_stage": 3}}
    r = recipe_from_dict(base)
    psi = analytic.param_counts(r.model)["total"]
    one = analytic.recipe_memory(r, 1)
    assert one["transient_bytes"] == int(2 * (analytic.ZERO_REDUCE_BUCKET + psi))  # Ψ < reuse distance / 2
    tuned = recipe_from_dict({**base, "parallel": {**base["parallel"], "deepspeed": {"zero_optimization": {
        "reduce_bucket_size": "5e6", "stage3_max_reuse_distance": 2 * psi // 4}}}})
    assert analytic.recipe_memory(tuned, 1)["transient_bytes"] == int(2 * (5e6 + psi // 4))
    block = analytic.param_counts(r.model)["per_layer"]
    block_psi = block["attention"] + block["ffn"] + block["norms"]
    assert analytic.recipe_memory(r, 2)["transient_bytes"] == int(2 * (analytic.ZERO_REDUCE_BUCKET + psi)
                                                                  + 2 * 2 * block_psi)
    stage2 = recipe_from_dict({**base, "parallel": {"engine": "deepspeed", "zero_stage": 2}})
    assert analytic.recipe_memory(stage2, 2)["transient_bytes"] == 0
