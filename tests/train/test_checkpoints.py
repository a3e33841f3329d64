"""Checkpoints as a careful user meets them: hostile pickles, damaged newest checkpoints, interrupted
saves, checkpoints of another model shape. Real files, real runs of the tiny recipe (engine single),
through the CLI where the user would be."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from scaletool.cli import main
from scaletool.config import load_recipe
from scaletool.engines.serialization import UnsafeCheckpointError, load_pt, read_dcp_metadata
from scaletool.errors import RecipeError
from scaletool.model import build_model
from scaletool.train.checkpoint import MARKER, load_model_weights

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
SETS = ["train.steps=4", "train.checkpoint_every=2", "train.measure_warmup_steps=1"]


class Payload:
    """A pickle that, when loaded without restriction, creates ``marker`` (standing in for any code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def train(out: Path, *sets: str, args=()):
    cmd = ["train", TINY, "--out", str(out), "--json", *args]
    for s in (*SETS, *sets):
        cmd += ["--set", s]
    return CliRunner().invoke(main, cmd)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (copy it before damaging it)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    r = train(out)
    assert r.exit_code == 0, r.stderr
    return out


def killed_copy(trained: Path, tmp_path: Path) -> Path:
    """The run as if killed after its last checkpoint: no summary, so a resume has work to do."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    (out / "summary.json").unlink()
    return out


def test_saves_are_complete_directories_with_a_manifest(trained):
    names = sorted(p.name for p in (trained / "checkpoints").iterdir())
    assert names == ["step_2", "step_4"]  # no .partial left behind
    manifest = json.loads((trained / "checkpoints" / "step_4" / MARKER).read_text())
    assert manifest["step"] == 4 and {".metadata", "trainer.json"} <= set(manifest["files"])
    assert all((trained / "checkpoints" / "step_4" / f).stat().st_size == n for f, n in manifest["files"].items())


def test_a_hostile_model_state_file_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "ds"
    d.mkdir()
    torch.save({"module": Payload(marker)}, d / "mp_rank_00_model_states.pt")
    model = build_model(load_recipe(TINY).model, "cpu", seed=0)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_model_weights(d, model)
    lines = err.value.problems
    assert len(lines) == 1 and "refused" in lines[0] and "posix.system" in lines[0] and "trust_checkpoint" in lines[0]
    with pytest.raises(UnsafeCheckpointError):
        load_pt(d / "mp_rank_00_model_states.pt")
    assert not marker.exists()


def test_a_hostile_dcp_metadata_stops_a_resume_with_one_line(trained, tmp_path):
    out = killed_copy(trained, tmp_path)
    marker = tmp_path / "pwned"
    for step in (2, 4):  # crafted to pass as checkpoints from before the completion marker
        (out / "checkpoints" / f"step_{step}" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        (out / "checkpoints" / f"step_{step}" / MARKER).unlink()
    with pytest.raises(UnsafeCheckpointError):
        read_dcp_metadata(out / "checkpoints" / "step_4")
    r = train(out, args=("--resume",))
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no intact checkpoint to resume from")
    assert str(out / "checkpoints" / "step_4") in lines[0] and "posix.system" in lines[0]
    assert not marker.exists() and "Traceback" not in r.output


def _truncate_data(d: Path) -> None:
    data = next(d.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _bad_trainer_json(d: Path) -> None:
    (d / "trainer.json").write_text("{not json")


def _no_metadata(d: Path) -> None:
    (d / ".metadata").unlink()


def _legacy_truncated(d: Path) -> None:
    """A checkpoint from before the completion marker, whose data file was cut short."""
    (d / MARKER).unlink()
    _truncate_data(d)


@pytest.mark.parametrize("damage, why", [
    (_truncate_data, "__0_0.distcp is"),
    (_bad_trainer_json, "trainer.json is"),
    (_no_metadata, ".metadata is missing"),
    (_legacy_truncated, "shorter than the"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(trained, tmp_path, damage, why):
    out = killed_copy(trained, tmp_path)
    damage(out / "checkpoints" / "step_4")
    r = train(out, args=("--resume",))
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["resumed_from"] == str(out / "checkpoints" / "step_2") and s["start_step"] == 2
    assert s["history"]["loss"] == pytest.approx(json.loads((trained / "summary.json").read_text())["history"]["loss"])
    log = (out / "train.log").read_text()
    assert f"warning: skipping checkpoint {out / 'checkpoints' / 'step_4'}: " in log and why in log


def test_an_interrupted_save_is_ignored_and_replaced(trained, tmp_path):
    out = killed_copy(trained, tmp_path)
    partial = out / "checkpoints" / ".step_4.partial"
    (out / "checkpoints" / "step_4").rename(partial)  # killed before the rename
    r = train(out, args=("--resume",))
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["start_step"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]


def test_a_checkpoint_of_another_shape_is_one_line_naming_the_tensor(trained, tmp_path):
    out = killed_copy(trained, tmp_path)
    r = train(out, "model.d_model=32", args=("--resume",))
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "tok_embeddings.weight has shape [256, 64] in the checkpoint but [256, 32] in the recipe's model" in lines[0]
    assert "another model configuration" in lines[0]
    model = build_model(load_recipe(TINY, ["model.n_heads=2"]).model, "cpu", seed=0)
    with pytest.raises(RecipeError, match=r"layers\.0\.attn\.wq\.weight has shape \[96, 64\] in the checkpoint but "
                                          r"\[48, 64\]"):
        load_model_weights(trained / "checkpoints" / "step_4", model)


def test_weights_load_into_a_plain_model(trained):
    model = build_model(load_recipe(TINY).model, "cpu", seed=99)
    load_model_weights(trained / "checkpoints" / "step_4", model)
    again = build_model(load_recipe(TINY).model, "cpu", seed=7)
    load_model_weights(trained / "checkpoints" / "step_4", again)
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
