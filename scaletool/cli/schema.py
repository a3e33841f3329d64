"""``scaletool schema``: the JSON Schema of a command's typed result, or the list of result kinds."""
from __future__ import annotations

import difflib
import sys

import click

from scaletool.cli.options import console, emit_json, json_option
from scaletool.errors import RecipeError

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"  # what pydantic v2 generates


def _first_line(doc: str | None) -> str:
    return next((ln.strip() for ln in (doc or "").splitlines() if ln.strip()), "")


@click.command()
@click.argument("kind", required=False, metavar="[COMMAND]")
@json_option
def schema(kind: str | None, as_json: bool):
    """Print the JSON Schema of COMMAND's result (what its --json prints and --result-file writes);
    without COMMAND, list the result kinds and their schema versions.

    Every result carries `kind` and `schema_version`; results written by an older scaletool are
    migrated when loaded, a newer one is refused with a line saying so.

    \b
    Examples:
      scaletool schema
      scaletool schema hardware > hardware.schema.json
    """
    from scaletool.results import registered

    kinds = registered()
    if kind is None:
        rows = [{"kind": k, "schema_version": cls.SCHEMA_VERSION, "model": f"{cls.__module__}.{cls.__name__}",
                 "description": _first_line(sys.modules[cls.__module__].__doc__)} for k, cls in sorted(kinds.items())]
        if as_json:
            emit_json({"kinds": rows})
        else:
            con = console()
            for r in rows:
                con.print(f"{r['kind']:<12} v{r['schema_version']}  {r['description']}", highlight=False, markup=False)
            con.print("`scaletool schema KIND` prints one as JSON Schema.", highlight=False, markup=False)
        return rows
    if kind not in kinds:
        close = difflib.get_close_matches(kind, list(kinds), n=1)
        tip = f"did you mean '{close[0]}'? " if close else ""
        raise RecipeError(f"{kind}: no typed result of that kind; {tip}known: {', '.join(sorted(kinds))}")
    cls = kinds[kind]
    doc = {"$schema": JSON_SCHEMA_DIALECT, "$comment": f"scaletool result kind {kind}, schema_version "
           f"{cls.SCHEMA_VERSION}", **cls.model_json_schema(mode="serialization")}
    emit_json(doc)
    return doc
