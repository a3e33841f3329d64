"""The result of ``scaletool profile``: the operator breakdown (``<run>/profile/breakdown.json``).

Its fields are described in :func:`scaletool.profile.trace.aggregate`; the model types the top
level and keeps the nested tables as they are. Files written before ``kind`` existed (they carry
``schema: "scaletool.profile.breakdown"``) load through :func:`load_breakdown`.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from scaletool.results.base import Result, ResultLoadError, load_among, register
from scaletool.stats import Spread

BREAKDOWN_SCHEMA = "scaletool.profile.breakdown"


@register
class ProfileResult(Result):
    """Where a profiled training step's time goes, by operator category and by module."""

    SCHEMA_VERSION: ClassVar[int] = 1
    kind: Literal["profile"] = "profile"
    # also kept (not declared: the name would shadow pydantic's own): schema = "scaletool.profile.breakdown"
    device: str
    ranks: list[int]
    n_steps: int
    step_time_s: float | None  # mean profiled step, from the trace
    step_s: Spread | None = None  # the profiled steps of every rank, from the trace
    loop_step_time_s: float | None = None  # the training loop's clock for the same steps
    categories: dict[str, dict[str, float | None]]
    modules: dict[str, dict[str, float | None]]
    communication_overlap: dict[str, float | None]
    ffn_matmul_fraction_of_matmul: float | None = None
    top_ops: list[dict[str, Any]] = Field(default_factory=list)
    per_rank: list[dict[str, Any]] = Field(default_factory=list)
    n_ranks: int | None = None
    recipe: dict[str, Any] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


def load_breakdown(data: Any, source: str = "breakdown.json") -> ProfileResult:
    """A profile result from a parsed ``breakdown.json`` (files without ``kind`` included)."""
    if isinstance(data, dict) and "kind" not in data and data.get("schema") == BREAKDOWN_SCHEMA:
        data = {**data, "kind": "profile"}
    if isinstance(data, dict) and isinstance(data.get("kind"), str) and data["kind"] != "profile":
        raise ResultLoadError(f"{source}: a {data['kind'][:40]} result, not a profile breakdown")
    return load_among({"profile": ProfileResult}, data, source)
