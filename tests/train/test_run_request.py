"""A train run from a typed request (scaletool.train.run) and settings as typed values: what the package sets
is taken as it is (never re-read from text), crosses to local ranks as JSON that reads back to the same value,
and a run's request cannot change once made."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from conftest import RECIPES

from scaletool import api
from scaletool.config import load_recipe
from scaletool.engines import launcher_env
from scaletool.errors import RecipeError
from scaletool.train.resume import Resume
from scaletool.train.run import TrainRequest, _rank_inputs, run_train
from scaletool.yaml_input import override_text, parse_override

TINY = RECIPES / "tiny.yaml"


@pytest.mark.parametrize("value", [8, 0.5, 1e-4, True, False, None, "bf16", "yes", "a=b: c # d", "[1,2]", [0, 2],
                                   {"k": [1, "x"]}, "1e3", "null", ""])
def test_a_setting_crosses_to_a_rank_as_text_that_reads_back_the_same(value):
    key, back = parse_override(override_text("train.x", value))
    assert key == "train.x" and back == value and type(back) is type(value)


def test_settings_are_taken_as_values_where_the_same_text_would_be_read_as_yaml():
    """``data.path=yes`` as --set text is YAML's true (refused); as a setting it is the file name "yes"."""
    with pytest.raises(RecipeError, match="data.path"):
        api.resolve(TINY, ["data.path=yes"])
    assert api.resolve(TINY, settings={"data.path": "yes"}).data.path == "yes"


def test_settings_apply_after_overrides_to_paths_and_recipe_objects_alike():
    r = api.resolve(TINY, ["train.steps=7", "train.lr=0.01"], {"train.steps": 3})
    assert (r.train.steps, r.train.lr) == (3, 0.01)
    again = api.resolve(load_recipe(TINY), ["train.steps=7"], {"train.steps": 3, "model.dtype": "fp32"})
    assert again.digest() == api.resolve(TINY, settings={"train.steps": 3, "model.dtype": "fp32"}).digest()
    with pytest.raises(RecipeError, match="unknown section"):
        api.resolve(TINY, settings={"trian.steps": 3})


def _request(source, tmp_path, **kw) -> TrainRequest:
    settings = kw.pop("settings", {})
    overrides = kw.pop("overrides", ())
    return TrainRequest(recipe=api.resolve(source, overrides, settings), source=source, out=tmp_path / "run",
                        launcher=launcher_env(), resume=kw.pop("resume", Resume.NEVER), overrides=tuple(overrides),
                        settings=settings, **kw)


def test_a_request_is_frozen(tmp_path):
    req = _request(TINY, tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.out = tmp_path / "elsewhere"
    assert req.resume is Resume.NEVER and req.run_dir() == tmp_path / "run"


def test_local_ranks_read_the_callers_file_with_its_overrides_then_the_settings(tmp_path):
    req = _request(TINY, tmp_path, overrides=("train.steps=9",), settings={"train.steps": 2, "data.path": "yes"})
    recipe, args = _rank_inputs(req, tmp_path)
    assert recipe == str(TINY) and args == ("train.steps=9", 'train.steps=2', 'data.path="yes"')
    assert load_recipe(recipe, list(args)).digest() == req.recipe.digest()  # what each rank resolves


def test_local_ranks_of_a_recipe_object_read_it_from_the_run_directory(tmp_path):
    req = _request(load_recipe(TINY), tmp_path, settings={"train.steps": 2})
    recipe, args = _rank_inputs(req, tmp_path)
    assert (recipe, args) == (str(tmp_path / "recipe.yaml"), ())
    written = yaml.safe_load(Path(recipe).read_text())
    assert written["train"]["steps"] == 2 and load_recipe(recipe).digest() == req.recipe.digest()


def test_callbacks_are_refused_for_a_run_over_local_ranks_before_anything_is_written(tmp_path):
    req = _request(TINY, tmp_path, nproc_per_node=2, callbacks=(object(),))
    with pytest.raises(RecipeError, match="callbacks: the ranks of a multi-process run are separate processes"):
        run_train(req)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_api_train_takes_settings_and_the_run_follows_them(tmp_path):
    """Two steps of the tiny recipe in this process, its step count and a constant learning rate set as typed
    values: the summary on disk has two steps, each at that rate."""
    settings = {"train.steps": 2, "train.lr": 0.002, "train.warmup_steps": 0, "train.min_lr_ratio": 1.0}
    res = api.train(TINY, settings=settings, out=tmp_path / "run", quiet=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert res.status == "completed" and res.steps_completed == summary["steps_completed"] == 2
    assert res.history.lr == pytest.approx([0.002, 0.002])
