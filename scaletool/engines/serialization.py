"""Reading checkpoints without running code from them, and checking them before they are loaded.

Pickle runs whatever a file tells it to construct, so a checkpoint from elsewhere can execute code
when loaded. Every read here is restricted to plain data:

- ``.pt`` files (DeepSpeed's model and optimizer states, any ``torch.save`` file) go through
  ``torch.load(weights_only=True)``, with DeepSpeed's two plain state classes allowed;
- ``torch.distributed.checkpoint`` (DCP) reads its ``.metadata`` with plain ``pickle.load`` and
  non-tensor entries with ``torch.load(weights_only=False)``; :class:`SafeFileSystemReader` and
  :class:`SafeLoadPlanner` replace both with allow-listed reads (the "restricting globals" recipe of
  the :mod:`pickle` documentation; torch's own weights-only unpickler for the entries).

A file that needs anything else is refused with :class:`UnsafeCheckpointError` (one line), unless
the caller trusts it (``trust=True``: full pickle, as the libraries would do).

:func:`shape_problem` compares a checkpoint's tensor shapes with a model's, so a checkpoint written
for another configuration fails with one line naming the tensor and both shapes instead of a
size-mismatch traceback from deep inside a loader.
"""
from __future__ import annotations

import io
import pathlib
import pickle
import re
import sys
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo

from scaletool.engines.checkpoint_files import dcp_data_problem, metadata_problem, model_states_problem
from scaletool.errors import RecipeError

_TRUST_HINT = "Load it only from a source you trust (trust_checkpoint)."


class UnsafeCheckpointError(RecipeError):
    """A checkpoint file that holds more than tensors and plain data (loading it could run code)."""


def _dcp_globals() -> dict[tuple[str, str], object]:
    allowed: dict[tuple[str, str], object] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("collections", "OrderedDict"): OrderedDict,
    }
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    for name, obj in vars(dcp_metadata).items():  # the metadata dataclasses and enums
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__:
            allowed[(dcp_metadata.__name__, name)] = obj
    for name, obj in vars(torch).items():
        if isinstance(obj, torch.dtype):
            allowed[("torch", name)] = obj
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, allowed: dict[tuple[str, str], object]):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed") from None


def _refusal(path: Path, err: Exception) -> RecipeError:
    """An unpickler's refusal as one line: a class beyond the allowed ones (unsafe), or bytes that are no
    pickle at all (corrupt)."""
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"([\w.]+) is not allowed", text)
    if found is None:
        return _corrupt(path, err)
    return UnsafeCheckpointError(
        f"{path}: refused: the file holds Python objects beyond tensors and plain data (it needs "
        f"{found.group(1)[:200]}); loading it could run code. {_TRUST_HINT}")


NOT_ARCHIVE = "not a torch.save archive (corrupt, cut short or another format)"
_NOISE = ("Weights only load failed", "In PyTorch", "Re-running", "Please file", "Check the documentation",
          "WeightsUnpickler error:")


def _reason(err: BaseException) -> str:
    """``Type: the first line that says what is wrong``, without torch's advice about weights_only."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and not ln.strip().startswith(_NOISE)]
    return f"{type(err).__name__}: {lines[0][:120]}" if lines else type(err).__name__


def _corrupt(path: Path, err: BaseException) -> RecipeError:
    if isinstance(err, IsADirectoryError):
        return RecipeError(f"{path}: a directory where a file is expected")
    if isinstance(err, OSError):
        return RecipeError(f"{path}: cannot read ({_reason(err)})")
    return RecipeError(f"{path}: not a readable checkpoint file (corrupt, cut short or written by something else: "
                       f"{_reason(err)})")


@contextmanager
def _quiet_interpreter_reports():
    """Garbage that makes the unpickler fail mid-object can also make CPython print a report of its own on the
    way out (a BYTEARRAY8 of an impossible length: "SystemError: deallocated bytearray object has exported
    buffers", through ``PyErr_Print``, i.e. ``sys.excepthook``; others through ``sys.unraisablehook``): held
    back here, since the failure itself becomes the one error line."""
    hooks = sys.excepthook, sys.unraisablehook
    sys.excepthook = lambda *args: None
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    finally:
        sys.excepthook, sys.unraisablehook = hooks


def read_dcp_metadata(ckpt_dir: str | Path, trust: bool = False) -> dcp_metadata.Metadata:
    """The ``.metadata`` of a DCP checkpoint directory, unpickled with DCP's own classes only."""
    path = Path(ckpt_dir) / ".metadata"
    try:
        data = path.read_bytes()
        with _quiet_interpreter_reports():
            md = pickle.loads(data) if trust else _RestrictedUnpickler(io.BytesIO(data), _dcp_globals()).load()
    except pickle.UnpicklingError as e:
        raise _refusal(path, e) from None
    except (Exception, RecursionError) as e:  # cut short or garbage: pickle raises many types
        raise _corrupt(path, e) from None
    problem = metadata_problem(md)
    if problem is not None:
        raise RecipeError(f"{path}: not the metadata torch.distributed.checkpoint writes: {problem}")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not written by scaletool
            raise RecipeError(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor entries (optimizer hyper-parameters, scaler state)
    read by ``torch.load(weights_only=True)`` instead of full pickle."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refusal(Path(str(read_item.storage_index.fqn)), e) from None
        except Exception as e:
            raise _corrupt(Path(str(read_item.storage_index.fqn)), e) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


@contextmanager
def single_process_intended():
    """DCP warns that "torch.distributed is disabled" whenever it saves or loads without a process group
    (the single engine, weights for decoding); that is the intended use, and nobody can act on it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def dcp_load(state: dict, ckpt_dir: str | Path, *, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` into ``state`` with the restricted reader and planner."""
    try:
        with single_process_intended():
            dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt_dir)), planner=SafeLoadPlanner(),
                     no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: every rank's failure, with its traceback as text
        err = next((exc for exc, _ in e.failures.values()), e)
        if isinstance(err, RecipeError):
            raise RecipeError(err.problems) from None
        raise RecipeError(f"{ckpt_dir}: cannot be loaded ({_reason(err)})") from None


