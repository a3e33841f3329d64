"""Untrusted YAML in: the bounded safe loader, ``--set KEY=VALUE`` overrides and dotted keys.

A recipe or sweep file is read with the safe loader (duplicate keys refused) and refused past
:data:`MAX_YAML_BYTES`, :data:`MAX_NODES` values (aliases expanded) or :data:`MAX_DEPTH` levels; every
problem is a one-line :class:`~scaletool.errors.RecipeError`. Nothing here knows the recipe schema:
callers hand in the section names.
"""
from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from scaletool.errors import RecipeError, echo, shorten
from scaletool.resources import read_bounded

# A recipe or sweep file is a few kilobytes and a few hundred values.
MAX_YAML_BYTES = 2**20
MAX_NODES = 100_000
MAX_DEPTH = 64


def key_text(part: Any) -> str:
    """A key of the location path, cut for the message (a key can be a megabyte string)."""
    return shorten(part, 60) if isinstance(part, (str, int)) else echo(part)


def flatten_dotted(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (an empty mapping stays a value)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten_dotted(v, key + "."))
        else:
            out[key] = v
    return out


class _SafeLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """The safe loader (libyaml's when present: it also caps nesting depth), refusing duplicate keys,
    which plain YAML resolves silently to the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {echo(key_node.value)} (first at line {seen[key] + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)



def check_tree(data: Any, source: str) -> None:
    """Refuse data whose tree, aliases expanded, has more than MAX_NODES values or MAX_DEPTH levels, or
    that contains itself (``a: &a [*a]``).

    The loader shares an aliased object instead of copying it, so a 700-byte file of nested aliases
    loads instantly, yet stands for 10^9 values to anything that walks it (validation, messages,
    hashing, JSON). Sizes are memoised per object: one pass over the distinct objects."""
    size: dict[int, tuple[int, int]] = {}  # id -> (values, depth) of the expanded subtree
    open_: set[int] = set()  # the containers on the path from the root
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        obj, leaving = stack.pop()
        if isinstance(obj, dict):
            kids = [x for kv in obj.items() for x in kv]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            kids = list(obj)
        else:
            continue  # a scalar: one value, depth 1
        key = id(obj)
        if leaving:
            sub = [size.get(id(k), (1, 1)) for k in kids]
            values, depth = 1 + sum(s[0] for s in sub), 1 + max((s[1] for s in sub), default=0)
            if values > MAX_NODES:
                raise RecipeError(f"{source}: more than {MAX_NODES:,} values once YAML aliases are expanded "
                                  "(a recipe has about a hundred); refusing it")
            if depth > MAX_DEPTH:
                raise RecipeError(f"{source}: nested more than {MAX_DEPTH} levels deep; refusing it")
            size[key] = (values, depth)
            open_.discard(key)
            continue
        if key in size:
            continue
        if key in open_:
            raise RecipeError(f"{source}: a YAML alias refers to a mapping or list that contains it (a cycle)")
        open_.add(key)
        stack.append((obj, True))
        stack.extend((k, False) for k in kids)


def load_yaml_text(text: str, source: str) -> Any:
    """Parse YAML text safely and bounded; problems become one-line RecipeErrors naming ``source``."""
    try:
        data = yaml.load(text, Loader=_SafeLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"{source}: malformed YAML{where}: {what[:200]}") from None
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit; nesting past the stack
        raise RecipeError(f"{source}: malformed YAML: {str(e).splitlines()[0][:200]}") from None
    check_tree(data, source)
    return data


# A float in exponent form without a dot (1e3, 5E-4): YAML 1.2 and JSON read a number, PyYAML (YAML 1.1) a string.
_EXPONENT_FLOAT = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+")


def exponent_floats(data: Any) -> Any:
    """``data`` with every string that is a float in exponent form without a dot (``1e3``) read as the
    float it is, as YAML 1.2 reads it: for files whose values are checked to be numbers of their kind
    (calibrations, hardware profiles), where PyYAML's string would otherwise be refused. Walks a tree
    :func:`check_tree` bounded; keys are left as they are."""
    if isinstance(data, str):
        return float(data) if len(data) <= 40 and _EXPONENT_FLOAT.fullmatch(data) else data
    if isinstance(data, dict):
        return {k: exponent_floats(v) for k, v in data.items()}
    if isinstance(data, list):
        return [exponent_floats(v) for v in data]
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """``model.kv_lora_rank=128`` -> (``model.kv_lora_rank``, 128); the value is read as YAML."""
    if "=" not in item:
        raise RecipeError(f"--set {echo(item)}: expected KEY=VALUE with a dotted key, e.g. model.kv_lora_rank=128")
    key, _, raw = item.partition("=")
    key = key.strip()
    try:
        value = load_yaml_text(raw, f"--set {key_text(key)}") if raw.strip() else None
    except RecipeError as e:
        if "malformed YAML" not in e.problems[0]:
            raise
        value = raw  # not YAML: the text itself (validation says if a string does not fit)
    return key, value


def override_text(key: str, value: Any) -> str:
    """``key=value`` with the value as JSON, which :func:`parse_override` reads back as the same value: how a
    typed setting crosses a process boundary (a child's ``--set``) without being re-spelled by hand."""
    return f"{key}={json.dumps(value)}"


def set_dotted(raw: dict, key: str, value: Any, sections: Sequence[str]) -> None:
    """Set ``raw['a']['b'] = value`` for ``key='a.b'``; a top-level key not in ``sections`` is an error."""
    parts = key.split(".")
    shown = key_text(key)
    if not all(parts):
        raise RecipeError(f"override {shown}: a dotted key needs a name at every level, e.g. model.d_model")
    if parts[0] not in sections:
        hint = difflib.get_close_matches(parts[0][:200], sections, n=1)
        tip = f"; did you mean '{hint[0]}'?" if hint else f"; sections are {', '.join(sections)}"
        raise RecipeError(f"override {shown}: unknown section {key_text(parts[0])!r}{tip}")
    if len(parts) == 1:  # a whole section: its keys are merged in, never the section reset to defaults
        if value and not isinstance(value, dict):
            raise RecipeError(f"override {shown}={echo(value)}: a section takes a mapping of its keys, e.g. "
                              f"{parts[0]}.KEY=VALUE (or {parts[0]}={{KEY: VALUE}})")
        if not value:
            raise RecipeError(f"override {shown}={echo(value)}: would reset the whole {parts[0]} section to its "
                              f"defaults; set its keys instead, e.g. {parts[0]}.KEY=VALUE (or {parts[0]}={{KEY: VALUE}})")
        for k, v in flatten_dotted(value, f"{parts[0]}.").items():
            set_dotted(raw, k, v, sections)
        return
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise RecipeError(f"override {shown}: '{key_text(p)}' is not a mapping")
        node = nxt
    node[parts[-1]] = value


def read_yaml(path: str | Path, sections: Sequence[str]) -> dict:
    """Read a YAML mapping (a recipe or sweep file) safely; problems become one-line RecipeErrors
    (``sections``: the recipe's, named when the file is not a mapping)."""
    p = Path(path)
    shown = shorten(p)
    blob = read_bounded(p, MAX_YAML_BYTES, "a recipe or sweep file")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{shown}: not a UTF-8 text file (byte {e.start})") from None
    data = load_yaml_text(text, shown)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{shown}: a recipe is a mapping of sections ({', '.join(sections)}), got {type(data).__name__}")
    return data
