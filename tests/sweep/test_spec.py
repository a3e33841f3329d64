"""Sweep files: validation, expansion into points, skipping invalid points, the equal-budget solver."""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner
from conftest import RECIPES

from scaletool.analytic import param_counts
from scaletool.cli import main
from scaletool.config import RecipeError, load_recipe
from scaletool.sweep.points import expand
from scaletool.sweep.spec import load_sweep

# tiny.yaml as MHA, so points name only what they change (MLA head dims then take their defaults)
AS_MHA = {"model.attention": "mha", "model.kv_lora_rank": 0, "model.qk_nope_head_dim": None,
          "model.qk_rope_head_dim": None, "model.v_head_dim": None}


@pytest.fixture
def write_sweep(tmp_path):
    def _write(spec: dict, name: str = "sweep.yaml"):
        p = tmp_path / name
        p.write_text(yaml.safe_dump({"recipe": str(RECIPES / "tiny.yaml"), **spec}, sort_keys=False))
        return p
    return _write


def test_grid_times_zip_expands_in_order_and_skips_invalid_combinations(write_sweep):
    sw = load_sweep(write_sweep({
        "set": AS_MHA,
        "zip": {"model.attention": ["mha", "mla"], "train.seed": [1, 2]},
        "grid": {"model.kv_lora_rank": [0, 16], "model.intermediate_size": [128, 256]},
        "modes": ["estimate"]}))
    points = expand(sw)
    assert len(points) == 2 * 2 * 2
    assert [p.values for p in points[:2]] == [
        {"model.attention": "mha", "train.seed": 1, "model.kv_lora_rank": 0, "model.intermediate_size": 128},
        {"model.attention": "mha", "train.seed": 1, "model.kv_lora_rank": 0, "model.intermediate_size": 256}]
    skipped = {p.label: p.reason for p in points if p.skipped}
    # mla without a latent rank is invalid, kept with the validator's reason
    assert set(skipped) == {"attention=mla seed=2 kv_lora_rank=0 intermediate_size=128",
                            "attention=mla seed=2 kv_lora_rank=0 intermediate_size=256"}
    assert all("kv_lora_rank" in why for why in skipped.values())
    ok = [p for p in points if not p.skipped]
    assert [p.recipe.model.intermediate_size for p in ok] == [128, 256, 128, 256, 128, 256]
    # mha with a latent rank: the key is inactive, so the point is the same recipe as mha without one
    assert [p.recipe.inactive for p in ok[:4]] == [{}, {}, {"model.kv_lora_rank": 16}, {"model.kv_lora_rank": 16}]
    assert [p.point_id for p in ok[:2]] == [p.point_id for p in ok[2:4]]
    distinct = ok[:2] + ok[4:]
    assert len({p.point_id for p in distinct + [p for p in points if p.skipped]}) == 6
    assert len({p.key(m, []) for p in distinct for m in ("estimate", "count")}) == 2 * len(distinct)


def test_zip_as_point_list_and_stable_keys(write_sweep):
    spec = {"set": AS_MHA, "zip": [{"model.attention": "mha"}, {"model.attention": "gqa", "model.n_kv_heads": 2},
                                   {"model.attention": "mla", "model.kv_lora_rank": 8}], "modes": ["estimate"]}
    a, b = expand(load_sweep(write_sweep(spec))), expand(load_sweep(write_sweep(spec, "again.yaml")))
    assert [p.label for p in a] == ["attention=mha", "attention=gqa n_kv_heads=2", "attention=mla kv_lora_rank=8"]
    assert [p.key("estimate", []) for p in a] == [p.key("estimate", []) for p in b]
    assert a[0].key("decode", ["--context", "16"]) != a[0].key("decode", ["--context", "32"])


