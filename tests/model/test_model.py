"""The model family: shapes, SDPA against the plain softmax reference, and learning on CPU, for every
attention kind, position encoding and norm placement."""
from __future__ import annotations

import math

import pytest
import torch

from scaletool.config import recipe_from_dict
from scaletool.model import build_model

ATTN = {
    "mha": {"attention": "mha"},
    "gqa": {"attention": "gqa", "n_kv_heads": 2},
    "mqa": {"attention": "mqa"},
    "mla": {"attention": "mla", "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12},
    "mla-q_lora": {"attention": "mla", "kv_lora_rank": 24, "q_lora_rank": 20},
    "mla-per_head": {"attention": "mla", "kv_lora_rank": 24, "mla_rope": "per_head", "q_lora_rank": 20},
    "mla-per_head-whole": {"attention": "mla", "kv_lora_rank": 24, "mla_rope": "per_head", "qk_nope_head_dim": 0,
                           "qk_rope_head_dim": 16},
    "gqa-alibi": {"attention": "gqa", "n_kv_heads": 2, "position_encoding": "alibi"},
}
# every position encoding and norm placement the MHA family can take (MLA: rope only, tested above)
ARCH = {
    "rope-post": {"norm_placement": "post"},
    "learned": {"position_encoding": "learned"},
    "sinusoidal": {"position_encoding": "sinusoidal"},
    "alibi": {"position_encoding": "alibi"},
    "none": {"position_encoding": "none"},
    "learned-post-layernorm": {"position_encoding": "learned", "norm_placement": "post", "norm": "layernorm",
                               "ffn": "gelu"},
}


def small(task="lm", **model):
    base = {"d_model": 64, "n_layers": 2, "n_heads": 4, "intermediate_size": 96, "vocab_size": 97,
            "max_seq_len": 32, "dtype": "fp32", "task": task}
    return recipe_from_dict({"model": {**base, **model}}).model


@pytest.mark.parametrize("name", list(ATTN))
def test_lm_shapes_and_backward(name):
    cfg = small(**ATTN[name])
    model = build_model(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (3, 17))
    assert model(x).shape == (3, 17, cfg.vocab_size)
    loss = model(x, x)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", list(ATTN))
def test_sdpa_matches_plain_softmax_reference(name):
    """The fused path and the reference softmax(QKᵀ·scale)·V give the same attention output."""
    cfg = small(**ATTN[name])
    model = build_model(cfg, seed=1).eval()
    attn = model.layers[0].attn
    x = torch.randn(2, 11, cfg.d_model)
    positions = model.positions(0, 11, 11, x.dtype)
    probs = attn.probs(x, positions)  # (B, H, T, T)
    assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
    assert probs[..., 0, 1:].abs().max() == 0  # causal: the first token sees only itself
    q, k, v = attn.qkv(x, positions)
    if v.shape[2] != probs.shape[1]:  # GQA/MQA: each KV head serves a group of query heads
        v = v.repeat_interleave(probs.shape[1] // v.shape[2], dim=2)
    ref = torch.einsum("bhts,bshd->bthd", probs, v).reshape(2, 11, -1)
    wo = attn.wo
    assert torch.allclose(attn(x, positions), wo(ref), atol=1e-5)


def test_rope_is_relative():
    """Rotated q·k depends only on the position difference."""
    from scaletool.model.positions import RotaryEmbedding, apply_rope
    rope = RotaryEmbedding(8, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def dot(i, j):
        ci, si = rope(i, 1)
        cj, sj = rope(j, 1)
        return (apply_rope(q, ci, si) * apply_rope(k, cj, sj)).sum()
    assert torch.allclose(dot(5, 2), dot(40, 37), atol=1e-5)
    assert not torch.allclose(dot(5, 2), dot(5, 4), atol=1e-3)


def _fit(cfg, steps=15, lr=3e-3):
    """Losses of AdamW steps on one fixed batch (the model must fit it)."""
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(ATTN))
def test_lm_loss_decreases(name):
    losses = _fit(small(**ATTN[name]))
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("name", list(ARCH))
def test_each_position_encoding_and_post_norm_train(name):
    """Post-LN and each position encoding train on CPU (loss falls on a fixed batch)."""
    losses = _fit(small(**ARCH[name]))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("name", list(ARCH))
def test_every_position_encoding_matches_the_softmax_reference(name):
    """The block's attention through SDPA (with ALiBi's bias where there is one) equals softmax(QKᵀ + bias)·V."""
    cfg = small(**ARCH[name])
    model = build_model(cfg, seed=1).eval()
    attn, x = model.layers[1].attn, torch.randn(2, 11, cfg.d_model)
    positions = model.positions(0, 11, 11, x.dtype)
    probs = attn.probs(x, positions)
    _, _, v = attn.qkv(x, positions)
    ref = attn.wo(torch.einsum("bhts,bshd->bthd", probs, v).reshape(2, 11, -1))
    torch.testing.assert_close(attn(x, positions), ref, atol=1e-5, rtol=1e-4)
    assert probs[..., 0, 1:].abs().max() == 0


def test_post_norm_normalises_after_each_residual_add_and_has_no_final_norm():
    """norm_placement=post is Vaswani et al.'s LayerNorm(x + Sublayer(x)); the model's output norm is the
    last block's (no separate final norm: a norm of a normalised stream)."""
    cfg = small(norm_placement="post", norm="layernorm", position_encoding="learned")
    model = build_model(cfg, seed=2).eval()
    block, x = model.layers[0], torch.randn(2, 7, cfg.d_model)
    positions = model.positions(0, 7, 7, x.dtype)
    h = block.attn_norm(x + block.attn(x, positions))
    torch.testing.assert_close(block(x, positions), block.ffn_norm(h + block.ffn(h)))
    assert isinstance(model.norm, torch.nn.Identity)
    out = model.hidden_states(torch.randint(0, cfg.vocab_size, (2, 7)))[-1]
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 7), atol=1e-5, rtol=0)  # LayerNorm's weight 1, bias 0
    pre = small(norm="layernorm", position_encoding="learned")
    assert build_model(pre, "meta").num_params() - build_model(cfg, "meta").num_params() == 2 * cfg.d_model


