"""Hostile `--set KEY=VALUE` values: refused with `error:` lines, fast; nothing a value says is executed."""
from __future__ import annotations

import pytest
from hostile import RECIPES, invoke


def bomb_value(levels: int = 8, fan: int = 9) -> str:
    """A flow-style YAML mapping whose last anchor stands for fan**levels values (about 600 bytes)."""
    parts = [f"a0: &a0 [{', '.join(['x'] * fan)}]"]
    parts += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, levels)]
    return "{" + ", ".join(parts) + "}"


# (id, the --set items, the expected start of the first error line after "error: ")
CASES = [
    ("alias-bomb", [f"parallel.deepspeed={bomb_value()}"], "--set parallel.deepspeed: more than 100,000 values"),
    ("recursive-alias", ["parallel.deepspeed=&d {self: *d}"], "--set parallel.deepspeed: a YAML alias refers to"),
    ("no-equals", ["model.d_model"], "--set 'model.d_model': expected KEY=VALUE"),
    ("empty-key", ["=5"], "override : a dotted key needs a name at every level"),
    ("empty-part", ["model..d_model=3"], "override model..d_model: a dotted key needs a name"),
    ("trailing-dot", ["model.=3"], "override model.: a dotted key needs a name"),
    ("unknown-section", ["modle.d_model=3"], "override modle.d_model: unknown section 'modle'; did you mean 'model'?"),
    ("into-a-scalar", ["model.d_model.width=3"], "override model.d_model.width: 'd_model' is not a mapping"),
    ("unknown-key", ["model.d_modle=3"], "recipe.yaml: model.d_modle: unknown key; did you mean 'd_model'?"),
    ("huge-key", ["model." + "k" * 200_000 + "=1"], "recipe.yaml: model." + "k" * 28 + "..." + "k" * 29 + ": unknown key"),
    ("huge-section-name", ["x" * 200_000 + ".y=1"], "override " + "x" * 28 + "..." + "x" * 27 + ".y: unknown section"),
    ("huge-value", ["model.attention=" + "m" * 200_000], "recipe.yaml: model.attention: Input should be"),
    ("integer-past-digit-limit", ["model.d_model=" + "9" * 5000], "recipe.yaml: model.d_model: Unable to parse"),
    ("inf-float", ["model.norm_eps=1.0e999"], "recipe.yaml: model.norm_eps: Input should be a finite number"),
    ("nan", ["train.lr=.nan"], "recipe.yaml: train.lr: Input should be a finite number"),
    ("inf-capacity", ["model.capacity_factor=.inf"], "recipe.yaml: model.capacity_factor: Input should be a finite"),
    ("n_layers-1e30", ["model.n_layers=" + "1" + "0" * 30], "recipe.yaml: model.n_layers: Input should be less than"),
    ("negative-heads", ["model.n_kv_heads=-1"], "recipe.yaml: model.n_kv_heads: Input should be greater than 0"),
    ("python-tag", ["parallel.deepspeed=!!python/object/apply:os.system ['touch pwned-by-set']"],
     "recipe.yaml: parallel.deepspeed: Input should be a valid dictionary"),
    ("list-for-a-section", ["model=[1, 2]"], "override model=[1, 2]: a section takes a mapping of its keys"),
    ("wrong-type", ["model.qkv_bias=maybe"], "recipe.yaml: model.qkv_bias: Input should be a valid boolean"),
    ("deepspeed-scheduler", ["parallel.engine=deepspeed", "parallel.deepspeed={scheduler: {type: WarmupLR}}"],
     "recipe.yaml: parallel.deepspeed.scheduler: the learning-rate schedule"),
    ("inf-in-deepspeed", ["parallel.deepspeed={x: .inf}"], "recipe.yaml: parallel.deepspeed: x: inf is not a finite"),
    ("date-in-deepspeed", ["parallel.deepspeed={when: 2024-05-01}"], "recipe.yaml: parallel.deepspeed: when: a date"),
]


@pytest.mark.parametrize("sets, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_override_is_refused(tmp_path, monkeypatch, sets, expected):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((RECIPES / "tiny.yaml").read_text())
    args = [a for s in sets for a in ("--set", s)]
    lines, _ = invoke(["recipe", "check", str(recipe), *args], within=tmp_path)
    shown = lines[0].removeprefix("error: ").removeprefix(str(tmp_path) + "/")
    assert shown.startswith(expected), shown[:300]
    assert not (tmp_path / "pwned-by-set").exists()
