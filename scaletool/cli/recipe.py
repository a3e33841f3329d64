"""``scaletool recipe``: check, show and import recipes."""
from __future__ import annotations

from pathlib import Path

import click
import yaml

from scaletool.cli.options import emit_json, json_option, recipe_argument, set_option
from scaletool.config import load_recipe


@click.group()
def recipe() -> None:
    """Validate, resolve and import recipes."""


@recipe.command("check")
@recipe_argument
@set_option
def check(recipe: str, overrides: tuple[str, ...]) -> None:
    """Validate RECIPE; print 'ok' or one line per problem (exit 2)."""
    load_recipe(recipe, overrides)
    click.echo(f"{recipe}: ok")


@recipe.command("show")
@recipe_argument
@set_option
@json_option
def show(recipe: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Print RECIPE with every default and derived field resolved."""
    r = load_recipe(recipe, overrides)
    if as_json:
        emit_json(r.to_dict())
    else:
        click.echo(yaml.safe_dump(r.to_dict(), sort_keys=False), nl=False)


@recipe.command("from-hf")
@click.argument("config_json", type=click.Path(dir_okay=False, path_type=str))
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="Write the recipe here (default stdout).")
@click.option("--drop", multiple=True, metavar="FEATURE",
              help="Import anyway without this feature (rope_scaling, mtp, quantization, moe, ...); repeatable.")
def from_hf(config_json: str, output: str | None, drop: tuple[str, ...]) -> None:
    """Turn a Hugging Face CONFIG_JSON (Llama/Mistral/Qwen2 dense, DeepSeek-V2/V3) into a recipe.

    DeepSeek configs keep their mixture-of-experts FFN and routing. Features the model family lacks
    (RoPE scaling, V3's MTP module, FP8 weights, ...) are an error naming them, unless passed with
    --drop; the recipe then records what was dropped in a comment. --drop moe on a DeepSeek config
    imports its dense twin.
    """
    from scaletool.hf import recipe_from_hf

    raw, dropped = recipe_from_hf(config_json, tuple(drop))
    head = f"# Imported from {Path(config_json).name} by `scaletool recipe from-hf`.\n"
    if dropped:
        head += f"# Dropped (not modelled): {', '.join(dropped)}\n"
    text = head + yaml.safe_dump(raw, sort_keys=False)
    if output:
        Path(output).write_text(text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)
