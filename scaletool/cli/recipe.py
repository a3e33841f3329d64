"""``scaletool recipe``: check, show and import recipes."""
from __future__ import annotations

from pathlib import Path

import click
import yaml

from scaletool.cli.options import deliver, json_option, recipe_argument, set_option
from scaletool.config import SWITCHES, Recipe, RecipeError
from scaletool.errors import echo, shorten
from scaletool.fmt import printable
from scaletool.hf import load_recipe
from scaletool.results.recipe import RecipeResult


@click.group()
def recipe() -> None:
    """Validate, resolve and import recipes.

    \b
    Examples:
      scaletool recipe check recipes/mla-1b.yaml --set model.attention=mha
      scaletool recipe show mla-1b --json
      scaletool recipe from-hf config.json -o recipes/my-model.yaml
    """


def _inactive_lines(r: Recipe) -> list[str]:
    lines = []
    for key, value in r.inactive.items():
        name = key.removeprefix("model.")
        for switch, kinds in SWITCHES.items():
            readers = "/".join(k for k, kind in kinds.items() if name in kind.reads)
            if readers and name not in kinds[getattr(r.model, switch)].reads:  # the switch that made it inactive
                lines.append(f"inactive: {key} = {echo(value)} (read by {switch}={readers}; this recipe has "
                             f"{switch}={getattr(r.model, switch)})")
    return lines


def _result(path: str, r: Recipe) -> RecipeResult:
    return RecipeResult(source=path, recipe=r.to_dict(), inactive=r.inactive, digest=r.digest())


@recipe.command("check")
@recipe_argument
@set_option
def check(recipe: str, overrides: tuple[str, ...]) -> RecipeResult:
    """Validate RECIPE with every rule train applies before launching; print 'ok' or one line per
    problem (exit 2). Keys of another attention or FFN type are listed as inactive.

    \b
    Examples:
      scaletool recipe check recipes/mla-1b.yaml
      # MLA keys become inactive
      scaletool recipe check mla-1b --set model.attention=mha
    """
    r = load_recipe(recipe, overrides)
    problems = r.engine_problems()
    if problems:
        raise RecipeError([f"{shorten(recipe)}: {p}" for p in problems])
    click.echo(f"{recipe}: ok")
    for line in _inactive_lines(r):
        click.echo(f"  {line}")
    return deliver(_result(recipe, r))


@recipe.command("show")
@recipe_argument
@set_option
@json_option
def show(recipe: str, overrides: tuple[str, ...], as_json: bool) -> RecipeResult:
    """Print RECIPE with every default and derived field resolved.

    Keys given for another attention or FFN type follow as comments (inactive: the recipe holds their
    defaults). --json prints {recipe, inactive, digest, ...}.

    \b
    Examples:
      scaletool recipe show tiny --set model.attention=gqa \\
          --set model.n_kv_heads=2
      scaletool recipe show recipes/deepseek-v3.yaml --json
    """
    r = load_recipe(recipe, overrides)
    result = deliver(_result(recipe, r), as_json)
    if not as_json:
        text = yaml.safe_dump(r.to_dict(), sort_keys=False, width=100, allow_unicode=True)
        text += "".join(f"# {line}\n" for line in _inactive_lines(r))
        click.echo(text, nl=False)
    return result


def _output_path(output: str) -> Path:
    """Where from-hf may write: checked before anything is imported, so a bad path wastes nothing."""
    out = Path(output)
    shown = shorten(output)
    try:
        if out.is_dir():
            raise RecipeError(f"-o {shown}: is a directory; give a file name, e.g. {shown}/recipe.yaml")
        if not out.parent.is_dir():
            raise RecipeError(f"-o {shown}: directory {shorten(out.parent)} does not exist")
        if out.exists() and not out.is_file():
            raise RecipeError(f"-o {shown}: not a regular file")
    except OSError as e:  # a name too long for the filesystem, a loop of links
        raise RecipeError(f"-o {shown}: {e.strerror or e}") from None
    return out


