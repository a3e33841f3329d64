"""The attention kinds and position encodings as data: the recipe rules that follow from them, the keys
they make inactive, and the decode modes they accept or refuse with a reason."""
from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import RECIPES, ROOT

from scaletool.cli import main
from scaletool.config import SWITCHES, ModelConfig, RecipeError, load_recipe, recipe_from_dict
from scaletool.kinds.attention import ABSORB_REFUSED, ATTENTION_KINDS, MLA_MODES, POSITION_KINDS, attention_kind

MLA = {"attention": "mla", "kv_lora_rank": 32}


def refused(model: dict) -> list[str]:
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"model": model})
    return e.value.problems


def test_every_key_a_kind_reads_is_a_model_field_and_every_switch_value_has_a_kind():
    fields = set(ModelConfig.model_fields)
    for kinds in (ATTENTION_KINDS, POSITION_KINDS):
        assert all(set(k.reads) <= fields for k in kinds.values())
    for switch, kinds in SWITCHES.items():
        assert set(kinds) == set(ModelConfig.model_fields[switch].annotation.__args__), switch


def test_the_spec_imports_without_torch():
    """estimate's closed forms come from here: importing it (and config) must not pull torch in."""
    code = "import sys, scaletool.kinds.attention, scaletool.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("model, line", [
    ({**MLA, "position_encoding": "alibi"}, "model.position_encoding: attention=mla defines only rope (its decoupled "
                                             "key is the RoPE part of q and k), got alibi"),
    ({**MLA, "qk_nope_head_dim": 0}, "model.qk_nope_head_dim: 0 leaves mla_rope=shared one key for every head"),
    ({"attention": "mha", "partial_rotary_factor": 0.2, "d_model": 64, "n_heads": 4},
     "model.partial_rotary_factor: 0.2 of head_dim=16 rotates 3 channels"),
    ({**MLA, "mla_rope": "sideways"}, "model.mla_rope: Input should be 'shared' or 'per_head'"),
    ({"position_encoding": "xpos"}, "model.position_encoding: Input should be 'rope', 'learned', 'sinusoidal', "
                                    "'alibi' or 'none'"),
])
def test_rules_that_follow_from_the_kinds(model, line):
    assert any(line in p for p in refused(model)), refused(model)


def test_partial_rotary_factor_must_rotate_pairs_only_with_rope():
    """Without RoPE nothing rotates: the factor is inactive and its parity no rule."""
    m = recipe_from_dict({"model": {"attention": "mha", "d_model": 64, "n_heads": 4, "partial_rotary_factor": 0.2,
                                    "position_encoding": "none"}}).model
    assert m.qk_rope_head_dim == 0 and m.inactive == {"partial_rotary_factor": 0.2}


def test_whole_head_rope_is_per_head_mla_only():
    m = recipe_from_dict({"model": {**MLA, "mla_rope": "per_head", "qk_nope_head_dim": 0, "qk_rope_head_dim": 64,
                                    "d_model": 512, "n_heads": 8}}).model
    assert (m.qk_head_dim, m.v_dim) == (64, 64)


def test_position_keys_are_inactive_without_rope_and_recipe_check_names_the_switch():
    res = CliRunner().invoke(main, ["recipe", "check", str(RECIPES / "mha-1b.yaml"), "--set",
                                    "model.position_encoding=alibi", "--set", "model.rope_theta=500000"])
    assert res.exit_code == 0, res.output
    assert "inactive: model.rope_theta = 500000.0 (read by position_encoding=rope; this recipe has " \
           "position_encoding=alibi)" in res.stdout
    # a key of the selected position kind that another attention kind made inactive is named by that switch only
    res = CliRunner().invoke(main, ["recipe", "check", str(RECIPES / "tiny.yaml"), "--set",
                                    "model.partial_rotary_factor=0.5"])
    lines = [ln.strip() for ln in res.stdout.splitlines() if "inactive:" in ln]
    assert lines == ["inactive: model.partial_rotary_factor = 0.5 (read by attention=mha/gqa/mqa; this recipe has "
                     "attention=mla)"]


def test_new_keys_at_their_defaults_keep_the_result_keys():
    """position_encoding, norm_placement and mla_rope at their defaults leave every digest as it was (the
    DIGESTS of tests/test_config.py pin them); a non-default value is a different key."""
    base = load_recipe(RECIPES / "mla-1b.yaml")
    same = load_recipe(RECIPES / "mla-1b.yaml", ["model.position_encoding=rope", "model.norm_placement=pre",
                                                  "model.mla_rope=shared"])
    assert same.digest() == base.digest()
    assert load_recipe(RECIPES / "mla-1b.yaml", ["model.mla_rope=per_head"]).digest() != base.digest()


def test_decode_modes_per_kind_and_the_reasons_for_refusing_one():
    shared = recipe_from_dict({"model": MLA}).model
    per_head = recipe_from_dict({"model": {**MLA, "mla_rope": "per_head"}}).model
    gqa = recipe_from_dict({"model": {"attention": "gqa", "n_kv_heads": 2}}).model
    kind = attention_kind(shared)
    assert kind.decode_modes(shared) == MLA_MODES and kind.decode_modes(per_head) == ("expand", "naive")
    assert [kind.decode_label(shared, m) for m in MLA_MODES] == ["mla", "mla-expand", "mla-naive"]
    assert [kind.decode_label(per_head, m) for m in (None, "naive")] == ["mla-per_head", "mla-per_head-naive"]
    assert kind.decode_problem(per_head, "absorbed") == f"mla_mode absorbed: {ABSORB_REFUSED}"
    assert attention_kind(gqa).decode_problem(gqa, "naive") == "mla_mode naive is for attention=mla recipes; this " \
                                                                "one is gqa"
    assert attention_kind(gqa).decode_problem(gqa, None) is None and attention_kind(gqa).decode_modes(gqa) == ()
    assert kind.decode_problem(shared, "latent").startswith("mla_mode: expected one of absorbed, expand, naive")
