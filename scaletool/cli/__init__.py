"""The ``scaletool`` command: one click group, one module per command, each imported only when needed.

``scaletool estimate ...`` imports the estimate module alone; ``scaletool --help`` imports every command
module for its one-line summary, which is why command modules import torch (and anything heavy) inside
the functions that run, never at module level (tests/cli/test_cli_contract.py holds this).

Errors have one format (docs/cli.md): a domain error (:class:`~scaletool.errors.RecipeError`) is one
``error: ...`` line per problem; click's own usage errors (an unknown option, a bad choice, a missing
argument) are one ``error: ...`` line ending in a ``try '... --help'`` hint; both exit with status 2 and
print no traceback. Both are caught once, here, in :class:`ScaletoolGroup`.
"""
from __future__ import annotations

import contextlib
import difflib
import errno
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import click

from scaletool import __version__
from scaletool.allocator import allocator_defaults
from scaletool.cli.options import RESULT_FILE_KEY
from scaletool.errors import RecipeError

# Command name -> the module scaletool.cli.<name>, which defines the command as the attribute <name>.
# In this order in --help: the estimate-measure-report workflow first, then the tools around it.
COMMANDS = ("estimate", "plan", "count", "train", "decode", "profile", "sweep", "report", "calibrate", "quickstart",
            "recipe", "launch", "hardware", "schema", "docs")


class ErrorLines(click.ClickException):
    """An error already worded as ``error: ...`` lines (what :meth:`show` prints, nothing else)."""

    def __init__(self, lines: list[str], exit_code: int = 2):
        super().__init__("\n".join(lines))
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        click.echo(self.message, err=True)


def _one_line(text: str) -> str:
    """click's message on one line, lower-cased first letter (unless an acronym), no final full stop."""
    line = " ".join(text.split()).rstrip(".")
    return line[:1].lower() + line[1:] if line[:1].isupper() and not line[1:2].isupper() else line


@contextlib.contextmanager
def one_error_format():
    """Turn click's usage errors and RecipeErrors raised inside into :class:`ErrorLines`."""
    try:
        yield
    except (ErrorLines, click.exceptions.Exit, click.Abort):
        raise
    except RecipeError as e:
        raise ErrorLines([f"error: {p}" for p in e.problems]) from None
    except click.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # click >= 8.2: a bare group prints its help
            raise
        hint = f"; try '{e.ctx.command_path} --help'" if e.ctx is not None else ""
        raise ErrorLines([f"error: {_one_line(e.format_message())}{hint}"], e.exit_code) from None
    except click.ClickException as e:
        raise ErrorLines([f"error: {_one_line(e.format_message())}"], e.exit_code) from None


class LazyGroup(click.Group):
    """A group whose subcommands are ``module:attribute`` names, imported when first used."""

    #: command name -> "package.module:attribute"
    lazy: dict[str, str] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*self.lazy, *(n for n in self.commands if n not in self.lazy)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            module, _, attr = self.lazy[cmd_name].partition(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        if name and not name.startswith("-") and not ctx.resilient_parsing and self.get_command(ctx, name) is None:
            names = self.list_commands(ctx)
            close = difflib.get_close_matches(name, names, n=1)
            tip = f"did you mean '{close[0]}'?" if close else f"commands: {', '.join(names)}"
            raise click.UsageError(f"no such command '{name}'; {tip}", ctx)
        return super().resolve_command(ctx, args)


class ScaletoolGroup(LazyGroup):
    lazy = {name: f"scaletool.cli.{name}:{name}" for name in COMMANDS
            if importlib.util.find_spec(f"scaletool.cli.{name}") is not None}  # tolerate a command not yet written

    def make_context(self, info_name, args, parent=None, **extra):
        with one_error_format():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context):
        with one_error_format():
            return super().invoke(ctx)

    def main(self, *args, **kwargs):
        """click's main, and an output that cannot be written (``> /dev/full``, a full disk under a redirection)
        ends as one ``error:`` line and status 2 instead of a traceback (click already ends a closed pipe,
        ``| head``, quietly)."""
        try:
            return super().main(*args, **kwargs)
        except OSError as e:
            if not _output_failed(e):
                raise
            _silence_stdout()
            click.echo(f"error: cannot write the output ({e.strerror or e}): standard output is full or closed",
                       err=True)
            sys.exit(2)


def _output_failed(e: OSError) -> bool:
    """An OSError from writing to an already open stream (no file name: opening and writing scaletool's own
    files goes through :func:`~scaletool.errors.cannot_write`, which names the file) that a full or
    broken output gives."""
    return e.filename is None and e.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG, errno.EBADF)


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's flush at exit does not fail again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@click.group(cls=ScaletoolGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="scaletool")
@click.option("--result-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Also write the command's result (its --json document) to FILE, atomically: how sweep "
                   "workers and scripts receive results without parsing stdout.")
@click.pass_context
def main(ctx: click.Context, result_file: Path | None) -> None:
    """What does Multi-head Latent Attention buy over MHA/GQA/MQA, and at what cost?

    \b
    Examples (analytic estimates and measurements, side by side):
      scaletool estimate llama3-8b     closed forms: params, FLOPs, KV, memory
      scaletool plan mla-1b --gpus 8   layouts that fit, ranked, as commands
      scaletool count mla-1b           measured params and FLOPs against them
      scaletool train tiny             train; throughput, MFU, memory
      scaletool decode mla-1b          KV cache and decoding speed
      scaletool sweep mla-compression  ablation grids; then `scaletool report`
      scaletool quickstart             the CPU demo: sweep + report in minutes

    A recipe is a YAML file, or the name of a shipped one (llama3-8b, mla-1b, tiny, ...; the
    error for an unknown name lists them). `--set key=value` overrides any dotted key.
    `scaletool docs recipes` is the recipe reference, `scaletool docs` lists every page;
    `scaletool hardware` lists the accelerator peaks.
    """
    allocator_defaults()  # expandable segments for this process and every one it starts (scaletool.allocator)
    if result_file is not None:
        if not result_file.parent.is_dir():
            raise RecipeError(f"--result-file {result_file}: directory {result_file.parent} does not exist")
        ctx.meta[RESULT_FILE_KEY] = result_file
