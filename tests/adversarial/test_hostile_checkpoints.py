"""Hostile checkpoints: `decode --checkpoint` and `train --resume` on checkpoints damaged after a real run.

One real run per engine (DCP for single, DeepSpeed's files for deepspeed) per module; each case copies
it and damages the copy: random bytes of the right size, empty and cut files, a directory where a file
is expected, a ``.metadata`` or model-state file that unpickles to allowed types of the wrong shape, a
``trainer.json`` lacking what a resume reads, a step number beyond int64. Each is one `error:` line,
exit 2, nothing written; DeepSpeed's own log lines never reach stdout.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from hostile import RECIPES, assert_process_refused, invoke, run_scaletool
from torch.distributed.checkpoint import metadata as md

from scaletool.engines.serialization import read_dcp_metadata

pytestmark = pytest.mark.slow  # real training runs

TINY = str(RECIPES / "tiny.yaml")
RUN = ["--no-measure", "--set", "train.steps=2", "--set", "train.checkpoint_every=2", "--set", "train.seq_len=16"]
DECODE = ["--device", "cpu", "--warmup-steps", "1", "--prefill-repeats", "1", "--context", "8", "--new-tokens", "2",
          "--json"]
DS = ["--set", "parallel.engine=deepspeed"]
STATES = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
BIG = "99999999999999999999999"


def _train(out: Path, *extra: str) -> Path:
    proc = run_scaletool("train", TINY, "--out", str(out), "--json", *RUN, *extra, timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory) -> Path:
    """A finished 2-step run of engine single, its checkpoint at step 2 (copy it before damaging it)."""
    return _train(tmp_path_factory.mktemp("dcp") / "run")


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory) -> Path:
    """The same with engine deepspeed (ZeRO's model and optimizer state files)."""
    return _train(tmp_path_factory.mktemp("ds") / "run", *DS)


def copy_of(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The run as if killed after its checkpoint (no summary: a resume has work to do); (run, checkpoint)."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / "summary.json").unlink()
    return out, out / "checkpoints" / "step_2"


def remanifest(d: Path) -> None:
    """Rewrite the completion marker to list the damaged files as they are now (a careful forger)."""
    files = {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file() and p.name != "COMPLETE"}
    (d / "COMPLETE").write_text(json.dumps({"step": 2, "files": files}))


def refused_decode(ckpt: Path, run: Path, *extra: str) -> str:
    (line,), _ = invoke(["decode", TINY, "--checkpoint", str(ckpt), *DECODE, *extra], within=run)
    return line


def refused_resume(run: Path, *extra: str) -> str:
    (line,), _ = invoke(["train", TINY, "--out", str(run), "--json", "--resume", *RUN[:1], "--set", "train.steps=3",
                         "--set", "train.checkpoint_every=2", "--set", "train.seq_len=16", *extra], within=run)
    assert line.startswith(f"error: no intact checkpoint to resume from; the newest, {run / 'checkpoints'}"), line
    return line


# -- DCP: data files and .metadata ------------------------------------------------------------------

def _random(name: str):
    def damage(d: Path):
        p = d / name
        p.write_bytes(os.urandom(p.stat().st_size))
    return damage


def _empty(name: str):
    return lambda d: (d / name).write_bytes(b"")


def _cut(name: str):
    def damage(d: Path):
        p = d / name
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    return damage


def _directory(name: str):
    def damage(d: Path):
        (d / name).unlink()
        (d / name).mkdir()
    return damage


def _metadata(change):
    """A .metadata that unpickles to DCP's own classes (or plain data), changed by ``change``."""
    def damage(d: Path):
        m = read_dcp_metadata(d)
        (d / ".metadata").write_bytes(pickle.dumps(change(m)))
    return damage


def _first(m: md.Metadata, cls=md.TensorStorageMetadata):
    return next(v for v in m.state_dict_metadata.values() if isinstance(v, cls))


def _set(obj, **attrs):
    for k, v in attrs.items():
        object.__setattr__(obj, k, v)


def _storage(m: md.Metadata, **attrs):
    _set(next(iter(m.storage_data.values())), **attrs)
    return m


def _chunk_beyond(m):
    t = _first(m)
    _set(t.chunks[0], sizes=torch.Size([s + 1 for s in t.size]))
    return m


def _unstored_chunk(m):
    t = _first(m)
    t.chunks.append(md.ChunkStorageMetadata(offsets=torch.Size([1] * len(t.size)), sizes=torch.Size([1] * len(t.size))))
    return m


DCP_CASES = [
    ("random data", _random("__0_0.distcp"), "__0_0.distcp: the item at byte 0"),
    ("empty data", _empty("__0_0.distcp"), "__0_0.distcp is 0 bytes, shorter than the"),
    ("cut data", _cut("__0_0.distcp"), "shorter than the"),
    ("data is a directory", _directory("__0_0.distcp"), "__0_0.distcp is not a regular file"),
    ("random metadata", _random(".metadata"), ".metadata"),
    # a BYTEARRAY8 of an impossible length: MemoryError, and CPython's own "SystemError: deallocated bytearray
    # object has exported buffers" report, which must not reach stderr beside the error line (a random .metadata
    # hit it once in CI)
    ("metadata an impossible bytearray", lambda d: (d / ".metadata").write_bytes(bytes.fromhex("96e47eae0b58d13b76")),
     "not a readable checkpoint file (corrupt, cut short or written by something else: MemoryError)"),
    ("empty metadata", _empty(".metadata"), "not a readable checkpoint file"),
    ("cut metadata", _cut(".metadata"), "not a readable checkpoint file"),
    ("metadata is a directory", _directory(".metadata"), "a directory where a file is expected"),
    ("metadata a dict", _metadata(lambda m: {"state_dict_metadata": {}}), "it holds dict, not DCP's Metadata"),
    ("metadata None", _metadata(lambda m: None), "it holds NoneType"),
    ("metadata a list", _metadata(lambda m: [m]), "it holds list"),
    ("metadata a number", _metadata(lambda m: 10**400), "it holds int"),
    ("entries a list", _metadata(lambda m: md.Metadata(state_dict_metadata=[1])), "its entries are list"),
    ("no storage_data", _metadata(lambda m: md.Metadata(state_dict_metadata=m.state_dict_metadata)),
     "its storage_data is NoneType"),
    ("size a string", _metadata(lambda m: (_set(_first(m), size="64"), m)[1]), "its size is '64'"),
    ("size negative", _metadata(lambda m: (_set(_first(m), size=(-1, 4)), m)[1]), "not a list of counts"),
    ("no dtype", _metadata(lambda m: (_set(_first(m), properties=None), m)[1]), "no tensor dtype"),
    ("chunks a dict", _metadata(lambda m: (_set(_first(m), chunks={}), m)[1]), "its chunks are {}"),
    ("chunk beyond the size", _metadata(_chunk_beyond), "a chunk reaches beyond the tensor's size"),
    ("chunk not stored", _metadata(_unstored_chunk), "is not in storage_data"),
    ("path outside", _metadata(lambda m: _storage(m, relative_path="../../../etc/passwd")),
     "not a file inside the checkpoint directory"),
    ("absolute path", _metadata(lambda m: _storage(m, relative_path="/etc/passwd")), "not a file inside"),
    ("offset negative", _metadata(lambda m: _storage(m, offset=-5)), "not a file, an offset and a length"),
    ("length a float", _metadata(lambda m: _storage(m, length=1.5)), "not a file, an offset and a length"),
    ("entry of another type", _metadata(lambda m: (m.state_dict_metadata.__setitem__("x", 3), m)[1]),
     "'x': int is neither tensor nor bytes metadata"),
]


@pytest.mark.parametrize("damage, why", [c[1:] for c in DCP_CASES], ids=[c[0] for c in DCP_CASES])
@pytest.mark.parametrize("marker", ["manifest rewritten", "no marker"])
def test_a_damaged_dcp_checkpoint_is_one_line_for_decode_and_resume(dcp_run, tmp_path, damage, why, marker):
    run, ckpt = copy_of(dcp_run, tmp_path)
    damage(ckpt)
    if marker == "no marker":  # as checkpoints from before the completion marker: verified without it
        (ckpt / "COMPLETE").unlink()
    else:
        remanifest(ckpt)
    line = refused_decode(ckpt, run)
    assert line.startswith(f"error: {ckpt}") and why in line, line
    assert why in refused_resume(run)


# -- DeepSpeed: model and optimizer state files ---------------------------------------------------------

def _states(obj):
    return lambda d: torch.save(obj, d / STATES)


def _without_module(d: Path):
    states = torch.load(d / STATES, weights_only=False)
    del states["module"]
    torch.save(states, d / STATES)


def _bad_shapes(d: Path):
    states = torch.load(d / STATES, weights_only=False)
    states["param_shapes"] = [{"tok_embeddings.weight": "big"}]
    torch.save(states, d / STATES)


DS_CASES = [
    ("random model states", _random(STATES), "not a torch.save archive"),
    ("empty model states", _empty(STATES), "not a torch.save archive"),
    ("cut model states", _cut(STATES), "not a torch.save archive"),
    ("model states a directory", _directory(STATES), "a directory where a file is expected"),
    ("module a list", _states({"module": [1, 2]}), "its module is list, not a mapping of names to tensors"),
    ("module a tensor", _states({"module": torch.zeros(3)}), "its module is Tensor"),
    ("module None", _states({"module": None}), "its module is NoneType"),
    ("module of numbers", _states({"module": {"w": 1}}), "its module maps 'w' to int, not a name to a tensor"),
    ("module keyed by numbers", _states({"module": {3: torch.zeros(1)}}), "its module maps 3 to Tensor"),
    ("states a list", _states([1]), "it holds list, not DeepSpeed's model states"),
    ("no module", _without_module, "its module is NoneType"),
    ("param_shapes of text", _bad_shapes, "its param_shapes maps 'tok_embeddings.weight' to 'big'"),
]


@pytest.mark.parametrize("damage, why", [c[1:] for c in DS_CASES], ids=[c[0] for c in DS_CASES])
def test_a_damaged_deepspeed_checkpoint_is_one_line_for_decode_and_resume(ds_run, tmp_path, damage, why):
    run, ckpt = copy_of(ds_run, tmp_path)
    damage(ckpt)
    remanifest(ckpt)
    line = refused_decode(ckpt, run)
    assert line.startswith(f"error: {ckpt}") and why in line, line
    assert why in refused_resume(run, *DS)


@pytest.mark.parametrize("damage, why", [
    (_random(OPTIM), f"{OPTIM}: not a torch.save archive"),
    (_empty(OPTIM), f"{OPTIM}: not a torch.save archive"),
    (_directory(OPTIM), f"{OPTIM}: a directory where a file is expected"),
    (lambda d: torch.save([1, 2], d / OPTIM), f"{OPTIM}: not the states DeepSpeed writes: it holds list"),
    (lambda d: torch.save({"x": os.system}, d / OPTIM), "it needs posix.system"),
], ids=["random", "empty", "directory", "a list", "a function"])
def test_a_damaged_deepspeed_optimizer_state_stops_a_resume_with_one_line(ds_run, tmp_path, damage, why):
    run, ckpt = copy_of(ds_run, tmp_path)
    damage(ckpt)
    remanifest(ckpt)
    assert why in refused_resume(run, *DS)


def test_a_deepspeed_checkpoint_resumes_and_decodes_with_only_json_on_stdout(ds_run, tmp_path):
    """The healthy neighbour: DeepSpeed's files (fragment_address, its plain dataclass, included) load, and
    its log lines stay off stdout."""
    run, ckpt = copy_of(ds_run, tmp_path)
    proc = run_scaletool("train", TINY, "--out", str(run), "--json", "--resume", *RUN[:1], "--set", "train.steps=3",
                         "--set", "train.checkpoint_every=2", "--set", "train.seq_len=16", *DS, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["start_step"] == 2
    proc = run_scaletool("decode", TINY, "--checkpoint", str(ckpt), *DECODE, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["checkpoint"] == str(ckpt)


def test_a_refused_deepspeed_checkpoint_prints_one_line_and_nothing_on_stdout(ds_run, tmp_path):
    """In a real process: DeepSpeed's logger takes sys.stdout at import; its notice must not precede the refusal."""
    run, ckpt = copy_of(ds_run, tmp_path)
    _states({"module": [1]})(ckpt)
    remanifest(ckpt)
    (line,) = assert_process_refused(run_scaletool("decode", TINY, "--checkpoint", str(ckpt), *DECODE, timeout=600,
                                                   cwd=tmp_path))
    assert "its module is list" in line


# -- trainer.json (the resume state) and step numbers ---------------------------------------------------

def _state(change):
    def damage(d: Path):
        state = json.loads((d / "trainer.json").read_text())
        change(state)
        (d / "trainer.json").write_text(json.dumps(state))
    return damage


STATE_CASES = [
    ("history empty", _state(lambda s: s.__setitem__("history", {})), "has no history of step, loss"),
    ("no loss", _state(lambda s: s["history"].pop("loss")), "has no history of loss"),
    ("no step", _state(lambda s: s["history"].pop("step")), "has no history of step"),
    ("no history", _state(lambda s: s.pop("history")), "has history None, not a mapping"),
    ("history a list", _state(lambda s: s.__setitem__("history", [])), "has history [], not a mapping"),
    ("loss text", _state(lambda s: s["history"].__setitem__("loss", "low")), "has history loss = 'low', not a list"),
    ("loss entry text", _state(lambda s: s["history"]["loss"].__setitem__(0, "x")), "loss entry 'x', not a number"),
    ("lengths differ", _state(lambda s: s["history"]["lr"].append(1.0)), "lists of different lengths"),
    ("step text", _state(lambda s: s.__setitem__("step", "2")), "has step '2', not a step number"),
    ("step true", _state(lambda s: s.__setitem__("step", True)), "has step True"),
    ("step float", _state(lambda s: s.__setitem__("step", 2.0)), "has step 2.0"),
    ("another step", _state(lambda s: s.__setitem__("step", 3)), "does not describe step 2"),
    ("no engine", _state(lambda s: s.pop("engine")), "has engine None, not an engine name"),
    ("segments a number", _state(lambda s: s.__setitem__("segments", 3)), "segments that are not a list"),
    ("a list", lambda d: (d / "trainer.json").write_text("[]"), "holds list, not a trainer state"),
    ("empty", _empty("trainer.json"), "trainer.json is unreadable"),
    ("not UTF-8", lambda d: (d / "trainer.json").write_bytes(b"\xff\xfe{"), "trainer.json is unreadable"),
    ("a directory", _directory("trainer.json"), "trainer.json is a directory"),
    ("nested deeply", lambda d: (d / "trainer.json").write_text("[" * 100000 + "]" * 100000), "unreadable"),
]


@pytest.mark.parametrize("damage, why", [c[1:] for c in STATE_CASES], ids=[c[0] for c in STATE_CASES])
def test_a_trainer_state_lacking_what_a_resume_reads_is_one_line(dcp_run, tmp_path, damage, why):
    run, ckpt = copy_of(dcp_run, tmp_path)
    damage(ckpt)
    remanifest(ckpt)
    assert why in refused_resume(run)


@pytest.mark.parametrize("digits", [BIG, "9" * 240, str(2**63)])
def test_a_step_number_beyond_int64_is_one_line(dcp_run, tmp_path, digits):
    run, ckpt = copy_of(dcp_run, tmp_path)
    big = ckpt.with_name(f"step_{digits}")
    ckpt.rename(big)
    _state(lambda s: s.__setitem__("step", int(digits)))(big)
    remanifest(big)
    why = "its step number is beyond 9223372036854775807"
    assert why in refused_resume(run)
    line = refused_decode(big, run)
    assert line.startswith("error: ") and line.endswith(f": {why} (not a checkpoint scaletool wrote)"), line
    (big / "COMPLETE").unlink()  # as a checkpoint from before the marker: still never resumed from
    assert why in refused_resume(run)


def test_a_checkpoint_path_that_is_a_file_is_one_line(dcp_run, tmp_path):
    run, ckpt = copy_of(dcp_run, tmp_path)
    line = refused_decode(ckpt / "trainer.json", run)
    assert line.startswith("error: invalid value for '--checkpoint'") and "is a file" in line, line
