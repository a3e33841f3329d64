"""Hostile Hugging Face config.json files and from-hf options: one `error:` line per problem, exit 2, and no
recipe written (wrong JSON types, 0 heads, non-UTF-8 bytes, -o into a missing directory)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hostile import invoke

LLAMA = json.loads((Path(__file__).parents[1] / "hf_configs" / "llama-3.1-8b.json").read_text())
V3 = json.loads((Path(__file__).parents[1] / "hf_configs" / "deepseek-v3.json").read_text())


def llama(**change) -> bytes:
    return json.dumps({**LLAMA, **change}).encode()


def v3(**change) -> bytes:
    return json.dumps({**V3, "quantization_config": None, **change}).encode()


# (id, config.json bytes, the expected start of the first error line after "error: PATH: ")
CASES = [
    ("model_type-list", llama(model_type=["llama"]), "model_type: expected a string, got list ['llama']"),
    ("model_type-unknown", llama(model_type="gpt2" * 100), "model_type 'gpt2gpt2"),
    ("hidden_act-list", llama(hidden_act=["silu"]), "hidden_act: expected a string, got list"),
    ("hidden_act-unknown", llama(hidden_act="tanh"), "hidden_act 'tanh' not supported"),
    ("rope_theta-string", llama(rope_theta="500000"), "rope_theta: expected a finite number, got str '500000'"),
    ("rope_theta-nan", llama(rope_theta=float("nan")), "rope_theta: expected a finite number, got float nan"),
    ("rope_theta-inf", llama(rope_theta=float("inf")), "rope_theta: expected a finite number, got float inf"),
    ("partial_rotary_factor-string", llama(partial_rotary_factor="0.5"), "partial_rotary_factor: expected a finite"),
    ("partial_rotary_factor-above-one", llama(partial_rotary_factor=1.5),
     "model.partial_rotary_factor: Input should be less than or equal to 1"),
    ("torch_dtype-dict", llama(torch_dtype={"a": 1}), "torch_dtype: expected a string, got dict"),
    ("torch_dtype-unknown", llama(torch_dtype="int4"), "torch_dtype 'int4' not supported"),
    ("zero-heads", llama(num_attention_heads=0), "num_attention_heads: must be at least 1, got 0"),
    ("negative-heads", llama(num_attention_heads=-32), "num_attention_heads: must be at least 1, got -32"),
    ("zero-kv-heads", llama(num_key_value_heads=0), "num_key_value_heads: must be at least 1, got 0"),
    ("heads-not-dividing", llama(num_attention_heads=31), "model.d_model: 4096 is not divisible by n_heads=31"),
    ("hidden_size-bool", llama(hidden_size=True), "hidden_size: expected an integer, got bool True"),
    ("hidden_size-fraction", llama(hidden_size=4096.5), "hidden_size: expected an integer, got float 4096.5"),
    ("hidden_size-missing", llama(hidden_size=None), "hidden_size: missing"),
    ("head_dim-list", llama(head_dim=[128]), "head_dim: expected an integer, got list"),
    ("vocab-past-the-bound", llama(vocab_size=10**400), "model.vocab_size: Input should be less than or equal to"),
    ("layers-past-the-bound", llama(num_hidden_layers=10**30), "model.n_layers: Input should be less than or equal"),
    ("tie-string", llama(tie_word_embeddings="yes"), "tie_word_embeddings: expected true or false, got str 'yes'"),
    ("rope_scaling-string", llama(rope_scaling="yarn"), "rope_scaling: RoPE scaling of this kind"),
    ("rope_scaling-unknown-kind", llama(rope_scaling={"rope_type": "longrope"}), "rope_scaling: RoPE scaling of this"),
    ("several-wrong-types", llama(hidden_size="4096", num_hidden_layers=[32]), "hidden_size: expected an integer"),
    ("deepseek-kv_lora_rank-string", v3(kv_lora_rank="512"), "kv_lora_rank: expected an integer, got str '512'"),
    ("deepseek-experts-string", v3(n_routed_experts="256"), "n_routed_experts: expected an integer, got str"),
    ("deepseek-moe_layer_freq-string", v3(moe_layer_freq="1"), "moe_layer_freq: expected an integer"),
    ("deepseek-scoring-list", v3(scoring_func=["sigmoid"]), "scoring_func: expected a string, got list"),
    ("deepseek-norm_topk_prob-int", v3(norm_topk_prob=1), "norm_topk_prob: expected true or false, got int 1"),
    ("deepseek-mtp-string", v3(num_nextn_predict_layers="1"), "num_nextn_predict_layers: expected an integer"),
    ("rope-factor-string", llama(rope_scaling={**LLAMA["rope_scaling"], "factor": "$(x)"}),
     "rope_scaling.factor: expected a finite number, got str '$(x)'"),
    ("rope-factor-below-one", llama(rope_scaling={**LLAMA["rope_scaling"], "factor": 0.0}),
     "rope_scaling.factor: must be at least 1, got 0.0"),
    ("rope-factor-negative", v3(rope_scaling={**V3["rope_scaling"], "factor": -40}),
     "rope_scaling.factor: must be at least 1, got -40"),
    ("rope-factor-missing", llama(rope_scaling={"rope_type": "linear"}), "rope_scaling.factor: missing"),
    ("rope-factor-huge", llama(rope_scaling={"rope_type": "dynamic", "factor": 1e400}),
     "rope_scaling.factor: expected a finite number"),
    ("rope-original-list", llama(rope_scaling={**LLAMA["rope_scaling"], "original_max_position_embeddings": [1]}),
     "rope_scaling.original_max_position_embeddings: expected an integer, got list"),
    ("rope-original-zero", llama(rope_scaling={**LLAMA["rope_scaling"], "original_max_position_embeddings": 0}),
     "rope_scaling.original_max_position_embeddings: must be at least 1, got 0"),
    ("rope-llama3-freq-order", llama(rope_scaling={**LLAMA["rope_scaling"], "low_freq_factor": 4.0,
                                                   "high_freq_factor": 1.0}),
     "rope_scaling.low_freq_factor 4.0, high_freq_factor 1.0: expected 0 < low_freq_factor < high_freq_factor"),
    ("rope-yarn-beta-dict", v3(rope_scaling={**V3["rope_scaling"], "beta_fast": {"a": 1}}),
     "rope_scaling.beta_fast: expected a finite number, got dict"),
    ("deepseek-experts-bool", v3(n_routed_experts=False), "n_routed_experts: expected an integer, got bool False"),
    ("top-level-list", b"[1, 2, 3]", "expected a JSON object, got list"),
    ("not-json", b"{model_type: llama}", "malformed JSON at line 1, column 2"),
    ("empty", b"", "malformed JSON at line 1, column 1"),
    ("non-utf8", b'{"model_type": "ll\xffama"}', "not UTF-8 text (byte 18)"),
    ("deep-nesting", b"[" * 100_000 + b"]" * 100_000, "malformed JSON"),
    ("integer-past-digit-limit", b'{"hidden_size": ' + b"9" * 5000 + b"}", "malformed JSON"),
    ("too-many-values", json.dumps({**LLAMA, "id2label": {str(i): "x" for i in range(60_000)}}).encode(),
     "more than 100,000 values"),
    ("huge-file", b'{"model_type": "llama"' + b" " * (4 * 2**20) + b"}", "larger than 4 MiB"),
]


@pytest.mark.parametrize("content, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_config_is_refused_and_nothing_written(tmp_path, monkeypatch, content, expected):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_bytes(content)
    out = tmp_path / "recipe.yaml"
    lines, _ = invoke(["recipe", "from-hf", str(cfg), "-o", str(out)], within=tmp_path)
    assert lines[0].startswith(f"error: {cfg}: {expected}"), lines[0][:300]
    assert not out.exists()


def test_a_name_too_long_is_cut_in_the_message(tmp_path):
    path = tmp_path / ("x" * 5000 + ".json")
    lines, _ = invoke(["recipe", "from-hf", str(path)], within=tmp_path)
    assert len(lines) == 1 and lines[0].endswith("xxxx.json: cannot read: File name too long") and "..." in lines[0]
    assert len(lines[0]) < 250


def test_several_problems_are_one_line_each(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_bytes(llama(hidden_size="4096", num_hidden_layers=[32], torch_dtype={"x": 1}))
    lines, _ = invoke(["recipe", "from-hf", str(cfg)], within=tmp_path)
    assert [ln.split(": ")[2] for ln in lines] == ["hidden_size", "num_hidden_layers", "torch_dtype"]


@pytest.mark.parametrize("make, args, expected", [
    (lambda d: d / "missing.json", [], "{cfg}: no such file"),
    (lambda d: d, [], "{cfg}: not a regular file"),
    (lambda d: (os.mkfifo(d / "fifo.json"), d / "fifo.json")[1], [], "{cfg}: not a regular file"),
    (lambda d: Path("/dev/zero"), [], "{cfg}: not a regular file"),
    (None, ["-o", "{tmp}/no/such/dir/r.yaml"], "-o {tmp}/no/such/dir/r.yaml: directory {tmp}/no/such/dir does not exist"),
    (None, ["-o", "{tmp}"], "-o {tmp}: is a directory"),
    (None, ["-o", "{tmp}/" + "x" * 5000 + ".yaml"], "-o {tmp}/xxxxxxxx"),
    (None, ["--drop", "flash_attention"], "{cfg}: --drop flash_attention: unknown feature"),
    (None, ["--drop", "mtp"], "{cfg}: --drop mtp: nothing to drop"),
], ids=["missing", "directory", "fifo", "dev-zero", "output-dir-missing", "output-is-a-dir", "output-name-too-long",
        "unknown-drop", "drop-mtp"])
def test_hostile_paths_and_options(tmp_path, make, args, expected):
    cfg = make(tmp_path) if make else tmp_path / "config.json"
    if make is None:
        cfg.write_bytes(llama())
    args = [a.format(tmp=tmp_path) for a in args]
    lines, _ = invoke(["recipe", "from-hf", str(cfg), *args], within=tmp_path)
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected.format(cfg=cfg, tmp=tmp_path)}"), lines


def test_a_deepseek_config_without_routed_experts_imports_dense_with_a_note(tmp_path):
    import yaml
    from click.testing import CliRunner

    from scaletool.cli import main
    cfg = tmp_path / "config.json"
    cfg.write_bytes(v3(n_routed_experts=0))
    res = CliRunner().invoke(main, ["recipe", "from-hf", str(cfg), "-o", str(tmp_path / "r.yaml")])
    assert res.exit_code == 0, res.output
    model = yaml.safe_load((tmp_path / "r.yaml").read_text())["model"]
    assert model.get("ffn") != "moe" and "n_routed_experts" not in model
    assert any(n.startswith("n_routed_experts 0: no routed experts") for n in model["notes"]), model["notes"]
