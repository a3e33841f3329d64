"""Hostile data.path values for data.source=tokens: the error names what the path is (/dev/zero once gave
"4096 bytes is not a multiple of 2"), checked before the file is opened, so a FIFO cannot block."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hostile import RECIPES, invoke

from scaletool.config import RecipeError
from scaletool.train.data import token_file


def written(name: str, data: bytes):
    def make(d: Path) -> Path:
        (d / name).write_bytes(data)
        return d / name
    return make


def fifo(d: Path) -> Path:
    os.mkfifo(d / "t.fifo")
    return d / "t.fifo"


def link_to_dev_null(d: Path) -> Path:
    (d / "null").symlink_to("/dev/null")
    return d / "null"


@pytest.mark.parametrize("make, dtype, expected", [
    (lambda d: Path("/dev/zero"), "uint16", "is a character device, not a regular file"),
    (fifo, "uint16", "is a FIFO (named pipe), not a regular file"),
    (lambda d: d, "uint16", "is a directory; data.source=tokens reads one flat file"),
    (written("empty.bin", b""), "uint16", "is empty"),
    (written("odd.bin", b"\0" * 7), "uint16",
     "holds 7 bytes, not a whole number of 2-byte uint16 token ids; is data.token_dtype right?"),
    (written("six.bin", b"\0" * 6), "uint32", "holds 6 bytes, not a whole number of 4-byte"),
    (link_to_dev_null, "uint16", "is a character device"),
    (lambda d: d / "missing.bin", "uint16", "cannot read: No such file or directory"),
], ids=["dev-zero", "fifo", "directory", "empty", "odd-size", "uint32-odd-size", "symlink-to-dev-null", "missing"])
def test_what_is_not_a_token_file_is_named(tmp_path, make, dtype, expected):
    path = make(tmp_path)
    with pytest.raises(RecipeError) as e:
        token_file(path, dtype)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(f"data.path: {path}")
    assert expected in e.value.problems[0]


def test_a_token_file_is_memory_mapped(tmp_path):
    ids = np.arange(1000, dtype=np.uint32)
    ids.tofile(tmp_path / "t.bin")
    got = token_file(tmp_path / "t.bin", "uint32")
    assert isinstance(got, np.memmap) and got.dtype == np.uint32 and (got == ids).all()


def test_train_names_the_device(tmp_path):
    lines, _ = invoke(["train", str(RECIPES / "tiny.yaml"), "--set", "data.source=tokens", "--set", "data.path=/dev/zero",
                       "--out", str(tmp_path / "run")])
    assert lines == ["error: data.path: /dev/zero is a character device, not a regular file; data.source=tokens "
                     "memory-maps a flat file of token ids"]