def test_position_tables_are_added_to_the_embeddings():
    """learned: a trained max_seq_len × d_model table (GPT-2), counted out of the non-embedding parameters;
    sinusoidal: Vaswani's fixed table, no parameters, token embeddings scaled by sqrt(d_model)."""
    learned = build_model(small(position_encoding="learned"), seed=0).eval()
    tokens = torch.randint(0, 97, (1, 5))
    h = learned.embed(tokens)
    torch.testing.assert_close(h, learned.tok_embeddings(tokens) + learned.pos_embeddings.weight[:5])
    assert learned.num_params() - learned.num_params(non_embedding=True) == (97 + 97 + 32) * 64
    fixed = build_model(small(position_encoding="sinusoidal"), seed=0).eval()
    table = fixed.pos_table.table
    p, i = 7, 5  # PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(same)
    assert table[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 64)), abs=1e-6)
    assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / 64)), abs=1e-6)
    torch.testing.assert_close(fixed.embed(tokens), fixed.tok_embeddings(tokens) * 8.0 + table[:5])
    assert not any("pos" in n for n, _ in fixed.named_parameters()) and "pos_table.table" not in fixed.state_dict()


def test_alibi_slopes_and_bias_follow_the_paper():
    """Press et al. 2022: slopes 2^-1..2^-8 for 8 heads (the non-power-of-two rule for 12); the bias is
    -slope·distance, -inf on future keys, symmetric without the causal mask."""
    from scaletool.model.positions import alibi_bias, alibi_slopes
    slopes = alibi_slopes(8)
    torch.testing.assert_close(slopes, torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    twelve = alibi_slopes(12)  # 8 from the power of two below, then every other one of 16
    torch.testing.assert_close(twelve[8:], torch.tensor([2.0 ** -(0.5 + i) for i in range(4)]))
    bias = alibi_bias(slopes, torch.arange(4), 4, causal=True)[0]  # (H, T, S)
    assert bias[0, 3, 1].item() == -0.5 * 2 and torch.isinf(bias[:, 1, 2]).all() and (bias.diagonal(0, 1, 2) == 0).all()
    sym = alibi_bias(slopes, torch.arange(4), 4, causal=False)[0]
    torch.testing.assert_close(sym, sym.transpose(1, 2))


@pytest.mark.parametrize("encoding", ["none", "rope", "alibi", "learned", "sinusoidal"])
def test_only_nope_is_blind_to_the_order_of_the_prefix(encoding):
    """One causal layer without positions sees its prefix as a set: swapping two earlier tokens leaves
    the last position's logits unchanged. Every position encoding breaks that."""
    cfg = small(position_encoding=encoding, n_layers=1)
    model = build_model(cfg, seed=3).eval()
    attn = model.layers[0].attn
    with torch.no_grad():  # sharp scores: near-uniform attention would average any order away
        attn.wq.weight.mul_(30)
        attn.wk.weight.mul_(30)
    x = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    swapped = x[:, [1, 0, 2, 3, 4, 5]]
    with torch.no_grad():
        a, b = model(x)[0, -1], model(swapped)[0, -1]
    change = ((a - b).norm() / a.norm()).item()
    assert change < 1e-5 if encoding == "none" else change > 1e-3, change


def test_learned_positions_cannot_grow_but_computed_tables_do():
    learned = build_model(small(position_encoding="learned"), seed=0)
    with pytest.raises(ValueError, match="learned: the table has max_seq_len=32 rows"):
        learned.extend_positions(40)
    assert learned.extend_positions(32) is None
    fixed = build_model(small(position_encoding="sinusoidal"), seed=0)
    before = fixed.pos_table.table.clone()
    assert fixed.extend_positions(40) == 40 and fixed.pos_table.table.shape == (40, 64)
    torch.testing.assert_close(fixed.pos_table.table[:32], before)  # the same function, longer
    assert build_model(small(position_encoding="alibi"), seed=0).extend_positions(10**4) is None  # no table at all


@pytest.mark.slow  # among the slowest of the rest (tens of seconds on a busy 2-core machine)
@pytest.mark.parametrize("name", ["mha", "mla"])
def test_regression_task(name):
    torch.manual_seed(0)
    cfg = small("regression", max_seq_len=180, **ATTN[name])
    model = build_model(cfg, seed=0)
    x = torch.randn(8, 180, 20)
    y = x[:, -10:, 0] * 0.5  # a learnable target: the last ten values of feature 0
    preds, feats = model(x, return_features=True)
    assert preds.shape == (8, 10) and feats.shape == (8, cfg.d_model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(15):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_regression_is_not_causal():
    """Changing the last time step changes what the first position attends to (no causal mask)."""
    cfg = small("regression", max_seq_len=180, **ATTN["mha"])
    model = build_model(cfg, seed=0).eval()
    x = torch.randn(1, 12, 20)
    h = model.embed(x)
    probs = model.layers[0].attn.probs(h, model.positions(0, 12, 12, h.dtype), causal=model.causal)
    assert (probs[0, :, 0, 1:] > 0).all()


def test_meta_build_allocates_nothing():
    cfg = small(d_model=8192, n_heads=64, n_layers=4, intermediate_size=28672, vocab_size=128000)
    model = build_model(cfg, "meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() > 2_000_000_000


def test_init_is_seeded():
    cfg = small(**ATTN["mla"])
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attn.wkv_a.weight"], sc["layers.0.attn.wkv_a.weight"])


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_attention_probs_are_the_weights_its_attention_uses(placement):
    """What the dynamics monitors read: the probabilities of the block's own attention input (norm(x) pre-norm,
    x post-norm), which with the values reproduce the block's attention output."""
    cfg = small(norm_placement=placement, position_encoding="alibi")
    model = build_model(cfg, seed=5).eval()
    block, x = model.layers[0], torch.randn(2, 9, cfg.d_model)
    positions = model.positions(0, 9, 9, x.dtype)
    probs = block.attention_probs(x, positions)
    h = x if placement == "post" else block.attn_norm(x)
    _, _, v = block.attn.qkv(h, positions)
    ref = block.attn.wo(torch.einsum("bhts,bshd->bthd", probs, v).reshape(2, 9, -1))
    torch.testing.assert_close(block.attn(h, positions), ref, atol=1e-5, rtol=1e-4)
    other = block.attn.probs(block.attn_norm(x) if placement == "post" else x, positions)
    assert not torch.allclose(other, probs, atol=1e-4)  # the other placement's input gives other weights


@pytest.mark.parametrize("name,extra,groups", [
    *[(f"{k}-swiglu", v, 2) for k, v in ATTN.items()],
    ("mha-gelu", {"attention": "mha", "ffn": "gelu"}, 1),
    ("mla-moe-shared", {**ATTN["mla-q_lora"], "ffn": "moe", "n_routed_experts": 4, "num_experts_per_tok": 2,
                        "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1}, 2),
])
def test_joined_projections_compute_the_same_forward(name, extra, groups):
    """Transformer.join_projections: every group of projections reading one input becomes one Linear, the
    forward (training path) and the parameter count stay what they were; a GELU MLP has nothing to join."""
    model = build_model(small(**extra), "cpu", seed=0).eval()
    x = torch.randint(97, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, n = model(x), model.num_params()
        assert model.join_projections() == groups * 2
        after = model(x)
    before, after = (t[0] if isinstance(t, tuple) else t for t in (before, after))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert model.num_params() == n
