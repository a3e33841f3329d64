"""Options shared by several commands, defined once; the one way a command hands out its result; the console
its tables and messages go to."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import click

from scaletool.fmt import emit_json, stdout_to_stderr  # noqa: F401 (the commands' JSON writer)

# A plain string: yaml_input.read_yaml checks the path itself, so a directory or a FIFO gets the same
# one-line `error:` as every other recipe problem instead of click's usage message.
recipe_argument = click.argument("recipe", metavar="RECIPE")

set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a recipe key, e.g. --set model.kv_lora_rank=128 (repeatable; the value is read as YAML).")

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of tables.")


class PositiveFloat(click.FloatRange):
    """A float > 0 that is finite: click's FloatRange lets NaN and infinity through (they fail no comparison)."""

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


RESULT_FILE_KEY = "scaletool.result_file"


def deliver(result, as_json: bool = False):
    """Hand out a command's result: to the ``--result-file`` given to ``scaletool`` (written atomically:
    a sweep worker's channel, never parsed from stdout) and, with ``--json``, to stdout. Returns it."""
    from scaletool.errors import RecipeError, shorten
    from scaletool.fmt import clean, write_atomic

    data = result.model_dump(mode="json") if hasattr(result, "model_dump") else result
    ctx = click.get_current_context(silent=True)
    path = ctx.find_root().meta.get(RESULT_FILE_KEY) if ctx is not None else None
    if as_json:  # first: a result file that cannot be written loses nothing from stdout
        emit_json(data)
    if path is not None:
        try:
            write_atomic(Path(path), json.dumps(clean(data), indent=2, sort_keys=True) + "\n", follow_links=True)
        except OSError as e:
            raise RecipeError(f"--result-file {shorten(str(path))}: cannot write: {e.strerror or e}") from None
    return result


def console(stderr: bool = False):
    """A rich console for a command's tables and messages. On a terminal it fits the terminal; piped or
    redirected it writes plain text without colour, live displays or folding at rich's default 80
    columns (a table is as wide as its content, or as ``COLUMNS`` when that is set), so a log or ``| less``
    shows whole lines."""
    import sys

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    # an explicit COLUMNS (a CI log, `COLUMNS=80 scaletool ... | tee`) is the width asked for
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() and int(columns) >= 40 else 1000
    return Console(stderr=stderr, width=width, no_color=True, force_terminal=False, soft_wrap=False)
