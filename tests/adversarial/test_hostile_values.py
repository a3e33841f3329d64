"""Values that would be silently wrong: YAML booleans taken as numbers (and numbers as booleans), and a
--set that resets a whole section to its defaults. Each is one line, in a recipe file and in --set."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hostile import RECIPES, invoke

from scaletool.cli import main

TINY = str(RECIPES / "tiny.yaml")


@pytest.mark.parametrize("override, key", [
    ("model.n_layers=yes", "model.n_layers"), ("model.n_layers=true", "model.n_layers"),
    ("model.d_model=on", "model.d_model"), ("train.lr=no", "train.lr"), ("train.steps=off", "train.steps"),
    ("train.micro_batch_size=True", "train.micro_batch_size"), ("model.vocab_size=false", "model.vocab_size"),
    ("model.dtype=yes", "model.dtype"), ("train.seed=y", None),
])
def test_a_boolean_is_not_a_number(override, key):
    if key is None:  # PyYAML reads a bare y as text, which is then no integer either
        lines, _ = invoke(["estimate", TINY, "--set", override])
        assert len(lines) == 1 and "train.seed" in lines[0]
        return
    lines, _ = invoke(["estimate", TINY, "--set", override])
    assert len(lines) == 1 and f"{key}: a boolean is not a number or text here" in lines[0], lines


@pytest.mark.parametrize("override, key", [
    ("train.fused_optimizer=2", "train.fused_optimizer"), ("parallel.expert_parallel=0", "parallel.expert_parallel"),
    ("model.tie_embeddings=1", "model.tie_embeddings"), ("model.qkv_bias=0.5", "model.qkv_bias"),
])
def test_a_number_is_not_a_boolean(override, key):
    lines, _ = invoke(["estimate", TINY, "--set", override])
    assert len(lines) == 1 and f"{key}: expected true or false, not a number" in lines[0], lines


def test_a_boolean_in_a_recipe_file_is_refused(tmp_path):
    text = (RECIPES / "tiny.yaml").read_text().replace("n_layers: 2", "n_layers: yes")
    assert "n_layers: yes" in text
    (tmp_path / "r.yaml").write_text(text)
    lines, _ = invoke(["estimate", str(tmp_path / "r.yaml")])
    assert len(lines) == 1 and "model.n_layers: a boolean is not a number" in lines[0]


@pytest.mark.parametrize("override, needle", [
    ("model={}", "override model={}: would reset the whole model section to its defaults"),
    ("train=null", "override train=None: would reset the whole train section"),
    ("parallel=", "override parallel=None: would reset the whole parallel section"),
    ("data=[]", "override data=[]: would reset the whole data section"),
    ("model=3", "override model=3: a section takes a mapping of its keys"),
    ("train=[1, 2]", "override train=[1, 2]: a section takes a mapping"),
])
def test_a_whole_section_is_never_silently_reset(override, needle):
    lines, _ = invoke(["estimate", TINY, "--set", override])
    assert len(lines) == 1 and lines[0].startswith(f"error: {needle}"), lines


def test_a_section_mapping_is_merged_into_the_recipe():
    res = CliRunner().invoke(main, ["estimate", TINY, "--set", "model={n_layers: 3}", "--json"])
    assert res.exit_code == 0, res.output
    model = json.loads(res.stdout)["model"]
    assert model["n_layers"] == 3 and model["d_model"] == 64  # the recipe's other keys kept
