"""Incremental decoding against the full-sequence forward pass, absorbed against naive MLA, generate().

Tolerances: fp32 logits agree to atol 1e-5 / rtol 1e-4 (summation order only). bf16 logits (|logit|
< 1 here) agree to atol 2e-2: the naive and MHA paths reproduce the forward pass bit for bit on
CPU, the absorbed MLA step multiplies q_nope·W_UK before the cache instead of W_UK·c_kv after,
which rounds differently in bf16 (observed max |Δ| 4e-3, two bf16 ulps at 0.5).
"""
from __future__ import annotations

import pytest
import torch
from conftest import RECIPES
from tiny_variants import VARIANTS, tiny_model

from scaletool.config import RecipeError, load_recipe
from scaletool.decode.generate import generate, prefill, sample
from scaletool.model import build_model
from scaletool.model.attention import DecodeMode
from scaletool.model.cache import make_caches

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=0.0)}


def _incremental_logits(model, cfg, mode, tokens, split, dtype):
    """Prefill tokens[:, :split] in chunks of 5 (so later chunks attend to a cached prefix), then one step per token."""
    B, T = tokens.shape
    caches = make_caches(cfg, B, T, dtype=dtype, device="cpu", mla_mode=mode)
    m = DecodeMode(mode)
    chunks = [model.step(tokens[:, s:min(s + 5, split)], s, caches, m, all_logits=True) for s in range(0, split, 5)]
    steps = [model.step(tokens[:, i:i + 1], i, caches, m) for i in range(split, T)]
    return torch.cat(chunks + [torch.stack(steps, 1)], 1)


@pytest.mark.parametrize("label", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_incremental_decoding_reproduces_the_full_forward(label, dtype):
    cfg, model, mode = tiny_model(label)
    model = model.to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens).float()
    inc = _incremental_logits(model, cfg, mode, tokens, 13, dtype).float()
    torch.testing.assert_close(inc, full, **TOL[dtype])


def test_absorbed_mla_reproduces_naive_mla_step_by_step():
    cfg, model, _ = tiny_model("mla")
    tokens = torch.randint(0, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    absorbed = make_caches(cfg, 3, 20, dtype=torch.float32, device="cpu", mla_mode="absorbed")
    naive = make_caches(cfg, 3, 20, dtype=torch.float32, device="cpu", mla_mode="naive")
    naive_mode = DecodeMode("naive")
    torch.testing.assert_close(prefill(model, tokens[:, :8], absorbed),
                               prefill(model, tokens[:, :8], naive, mode=naive_mode))
    for i in range(8, 20):
        a, n = model.step(tokens[:, i:i + 1], i, absorbed), model.step(tokens[:, i:i + 1], i, naive, naive_mode)
        torch.testing.assert_close(a, n, **TOL[torch.float32])
    # The absorbed cache really is the latent: (32 + 8) numbers per token and layer against 4·(24 + 16).
    assert sum(b.numel() for b in absorbed.buffers()) * 4 == sum(b.numel() for b in naive.buffers())


@pytest.mark.parametrize("label", list(VARIANTS))
def test_greedy_generate_continues_with_the_forward_pass_argmax(label):
    cfg, model, mode = tiny_model(label)
    prompt = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    out = generate(model, prompt, 9, mla_mode=mode, chunk=4)
    assert out.shape == (2, 16) and torch.equal(out[:, :7], prompt)
    with torch.no_grad():
        teacher = model(out[:, :-1]).argmax(-1)  # the argmax after every prefix of the generated sequence
    assert torch.equal(out[:, 7:], teacher[:, 6:])


@pytest.mark.slow  # among the slowest of the rest (tens of seconds on a busy 2-core machine)
def test_sampling_is_seeded_and_top_k_limits_the_choices():
    cfg, model, _ = tiny_model("mla")
    prompt = torch.randint(0, cfg.vocab_size, (4, 5), generator=torch.Generator().manual_seed(4))
    a = generate(model, prompt, 12, temperature=1.0, top_k=20, seed=7)
    assert torch.equal(a, generate(model, prompt, 12, temperature=1.0, top_k=20, seed=7))
    assert not torch.equal(a, generate(model, prompt, 12, temperature=1.0, top_k=20, seed=8))
    assert not torch.equal(a, generate(model, prompt, 12))  # random weights: sampling departs from greedy
    assert torch.equal(generate(model, prompt, 12, temperature=0.7, top_k=1, seed=9), generate(model, prompt, 12))
    logits = torch.randn(2000, 50, generator=torch.Generator().manual_seed(5))
    picks = sample(logits, temperature=2.0, top_k=3, generator=torch.Generator().manual_seed(6))
    top3 = logits.topk(3, dim=-1).indices
    assert (picks[:, None] == top3).any(-1).all()
    assert len(picks.unique()) > 3  # not always the same column: the choice is random within the top 3


def test_generation_stops_at_the_end_token_and_pads_after_it():
    cfg, model, _ = tiny_model("mqa")
    prompt = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(8))
    free = generate(model, prompt, 40)
    end = int(free[0, 9])  # the fourth generated token becomes the end token
    first = int((free[0, 6:] == end).nonzero()[0])
    out = generate(model, prompt, 40, end_token=end)
    assert out.shape[1] < free.shape[1]  # stopped early (checked every 16 steps)
    assert torch.equal(out[0, :7 + first], free[0, :7 + first])
    assert (out[0, 6 + first:] == end).all()


