"""FlopCounterMode and fvcore against the analytic model, on meta and on real CPU kernels."""
from __future__ import annotations

import pytest
from conftest import MODEL_RECIPES, assert_counted_exactly

from scaletool.config import load_recipe, recipe_from_dict
from scaletool.measure.count import count

SHAPES = {
    "mha": {"attention": "mha"},
    "gqa": {"attention": "gqa", "n_kv_heads": 2},
    "mqa": {"attention": "mqa"},
    "mla": {"attention": "mla", "kv_lora_rank": 32, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 16},
    "mla-q_lora": {"attention": "mla", "kv_lora_rank": 32, "q_lora_rank": 16},
    "mla-per_head": {"attention": "mla", "kv_lora_rank": 32, "q_lora_rank": 16, "mla_rope": "per_head"},
    "gqa-alibi-post": {"attention": "gqa", "n_kv_heads": 2, "position_encoding": "alibi", "norm_placement": "post"},
    "mha-learned": {"attention": "mha", "position_encoding": "learned", "norm": "layernorm", "ffn": "gelu"},
}


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_counters_agree_with_the_full_convention(name, device):
    r = recipe_from_dict({"model": {"d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 300,
                                    "intermediate_size": 80, "max_seq_len": 48, "dtype": "fp32", **SHAPES[name]}})
    res = count(r, device=device, batch=2)
    f = res["flops"]
    assert_counted_exactly(res)
    modes = {"mla": 3, "mla-q_lora": 3, "mla-per_head": 2}.get(name, 1)  # absorbed, expand, naive; no absorbed
    assert len(f["decode"]) == modes and all(d["context"] == 48 for d in f["decode"].values())
    assert f["fvcore"]["by_operator"]["scaled_dot_product_attention"] > 0


@pytest.mark.parametrize("path", MODEL_RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_within_one_percent(path):
    r = load_recipe(path)
    if r.model.n_layers > 40:  # the >400B recipe: counted in test_cli, once
        pytest.skip("counted by the CLI test")
    f = count(r, device="meta")["flops"]
    assert abs(f["flop_counter"]["forward_rel_error"]) < 0.01
    assert abs(f["flop_counter"]["train_rel_error"]) < 0.01
    assert abs(f["fvcore"]["forward_rel_error"]) < 0.01
