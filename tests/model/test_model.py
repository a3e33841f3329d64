"""The model family: shapes, SDPA against the plain softmax reference, and learning on CPU."""
from __future__ import annotations

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
    cos, sin = model.rope(0, 11)
    probs = attn.probs(x, cos, sin)  # (B, H, T, T)
    assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
    assert probs[..., 0, 1:].abs().max() == 0  # causal: the first token sees only itself
    q, k, v = attn.qkv(x, cos, sin)
    if v.shape[2] != probs.shape[1]:  # GQA/MQA: each KV head serves a group of query heads
        v = v.repeat_interleave(probs.shape[1] // v.shape[2], dim=2)
    ref = torch.einsum("bhts,bshd->bthd", probs, v).reshape(2, 11, -1)
    wo = attn.wo
    assert torch.allclose(attn(x, cos, sin), wo(ref), atol=1e-5)


def test_rope_is_relative():
    """Rotated q·k depends only on the position difference."""
    from scaletool.model.layers import RotaryEmbedding, apply_rope
    rope = RotaryEmbedding(8, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def dot(i, j):
        ci, si = rope(i, 1)
        cj, sj = rope(j, 1)
        return (apply_rope(q, ci, si) * apply_rope(k, cj, sj)).sum()
    assert torch.allclose(dot(5, 2), dot(40, 37), atol=1e-5)
    assert not torch.allclose(dot(5, 2), dot(5, 4), atol=1e-3)


@pytest.mark.parametrize("name", list(ATTN))
def test_lm_loss_decreases(name):
    torch.manual_seed(0)
    cfg = small(**ATTN[name])
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, cfg.vocab_size, (4, 16))  # one fixed batch: the model must fit it
    losses = []
    for _ in range(15):
        loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


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
    cos, sin = model.rope(0, 12)
    probs = model.layers[0].attn.probs(h, cos, sin, causal=model.causal)
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