def test_sweep_file_problems_are_one_line_each_and_exit_2(write_sweep):
    path = write_sweep({"grid": {"model.kv_lora_rnak": [1], "train.seed": []},
                        "zip": {"model.n_layers": [1, 2], "model.d_model": [64]},
                        "modes": ["estimate", "estimate"], "args": {"estimate": ["--json"]},
                        "timout_s": 5})
    res = CliRunner().invoke(main, ["sweep", str(path), "--dry-run"])
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    assert "timout_s: unknown key; did you mean 'timeout_s'?" in res.output
    path = write_sweep({"grid": {"model.kv_lora_rnak": [1], "train.seed": []},
                        "zip": {"model.n_layers": [1, 2], "model.d_model": [64]},
                        "modes": ["estimate", "estimate"], "args": {"estimate": ["--json"]},
                        "match_params": {"key": "model.n_layers", "target": 10**6}})
    res = CliRunner().invoke(main, ["sweep", str(path), "--dry-run"])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 6, res.output
    text = "\n".join(lines)
    for needle in ("unknown key 'kv_lora_rnak'; did you mean 'kv_lora_rank'?", "grid.train.seed: empty list",
                   "zip: lists must have equal lengths", "modes: listed twice: estimate",
                   "--json is set by the sweep itself", "match_params.key: model.n_layers is also varied by the zip"):
        assert needle in text


def test_bad_base_recipe_is_reported_with_its_problem(write_sweep, tmp_path):
    (tmp_path / "base.yaml").write_text("model: {attention: gqa}\n")
    path = tmp_path / "s.yaml"
    path.write_text("recipe: base.yaml\nmodes: [estimate]\n")
    with pytest.raises(RecipeError) as e:
        load_sweep(path)
    assert "model.n_kv_heads: required for attention=gqa" in str(e.value)


@pytest.mark.parametrize("key,unit", [("model.intermediate_size", 64), ("model.n_layers", 1)])
def test_match_params_solves_each_point_to_the_nearest_multiple(write_sweep, key, unit):
    target = RECIPES / "tiny.yaml"  # the MLA tiny model's count is the target
    sw = load_sweep(write_sweep({
        "set": AS_MHA, "zip": [{"model.attention": "mha"}, {"model.attention": "mla", "model.kv_lora_rank": 8},
                               {"model.attention": "mla", "model.kv_lora_rank": 64}],
        "match_params": {"key": key, "target": str(target), "multiple_of": unit}, "modes": ["estimate"]}))
    points = expand(sw)
    want = param_counts(load_recipe(target).model)["total"]
    assert sw.target_params == want
    field = key.split(".")[1]
    for p in points:
        mp = p.match_params
        got = getattr(p.recipe.model, field)
        assert mp["value"] == got and got % unit == 0
        assert mp["achieved"] == param_counts(p.recipe.model)["total"]
        # nearest: one step either way is no closer
        for k in (got - unit, got + unit):
            if k > 0:
                other = param_counts(p.recipe.model.model_copy(update={field: k}))["total"]
                assert abs(other - want) >= abs(mp["achieved"] - want)
        assert field + "=" not in p.label and p.raw["model"][field] == got


def test_match_params_unreachable_target_skips_the_point(write_sweep):
    sw = load_sweep(write_sweep({"set": AS_MHA, "zip": [{"model.attention": "mha"}],
                                 "match_params": {"key": "model.intermediate_size", "target": 1000},
                                 "modes": ["estimate"]}))
    (p,) = expand(sw)
    assert p.skipped and "above the target 1,000" in p.reason


def test_dry_run_lists_points_as_json(write_sweep, tmp_path):
    path = write_sweep({"set": AS_MHA, "zip": [{"model.attention": "mha"}, {"model.attention": "gqa"}],
                        "modes": ["estimate", "count"]})
    res = CliRunner().invoke(main, ["sweep", str(path), "--dry-run", "--json", "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    runs = json.loads(res.output)["runs"]
    assert [(r["label"], r["mode"], r["state"], r["will_run"]) for r in runs] == [
        ("attention=mha", "estimate", "pending", True), ("attention=mha", "count", "pending", True),
        ("attention=gqa", "estimate", "skipped", False), ("attention=gqa", "count", "skipped", False)]
    assert "n_kv_heads: required for attention=gqa" in runs[2]["reason"]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_a_recipe_is_not_a_sweep_file():
    from conftest import RECIPES

    with pytest.raises(RecipeError, match="this is a recipe, not a sweep file"):
        load_sweep(RECIPES / "tiny.yaml")
