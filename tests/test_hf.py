"""Hugging Face config import: the published config.json files of Llama-3.1-8B, Qwen2-7B, Mistral-7B,
DeepSeek-V3 and GPT-2 (tests/hf_configs/, as shipped on the hub) import to recipes whose exact parameter
counts match the published figures (GPT-2: less the biases it imports without); cost-free features import
with a note that survives `recipe show`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from scaletool.analytic.params import param_counts
from scaletool.cli import main
from scaletool.config import RecipeError, load_recipe, recipe_from_dict
from scaletool.hf import FREE_ROPE_SCALINGS, recipe_from_hf

CONFIGS = Path(__file__).parent / "hf_configs"
QWEN2_05B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
             "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
             "sliding_window": 32768, "use_sliding_window": False}


def write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


def from_hf(path, *args: str):
    return CliRunner().invoke(main, ["recipe", "from-hf", str(path), *args])


def real(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


@pytest.mark.parametrize("name, drop, attention, kv_heads, total, notes", [
    # published totals: Llama-3.1-8B 8.03B, Qwen2-7B 7.62B, Mistral-7B 7.24B (v0.1) / 7.25B (v0.3, 32768 vocab)
    ("llama-3.1-8b.json", (), "gqa", 8, 8_030_261_248, ["rope_scaling llama3 (factor 8.0, original_max_position_"]),
    ("qwen2-7b.json", (), "gqa", 4, 7_615_616_512, []),
    ("mistral-7b-v0.3.json", (), "gqa", 8, 7_248_023_552, []),
    ("mistral-7b-v0.1.json", ("sliding_window",), "gqa", 8, 7_241_732_096,
     ["--drop sliding_window: imported without sliding-window attention"]),
    ("deepseek-v3.json", ("quantization",), "mla", 128, 671_026_404_352,
     ["rope_scaling yarn (factor 40, ", "num_nextn_predict_layers 1: multi-token prediction is not modelled",
      "--drop quantization: imported without quantized weights"]),
    # GPT-2 small, 124,439,808 published, less the attention-output and MLP biases: 12 · (768 + 3072 + 768)
    ("gpt2.json", ("output_bias", "mlp_bias"), "mha", 12, 124_439_808 - 12 * (768 + 3072 + 768),
     ["--drop output_bias: imported without a bias on the attention output", "--drop mlp_bias: imported without"]),
])
def test_published_configs_import_with_exact_counts(tmp_path, name, drop, attention, kv_heads, total, notes):
    out = tmp_path / "r.yaml"
    res = from_hf(CONFIGS / name, "-o", str(out), *(a for d in drop for a in ("--drop", d)))
    assert res.exit_code == 0, res.output
    r = load_recipe(out)
    assert (r.model.attention, r.model.n_kv_heads) == (attention, kv_heads)
    assert param_counts(r.model)["total"] == total
    assert len(r.model.notes) == len(notes) and all(n.startswith(s) for n, s in zip(r.model.notes, notes))
    # the notes survive `recipe show`, in YAML and JSON, and do not change the result key
    shown = CliRunner().invoke(main, ["recipe", "show", str(out), "--json"])
    assert json.loads(shown.stdout)["recipe"]["model"]["notes"] == r.model.notes
    yaml_shown = CliRunner().invoke(main, ["recipe", "show", str(out)]).stdout
    assert all(n[:30] in yaml_shown for n in notes)
    assert r.digest() == recipe_from_dict({"model": {**r.given()["model"], "notes": []}}).digest()


def test_features_that_change_the_figures_still_need_drop():
    for name, features in (("mistral-7b-v0.1.json", ["sliding_window"]), ("deepseek-v3.json", ["quantization"]),
                           ("gpt2.json", ["output_bias", "mlp_bias"])):
        res = from_hf(CONFIGS / name)
        assert res.exit_code == 2 and res.stderr.count("\n") == len(features)
        assert all(f"{f}: " in res.stderr and f"pass --drop {f}" in res.stderr for f in features)


def test_gpt2_is_learned_positions_layernorm_gelu_and_a_tied_head(tmp_path):
    """What GPT-2 is in recipe keys; its attention variants that change no figure import with a note, and
    cross-attention (an encoder-decoder) is refused."""
    drops = ("output_bias", "mlp_bias")
    raw, _ = recipe_from_hf(CONFIGS / "gpt2.json", drops)
    m = recipe_from_dict(raw).model
    assert (m.position_encoding, m.norm, m.norm_placement, m.ffn, m.tie_embeddings, m.qkv_bias) == (
        "learned", "layernorm", "pre", "gelu", True, True)
    assert (m.max_seq_len, m.intermediate_size, m.norm_eps) == (1024, 4 * 768, 1e-5)
    assert param_counts(m)["position_embedding"] == 1024 * 768
    cfg = {**real("gpt2.json"), "n_inner": 1000, "scale_attn_by_inverse_layer_idx": True}
    raw, _ = recipe_from_hf(write(tmp_path, cfg), drops)
    assert raw["model"]["intermediate_size"] == 1000
    assert raw["model"]["notes"][0].startswith("scale_attn_by_inverse_layer_idx True: scores are also divided")
    with pytest.raises(RecipeError, match="cross_attention: cross-attention layers"):
        recipe_from_hf(write(tmp_path, {**cfg, "add_cross_attention": True}), drops)


@pytest.mark.parametrize("kind", FREE_ROPE_SCALINGS)
def test_rope_scalings_that_change_no_cost_import_with_a_note(tmp_path, kind):
    cfg = {**real("llama-3.1-8b.json"), "rope_scaling": {"rope_type": kind, "factor": 4.0}}
    raw, dropped = recipe_from_hf(write(tmp_path, cfg))
    assert dropped == [] and raw["model"]["notes"][0].startswith(f"rope_scaling {kind} (factor 4.0)")
    plain, _ = recipe_from_hf(write(tmp_path, {**cfg, "rope_scaling": None}, "plain.json"))
    assert {**raw["model"], "notes": []} == {**plain["model"], "notes": []}


def test_other_rope_scalings_are_named(tmp_path):
    cfg = {**real("llama-3.1-8b.json"), "rope_scaling": {"type": "longrope", "short_factor": [1.0]}}
    with pytest.raises(RecipeError, match=r"rope_scaling: RoPE scaling of this kind .* --drop rope_scaling"):
        recipe_from_hf(write(tmp_path, cfg))
    raw, dropped = recipe_from_hf(write(tmp_path, cfg), ("rope_scaling",))
    assert dropped == ["rope_scaling"] and raw["model"]["notes"] == [
        "--drop rope_scaling: imported without RoPE scaling of this kind (llama3, yarn, linear and dynamic import "
        "with a note)"]


def test_drop_mtp_is_explained_not_needed(tmp_path):
    res = from_hf(CONFIGS / "deepseek-v3.json", "--drop", "mtp", "--drop", "quantization")
    assert res.exit_code == 2 and "--drop mtp: nothing to drop" in res.stderr


def test_first_k_dense_replace_equal_to_layers_is_a_dense_model(tmp_path):
    """transformers builds no MoE layer when first_k_dense_replace >= num_hidden_layers."""
    v3 = real("deepseek-v3.json")
    cfg = {**v3, "num_hidden_layers": 4, "first_k_dense_replace": 4}
    raw, _ = recipe_from_hf(write(tmp_path, cfg), ("quantization",))
    m = recipe_from_dict(raw).model
    assert m.ffn == "swiglu" and m.n_moe_layers == 0 and "n_routed_experts" not in raw["model"]
    assert any(n.startswith("first_k_dense_replace 4 >= num_hidden_layers 4: every layer is dense") for n in m.notes)
    dense_twin, _ = recipe_from_hf(write(tmp_path, {**cfg, "first_k_dense_replace": 0}, "twin.json"),
                                   ("quantization", "moe"))
    assert param_counts(m) == param_counts(recipe_from_dict(dense_twin).model)


def test_qwen2_has_qkv_bias_and_tied_head(tmp_path):
    raw, dropped = recipe_from_hf(write(tmp_path, QWEN2_05B))
    m = raw["model"]
    assert m["qkv_bias"] is True and m["tie_embeddings"] is True and dropped == [] and "notes" not in m
    # Qwen2-0.5B: 494,032,768 parameters (tied embeddings), as its model card states
    assert param_counts(recipe_from_dict(raw).model)["total"] == 494_032_768
    assert param_counts(recipe_from_dict(recipe_from_hf(CONFIGS / "qwen2-7b.json")[0]).model)["attention"] \
        == 28 * (3584 * 3584 * 2 + 2 * 3584 * 512 + 3584 + 2 * 512)  # q, o; k, v (4 heads × 128); q/k/v biases


def test_partial_rotary_factor_is_the_recipe_key(tmp_path):
    cfg = {**real("mistral-7b-v0.3.json"), "model_type": "phi3", "partial_rotary_factor": 0.5}
    raw, _ = recipe_from_hf(write(tmp_path, cfg))
    m = recipe_from_dict(raw).model
    assert raw["model"]["partial_rotary_factor"] == 0.5 and (m.head_dim, m.qk_rope_head_dim) == (128, 64)


def test_bad_inputs(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path, msg in [(bad, "malformed JSON at line 1"), (tmp_path / "missing.json", "no such file"),
                      (write(tmp_path, {"model_type": "bert"}, "b.json"), "model_type 'bert' is not supported"),
                      (write(tmp_path, {"model_type": "llama"}, "c.json"), "hidden_size: missing")]:
        res = from_hf(path)
        assert res.exit_code == 2 and msg in res.stderr and isinstance(res.exception, SystemExit)
