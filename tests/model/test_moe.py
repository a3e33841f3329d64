"""The MoE FFN: parameter counts, routing, the balance loss, dropless and capacity dispatch against a
per-token reference (outputs and gradients), FLOP counts, and the grouped GEMM on CUDA."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_counted_exactly

from scaletool.analytic import expert_parallel
from scaletool.analytic.flops import flops_per_token, routed_experts_computed
from scaletool.analytic.memory import recipe_memory
from scaletool.analytic.params import matmul_params, matmul_split, moe_params, param_counts
from scaletool.analytic.timeline import _activation_bytes_per_token_per_layer
from scaletool.config import RecipeError, expert_capacity, recipe_from_dict
from scaletool.measure.count import count
from scaletool.model import build_model
from scaletool.model.moe import MoE, expert_load_metrics, segment_matmul

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
    counts = param_counts(cfg)
    assert model.num_params() == counts["total"]
    d, E, k, i, s = cfg.d_model, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_shared_experts
    moe_layer_params = d * E + E * 3 * d * i + 3 * d * s * i  # gate + routed + one shared SwiGLU of s·i
    moe = model.layers[-1].ffn
    assert sum(p.numel() for p in moe.parameters()) == moe_layer_params
    n_moe = cfg.n_layers - cfg.first_k_dense_replace
    dense_ffn = 3 * d * cfg.intermediate_size
    assert counts["ffn"] == n_moe * moe_layer_params + cfg.first_k_dense_replace * dense_ffn
    assert counts["active"] == counts["total"] - n_moe * (E - k) * 3 * d * i
    split = matmul_split(cfg)
    assert split["routed_total"] == n_moe * E * 3 * d * i and split["routed_active"] == n_moe * k * 3 * d * i
    assert matmul_params(cfg) == split["dense"] + split["routed_active"]
    # the router bias is a buffer: state, no gradient, not a parameter
    assert (moe.router_bias is not None) == (cfg.scoring_func == "sigmoid")
    assert all(b is not moe.router_bias for b in moe.parameters())


def test_capacity_convention():
    cfg = cfg_of(moe_dispatch="capacity", capacity_factor=1.25)
    assert expert_capacity(cfg, 100) == math.ceil(1.25 * 100 * 2 / 8) == 32
    assert expert_capacity(cfg_of(moe_dispatch="capacity", capacity_factor=100.0), 10) == 10  # never more
    per_tok = flops_per_token(cfg, 16, tokens=100)
    expert_fwd = 2 * 3 * cfg.d_model * cfg.moe_intermediate_size
    extra = 2 * expert_fwd * (8 * 32 / 100 - 2)  # two MoE layers compute E·C/N - k experts too many per token
    assert per_tok["forward_full_computed"] - per_tok["forward_full"] == pytest.approx(extra)
    assert per_tok["train_full"] == 3 * per_tok["forward_full"]


def test_dropless_convention_computes_exactly_top_k():
    """Dropless: computed FLOPs equal useful ones at any dispatch size, and the activation estimate keeps
    k dispatch slots per token where capacity keeps E·C/N ≈ capacity_factor·k."""
    dropless, capacity = cfg_of(), cfg_of(moe_dispatch="capacity", capacity_factor=1.25)
    for tokens in (None, 100, 4096):
        per_tok = flops_per_token(dropless, 16, tokens=tokens)
        assert per_tok["train_causal_computed"] == per_tok["train_causal"]
        assert per_tok["moe"]["routed_experts_per_token_computed"] == 2
    assert routed_experts_computed(capacity) == 2.5
    a = _activation_bytes_per_token_per_layer(dropless, moe=True)
    b = _activation_bytes_per_token_per_layer(capacity, moe=True)
    assert b - a == pytest.approx(4 * 0.5 * (32 + 4 * 24))  # fp32: half a slot more per token, d + 4·i each
    assert (moe_layer().expert_gemm(torch.float32), moe_layer(moe_dispatch="capacity").expert_gemm(torch.float32)) \
        == ("loop", "bmm")


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
    moe = moe_layer(moe_dispatch="capacity", capacity_factor=E / k, **kw)  # C = N: no expert can overflow
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
    moe = moe_layer(moe_dispatch="capacity", capacity_factor=0.5, n_shared_experts=0)
    with torch.no_grad():  # every token picks expert 0 first and expert 1 second (x[..., 0] > 1 below)
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0], moe.gate.weight[1, 0] = 10.0, 5.0
    x = torch.randn(1, 16, 32)
    x[..., 0] = x[..., 0].abs() + 1
    out = moe(x)
    C = expert_capacity(moe.cfg, 16)
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


def per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer by its definition, token by token: y_t = shared(x_t) + Σ_j g_tj · expert_{e_tj}(x_t)."""
    flat = x.reshape(-1, x.shape[-1])
    idx, weights, _ = moe.route(flat)
    rows = []
    for t in range(flat.shape[0]):
        y = sum(weights[t, j] * moe.experts.expert(int(idx[t, j]), flat[t:t + 1])[0] for j in range(moe.top_k))
        rows.append(y if moe.shared is None else y + moe.shared(flat[t:t + 1])[0])
    return torch.stack(rows).view_as(x)


