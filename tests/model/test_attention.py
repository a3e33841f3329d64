"""The torch side of each attention kind: found through the kind's name, with a tensor-parallel plan
over its own submodules."""
from __future__ import annotations

import torch.nn as nn

from scaletool.config import recipe_from_dict
from scaletool.engines.tp import ATTENTION_PLANS, ReplicateInRegion
from scaletool.kinds.attention import ATTENTION_KINDS, attention_kind
from scaletool.model import build_model
from scaletool.model.attention import ATTENTION_MODULES

SHAPES = {
    "mha": {"attention": "mha", "qkv_bias": True},
    "gqa": {"attention": "gqa", "n_kv_heads": 2, "position_encoding": "alibi"},
    "mqa": {"attention": "mqa"},
    "mla": {"attention": "mla", "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12},
    "mla-q_lora": {"attention": "mla", "kv_lora_rank": 24, "q_lora_rank": 20},
    "mla-per_head": {"attention": "mla", "kv_lora_rank": 24, "mla_rope": "per_head"},
}


def small(**model):
    base = {"d_model": 64, "n_layers": 1, "n_heads": 4, "intermediate_size": 96, "vocab_size": 97,
            "max_seq_len": 32, "dtype": "fp32"}
    return recipe_from_dict({"model": {**base, **model}}).model


def test_every_kind_has_a_module_and_a_tensor_parallel_plan():
    assert {shape["attention"] for shape in SHAPES.values()} == set(ATTENTION_KINDS)
    for shape in SHAPES.values():
        cfg = small(**shape)
        name = cfg.attention
        attn = build_model(cfg, "meta").layers[0].attn
        assert type(attn) is ATTENTION_MODULES[name]
        linears = {n for n, m in attn.named_modules() if isinstance(m, nn.Linear)}
        norms = {n for n, m in attn.named_modules() if n and not isinstance(m, nn.Linear)}
        plan = ATTENTION_PLANS[name](cfg, 2)
        assert set(plan.styles) <= linears | norms, name


def test_mqa_replicates_its_one_kv_head_under_tensor_parallelism():
    """One answer everywhere: config accepts MQA at any TP degree that splits the query heads, the plan
    replicates wk and wv, and the analytic model keeps the K/V head whole on every rank."""
    mqa = small(attention="mqa")
    assert attention_kind(mqa).tp_problems(mqa, 2) == []
    assert attention_kind(mqa).tp_kv_heads(mqa, 2) == 1
    plan = ATTENTION_PLANS["mqa"](mqa, 2)
    assert "n_kv_heads" not in plan.local and plan.local["n_heads"] == 2
    assert {type(plan.styles["wk"]), type(plan.styles["wv"])} == {ReplicateInRegion}
    gqa = small(attention="gqa", n_kv_heads=2)
    assert attention_kind(gqa).tp_problems(gqa, 4) == [
        "model.n_kv_heads: 2 K/V heads do not split over parallel.tensor_parallel=4 ranks "
        "(attention=mqa replicates its single K/V head instead)"]

