"""Options shared by several commands, defined once."""
from __future__ import annotations

import click

from scaletool.fmt import emit_json, stdout_to_stderr  # noqa: F401 (the commands' JSON writer)

recipe_argument = click.argument("recipe", type=click.Path(dir_okay=False, path_type=str))

set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a recipe key, e.g. --set model.kv_lora_rank=128 (repeatable; the value is read as YAML).")

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of tables.")
