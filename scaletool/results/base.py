"""The base of every typed result, the registry of result kinds, and loading with a schema version.

A result model subclasses :class:`Result`, sets ``kind`` (a ``Literal``) and ``SCHEMA_VERSION``, and is
registered with :func:`register`. :func:`load_result` picks the model by ``kind``; a document written
with an older schema version goes through the model's ``migrate`` (a classmethod taking the raw
document, returning a dict) first, and a newer one is refused with one line naming both versions.
A document written before results had a ``kind`` is schema version 1 of the kind its reader names.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from scaletool.errors import RecipeError, validation_lines


class ResultLoadError(RecipeError):
    """A results document that cannot be read as the result it claims to be (one line per problem)."""


class Result(BaseModel):
    """Base of every command's result. Unknown keys are kept (``extra="allow"``) so a newer writer's
    additions survive a round trip through an older reader; typed fields are validated."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    SCHEMA_VERSION: ClassVar[int] = 1
    kind: str
    schema_version: int = 1

    @classmethod
    def migrate(cls, data: Any) -> Any:
        """Bring a document of an older ``schema_version`` up to :attr:`SCHEMA_VERSION` (default: as is)."""
        return data

    def to_json(self) -> str:
        """The ``--json`` text: sorted keys, NaN/Inf as null (one writer: :func:`scaletool.fmt.emit_json`)."""
        from scaletool.fmt import clean

        return json.dumps(clean(self.model_dump(mode="json")), indent=2, sort_keys=True)


_KINDS: dict[str, type[Result]] = {}


def register(cls: type[Result]) -> type[Result]:
    """Class decorator: make ``cls`` loadable by its ``kind``."""
    kind = cls.model_fields["kind"].default
    if not isinstance(kind, str):
        raise TypeError(f"{cls.__name__}.kind needs a string default")
    _KINDS[kind] = cls
    return cls


def kinds_of(*names: str) -> dict[str, type[Result]]:
    """The registered result kinds named (those whose modules the caller imported)."""
    return {n: _KINDS[n] for n in names if n in _KINDS}


def load_among(kinds: dict[str, type[Result]], data: Any, source: str = "result", kind: str | None = None) -> Result:
    """Validate a parsed JSON document as the result its ``kind`` names among ``kinds``, migrating older
    versions (:func:`scaletool.results.all.load_result` reads any kind).

    ``kind``: what the caller expects; a document without a ``kind`` of its own is then read as
    version 1 of it (through its model's ``migrate``), and one of another kind is refused."""
    if kind is not None:
        if kind not in kinds:
            raise ResultLoadError(f"{source}: unknown result kind {kind!r}")
        if not isinstance(data, dict) or "kind" not in data:
            data = kinds[kind].migrate(data)
            if not isinstance(data, dict):
                raise ResultLoadError(f"{source}: a result is a JSON object, got {type(data).__name__}")
            data = {**data, "kind": kind, "schema_version": kinds[kind].SCHEMA_VERSION}
        elif data["kind"] != kind:
            raise ResultLoadError(f"{source}: a {str(data['kind'])[:40]} result where a {kind} result belongs")
    if not isinstance(data, dict):
        raise ResultLoadError(f"{source}: a result is a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in kinds:
        raise ResultLoadError(f"{source}: unknown result kind {str(kind)[:60]!r}; known: {', '.join(sorted(kinds))}")
    cls = kinds[kind]
    version = data.get("schema_version", 1)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ResultLoadError(f"{source}: schema_version must be an integer, got {str(version)[:40]!r}")
    if version > cls.SCHEMA_VERSION:
        raise ResultLoadError(f"{source}: {kind} schema version {version} was written by a newer scaletool "
                              f"(this one reads up to {cls.SCHEMA_VERSION}); upgrade scaletool to read it")
    if version < cls.SCHEMA_VERSION:
        data = {**cls.migrate(dict(data)), "schema_version": cls.SCHEMA_VERSION}
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ResultLoadError(validation_lines(e, source, root=kind, show_input=lambda err: False, limit=5)) from None
