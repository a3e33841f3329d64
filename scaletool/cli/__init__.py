"""The ``scaletool`` command: one click group, one module per command.

Domain errors (a bad recipe, a missing file) are caught once, in :class:`ScaletoolGroup`, and become
one line per problem on stderr with exit status 2; nothing else is turned into a traceback-free exit.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from scaletool import __version__
from scaletool.cli.options import RESULT_FILE_KEY
from scaletool.config import RecipeError

# (module, command attribute): each module under scaletool/cli defines its own command.
COMMANDS = [
    ("estimate", "estimate"),
    ("count", "count"),
    ("recipe", "recipe"),
    ("train", "train"),
    ("decode", "decode"),
    ("sweep", "sweep"),
    ("report", "report"),
    ("quickstart", "quickstart"),
    ("profile", "profile"),
    ("launch", "launch"),
]


class ScaletoolGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RecipeError as e:
            for line in e.problems:
                click.echo(f"error: {line}", err=True)
            sys.exit(2)


@click.group(cls=ScaletoolGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="scaletool")
@click.option("--result-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Also write the command's result (its --json document) to FILE, atomically: how sweep "
                   "workers and scripts receive results without parsing stdout.")
@click.pass_context
def main(ctx: click.Context, result_file: Path | None) -> None:
    """What does Multi-head Latent Attention buy over MHA/GQA/MQA, and at what cost?

    \b
    Analytic estimates and measurements, side by side:
      scaletool estimate recipes/mla-1b.yaml        closed forms: params, FLOPs, KV cache, memory
      scaletool count recipes/mla-1b.yaml           measured params and FLOPs against them
      scaletool train recipes/tiny.yaml             train and measure throughput, MFU, memory
      scaletool decode recipes/mla-1b.yaml          KV cache and decoding speed
      scaletool sweep recipes/sweeps/X.yaml         ablation grids; then `scaletool report`
      scaletool quickstart                          the CPU demo: sweep + report in minutes

    A recipe is YAML with sections model, train, parallel, data, profile; `--set key=value`
    overrides any dotted key. See README.md for the recipe reference.
    """
    if result_file is not None:
        if not result_file.parent.is_dir():
            raise RecipeError(f"--result-file {result_file}: directory {result_file.parent} does not exist")
        ctx.meta[RESULT_FILE_KEY] = result_file


for _mod, _attr in COMMANDS:
    try:
        _m = importlib.import_module(f"scaletool.cli.{_mod}")
    except ModuleNotFoundError as _e:  # a command module not written yet; the others still work
        if _e.name != f"scaletool.cli.{_mod}":
            raise
        continue
    main.add_command(getattr(_m, _attr))