def test_decoding_past_max_seq_len_extends_rope():
    cfg, model, _ = tiny_model("mla", **{"model.max_seq_len": 16, "train.seq_len": 16})
    prompt = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(9))
    caches = make_caches(cfg, 1, 24, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="extend_positions"):
        prefill(model, torch.cat([prompt, prompt], 1), caches)
    out = generate(model, prompt, 10)
    assert out.shape == (1, 22) and model.rope.max_seq_len == 22
    with torch.no_grad():
        teacher = model(out[:, :-1]).argmax(-1)  # the forward pass reads the same extended table
    assert torch.equal(out[:, 12:], teacher[:, 11:])


def test_regression_recipes_are_refused_with_one_line():
    cfg = load_recipe(RECIPES / "price-transformer.yaml").model
    model = build_model(cfg, "cpu", seed=0)
    with pytest.raises(RecipeError, match="decode is for task=lm"):
        generate(model, torch.zeros(1, 4, dtype=torch.long), 2)


@pytest.mark.parametrize("rope", ["shared", "per_head"])
def test_every_decode_mode_of_mla_gives_the_same_logits_step_by_step(rope):
    """absorbed, expand and naive are one attention computed three ways; per_head has no absorbed form."""
    cfg, model, _ = tiny_model("mla" if rope == "shared" else "mla-per_head")
    modes = ("absorbed", "expand", "naive") if rope == "shared" else ("expand", "naive")
    tokens = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(5))
    caches = {m: make_caches(cfg, 2, 14, dtype=torch.float32, device="cpu", mla_mode=m) for m in modes}
    first = [prefill(model, tokens[:, :6], caches[m], mode=DecodeMode(m)) for m in modes]
    for i in range(6, 14):
        out = [model.step(tokens[:, i:i + 1], i, caches[m], DecodeMode(m, "torch")) for m in modes]
        for o in out[1:]:
            torch.testing.assert_close(o, out[0], **TOL[torch.float32])
    for f in first[1:]:
        torch.testing.assert_close(f, first[0], **TOL[torch.float32])


def test_per_head_rope_mla_refuses_the_absorbed_mode_with_the_reason():
    cfg, model, _ = tiny_model("mla-per_head")
    with pytest.raises(ValueError, match="mla_rope=per_head cannot absorb W_UK into the query: each cached key's "
                                         "RoPE part is RoPE_t"):
        DecodeMode("absorbed").resolved(cfg)
    caches = make_caches(cfg, 1, 8, dtype=torch.float32, device="cpu")  # the default: expand
    with pytest.raises(ValueError, match="cannot absorb"):
        model.step(torch.zeros(1, 1, dtype=torch.long), 0, caches, DecodeMode("absorbed"))
    assert DecodeMode().resolved(cfg).mla == "expand" and DecodeMode().resolved(tiny_model("mla")[0]).mla == "absorbed"
    with pytest.raises(ValueError, match="mla_mode expand is for attention=mla recipes; this one is mha"):
        DecodeMode("expand").resolved(tiny_model("mha")[0])