def dcp_problem(ckpt_dir: str | Path) -> str | None:
    """Why a DCP checkpoint directory cannot be loaded (missing or unsafe metadata, a data file that is
    missing or shorter than the metadata says), or None."""
    d = Path(ckpt_dir)
    if not (d / ".metadata").exists():
        return "no .metadata (an interrupted save)"
    try:
        md = read_dcp_metadata(d)
    except RecipeError as e:
        return ".metadata: " + str(e).removeprefix(f"{d / '.metadata'}: ")
    return dcp_data_problem(d, md)


def dcp_shapes(ckpt_dir: str | Path, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Tensor shapes stored under ``prefix`` in a DCP checkpoint, by name without the prefix."""
    md = read_dcp_metadata(ckpt_dir)
    return {k[len(prefix):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, dcp_metadata.TensorStorageMetadata)}


def shape_problem(where: str | Path, found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
                  ) -> str | None:
    """One line naming the first tensor whose checkpoint shape differs from the model's (or that is
    missing), with a count of the others; None when every expected tensor is there with its shape."""
    bad = []
    for name, shape in expected.items():
        got = found.get(name)
        if got is None:
            bad.append(f"{name} is missing from the checkpoint (the model has it with shape {list(shape)})")
        elif tuple(got) != tuple(shape):
            bad.append(f"{name} has shape {list(got)} in the checkpoint but {list(shape)} in the recipe's model")
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more tensor{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
    return f"{where}: {bad[0]}{more}: the checkpoint was written for another model configuration"


# DeepSpeed's plain state classes found in its checkpoint files: loss scalers, the ZeRO stage, and where a
# parameter's fragment lies in a flat partition (a dataclass of two numbers)
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")


def _deepspeed_globals() -> list:
    import importlib

    from scaletool.engines.deepspeed_import import quiet_deepspeed

    found = []
    with quiet_deepspeed():
        for full in DEEPSPEED_GLOBALS:
            module, name = full.rsplit(".", 1)
            obj = getattr(importlib.import_module(module), name, None)  # by module: a package attribute may shadow it
            if obj is not None:
                found.append(obj)
    return found


def unsafe_globals(path: str | Path, *, deepspeed: bool = False) -> list[str]:
    """The classes and functions a ``torch.save`` file names beyond plain data (DeepSpeed's plain state
    classes allowed with ``deepspeed``), read from its pickle without running it or importing them."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (Exception, RecursionError) as e:
        raise _corrupt(Path(path), e) from None
    return [n for n in names if not (deepspeed and n in DEEPSPEED_GLOBALS)]


def load_pt(path: str | Path, *, trust: bool = False, map_location="cpu", deepspeed: bool = False, mmap: bool = False):
    """``torch.load`` a ``.pt`` file as plain data (tensors, containers, numbers, strings); with
    ``deepspeed`` also DeepSpeed's loss-scaler and ZeRO-stage classes. ``trust`` allows full pickle."""
    path = Path(path)
    if path.is_file() and not zipfile.is_zipfile(path):  # torch.save writes a zip archive; random bytes are none
        raise RecipeError(f"{path}: {NOT_ARCHIVE}")
    try:
        if trust:
            return torch.load(path, map_location=map_location, weights_only=False)
        if deepspeed:
            with torch.serialization.safe_globals(_deepspeed_globals()):
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise _refusal(path, e) from None
    except (Exception, RecursionError) as e:  # not a zip, a cut archive, a directory, no permission
        if isinstance(e, RecipeError):
            raise
        raise _corrupt(path, e) from None


def load_model_states(path: str | Path, *, trust: bool = False, mmap: bool = False) -> dict:
    """A DeepSpeed model-state file, checked to hold ``module`` as a mapping of names to tensors."""
    obj = load_pt(path, trust=trust, deepspeed=True, mmap=mmap)
    problem = model_states_problem(obj)
    if problem is not None:
        raise RecipeError(f"{path}: not the model states DeepSpeed writes: {problem}")
    return obj
