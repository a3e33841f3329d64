"""Hugging Face config import."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from scaletool import analytic
from scaletool.cli import main
from scaletool.config import RecipeError, load_recipe
from scaletool.hf import recipe_from_hf

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu"}
QWEN2_05B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
             "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
             "sliding_window": 32768, "use_sliding_window": False}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
                    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "vocab_size": 102400,
                    "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
                    "rope_scaling": {"type": "yarn", "factor": 40}}


def write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


def test_llama3_round_trip(tmp_path):
    out = tmp_path / "r.yaml"
    res = CliRunner().invoke(main, ["recipe", "from-hf", str(write(tmp_path, LLAMA3_8B)), "-o", str(out)])
    assert res.exit_code == 0, res.output
    r = load_recipe(out)
    assert (r.model.attention, r.model.n_kv_heads, r.model.rope_theta) == ("gqa", 8, 500000.0)
    assert analytic.param_counts(r.model)["total"] == 8_030_261_248


def test_qwen2_has_qkv_bias_and_tied_head(tmp_path):
    raw, dropped = recipe_from_hf(write(tmp_path, QWEN2_05B))
    m = raw["model"]
    assert m["qkv_bias"] is True and m["tie_embeddings"] is True and dropped == []
    from scaletool.config import recipe_from_dict
    # Qwen2-0.5B: 494,032,768 parameters (tied embeddings), as its model card states
    assert analytic.param_counts(recipe_from_dict(raw).model)["total"] == 494_032_768


def test_unsupported_features_are_named_not_dropped(tmp_path):
    p = write(tmp_path, DEEPSEEK_V2_LITE)
    with pytest.raises(RecipeError) as e:
        recipe_from_hf(p)
    assert [line.split(":")[0] for line in e.value.problems] == ["rope_scaling"]  # MoE is imported (issue 8)
    res = CliRunner().invoke(main, ["recipe", "from-hf", str(p)])
    assert res.exit_code == 2 and "--drop rope_scaling" in res.output


def test_deepseek_with_drops_records_them(tmp_path):
    out = tmp_path / "ds.yaml"
    res = CliRunner().invoke(main, ["recipe", "from-hf", str(write(tmp_path, DEEPSEEK_V2_LITE)), "--drop", "moe",
                                    "--drop", "rope_scaling", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "# Dropped (not modelled): moe, rope_scaling" in out.read_text()
    m = load_recipe(out).model
    assert (m.attention, m.kv_lora_rank, m.q_lora_rank, m.qk_rope_head_dim, m.v_head_dim) == ("mla", 512, 0, 64, 128)
    assert m.ffn == "swiglu"  # --drop moe: the dense twin


def test_bad_inputs(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path, msg in [(bad, "malformed JSON at line 1"), (tmp_path / "missing.json", "no such file"),
                      (write(tmp_path, {"model_type": "bert"}, "b.json"), "model_type 'bert' is not supported"),
                      (write(tmp_path, {"model_type": "llama"}, "c.json"), "missing key 'hidden_size'")]:
        res = CliRunner().invoke(main, ["recipe", "from-hf", str(path)])
        assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output
