"""Recipe validation: every documented problem gives one clear line and exit status 2; keys of another
attention or FFN type are inactive; sizes, floats and YAML are bounded; check runs train's rules."""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner
from conftest import MODEL_RECIPES, RECIPES, no_hang

from scaletool import api
from scaletool.cli import main
from scaletool.config import RecipeError, load_recipe, recipe_from_dict, weights_bound
from scaletool.yaml_input import MAX_NODES, check_tree, load_yaml_text


def check(path, *sets: str):
    return CliRunner().invoke(main, ["recipe", "check", str(path), *(a for s in sets for a in ("--set", s))])


def refused(res) -> list[str]:
    """The stderr lines of a refused command: exit 2, every line an `error:` line, nothing on stdout."""
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.exit_code, res.output, res.exception)
    lines = res.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), lines
    assert res.stdout == ""
    return lines


@pytest.mark.parametrize("model, expected", [
    ({"n_head": 4}, "model.n_head: unknown key; did you mean 'n_heads'?"),
    ({"d_model": "wide"}, "model.d_model: Input should be a valid integer"),
    ({"d_model": 100, "n_heads": 8}, "model.d_model: 100 is not divisible by n_heads=8"),
    ({"attention": "mla", "kv_lora_rank": 16, "qk_rope_head_dim": 7}, "model.qk_rope_head_dim: 7 is odd"),
    ({"d_model": 64, "n_heads": 4, "partial_rotary_factor": 0.2},
     "model.partial_rotary_factor: 0.2 of head_dim=16 rotates 3 channels; RoPE rotates pairs"),
    ({"partial_rotary_factor": 1.5}, "model.partial_rotary_factor: Input should be less than or equal to 1"),
    ({"attention": "mla", "kv_lora_rank": 0}, "model.kv_lora_rank: must be > 0 for attention=mla"),
    ({"attention": "gqa", "n_heads": 8, "n_kv_heads": 3}, "model.n_heads: 8 is not divisible by n_kv_heads=3"),
    ({"attention": "gqa"}, "model.n_kv_heads: required for attention=gqa"),
    ({"n_layers": -2}, "model.n_layers: Input should be greater than 0"),
    ({"intermediate_size": 0}, "model.intermediate_size: Input should be greater than 0"),
    ({"attention": "flash"}, "model.attention: Input should be 'mha', 'gqa', 'mqa' or 'mla'"),
    ({"ffn": "moe", "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "first_k_dense_replace": 8}, "model.first_k_dense_replace: 8 leaves no MoE layer (n_layers=8)"),
])
def test_model_problems_are_one_line_each(write_recipe, model, expected):
    lines = refused(check(write_recipe({"model": model})))
    assert len(lines) == 1 and expected in lines[0], lines


def test_unknown_section_and_key_in_other_sections(write_recipe):
    assert "trian: unknown key; did you mean 'train'?" in refused(check(write_recipe({"trian": {"steps": 3}})))[0]
    assert "train.step: unknown key; did you mean 'steps'?" in refused(check(write_recipe({"train": {"step": 3}})))[0]


def test_several_problems_give_several_lines(write_recipe):
    lines = refused(check(write_recipe({"model": {"attention": "gqa", "n_heads": 8, "n_kv_heads": 3, "d_model": 64,
                                                  "partial_rotary_factor": 0.2}, "train": {"lr": float("inf")}})))
    assert len(lines) == 3 and "partial_rotary_factor" in lines[0] and "not divisible by n_kv_heads" in lines[1]
    assert "train.lr: Input should be a finite number" in lines[2]


def test_missing_file_and_malformed_yaml(tmp_path, write_recipe):
    assert "nope.yaml: no such file" in refused(check(tmp_path / "nope.yaml"))[0]
    assert "malformed YAML at line " in refused(check(write_recipe("model:\n  d_model: 64\n  n_heads: [4\n")))[0]
    assert "a recipe is a mapping" in refused(check(write_recipe("- just\n- a list\n")))[0]


def test_yaml_is_read_with_the_safe_loader(write_recipe):
    lines = refused(check(write_recipe("model: !!python/object/apply:os.system ['echo pwned']\n")))
    assert "malformed YAML" in lines[0] and "pwned" not in "".join(lines)


def test_duplicate_keys_are_refused_not_silently_resolved(write_recipe):
    lines = refused(check(write_recipe("model:\n  d_model: 64\n  n_heads: 4\n  d_model: 128\n")))
    assert len(lines) == 1 and "malformed YAML at line 4, column 3: duplicate key 'd_model' (first at line 2)" in lines[0]
    # merge keys may repeat what they merge: only literal duplicates are errors
    ok = check(write_recipe("base: &b {d_model: 64, n_heads: 4}\nmodel: {<<: *b, d_model: 128}\n", "m.yaml"))
    assert ok.exit_code == 2 and "base: unknown key" in ok.stderr  # the anchor's holder is not a section


def test_overrides(write_recipe):
    r = load_recipe(RECIPES / "tiny.yaml", ["model.kv_lora_rank=16", "parallel.engine=fsdp", "train.lr=1e-3"])
    assert r.model.kv_lora_rank == 16 and r.parallel.engine == "fsdp" and r.train.lr == 1e-3
    with pytest.raises(RecipeError, match="unknown section 'modle'; did you mean 'model'"):
        load_recipe(RECIPES / "tiny.yaml", ["modle.d_model=3"])
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        load_recipe(RECIPES / "tiny.yaml", ["model.d_model"])
    with pytest.raises(RecipeError, match="a dotted key needs a name at every level"):
        load_recipe(RECIPES / "tiny.yaml", ["model..d_model=3"])
    assert "not divisible" in refused(check(RECIPES / "tiny.yaml", "model.n_heads=5"))[0]
    # a typo is still an error once the attention switch makes the MLA keys inactive
    line = refused(check(RECIPES / "mla-1b.yaml", "model.attention=mha", "model.kv_lora_rnk=8"))[0]
    assert "model.kv_lora_rnk: unknown key; did you mean 'kv_lora_rank'?" in line


def test_defaults_are_resolved_once():
    r = recipe_from_dict({"model": {"attention": "mla", "d_model": 256, "n_heads": 4, "kv_lora_rank": 64}})
    m = r.model
    assert (m.head_dim, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.n_kv_heads) == (64, 64, 32, 64, 4)
    assert m.qk_head_dim == 96 and m.v_dim == 64
    # derived fields are not "given": re-validating what was given with d_model changed derives them again
    assert r.given() == {"model": {"attention": "mla", "d_model": 256, "n_heads": 4, "kv_lora_rank": 64}}
    assert api.resolve(r, ["model.d_model=512"]).model.head_dim == 128
    mqa = recipe_from_dict({"model": {"attention": "mqa"}}).model
    assert mqa.n_kv_heads == 1 and mqa.qk_rope_head_dim == mqa.head_dim
    half = recipe_from_dict({"model": {"d_model": 64, "n_heads": 4, "partial_rotary_factor": 0.5}}).model
    assert half.qk_rope_head_dim == 8 and half.qk_head_dim == 16


@pytest.mark.parametrize("path", MODEL_RECIPES + [RECIPES / "mla-1b.yaml"], ids=lambda p: p.name)
def test_a_resolved_recipe_reads_back_unchanged(path):
    """What `recipe show` prints is a recipe with the same resolution, digest and no inactive keys."""
    for r in (load_recipe(path), load_recipe(path, ["model.attention=mha"])):
        again = recipe_from_dict(r.to_dict())
        assert again.to_dict() == r.to_dict() and again.digest() == r.digest() and again.inactive == {}


def test_regression_feature_groups():
    m = recipe_from_dict({"model": {"task": "regression", "n_features": 22}}).model
    assert m.feature_groups == [6, 6, 5, 5] and sum(m.group_widths) == m.d_model
    with pytest.raises(RecipeError, match="sum to 19, not n_features=20"):
        recipe_from_dict({"model": {"task": "regression", "feature_groups": [10, 9]}})
    with pytest.raises(RecipeError, match="csv is for task=regression"):
        recipe_from_dict({"data": {"source": "csv", "path": "x.csv"}})


@pytest.mark.parametrize("path", MODEL_RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_are_valid(path):
    assert check(path).exit_code == 0


def test_a_sweep_file_is_not_a_recipe():
    lines = refused(check(RECIPES / "quickstart.yaml"))
    assert "this is a sweep file" in lines[0] and "scaletool sweep" in lines[0]


# ---------------------------------------------------------------------------------------------
# Inactive keys: switching attention or FFN needs no other change

# Recipe.digest of the shipped recipes as scaletool computed them before inactive keys existed: the
# keys of stored sweep results (benchmarks/results) must not move. The MoE recipes are the
# deliberate exception: their digest names model.moe_dispatch since its default became dropless, so a
# result of the capacity-dispatch era never passes for a dropless one.
DIGESTS = {"deepseek-v2-lite-dense.yaml": "518cf1268fc3fdfd", "deepseek-v2-lite.yaml": "b09a5188c98e4019",
           "deepseek-v3.yaml": "1d77fea06ac911ae", "llama3-405b-dense.yaml": "3484a3055f983457",
           "llama3-8b.yaml": "4e4d8fe615599eac", "mha-1b.yaml": "96128766125d413b", "mla-1b.yaml": "5689847a0352332a",
           "price-transformer.yaml": "247634a756c2bea4", "tiny.yaml": "929131e4362bde87"}


def test_digests_of_shipped_recipes_are_stable():
    assert {p.name: load_recipe(p).digest() for p in MODEL_RECIPES} == DIGESTS


def test_mla_recipe_switched_to_mha_is_the_mha_recipe():
    mha = load_recipe(RECIPES / "mla-1b.yaml", ["model.attention=mha"])
    assert mha.inactive == {"model.kv_lora_rank": 512, "model.qk_nope_head_dim": 128, "model.qk_rope_head_dim": 64,
                            "model.v_head_dim": 128}
    plain = load_recipe(RECIPES / "mha-1b.yaml")
    assert mha.model.kv_lora_rank == 0 and mha.model.qk_rope_head_dim == mha.model.head_dim == 128
    assert mha.to_dict() == plain.to_dict() and mha.digest() == plain.digest()
    # and back: the given MLA keys come back with the switch (api.resolve re-validates what was given)
    assert api.resolve(mha, ["model.attention=mla"]).digest() == load_recipe(RECIPES / "mla-1b.yaml").digest()


def test_estimate_of_the_switched_recipe_works():
    res = CliRunner().invoke(main, ["estimate", str(RECIPES / "mla-1b.yaml"), "--set", "model.attention=mha", "--json"])
    assert res.exit_code == 0, res.output
    ref = CliRunner().invoke(main, ["estimate", str(RECIPES / "mha-1b.yaml"), "--json"])
    assert json.loads(res.stdout)["params"] == json.loads(ref.stdout)["params"]


@pytest.mark.parametrize("sets, inactive", [
    (("model.attention=mqa", "model.n_kv_heads=4"), {"model.n_kv_heads": 4}),
    (("model.attention=mla", "model.kv_lora_rank=16", "model.qkv_bias=true", "model.partial_rotary_factor=0.5"),
     {"model.qkv_bias": True, "model.partial_rotary_factor": 0.5}),
    (("model.n_routed_experts=8", "model.scoring_func=sigmoid"), {"model.n_routed_experts": 8, "model.scoring_func": "sigmoid"}),
    (("model.n_routed_experts=0", "model.capacity_factor=1.25"), {}),  # given at their defaults: nothing to report
])
def test_keys_of_other_kinds_are_inactive_and_listed(sets, inactive):
    base = RECIPES / "mha-1b.yaml"
    r = load_recipe(base, ["model.attention=mha", *sets])
    assert r.inactive == inactive
    res = check(base, "model.attention=mha", *sets)
    assert res.exit_code == 0 and res.stdout.count("inactive: ") == len(inactive)
    show = CliRunner().invoke(main, ["recipe", "show", str(base), "--set", "model.attention=mha",
                                     *(a for s in sets for a in ("--set", s)), "--json"])
    doc = json.loads(show.stdout)
    assert doc["kind"] == "recipe" and doc["inactive"] == inactive and doc["digest"] == r.digest()
    assert recipe_from_dict(doc["recipe"]).digest() == r.digest()


def test_show_lists_inactive_keys_as_comments_and_stays_a_recipe(tmp_path):
    res = CliRunner().invoke(main, ["recipe", "show", str(RECIPES / "tiny.yaml"), "--set", "model.attention=gqa",
                                    "--set", "model.n_kv_heads=2"])
    assert res.exit_code == 0
    comments = [ln for ln in res.stdout.splitlines() if ln.startswith("#")]
    assert comments == [f"# inactive: model.{k} = {v} (read by attention=mla; this recipe has attention=gqa)"
                        for k, v in (("kv_lora_rank", 32), ("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8),
                                     ("v_head_dim", 16))]
    shown = tmp_path / "shown.yaml"
    shown.write_text(res.stdout)
    assert load_recipe(shown).digest() == load_recipe(RECIPES / "tiny.yaml", ["model.attention=gqa",
                                                                              "model.n_kv_heads=2"]).digest()


def test_quickstart_needs_no_null_lines(tmp_path):
    """recipes/quickstart.yaml nulls tiny.yaml's MLA keys for its MHA base; without those lines every
    point has the same key, so the lines can go."""
    from scaletool.sweep.points import expand
    from scaletool.sweep.spec import load_sweep

    spec = yaml.safe_load((RECIPES / "quickstart.yaml").read_text())
    trimmed = {**spec, "recipe": str(RECIPES / "tiny.yaml"),
               "set": {k: v for k, v in spec["set"].items() if k in ("model.attention",) or k.startswith("train.")}}
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(trimmed))
    keys = [[p.key(m, []) for m in spec["modes"]] for p in expand(load_sweep(RECIPES / "quickstart.yaml"))]
    assert keys == [[p.key(m, []) for m in spec["modes"]] for p in expand(load_sweep(tmp_path / "q.yaml"))]


def test_notes_are_kept_but_not_part_of_the_key():
    a = recipe_from_dict({"model": {"d_model": 256, "notes": ["imported from somewhere"]}})
    assert a.model.notes == ["imported from somewhere"] and a.to_dict()["model"]["notes"] == ["imported from somewhere"]
    assert a.digest() == recipe_from_dict({"model": {"d_model": 256}}).digest()


# ---------------------------------------------------------------------------------------------
# Bounds: every float finite, every size bounded, before anything builds or counts a model


@pytest.mark.parametrize("key, value", [
    ("train.lr", ".inf"), ("model.norm_eps", ".inf"), ("model.capacity_factor", ".inf"), ("model.rope_theta", ".nan"),
    ("train.weight_decay", ".nan"), ("model.routed_scaling_factor", ".inf"), ("profile.monitors.entropy_threshold", ".inf"),
    ("model.dropout", ".nan"), ("model.partial_rotary_factor", ".nan"),
])
def test_floats_are_finite(key, value):
    lines = refused(check(RECIPES / "tiny.yaml", f"{key}={value}"))
    assert len(lines) == 1 and f"{key}: Input should be a finite number" in lines[0]


@pytest.mark.parametrize("sets, expected", [
    (("model.n_layers=1000000000000000000000000000000",), "model.n_layers: Input should be less than or equal to 4096"),
    (("model.d_model=10000000000000000000",), "model.d_model: Input should be less than or equal to 1048576"),
    (("model.vocab_size=4294967296", "model.d_model=1048576", "model.n_heads=1024", "model.attention=mha"),
     "model: up to 9.02e+15 weights (n_layers=2, d_model=1048576, vocab_size=4294967296, ...), past the 1e+15"),
    (("model.attention=mha", "model.n_layers=4096", "model.d_model=131072", "model.n_heads=1024",
      "model.intermediate_size=524288"), "model: up to 1.13e+15 weights (n_layers=4096, d_model=131072"),
    (("train.seed=100000000000000000000",), "train.seed: must fit a 64-bit integer"),
    (("train.steps=9223372036854775808",), "train.steps: must fit a 64-bit integer"),
    (("model.max_seq_len=1000000000000",), "model.max_seq_len: Input should be less than or equal to 16777216"),
])
def test_sizes_are_bounded_with_the_figure_named(sets, expected):
    with no_hang():  # a size checked by building it would hang here
        lines = refused(check(RECIPES / "tiny.yaml", *sets))
    assert len(lines) == 1 and expected in lines[0], lines
    assert len(lines[0]) < 300


def test_the_weights_bound_is_an_upper_bound_within_a_small_factor():
    from scaletool.analytic.params import param_counts
    for path in MODEL_RECIPES:
        for sets in ((), ("model.attention=mha",), ("model.attention=mqa",)):
            m = load_recipe(path, list(sets)).model
            exact = param_counts(m)["total"]
            assert exact <= weights_bound(m) <= 3 * exact, (path.name, sets)


def test_estimate_and_count_refuse_absurd_sizes_before_building():
    for cmd in ("estimate", "count"):
        with no_hang():
            res = CliRunner().invoke(main, [cmd, str(RECIPES / "tiny.yaml"), "--set", f"model.n_layers={10**30}"])
        assert "model.n_layers: Input should be less than or equal to 4096" in refused(res)[0]


# ---------------------------------------------------------------------------------------------
# recipe check runs every rule train runs before launching


@pytest.mark.parametrize("sets, expected", [
    (("parallel.zero_stage=2",), "parallel.zero_stage: only used by engine=deepspeed, but parallel.engine=single"),
    (("parallel.cpu_offload=true", "parallel.engine=ddp"), "parallel.cpu_offload: only used by engine=fsdp"),
    (("parallel.engine=deepspeed", "parallel.deepspeed={gradient_clipping: 0.5}"),
     "parallel.deepspeed.gradient_clipping=0.5 conflicts with train.grad_clip (= 1.0); set it in one place"),
    (("parallel.engine=deepspeed", "parallel.deepspeed={scheduler: {type: WarmupLR}}"),
     "parallel.deepspeed.scheduler: the learning-rate schedule comes from train.lr"),
    (("parallel.engine=deepspeed", "parallel.offload_params=true"), "parallel.offload_params: needs parallel.zero_stage=3"),
    (("parallel.engine=deepspeed", "parallel.zero_stage=0", "parallel.offload_optimizer=true"),
     "parallel.offload_optimizer: needs parallel.zero_stage >= 1"),
])
def test_check_and_train_share_the_engine_rules(sets, expected):
    from scaletool.engines import check_recipe

    lines = refused(check(RECIPES / "tiny.yaml", *sets))
    assert len(lines) == 1 and expected in lines[0], lines
    with pytest.raises(RecipeError) as e:
        check_recipe(load_recipe(RECIPES / "tiny.yaml", list(sets)), 1, None)
    assert [f"error: {RECIPES / 'tiny.yaml'}: {p}" for p in e.value.problems] == lines
    # the engine is not used by estimate: it still estimates such a recipe
    assert CliRunner().invoke(main, ["estimate", str(RECIPES / "tiny.yaml"), "--json",
                                     *(a for s in sets for a in ("--set", s))]).exit_code == 0


@pytest.mark.parametrize("sets, expected", [
    (("data.source=text", "data.path=corpus.txt"), "model.vocab_size: 256 is too small for the byte-level tokenizer"),
    (("model.vocab_size=3",), "model.vocab_size: 3 is too small for synthetic tokens (need >= 4)"),
])
def test_check_runs_the_data_rules_that_need_no_file(sets, expected):
    from scaletool.config import BYTE_VOCAB
    from scaletool.train.data import ByteTokenizer

    assert BYTE_VOCAB == ByteTokenizer().vocab_size
    lines = refused(check(RECIPES / "tiny.yaml", *sets))
    assert len(lines) == 1 and expected in lines[0]


def test_world_size_rules_stay_at_launch():
    from scaletool.engines import check_recipe

    r = load_recipe(RECIPES / "tiny.yaml", ["parallel.engine=deepspeed", "parallel.deepspeed={train_batch_size: 8}"])
    assert check(RECIPES / "tiny.yaml", "parallel.engine=deepspeed", "parallel.deepspeed={train_batch_size: 8}").exit_code == 0
    check_recipe(r, 2, 2)  # 4 sequences × 1 micro-step × 2 ranks = 8
    with pytest.raises(RecipeError, match=r"train_batch_size=8 conflicts with .* \(= 16\)"):
        check_recipe(r, 4, 4)


# ---------------------------------------------------------------------------------------------
# YAML: bounded, safe, one line per problem


def _alias_bomb(levels: int = 9, fan: int = 9) -> str:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_unexpanded_in_one_line(write_recipe):
    """Nine levels of nine aliases: 700 bytes standing for 9^9 values in model.d_model."""
    path = write_recipe(_alias_bomb() + "model: {d_model: *a8}\n")
    assert len(path.read_bytes()) < 800
    for cmd in (["recipe", "check"], ["recipe", "show", "--json"], ["estimate"]):
        with no_hang():  # expanding 9^9 values would hang here
            lines = refused(CliRunner().invoke(main, [*cmd[:2], str(path), *cmd[2:]]))
        assert lines == [f"error: {path}: more than {MAX_NODES:,} values once YAML aliases are expanded "
                         "(a recipe has about a hundred); refusing it"]


def test_check_tree_counts_shared_objects_as_expanded_and_finds_cycles():
    leaf = [0] * 10
    tree = leaf
    for _ in range(4):
        tree = [tree] * 10  # 10^5 leaves, five distinct lists
    with pytest.raises(RecipeError, match="more than 100,000 values"):
        check_tree({"deepspeed": tree}, "x")
    check_tree([[0] * 10] * 10, "x")  # 111 values
    loop: list = []
    loop.append(loop)
    with pytest.raises(RecipeError, match="a cycle"):
        check_tree({"a": loop}, "x")
    deep: list = []
    for _ in range(70):
        deep = [deep]
    with pytest.raises(RecipeError, match="nested more than 64 levels"):
        check_tree(deep, "x")
    with pytest.raises(RecipeError, match="a cycle"):
        load_yaml_text("a: &a [1, *a]\n", "x")


def test_a_recipe_built_in_python_is_bounded_too():
    """api and sweep callers hand recipe_from_dict dicts, not files: digest and show must not walk a bomb."""
    tree: list = ["lol"] * 10
    for _ in range(8):
        tree = [tree] * 10
    with pytest.raises(RecipeError, match="once YAML aliases are expanded"):
        recipe_from_dict({"parallel": {"engine": "deepspeed", "deepspeed": {"x": tree}}})
