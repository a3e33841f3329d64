"""Recipe validation: every documented problem gives one clear line and exit status 2."""
from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import MODEL_RECIPES, RECIPES

from scaletool.cli import main
from scaletool.config import RecipeError, load_recipe, recipe_from_dict


def check(path) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["recipe", "check", str(path)])
    return res.exit_code, res.output


@pytest.mark.parametrize("model, expected", [
    ({"n_head": 4}, "model.n_head: unknown key; did you mean 'n_heads'?"),
    ({"d_model": "wide"}, "model.d_model: Input should be a valid integer"),
    ({"d_model": 100, "n_heads": 8}, "model.d_model: 100 is not divisible by n_heads=8"),
    ({"d_model": 64, "n_heads": 4, "qk_rope_head_dim": 7}, "model.qk_rope_head_dim: 7 is odd"),
    ({"d_model": 64, "n_heads": 4, "qk_rope_head_dim": 32}, "model.qk_rope_head_dim: 32 is larger than the head (head_dim=16)"),
    ({"attention": "mla", "kv_lora_rank": 0}, "model.kv_lora_rank: must be > 0 for attention=mla"),
    ({"attention": "gqa", "n_heads": 8, "n_kv_heads": 3}, "model.n_heads: 8 is not divisible by n_kv_heads=3"),
    ({"n_layers": -2}, "model.n_layers: Input should be greater than 0"),
    ({"intermediate_size": 0}, "model.intermediate_size: Input should be greater than 0"),
    ({"attention": "mha", "kv_lora_rank": 64}, "model.kv_lora_rank: only used by attention=mla"),
    ({"attention": "mqa", "n_kv_heads": 2}, "model.n_kv_heads: 2 contradicts attention=mqa"),
    ({"attention": "flash"}, "model.attention: Input should be 'mha', 'gqa', 'mqa' or 'mla'"),
])
def test_model_problems_are_one_line_each(write_recipe, model, expected):
    code, out = check(write_recipe({"model": model}))
    assert code == 2
    assert expected in out
    assert "Traceback" not in out
    assert all(line.startswith("error: ") for line in out.strip().splitlines())


def test_unknown_section_and_key_in_other_sections(write_recipe):
    code, out = check(write_recipe({"trian": {"steps": 3}}))
    assert code == 2 and "trian: unknown key; did you mean 'train'?" in out
    code, out = check(write_recipe({"train": {"step": 3}}))
    assert code == 2 and "train.step: unknown key; did you mean 'steps'?" in out


def test_several_problems_give_several_lines(write_recipe):
    code, out = check(write_recipe({"model": {"attention": "gqa", "n_heads": 8, "n_kv_heads": 3, "qk_rope_head_dim": 5,
                                              "d_model": 64}}))
    assert code == 2
    lines = out.strip().splitlines()
    assert len(lines) == 2 and "odd" in out and "not divisible by n_kv_heads" in out


def test_missing_file_and_malformed_yaml(tmp_path, write_recipe):
    code, out = check(tmp_path / "nope.yaml")
    assert code == 2 and "nope.yaml: no such file" in out
    code, out = check(write_recipe("model:\n  d_model: 64\n  n_heads: [4\n"))
    assert code == 2 and "malformed YAML at line" in out and "Traceback" not in out
    code, out = check(write_recipe("- just\n- a list\n"))
    assert code == 2 and "a recipe is a mapping" in out


def test_yaml_is_read_with_the_safe_loader(write_recipe):
    code, out = check(write_recipe("model: !!python/object/apply:os.system ['echo pwned']\n"))
    assert code == 2 and "malformed YAML" in out and "pwned" not in out


def test_overrides(write_recipe):
    r = load_recipe(RECIPES / "tiny.yaml", ["model.kv_lora_rank=16", "parallel.engine=fsdp", "train.lr=1e-3"])
    assert r.model.kv_lora_rank == 16 and r.parallel.engine == "fsdp" and r.train.lr == 1e-3
    with pytest.raises(RecipeError, match="unknown section 'modle'; did you mean 'model'"):
        load_recipe(RECIPES / "tiny.yaml", ["modle.d_model=3"])
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        load_recipe(RECIPES / "tiny.yaml", ["model.d_model"])
    res = CliRunner().invoke(main, ["recipe", "check", str(RECIPES / "tiny.yaml"), "--set", "model.n_heads=5"])
    assert res.exit_code == 2 and "not divisible" in res.output


def test_defaults_are_resolved_once():
    r = recipe_from_dict({"model": {"attention": "mla", "d_model": 256, "n_heads": 4, "kv_lora_rank": 64}})
    m = r.model
    assert (m.head_dim, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.n_kv_heads) == (64, 64, 32, 64, 4)
    assert m.qk_head_dim == 96 and m.v_dim == 64
    # the resolved recipe round-trips through validation unchanged
    again = recipe_from_dict(r.to_dict())
    assert again.to_dict() == r.to_dict() and again.digest() == r.digest()
    mqa = recipe_from_dict({"model": {"attention": "mqa"}}).model
    assert mqa.n_kv_heads == 1 and mqa.qk_rope_head_dim == mqa.head_dim


def test_regression_feature_groups():
    m = recipe_from_dict({"model": {"task": "regression", "n_features": 22}}).model
    assert m.feature_groups == [6, 6, 5, 5] and sum(m.group_widths) == m.d_model
    with pytest.raises(RecipeError, match="sum to 19, not n_features=20"):
        recipe_from_dict({"model": {"task": "regression", "feature_groups": [10, 9]}})
    with pytest.raises(RecipeError, match="csv is for task=regression"):
        recipe_from_dict({"data": {"source": "csv", "path": "x.csv"}})


@pytest.mark.parametrize("path", MODEL_RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_are_valid(path):
    load_recipe(path)


def test_a_sweep_file_is_not_a_recipe():
    code, out = check(RECIPES / "quickstart.yaml")
    assert code == 2 and "this is a sweep file" in out and "scaletool sweep" in out
