"""The shape a checkpoint's files must have before a library is given them.

A restricted unpickler only keeps code from running: a ``.metadata`` that unpickles to a list, a
tensor entry whose size is a string, a ``storage_data`` entry pointing outside the checkpoint, a
DeepSpeed model-state file whose ``module`` is not a mapping of tensors, or a data file of the right
size holding random bytes all still reach torch or DeepSpeed, which fail deep inside with a traceback.
Each check here returns one line saying what is wrong (or None), read from the files without loading
the tensors.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint.metadata as m
from torch.distributed.checkpoint.filesystem import _StorageInfo

from scaletool.errors import echo

_MAX = 2**63 - 1  # sizes, offsets and lengths are int64 in torch
# torch.save writes a zip archive: a local file header first, the end-of-central-directory record last
_ZIP_HEAD, _ZIP_END, _END_RECORD = b"PK\x03\x04", b"PK\x05\x06", 22


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX


def _shape(v) -> bool:
    return isinstance(v, (tuple, list, torch.Size)) and all(_count(x) for x in v)


def _tensor_problem(name: str, meta: m.TensorStorageMetadata) -> str | None:
    size, chunks, props = (getattr(meta, a, None) for a in ("size", "chunks", "properties"))
    if not _shape(size):
        return f"{name}: its size is {echo(size)}, not a list of counts"
    if not isinstance(props, m.TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
        return f"{name}: no tensor dtype"
    if not isinstance(chunks, list):
        return f"{name}: its chunks are {echo(chunks)}, not a list"
    for c in chunks:
        offsets, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
        if not (isinstance(c, m.ChunkStorageMetadata) and _shape(offsets) and _shape(sizes)
                and len(offsets) == len(sizes) == len(size)):
            return f"{name}: a chunk that is not offsets and sizes of a {len(size)}-dimensional tensor"
        if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            return f"{name}: a chunk reaches beyond the tensor's size {list(size)}"
    return None


def metadata_problem(md) -> str | None:
    """Why an unpickled DCP ``.metadata`` is not the metadata DCP writes (entries, chunks, where each
    chunk is stored), or None."""
    if not isinstance(md, m.Metadata):
        return f"it holds {type(md).__name__}, not DCP's Metadata"
    entries, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(entries, dict):
        return f"its entries are {type(entries).__name__}, not a mapping"
    if not isinstance(storage, dict):
        return f"its storage_data is {type(storage).__name__}, not a mapping"
    for info in storage.values():
        path, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(info, _StorageInfo) or not (_count(offset) and _count(length)):
            return "a storage_data entry is not a file, an offset and a length"
        if not isinstance(path, str) or path in ("", ".", "..") or "/" in path or "\\" in path or "\0" in path:
            return f"a storage_data entry names {echo(path)}, not a file inside the checkpoint directory"
    for name, meta in entries.items():
        if not isinstance(name, str):
            return f"an entry is named {echo(name)}, not by text"
        if isinstance(meta, m.BytesStorageMetadata):
            if m.MetadataIndex(name) not in storage:
                return f"{echo(name)}: not in storage_data"
        elif isinstance(meta, m.TensorStorageMetadata):
            problem = _tensor_problem(echo(name), meta)
            if problem:
                return problem
            for c in meta.chunks:
                if m.MetadataIndex(name, c.offsets) not in storage:
                    return f"{echo(name)}: a chunk at {list(c.offsets)} is not in storage_data"
        else:
            return f"{echo(name)}: {type(meta).__name__} is neither tensor nor bytes metadata"
    return None


def dcp_data_problem(d: Path, md: m.Metadata) -> str | None:
    """Why the data files a checked ``md`` points into cannot hold what it says: missing, shorter than
    it needs, not a file, or a stored item that is not a ``torch.save`` archive (random or shifted
    bytes). Reads a few bytes at each item's ends, not the tensors."""
    items: dict[str, list[_StorageInfo]] = {}
    for info in md.storage_data.values():
        items.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(items.items()):
        f = d / name
        if not f.exists():
            return f"{name} is missing"
        if not f.is_file():
            return f"{name} is not a regular file"
        size, end = f.stat().st_size, max(i.offset + i.length for i in infos)
        if size < end:
            return f"{name} is {size} bytes, shorter than the {end} its metadata needs (a half-written file)"
        try:
            with f.open("rb") as fh:
                for i in sorted(infos, key=lambda i: i.offset):
                    fh.seek(i.offset)
                    head = fh.read(len(_ZIP_HEAD))
                    fh.seek(i.offset + i.length - _END_RECORD)
                    tail = fh.read(len(_ZIP_END))
                    if i.length < _END_RECORD or head != _ZIP_HEAD or tail != _ZIP_END:
                        return (f"{name}: the item at byte {i.offset} ({i.length} bytes) is not a torch.save "
                                "archive (the file is corrupt)")
        except OSError as e:
            return f"{name}: cannot read ({e.strerror or e})"
    return None


def model_states_problem(obj) -> str | None:
    """Why a DeepSpeed model-state file's contents are not what DeepSpeed writes (a mapping holding
    ``module``, a mapping of names to tensors, and ``param_shapes``, a list of name-to-shape mappings,
    when present), or None."""
    if not isinstance(obj, Mapping):
        return f"it holds {type(obj).__name__}, not DeepSpeed's model states (a mapping)"
    module = obj.get("module")
    if not isinstance(module, Mapping):
        return f"its module is {type(module).__name__}, not a mapping of names to tensors"
    for k, v in module.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            return f"its module maps {echo(k)} to {type(v).__name__}, not a name to a tensor"
    groups = obj.get("param_shapes")
    if groups is not None:
        if not isinstance(groups, Sequence) or not all(isinstance(g, Mapping) for g in groups):
            return "its param_shapes is not a list of name-to-shape mappings"
        for g in groups:
            for k, v in g.items():
                if not isinstance(k, str) or not _shape(v):
                    return f"its param_shapes maps {echo(k)} to {echo(v)}, not a name to a shape"
    return None