def _write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file in the same directory and rename: a failure leaves no partial recipe."""
    from scaletool.fmt import write_atomic

    try:
        write_atomic(path, text, follow_links=True)  # the user named it
    except OSError as e:
        raise RecipeError(f"-o {shorten(path)}: cannot write: {e.strerror or e}") from None


@recipe.command("from-hf")
@click.argument("config_json", metavar="CONFIG_JSON")
@click.option("-o", "--output", metavar="RECIPE", help="Write the recipe here (default stdout).")
@click.option("--drop", multiple=True, metavar="FEATURE",
              help="Import anyway without this feature (sliding_window, quantization, moe, ...); repeatable.")
def from_hf(config_json: str, output: str | None, drop: tuple[str, ...]) -> dict:
    """Turn a Hugging Face CONFIG_JSON (Llama/Mistral/Qwen2 dense, DeepSeek-V2/V3) into a recipe.

    DeepSeek configs keep their mixture-of-experts FFN and routing. What changes no figure imports
    with a note kept in model.notes (RoPE scaling of the llama3, yarn, linear and dynamic kinds;
    V3's multi-token-prediction module, which the figures leave out). Features that would change the
    figures (sliding windows, FP8 weights, extra biases, ...) are an error naming them, unless passed
    with --drop; the notes then record the drop. --drop moe on a DeepSeek config imports its dense twin.

    \b
    Examples:
      scaletool recipe from-hf Llama-3.1-8B/config.json -o llama3.1-8b.yaml
      scaletool recipe from-hf DeepSeek-V3/config.json --drop quantization \\
          -o v3.yaml
    """
    from scaletool.hf import recipe_from_hf

    out = _output_path(output) if output else None
    raw, _ = recipe_from_hf(config_json, tuple(drop))
    text = f"# Imported from {Path(config_json).name} by `scaletool recipe from-hf`.\n"
    text += yaml.safe_dump(raw, sort_keys=False, width=100, allow_unicode=True)
    if out is not None:
        _write_atomically(out, text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)
    return raw


@recipe.command("from-published")
@click.argument("row_id", metavar="ID")
@click.option("-o", "--output", metavar="RECIPE", help="Write the recipe here (default stdout).")
@click.option("--table", type=click.Path(dir_okay=False), metavar="TSV",
              help="A published-runs table of the same columns (default: the shipped one).")
def from_published(row_id: str, output: str | None, table: str | None) -> dict:
    """Write the recipe of another project's published run ID (a row of `calibrate --validate --published`):
    its model, sequence length, micro-batch, accumulation, checkpointing, precision, compile and layout, as
    that command predicts it, so the same shape can be trained and measured here.

    The row's GPU count is parallel.world_size; to train it on fewer GPUs set that key to the ranks you
    start (FSDP2's work per GPU is the same). A row scaletool cannot express is an error with the reason.

    \b
    Examples:
      scaletool recipe from-published TT1 -o tt1.yaml
      scaletool train tt1.yaml --nproc-per-node 4 --set parallel.world_size=4
      scaletool recipe from-published MP3 --table my-runs.tsv
    """
    from scaletool.predict.published import NotExpressible, express, published_row

    out = _output_path(output) if output else None
    row = published_row(row_id, Path(table) if table else None)
    try:
        x = express(row)
    except NotExpressible as e:
        raise RecipeError(f"published row {printable(row['id'])}: scaletool cannot express it: {printable(e)}") from None
    f = {k: printable(v) for k, v in row.items()}  # the table's text in comments: every line break escaped
    text = (f"# {f['model']} as published ({f['n_gpus']} x {f['gpu']}, {f['layout']}: {f['tok_s_per_gpu']} "
            f"tokens/s per GPU)\n# source: {f['source']}\n"
            f"# written by `scaletool recipe from-published {f['id']}`; "
            f"{printable('; '.join(x['notes'])) or 'as published'}\n")
    text += yaml.safe_dump(x["raw"], sort_keys=False, width=100, allow_unicode=True)
    if out is not None:
        _write_atomically(out, text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)
    return x["raw"]
