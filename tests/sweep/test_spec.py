"""Sweep files: validation, expansion into points, skipping invalid points, the equal-budget solver."""
from __future__ import annotations

import io
import json

import pytest
import yaml
from click.testing import CliRunner
from conftest import RECIPES

from scaletool.analytic.params import param_counts
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
    # mla without a latent rank is invalid, kept with the validator's reason; mha with a latent rank is the
    # same recipe as mha without one (the key is inactive): kept as skipped, naming the point it repeats
    assert set(skipped) == {"attention=mla seed=2 kv_lora_rank=0 intermediate_size=128",
                            "attention=mla seed=2 kv_lora_rank=0 intermediate_size=256",
                            "attention=mha seed=1 kv_lora_rank=16 intermediate_size=128",
                            "attention=mha seed=1 kv_lora_rank=16 intermediate_size=256"}
    assert skipped["attention=mha seed=1 kv_lora_rank=16 intermediate_size=128"].startswith(
        "same recipe as point 0 (attention=mha seed=1 kv_lora_rank=0 intermediate_size=128): model.kv_lora_rank inactive")
    assert all("kv_lora_rank" in why for why in skipped.values())
    ok = [p for p in points if not p.skipped]
    assert [p.recipe.model.intermediate_size for p in ok] == [128, 256, 128, 256]
    assert len({p.point_id for p in points}) == 8
    assert len({p.key(m, []) for p in ok for m in ("estimate", "count")}) == 2 * len(ok)


def test_points_that_collide_beyond_inactive_keys_are_an_error(write_sweep):
    with pytest.raises(RecipeError, match=r"points 0 \(intermediate_size=128\) and 1 \(intermediate_size=128.0\) "
                                          "resolve to the same recipe"):
        expand(load_sweep(write_sweep({"set": AS_MHA, "grid": {"model.intermediate_size": [128, 128.0]},
                                       "modes": ["estimate"]})))


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


@pytest.mark.parametrize("timeout", [0, -5, ".nan", ".inf", "{train: 0}", "{train: .nan, count: 10}", "soon"])
def test_timeouts_must_be_positive_and_finite(write_sweep, tmp_path, timeout):
    path = write_sweep({"set": AS_MHA, "modes": ["count", "train"]})
    path.write_text(path.read_text() + f"timeout_s: {timeout}\n")
    res = CliRunner().invoke(main, ["sweep", str(path), "--dry-run"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    (line,) = [ln for ln in res.output.splitlines() if ln.startswith("error: ")]
    assert "timeout_s" in line and ("positive, finite number of seconds" in line or "expected a number" in line)


@pytest.mark.parametrize("values,same", [
    ([128, 128.0], "0 (intermediate_size=128) and 1 (intermediate_size=128.0)"),
    (["256", 256, 512], "0 (intermediate_size=256) and 1 (intermediate_size=256)"),
])
def test_two_values_resolving_to_one_recipe_are_an_error_naming_both(write_sweep, values, same):
    path = write_sweep({"set": AS_MHA, "grid": {"model.intermediate_size": values}, "modes": ["estimate"]})
    res = CliRunner().invoke(main, ["sweep", str(path), "--dry-run"])
    assert res.exit_code == 2, res.output
    (line,) = [ln for ln in res.output.splitlines() if ln.startswith("error: ")]
    assert f"points {same} resolve to the same recipe" in line


def test_a_value_equal_to_the_default_it_replaces_is_a_duplicate_too(write_sweep):
    """tiny.yaml's MLA rope dim defaults to 8: setting it to 8 explicitly is the same recipe."""
    path = write_sweep({"zip": [{"model.qk_rope_head_dim": None}, {"model.qk_rope_head_dim": 8}], "modes": ["estimate"]})
    sw = load_sweep(path)
    if load_recipe(RECIPES / "tiny.yaml").model.qk_rope_head_dim != 8:
        pytest.skip("tiny.yaml's rope dim changed")
    with pytest.raises(RecipeError, match="resolve to the same recipe"):
        expand(sw)


def test_repeats_apply_to_timed_modes_and_keep_the_first_repeat_key(write_sweep, tmp_path):
    base = {"set": AS_MHA, "modes": ["estimate", "train"]}
    one = expand(load_sweep(write_sweep(base)))[0]
    res = CliRunner().invoke(main, ["sweep", str(write_sweep({**base, "repeats": 3}, "r.yaml")), "--dry-run", "--json",
                                    "-o", str(tmp_path / "out")])
    runs = json.loads(res.output)["runs"]
    assert [(r["mode"], r["repeat"], r["repeats"], r["task"]) for r in runs] == [
        ("estimate", 0, 1, 0), ("train", 0, 3, 1), ("train", 1, 3, 2), ("train", 2, 3, 3)]
    assert runs[1]["key"] == one.key("train", []) and len({r["key"] for r in runs}) == 4
    res = CliRunner().invoke(main, ["sweep", str(tmp_path / "r.yaml"), "--dry-run", "-o", str(tmp_path / "out")])
    assert "train ×3" in res.output and "3/3" in res.output  # repeats share a row in the table


def test_the_dry_run_table_fits_the_terminal(write_sweep):
    from rich.console import Console

    from scaletool.api import sweep_plan
    from scaletool.cli.sweep import print_plan

    path = write_sweep({"set": AS_MHA, "zip": [{"model.attention": "mha", "train.seed": 10**30},
                                               {"model.kv_lora_rank": 8, "data.path": "/a/very/long/path/" * 6}],
                        "modes": ["estimate", "train"], "repeats": 2})
    for width in (60, 100):
        con = Console(width=width, record=True, file=io.StringIO())
        print_plan(sweep_plan(path), con)
        text = con.export_text()
        assert max(len(line) for line in text.splitlines()) <= width
        assert "…" not in text and "64-bit" in text  # long cells fold; nothing is cut off


def test_each_mode_runs_its_command_with_a_result_file_and_its_gpu_needs(write_sweep, tmp_path):
    from scaletool.sweep.runner import gpus_needed, plan, prepare

    sw = load_sweep(write_sweep({"set": AS_MHA, "modes": ["estimate", "count", "train", "decode", "profile"],
                                 "nproc_per_node": 2, "args": {"decode": ["--device", "cpu"]}}))
    tasks, _ = plan(sw, tmp_path / "out")
    launches = {t.mode: prepare(t, sw, tmp_path / "out") for t in tasks}
    for mode, launch in launches.items():
        run_dir = launch.stdout.parent
        assert launch.argv[1:6] == ["-m", "scaletool", "--result-file", str(run_dir / "result.json"), mode]
        assert run_dir.is_dir() and (run_dir.parent / "recipe.yaml").is_file()
        assert ("--out" in launch.argv) == (mode in ("train", "profile"))
        assert ("--nproc-per-node" in launch.argv) == (launch.ranks == 2) == (mode in ("train", "profile"))
    assert {m: gpus_needed(sw, m, sw.mode_args(m)) for m in launches} == {
        "estimate": 0, "count": 0, "train": 2, "decode": 0, "profile": 2}
