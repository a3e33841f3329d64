"""Options shared by several commands, defined once."""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager

import click

recipe_argument = click.argument("recipe", type=click.Path(dir_okay=False, path_type=str))

set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a recipe key, e.g. --set model.kv_lora_rank=128 (repeatable; the value is read as YAML).")

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of tables.")


def emit_json(obj) -> None:
    """The single place JSON goes to stdout: sorted for diffing, no NaN/Inf (null instead)."""
    from scaletool.measure.metrics import clean

    sys.stdout.write(json.dumps(clean(obj), indent=2, sort_keys=True) + "\n")


@contextmanager
def stdout_to_stderr(enabled: bool = True):
    """Point file descriptor 1 at stderr (inherited by every worker a command starts), so that stdout
    carries only the command's own --json."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
