"""``python -m scaletool.cli.remote WORD`` runs ``scaletool ARGS`` with ARGS packed in one word; the packing.

DeepSpeed's pdsh runner joins its arguments into the command a remote shell runs on every host and
quotes only arguments that contain spaces (in double quotes, where ``$(...)`` still expands). So a
multi-node DeepSpeed launch hands its workers the ``scaletool train`` arguments (recipe path, run
directory, ``--set`` values) as one URL-safe base64 word of a JSON list: letters, digits, ``-``,
``_`` and ``=``, which no shell reads anything into.
"""
from __future__ import annotations

import base64
import binascii
import json

MODULE = "scaletool.cli.remote"  # the entry point that unpacks and runs the arguments


def encode(args: list[str]) -> str:
    """``args`` as one shell-inert word."""
    return base64.urlsafe_b64encode(json.dumps(list(args)).encode()).decode("ascii")


def decode(word: str) -> list[str]:
    """The argument list of :func:`encode`; ValueError for anything else."""
    try:
        args = json.loads(base64.urlsafe_b64decode(word.encode("ascii")) if word.isascii() else b"")
    except (binascii.Error, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not an encoded argument list ({e})") from None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError("not an encoded argument list")
    return args