def grads_of(moe: MoE, out: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    params = [x, moe.experts.w1, moe.experts.w2, moe.experts.w3, moe.gate.weight]
    return list(torch.autograd.grad((out * g).sum(), params))


@pytest.mark.parametrize("kw", [{}, {"scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2, "topk_group": 1,
                                     "routed_scaling_factor": 2.5},
                                {"n_shared_experts": 0, "num_experts_per_tok": 1}, {"num_experts_per_tok": 3}])
def test_dropless_matches_per_token_reference_outputs_and_gradients(kw):
    moe = moe_layer(seed=2, **kw)
    assert moe.cfg.moe_dispatch == "dropless"  # the default
    torch.manual_seed(3)
    x = torch.randn(2, 9, 32, requires_grad=True)
    out = moe(x)
    ref = per_token_reference(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    for a, b in zip(grads_of(moe, out, g, x), grads_of(moe, ref, g, x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    k = moe.top_k
    idx, _, _ = moe.route(x.detach().reshape(-1, 32))
    assert torch.equal(moe.tokens_per_expert, torch.bincount(idx.reshape(-1), minlength=8))
    assert moe.dropped.item() == 0 and moe.assignments == k * 18


def test_dropless_serves_every_token_where_capacity_drops():
    with torch.no_grad():  # every token picks expert 0 first and expert 1 second (x[..., 0] > 1 below)
        layers = [moe_layer(n_shared_experts=0, **kw) for kw in ({}, {"moe_dispatch": "capacity", "capacity_factor": 0.5})]
        for m in layers:
            m.gate.weight.zero_()
            m.gate.weight[0, 0], m.gate.weight[1, 0] = 10.0, 5.0
    x = torch.randn(1, 16, 32)
    x[..., 0] = x[..., 0].abs() + 1
    dropless, capacity = layers
    out = dropless(x)
    assert dropless.dropped.item() == 0 and dropless.tokens_per_expert[:2].tolist() == [16, 16]
    torch.testing.assert_close(out, per_token_reference(dropless, x), rtol=1e-5, atol=1e-6)
    capacity(x)
    assert capacity.dropped.item() > 0  # the same routing overflows the capacity buffer
    metrics = expert_load_metrics(torch.nn.ModuleList([dropless]))
    assert metrics["moe/dropped_fraction"] == 0 and metrics["moe/imbalance_ratio_max"] == pytest.approx(16 / 4)


def test_segment_matmul_loop_handles_empty_and_all_in_one_segments():
    torch.manual_seed(0)
    w = torch.randn(4, 6, 5)
    for counts in ([3, 0, 4, 1], [0, 0, 8, 0]):
        c = torch.tensor(counts)
        x = torch.randn(8, 6)
        expert = torch.repeat_interleave(torch.arange(4), c)
        want = torch.stack([x[r] @ w[expert[r]] for r in range(8)])
        torch.testing.assert_close(segment_matmul(x, w, c, "loop"), want)
    assert segment_matmul(torch.empty(8, 6, device="meta"), w.to("meta"), c.to("meta"), "loop").shape == (8, 5)


@pytest.mark.slow  # among the slowest of the rest (tens of seconds on a busy 2-core machine)
def test_dropless_grouped_path_captures_in_one_graph():
    """No host sync and no data-dependent shapes on the grouped path: Dynamo captures it in one graph
    with no break, where the loop path (the reference, which reads the counts) breaks at every
    segment split. The compiled grouped path agrees with the loop and runs backward. CPU:
    torch._grouped_mm's composite fallback, in bf16 (the only dtype its shape checks accept)."""
    moe = moe_layer(seed=1).to(torch.bfloat16)
    flat = torch.randn(20, 32, dtype=torch.bfloat16)
    idx, weights, _ = moe.route(flat)
    try:
        torch._grouped_mm(flat[:4], moe.experts.w1[:2], offs=torch.tensor([2, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as e:  # torch builds without the CPU fallback
        pytest.skip(f"torch._grouped_mm does not run on CPU here: {e}")
    graphs = {}
    for impl in ("grouped_mm", "loop"):
        torch._dynamo.reset()
        ex = torch._dynamo.explain(lambda f, i, w, impl=impl: moe.dispatch_dropless(f, i, w, impl=impl))(flat, idx, weights)
        graphs[impl] = (ex.graph_count, ex.graph_break_count)
    assert graphs["grouped_mm"] == (1, 0) and graphs["loop"][1] > 0, graphs
    torch._dynamo.reset()
    compiled = torch.compile(lambda f, i, w: moe.dispatch_dropless(f, i, w, impl="grouped_mm"),
                             fullgraph=True, backend="aot_eager")
    x = flat.clone().requires_grad_()
    out = compiled(x, idx, weights)
    torch.testing.assert_close(out, moe.dispatch_dropless(flat, idx, weights, impl="loop"), rtol=1e-2, atol=1e-3)
    out.sum().backward()
    assert x.grad is not None and moe.experts.w2.grad is not None


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="torch._grouped_mm's bf16 kernels need a Hopper (sm90+) GPU")
@pytest.mark.parametrize("skew", [False, True])
def test_grouped_mm_equals_loop_on_cuda(skew):
    """bf16 on Hopper: the grouped GEMM path equals the per-segment loop (outputs and gradients), at
    shapes with empty experts when skewed."""
    cfg = cfg_of(d_model=256, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=2)
    moe = build_model(cfg, "cuda", seed=0).layers[-1].ffn.to(torch.bfloat16)
    torch.manual_seed(0)
    flat = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    if skew:  # most tokens to a few experts, some experts empty
        with torch.no_grad():
            moe.gate.weight[:4] += 0.5 * flat[:1]
    idx, weights, _ = moe.route(flat)
    assert moe.experts.impl_for(flat) == "grouped_mm"
    results = {}
    for impl in ("grouped_mm", "loop"):
        x = flat.clone().requires_grad_()
        out = moe.dispatch_dropless(x, idx, weights, impl=impl)
        g = torch.randn_like(out, generator=torch.Generator("cuda").manual_seed(1))
        grads = torch.autograd.grad((out.float() * g.float()).sum(), [x, moe.experts.w1, moe.experts.w2, moe.experts.w3])
        results[impl] = [out, *grads]
    for a, b in zip(results["grouped_mm"], results["loop"]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_bias_update_moves_towards_balance():
    moe = moe_layer(scoring_func="sigmoid", bias_update_speed=0.001)
    moe.update_bias(torch.tensor([9, 0, 2, 2, 2, 1, 0, 0]), 0.001)  # mean load 2
    assert moe.router_bias[0] < 0 and moe.router_bias[1] > 0 and moe.router_bias[2] == 0


@pytest.mark.parametrize("kw", [{}, {"moe_dispatch": "capacity"},
                                {"moe_dispatch": "capacity", "scoring_func": "sigmoid", "n_group": 2, "topk_group": 1,
                                 "capacity_factor": 0.7},
                                {"first_k_dense_replace": 0, "attention": "mla", "kv_lora_rank": 16}])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_flop_counters_agree_exactly_with_computed_flops(kw, device):
    r = recipe_from_dict({"model": {**BASE, **kw}})
    res = count(r, device=device, batch=2)
    f = res["flops"]
    assert_counted_exactly(res)
    useful, computed = f["analytic"]["train_full_useful"], f["analytic"]["train_full"]
    if r.model.moe_dispatch == "dropless":  # exactly k experts per token: computed is useful
        assert computed == useful
    else:  # capacity above 1 computes padding beyond the useful top-k; below 1 it computes less (drops)
        assert (useful < computed) == (r.model.capacity_factor > 1)


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
    ({"capacity_factor": 2.0}, "model.capacity_factor: only used by moe_dispatch=capacity"),
    ({"moe_dispatch": "padded"}, "model.moe_dispatch: Input should be 'dropless' or 'capacity'"),
])
def test_validation_lines(extra, message):
    with pytest.raises(RecipeError) as e:
        cfg_of(**extra)
    assert any(message in p for p in e.value.problems), e.value.problems


def test_expert_parallel_recipe_checks_and_memory():
    base = {"model": {**BASE, "moe_dispatch": "capacity"}, "parallel": {"engine": "fsdp"}}
    for raw, message in [({**base, "parallel": {"engine": "ddp", "expert_parallel": True}}, "supported with engine=fsdp"),
                         ({**base, "parallel": {"engine": "fsdp", "expert_parallel": True, "expert_parallel_degree": 3}},
                          "parallel.expert_parallel_degree: 8 routed experts do not split over 3 ranks"),
                         ({**base, "parallel": {"engine": "fsdp", "expert_parallel_degree": 2}},
                          "parallel.expert_parallel_degree: needs parallel.expert_parallel=true")]:
        with pytest.raises(RecipeError) as e:
            recipe_from_dict(raw)
        assert any(message in p for p in e.value.problems), e.value.problems
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"model": {**BASE, "ffn": "swiglu", **{k: 0 for k in ("n_routed_experts", "n_shared_experts",
                          "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace")}},
                          "parallel": {"engine": "fsdp", "expert_parallel": True}})
    assert any("needs model.ffn=moe" in p for p in e.value.problems)
    # FSDP's block all-gather leaves the expert-parallel experts out; the sharded states stay Ψ/N
    ep = recipe_from_dict({**base, "parallel": {"engine": "fsdp", "expert_parallel": True}})
    plain = recipe_from_dict(base)
    a, b = recipe_memory(ep, 4), recipe_memory(plain, 4)
    routed = moe_params(ep.model)["routed"]
    # ... and the all-to-all's receive and return buffers of one layer come in (analytic.expert_parallel)
    buffers = expert_parallel.transient_bytes(ep.model, ep.train.micro_batch_size * ep.seq_len, 4)
    assert buffers > 0
    assert b["transient_bytes"] - a["transient_bytes"] == routed * (2 * 4 + 4 + 4) - buffers  # fp32: 2 gathered + grads
    assert a["optimizer_bytes"] == b["optimizer_bytes"]
