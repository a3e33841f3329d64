"""``python -m scaletool.launch.remote WORD``: run ``scaletool ARGS`` with ARGS packed in one word.

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
import sys

MODULE = "scaletool.launch.remote"


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


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("error: usage: python -m scaletool.launch.remote WORD (the encoded scaletool arguments)")
    try:
        args = decode(argv[0])
    except ValueError as e:
        print(f"error: {MODULE}: {e}", file=sys.stderr)
        sys.exit(2)
    from scaletool.cli import main as cli

    cli(args=args, prog_name="scaletool")


if __name__ == "__main__":
    main(sys.argv[1:])
