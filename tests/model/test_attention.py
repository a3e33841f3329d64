"""The torch side of each attention kind: found through the kind's name, and its tensor-parallel plan
correct (the heads' shards, summed after the row-parallel projection, give the unsharded output)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from scaletool.config import recipe_from_dict
from scaletool.kinds.attention import ATTENTION_KINDS, attention_kind
from scaletool.model import build_model
from scaletool.model.attention import ATTENTION_MODULES, DecodeMode, tp_plan
from scaletool.model.cache import make_caches

SHAPES = {
    "mha": {"attention": "mha", "qkv_bias": True},
    "gqa": {"attention": "gqa", "n_kv_heads": 2, "position_encoding": "alibi"},
    "mla": {"attention": "mla", "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12},
    "mla-q_lora": {"attention": "mla", "kv_lora_rank": 24, "q_lora_rank": 20},
    "mla-per_head": {"attention": "mla", "kv_lora_rank": 24, "mla_rope": "per_head"},
}


def small(**model):
    base = {"d_model": 64, "n_layers": 1, "n_heads": 4, "intermediate_size": 96, "vocab_size": 97,
            "max_seq_len": 32, "dtype": "fp32"}
    return recipe_from_dict({"model": {**base, **model}}).model


def test_every_kind_has_a_module_and_a_plan_over_its_projections():
    for name in ATTENTION_KINDS:
        cfg = small(**{**SHAPES.get(name, {}), "attention": name})
        attn = build_model(cfg, "meta").layers[0].attn
        assert type(attn) is ATTENTION_MODULES[name]
        linears = {n for n, m in attn.named_modules() if isinstance(m, nn.Linear)}
        plan = tp_plan(cfg)
        assert set(plan) <= linears and set(plan.values()) <= {"colwise", "rowwise"}
        assert list(plan.values()).count("rowwise") == 1  # one all-reduce per attention, after wo


def _shard(attn: nn.Module, plan: dict[str, str], rank: int, degree: int) -> nn.Module:
    """This rank's attention under ``plan``: colwise projections keep their slice of output features
    (and bias), rowwise ones their slice of input features, the rest stay whole."""
    part = copy.deepcopy(attn)
    for name, style in plan.items():
        lin = getattr(part, name)
        dim = 0 if style == "colwise" else 1
        n = lin.weight.shape[dim] // degree
        lin.weight = nn.Parameter(lin.weight.narrow(dim, rank * n, n).clone())
        if lin.bias is not None and style == "colwise":
            lin.bias = nn.Parameter(lin.bias.narrow(0, rank * n, n).clone())
    return part


@pytest.mark.parametrize("name", list(SHAPES))
def test_head_shards_of_the_plan_sum_to_the_whole_attention(name):
    """What a TP engine applying ``tp_plan`` computes, on one process: every rank runs its heads, the
    row-parallel wo gives partial sums, their sum (the all-reduce) is the unsharded output. Training
    forward and, for MLA, the absorbed decode step (its latent cache replicated on every rank)."""
    cfg = small(**SHAPES[name])
    assert attention_kind(cfg).tp_problems(cfg, 2) == []
    model = build_model(cfg, seed=0).eval()
    attn, plan = model.layers[0].attn, tp_plan(cfg)
    positions = model.positions(0, 9, 9, torch.float32)
    if name == "gqa":  # the ALiBi bias is per head: each rank takes its heads' rows
        half = positions.bias.shape[1] // 2
        biases = [positions.bias[:, r * half:(r + 1) * half] for r in range(2)]
    x = torch.randn(2, 9, cfg.d_model, generator=torch.Generator().manual_seed(1))
    shards = [_shard(attn, plan, r, 2) for r in range(2)]
    with torch.no_grad():
        parts = [s(x, positions if name != "gqa" else type(positions)(bias=biases[r])) for r, s in enumerate(shards)]
        torch.testing.assert_close(sum(parts), attn(x, positions), atol=1e-5, rtol=1e-4)
    if cfg.attention == "mla" and cfg.mla_rope == "shared":
        tok = x[:, -1:]
        step = model.positions(8, 1, 9, torch.float32)

        def decode(a):
            caches = make_caches(cfg, 2, 9, dtype=torch.float32, device="cpu", mla_mode="absorbed")
            a.decode(x[:, :8], model.positions(0, 8, 8, torch.float32), caches[0], 0, DecodeMode("absorbed", "torch"))
            return a.decode(tok, step, caches[0], 8, DecodeMode("absorbed", "torch"))
        with torch.no_grad():
            torch.testing.assert_close(sum(decode(s) for s in shards), decode(attn), atol=1e-5, rtol=1e-4)


def test_heads_that_do_not_split_are_named():
    mqa = small(attention="mqa")
    assert attention_kind(mqa).tp_problems(mqa, 2) == [
        "model.n_kv_heads: 1 KV heads do not split over 2 tensor-parallel ranks"]
    mla = small(**SHAPES["mla"])
    assert attention_kind(mla).tp_problems(mla, 3) == ["model.n_heads: 4 heads do not split over 3 tensor-parallel ranks"]
