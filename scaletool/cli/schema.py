"""``scaletool schema``: the JSON Schema of a command's typed result, or the list of result kinds."""
from __future__ import annotations

import difflib
import re
import sys
import textwrap

import click

from scaletool.cli.options import console, emit_json, json_option
from scaletool.errors import RecipeError

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"  # what pydantic v2 generates


# Sphinx roles (:class:`~a.B`, :func:`text <target>`) and literals (``x``) as the plain words they show
_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)\s*(?:<[^`>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``")


def plain_text(doc: str) -> str:
    """``doc`` with Sphinx markup reduced to the text it shows, on one line."""
    text = _LITERAL.sub(r"\1", _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if "." in m.group(1)
                                          and " " not in m.group(1) else m.group(1), doc))
    return " ".join(text.split())


def plain_descriptions(node):
    """``node`` (a JSON Schema) with every ``description`` in plain words: pydantic copies the models'
    docstrings there, Sphinx roles and all, and a schema is read by tools and people, not by Sphinx."""
    if isinstance(node, dict):
        return {k: plain_text(v) if k == "description" and isinstance(v, str) else plain_descriptions(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [plain_descriptions(v) for v in node]
    return node


def _first_paragraph(doc: str | None) -> str:
    return plain_text(textwrap.dedent((doc or "").strip()).split("\n\n")[0])


def describe(cls, kinds: dict) -> str:
    """What a result kind is, in whole sentences: the module's docstring where the module holds this kind
    alone, the class's own where it holds several (the sweep's plan, record, submission and summary)."""
    module_doc, class_doc = _first_paragraph(sys.modules[cls.__module__].__doc__), _first_paragraph(cls.__doc__)
    shared = sum(c.__module__ == cls.__module__ for c in kinds.values()) > 1
    return (class_doc or module_doc) if shared else (module_doc or class_doc)


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
                 "description": describe(cls, kinds)} for k, cls in sorted(kinds.items())]
        if as_json:
            emit_json({"kinds": rows})
        else:
            con = console()
            pad = max(len(r["kind"]) for r in rows) + 6
            for r in rows:
                head = f"{r['kind']} v{r['schema_version']}".ljust(pad)
                con.print(textwrap.fill(r["description"], max(con.width, pad + 30), initial_indent=head,
                                        subsequent_indent=" " * pad, break_long_words=False, break_on_hyphens=False),
                          highlight=False, markup=False)
            con.print("`scaletool schema KIND` prints one as JSON Schema.", highlight=False, markup=False)
        return rows
    if kind not in kinds:
        close = difflib.get_close_matches(kind, list(kinds), n=1)
        tip = f"did you mean '{close[0]}'? " if close else ""
        raise RecipeError(f"{kind}: no typed result of that kind; {tip}known: {', '.join(sorted(kinds))}")
    cls = kinds[kind]
    doc = {"$schema": JSON_SCHEMA_DIALECT, "$comment": f"scaletool result kind {kind}, schema_version "
           f"{cls.SCHEMA_VERSION}", **plain_descriptions(cls.model_json_schema(mode="serialization"))}
    emit_json(doc)
    return doc
