"""Argument checks the GPU probe scripts share (``sm_partition.py``, ``l2_prefetch.py``, ``merge_up_tune.py``,
``read_ceiling.py``):
a bad value is argparse's one ``error:`` line and exit 2 before anything runs or is written."""
from __future__ import annotations

import argparse
from pathlib import Path


def _at_least(text: str, low: int) -> int:
    try:
        n = int(text)
    except ValueError:
        n = low - 1
    if n < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text[:40]!r}")
    return n


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse ``type=``)."""
    return _at_least(text, 1)


def count(text: str) -> int:
    """An integer >= 0 (argparse ``type=``)."""
    return _at_least(text, 0)


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (argparse ``type=``)."""
    return [positive_int(x) for x in text.split(",")]


def checked(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``ap.parse_args(argv)``; then ``--out`` must name a file in an existing folder, and a CUDA GPU must be
    there (each refusal one ``error:`` line, exit 2)."""
    a = ap.parse_args(argv)
    out = Path(a.out)
    if out.is_dir() or not out.parent.is_dir():
        ap.error(f"--out {str(out)[:200]!r}: not a file in an existing folder")
    import torch

    if not torch.cuda.is_available():
        ap.error("the probe needs a CUDA GPU")
    return a
