"""The MoE FFN: parameter counts, routing, the balance loss, batched vs reference dispatch, FLOP counts."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_counted_exactly

from scaletool import analytic
from scaletool.config import RecipeError, recipe_from_dict
from scaletool.measure.count import count
from scaletool.model import build_model
from scaletool.model.moe import MoE, expert_load_metrics

BASE = {"d_model": 32, "n_layers": 3, "n_heads": 4, "intermediate_size": 48, "vocab_size": 61, "max_seq_len": 16,
        "dtype": "fp32", "ffn": "moe", "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "moe_intermediate_size": 24, "first_k_dense_replace": 1}


def cfg_of(**kw):
    return recipe_from_dict({"model": {**BASE, **kw}}).model


def moe_layer(seed=0, **kw) -> MoE:
    model = build_model(cfg_of(**kw), seed=seed)
    return model.layers[-1].ffn


@pytest.mark.parametrize("kw", [
    {},
    {"n_shared_experts": 0, "first_k_dense_replace": 0, "attention": "mla", "kv_lora_rank": 16},
    {"n_routed_experts": 12, "num_experts_per_tok": 3, "n_shared_experts": 2, "moe_intermediate_size": 20,
     "scoring_func": "sigmoid", "n_group": 4, "topk_group": 2, "tie_embeddings": True},
    {"task": "regression", "n_layers": 2, "first_k_dense_replace": 1},
])
def test_param_counts_match_closed_forms(kw):
    cfg = cfg_of(**kw)
    model = build_model(cfg, device="meta")
    counts = analytic.param_counts(cfg)
    assert model.num_params() == counts["total"]
    d, E, k, i, s = cfg.d_model, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_shared_experts
    moe_layer_params = d * E + E * 3 * d * i + 3 * d * s * i  # gate + routed + one shared SwiGLU of s·i
    moe = model.layers[-1].ffn
    assert sum(p.numel() for p in moe.parameters()) == moe_layer_params
    n_moe = cfg.n_layers - cfg.first_k_dense_replace
    dense_ffn = 3 * d * cfg.intermediate_size
    assert counts["ffn"] == n_moe * moe_layer_params + cfg.first_k_dense_replace * dense_ffn
    assert counts["active"] == counts["total"] - n_moe * (E - k) * 3 * d * i
    split = analytic.matmul_split(cfg)
    assert split["routed_total"] == n_moe * E * 3 * d * i and split["routed_active"] == n_moe * k * 3 * d * i
    assert analytic.matmul_params(cfg) == split["dense"] + split["routed_active"]
    # the router bias is a buffer: state, no gradient, not a parameter
    assert (moe.router_bias is not None) == (cfg.scoring_func == "sigmoid")
    assert all(b is not moe.router_bias for b in moe.parameters())


def test_capacity_convention():
    cfg = cfg_of(capacity_factor=1.25)
    assert analytic.expert_capacity(cfg, 100) == math.ceil(1.25 * 100 * 2 / 8) == 32
    assert analytic.expert_capacity(cfg_of(capacity_factor=100.0), 10) == 10  # never more than the tokens
    per_tok = analytic.flops_per_token(cfg, 16, tokens=100)
    expert_fwd = 2 * 3 * cfg.d_model * cfg.moe_intermediate_size
    extra = 2 * expert_fwd * (8 * 32 / 100 - 2)  # two MoE layers compute E·C/N - k experts too many per token
    assert per_tok["forward_full_computed"] - per_tok["forward_full"] == pytest.approx(extra)
    assert per_tok["train_full"] == 3 * per_tok["forward_full"]


def test_routing_sums_and_choices():
    torch.manual_seed(0)
    x = torch.randn(40, 32)
    # softmax, no renormalisation: the weights are the router probabilities of the chosen experts
    moe = moe_layer()
    idx, w, scores = moe.route(x)
    assert torch.allclose(scores.sum(-1), torch.ones(40))
    assert torch.equal(idx, scores.topk(2, -1).indices) and torch.allclose(w, scores.gather(1, idx))
    assert (idx[:, 0] != idx[:, 1]).all()
    # norm_topk_prob: the kept gates of each token sum to 1, then scale by routed_scaling_factor
    moe = moe_layer(norm_topk_prob=True, routed_scaling_factor=2.5)
    _, w, _ = moe.route(x)
    assert torch.allclose(w.sum(-1), torch.full((40,), 2.5))
    # sigmoid + bias: the bias steers the choice but does not enter the weights
    moe = moe_layer(scoring_func="sigmoid")
    moe.router_bias[5] = 10.0
    idx, w, scores = moe.route(x)
    assert (idx == 5).any(-1).all()
    assert torch.allclose(w, scores.gather(1, idx)) and (scores <= 1).all()
    # group-limited: every choice falls within topk_group of the n_group groups
    moe = moe_layer(scoring_func="sigmoid", n_group=4, topk_group=1)
    idx, _, _ = moe.route(x)
    groups = idx // 2  # 8 experts in 4 groups of 2
    assert (groups == groups[:, :1]).all()
    moe = moe_layer(n_group=4, topk_group=2, num_experts_per_tok=3)
    idx, _, scores = moe.route(x)
    best_groups = scores.view(40, 4, 2).amax(-1).topk(2, -1).indices
    assert all(set((idx[t] // 2).tolist()) <= set(best_groups[t].tolist()) for t in range(40))


def test_balance_loss_against_hand_computation():
    moe = moe_layer(aux_loss_alpha=0.1, scoring_func="sigmoid")
    B, T, E, k = 2, 5, 8, 2
    torch.manual_seed(1)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(B * T)])  # (N, k)
    scores = torch.rand(B * T, E)
    expected = 0.0
    for b in range(B):
        rows = range(b * T, (b + 1) * T)
        for i in range(E):
            f_i = E / (k * T) * sum(int(i in idx[t].tolist()) for t in rows)
            P_i = sum(float(scores[t, i] / scores[t].sum()) for t in rows) / T
            expected += f_i * P_i
    expected = 0.1 * expected / B
    assert moe.balance_loss(idx, scores, B).item() == pytest.approx(expected, rel=1e-5)
    # perfectly uniform routing (each expert picked once per sequence of 4 tokens) and scores give α·1
    uniform = (torch.arange(B * 4 * k) % E).view(B * 4, k)
    assert moe.balance_loss(uniform, torch.ones(B * 4, E), B).item() == pytest.approx(0.1)


def test_model_loss_includes_alpha_times_aux():
    torch.manual_seed(0)
    x = torch.randint(0, 61, (2, 16))
    plain = build_model(cfg_of(), seed=3)(x, x)
    model = build_model(cfg_of(aux_loss_alpha=0.01), seed=3)
    loss = model(x, x)
    layers = [b.ffn for b in model.layers if isinstance(b.ffn, MoE)]
    aux = sum(m.aux_loss for m in layers)
    assert len(layers) == 2 and aux.item() > 0
    assert loss.item() == pytest.approx(plain.item() + aux.item(), rel=1e-6)
    loss.backward()
    assert layers[0].gate.weight.grad is not None
    model.eval()
    model(x, x)
    assert all(m.aux_loss is None for m in layers)  # evaluation adds no balance loss


@pytest.mark.parametrize("kw", [{}, {"scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2, "topk_group": 1},
                                {"n_shared_experts": 0, "num_experts_per_tok": 1}])
def test_batched_dispatch_matches_reference_when_nothing_drops(kw):
    E, k = 8, kw.get("num_experts_per_tok", 2)
    moe = moe_layer(capacity_factor=E / k, **kw)  # C = N: no expert can overflow
    x = torch.randn(3, 10, 32, requires_grad=True)
    out = moe(x)
    assert moe.dropped.item() == 0 and moe.tokens_per_expert.sum().item() == k * 30
    ref = moe.reference(x)
    assert torch.allclose(out, ref, atol=1e-6)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), [x, moe.experts.w1, moe.gate.weight])
    ref_grads = torch.autograd.grad((ref * g).sum(), [x, moe.experts.w1, moe.gate.weight])
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_capacity_drops_are_counted_and_only_touch_dropped_tokens():
    moe = moe_layer(capacity_factor=0.5, n_shared_experts=0)
    with torch.no_grad():  # every token picks expert 0 first and expert 1 second (x[..., 0] > 1 below)
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0], moe.gate.weight[1, 0] = 10.0, 5.0
    x = torch.randn(1, 16, 32)
    x[..., 0] = x[..., 0].abs() + 1
    out = moe(x)
    C = analytic.expert_capacity(moe.cfg, 16)
    load = moe.tokens_per_expert
    assert load[0].item() == 16 and load.sum().item() == 32
    assert moe.dropped.item() == int((load - C).clamp_min(0).sum())
    ref = moe.reference(x)
    # both experts fill in token order: the first C tokens are served in full, the rest not at all
    assert torch.allclose(out[0, :C], ref[0, :C], atol=1e-6)
    assert not torch.allclose(out[0, C:], ref[0, C:], atol=1e-4)
    metrics = expert_load_metrics(torch.nn.ModuleList([moe]))
    assert metrics["moe/dropped_fraction"] == pytest.approx(moe.dropped.item() / 32)
    assert metrics["moe/imbalance_ratio_max"] == pytest.approx(16 / 4)


def test_bias_update_moves_towards_balance():
    moe = moe_layer(scoring_func="sigmoid", bias_update_speed=0.001)
    moe.update_bias(torch.tensor([9, 0, 2, 2, 2, 1, 0, 0]), 0.001)  # mean load 2
    assert moe.router_bias[0] < 0 and moe.router_bias[1] > 0 and moe.router_bias[2] == 0


@pytest.mark.parametrize("kw", [{}, {"scoring_func": "sigmoid", "n_group": 2, "topk_group": 1, "capacity_factor": 0.7},
                                {"first_k_dense_replace": 0, "attention": "mla", "kv_lora_rank": 16}])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_flop_counters_agree_exactly_with_computed_flops(kw, device):
    r = recipe_from_dict({"model": {**BASE, **kw}})
    res = count(r, device=device, batch=2)
    f = res["flops"]
    assert_counted_exactly(res)
    # capacity above 1 computes padding beyond the useful top-k; below 1 it computes less (drops)
    assert (f["analytic"]["train_full_useful"] < f["analytic"]["train_full"]) == (r.model.capacity_factor > 1)


def test_trains_on_cpu():
    cfg = cfg_of(aux_loss_alpha=0.01)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (4, 16))
    losses = []
    for _ in range(8):
        loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("extra, message", [
    ({"num_experts_per_tok": 9}, "model.num_experts_per_tok: top-9 of 8 routed experts is impossible"),
    ({"n_routed_experts": 0}, "model.n_routed_experts: must be > 0 for ffn=moe"),
    ({"first_k_dense_replace": 3}, "model.first_k_dense_replace: 3 leaves no MoE layer (n_layers=3)"),
    ({"n_group": 3}, "model.n_group: 8 routed experts do not split into 3 groups"),
    ({"n_group": 4, "topk_group": 5}, "model.topk_group: 5 is more than n_group=4"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "does not fit in topk_group=1 groups of 2 experts"),
    ({"bias_update_speed": 0.001}, "model.bias_update_speed: the aux-loss-free bias belongs to scoring_func=sigmoid"),
])
def test_validation_lines(extra, message):
    with pytest.raises(RecipeError) as e:
        cfg_of(**extra)
    assert any(message in p for p in e.value.problems), e.value.problems


def test_expert_parallel_recipe_checks_and_memory():
    base = {"model": BASE, "parallel": {"engine": "fsdp"}}
    for parallel, message in [({"engine": "ddp", "expert_parallel": True}, "supported with engine=fsdp"),
                              ({"engine": "fsdp", "expert_parallel": True}, None)]:
        raw = {**base, "parallel": parallel}
        if message:
            with pytest.raises(RecipeError) as e:
                recipe_from_dict(raw)
            assert any(message in p for p in e.value.problems)
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"model": {**BASE, "ffn": "swiglu", **{k: 0 for k in ("n_routed_experts", "n_shared_experts",
                          "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace")}},
                          "parallel": {"engine": "fsdp", "expert_parallel": True}})
    assert any("needs model.ffn=moe" in p for p in e.value.problems)
    # FSDP's block all-gather leaves the expert-parallel experts out; the sharded states stay Ψ/N
    ep = recipe_from_dict({**base, "parallel": {"engine": "fsdp", "expert_parallel": True}})
    plain = recipe_from_dict(base)
    a, b = analytic.recipe_memory(ep, 4), analytic.recipe_memory(plain, 4)
    routed = analytic.moe_params(ep.model)["routed"]
    assert b["transient_bytes"] - a["transient_bytes"] == routed * (2 * 4 + 4 + 4)  # fp32: 2 gathered + grads
    assert a["optimizer_bytes"] == b["optimizer_bytes"]
