"""DeepSeek-V2, V2-Lite and V3 config.json files imported with their mixture-of-experts FFNs, and the
parameter counts against hand-derived closed forms and the published (rounded) figures."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import RECIPES

from scaletool.analytic.params import matmul_params, param_counts
from scaletool.cli import main
from scaletool.config import RecipeError, load_recipe, recipe_from_dict
from scaletool.hf import recipe_from_hf

# The published config.json files (deepseek-ai on the Hugging Face hub), keys as shipped.
V2_LITE = {"model_type": "deepseek_v2", "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps":
    1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 10000, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400}
V3 = {"model_type": "deepseek_v3", "aux_loss_alpha": 0.001, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func":
    "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype":
    "bfloat16", "v_head_dim": 128, "vocab_size": 129280, "quantization_config": {"activation_scheme": "dynamic", "fmt":
    "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}, "rope_scaling": {"beta_fast": 32, "beta_slow": 1,
    "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}}
V2_OVER_LITE = {"aux_loss_alpha": 0.003, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size":
    1536, "n_group": 8, "n_routed_experts": 160, "num_attention_heads": 128, "num_hidden_layers": 60,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "routed_scaling_factor": 16.0, "topk_group": 3, "topk_method":
    "group_limited_greedy"}
V2 = {**V2_LITE, **V2_OVER_LITE}


def imported(tmp_path, cfg, *drop):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    raw, dropped = recipe_from_hf(p, drop)
    return recipe_from_dict(raw).model, dropped


def mla_attention(d, H, q_lora, kv_lora, nope, rope, v):
    q = d * H * (nope + rope) if not q_lora else d * q_lora + q_lora + q_lora * H * (nope + rope)
    return q + d * (kv_lora + rope) + kv_lora + kv_lora * H * (nope + v) + H * v * d


def deepseek_total(d, L, dense, vocab, i, E, shared, i_moe, attn):
    moe = d * E + E * 3 * d * i_moe + shared * 3 * d * i_moe  # gate + routed + shared SwiGLU
    return 2 * vocab * d + L * (attn + 2 * d) + dense * 3 * d * i + (L - dense) * moe + d


def test_v2_lite(tmp_path):
    m, dropped = imported(tmp_path, V2_LITE)
    assert dropped == [] and len(m.notes) == 1 and m.notes[0].startswith("rope_scaling yarn (factor 40, ")
    assert (m.ffn, m.n_routed_experts, m.n_shared_experts, m.num_experts_per_tok, m.first_k_dense_replace,
            m.scoring_func, m.n_group, m.aux_loss_alpha) == ("moe", 64, 2, 6, 1, "softmax", 1, 0.001)
    shipped = load_recipe(RECIPES / "deepseek-v2-lite.yaml").model
    assert m.model_copy(update={"max_seq_len": shipped.max_seq_len, "notes": []}) == shipped
    p = param_counts(m)
    attn = mla_attention(2048, 16, 0, 512, 128, 64, 128)
    assert p["total"] == deepseek_total(2048, 27, 1, 102400, 10944, 64, 2, 1408, attn) == 15_706_484_224
    assert round(p["total"] / 1e8) == 157  # "15.7B total parameters"
    active = p["total"] - 26 * (64 - 6) * 3 * 2048 * 1408
    assert p["active"] == active
    # "2.4B activated": the embedding lookup left out gives 2.451B, which the model card truncates to 2.4B
    assert p["moe"]["active_excl_embedding"] == active - 102400 * 2048 == 2_451_435_008
    assert 2.4e9 <= p["moe"]["active_excl_embedding"] < 2.5e9


def test_v2_group_limited_routing(tmp_path):
    m, _ = imported(tmp_path, V2)
    assert (m.n_group, m.topk_group, m.scoring_func, m.routed_scaling_factor, m.q_lora_rank) == (8, 3, "softmax", 16.0, 1536)
    p = param_counts(m)
    assert round(p["total"] / 1e9) == 236 and round(p["moe"]["active_excl_embedding"] / 1e9) == 21  # 236B, 21B


def test_v3(tmp_path):
    with pytest.raises(RecipeError) as e:
        imported(tmp_path, V3)
    assert [line.split(": ")[1] for line in e.value.problems] == ["quantization"]  # yarn and MTP import with notes
    m, dropped = imported(tmp_path, V3, "quantization")
    assert dropped == ["quantization"] and len(m.notes) == 3
    assert (m.scoring_func, m.norm_topk_prob, m.n_group, m.topk_group, m.routed_scaling_factor) == (
        "sigmoid", True, 8, 4, 2.5)
    shipped = load_recipe(RECIPES / "deepseek-v3.yaml").model
    assert m.model_copy(update={"max_seq_len": shipped.max_seq_len, "notes": []}) == shipped
    p = param_counts(m)
    attn = mla_attention(7168, 128, 1536, 512, 128, 64, 128)
    assert p["total"] == deepseek_total(7168, 61, 3, 129280, 18432, 256, 1, 2048, attn) == 671_026_404_352
    assert round(p["total"] / 1e9) == 671  # "671B total parameters" (without the MTP module)
    assert p["active"] == p["total"] - 58 * (256 - 8) * 3 * 7168 * 2048
    assert round(p["moe"]["active_excl_embedding"] / 1e9) == 37  # "37B activated for each token"


def test_v3_recipe_estimate_cli():
    res = CliRunner().invoke(main, ["estimate", str(RECIPES / "deepseek-v3.yaml"), "--json"])
    assert res.exit_code == 0, res.output
    est = json.loads(res.output)
    assert est["params"]["total"] == 671_026_404_352 and est["params"]["active"] < est["params"]["total"] / 15
    pt = est["flops"]["per_token"]
    assert pt["train"] == pytest.approx(6 * matmul_params(load_recipe(RECIPES / "deepseek-v3.yaml").model)
                                        + 3 * pt["attention_forward_causal"])


@pytest.mark.parametrize("change, message", [
    ({"topk_method": "noaux_tc"}, "topk_method noaux_tc with scoring_func softmax"),
    ({"moe_layer_freq": 2}, "moe_layer_freq 2: MoE in every n-th layer is not supported"),
    ({"topk_method": "random"}, "topk_method 'random' not supported"),
    ({"seq_aux": False}, "batch_aux_loss: batch-wise balance loss"),
])
def test_routing_it_cannot_express_is_named(tmp_path, change, message):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**V2_LITE, **change}))
    res = CliRunner().invoke(main, ["recipe", "from-hf", str(p)])
    assert res.exit_code == 2 and message in res.stderr and isinstance(res.exception, SystemExit)
