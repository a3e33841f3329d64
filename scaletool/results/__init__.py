"""Typed results: what each command produces, defined once as pydantic models.

The producer builds the model, the report and the sweep read its attributes, ``--json`` is its
``model_dump_json``, and ``scaletool schema COMMAND`` prints its JSON Schema. Every result carries
``kind`` and ``schema_version`` so that results written by an older scaletool still load (or fail
with a line saying why): see :func:`scaletool.results.base.load_result`.

One module per command: :mod:`.base` (the common base, the registry, loading), and the modules that
define each command's result.
"""
from scaletool.results.all import load_result, registered
from scaletool.results.base import Result, ResultLoadError, register

__all__ = ["Result", "ResultLoadError", "load_result", "register", "registered"]
