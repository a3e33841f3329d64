"""``python -m scaletool.cli.remote WORD``: run ``scaletool ARGS`` with ARGS packed by
:func:`scaletool.launch.remote.encode` (what a multi-node DeepSpeed launch hands its ranks over pdsh)."""
from __future__ import annotations

import sys

from scaletool.launch.remote import MODULE, decode


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        print(f"error: usage: python -m {MODULE} WORD (the encoded scaletool arguments)", file=sys.stderr)
        sys.exit(2)
    try:
        args = decode(argv[0])
    except ValueError as e:
        print(f"error: {MODULE}: {e}", file=sys.stderr)
        sys.exit(2)
    from scaletool.cli import main as cli

    cli(args=args, prog_name="scaletool")


if __name__ == "__main__":
    main(sys.argv[1:])
