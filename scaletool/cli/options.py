"""Options shared by several commands, defined once."""
from __future__ import annotations

import json
import sys

import click

recipe_argument = click.argument("recipe", type=click.Path(dir_okay=False, path_type=str))

set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a recipe key, e.g. --set model.kv_lora_rank=128 (repeatable; the value is read as YAML).")

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of tables.")


def emit_json(obj) -> None:
    """The single place JSON goes to stdout: sorted for diffing, no NaN (null instead)."""
    sys.stdout.write(json.dumps(_clean(obj), indent=2, sort_keys=True) + "\n")


def _clean(o):
    if isinstance(o, float) and o != o:
        return None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o
