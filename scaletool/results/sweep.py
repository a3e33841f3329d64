"""What ``scaletool sweep`` writes and returns: one record per finished run, the plan, the summary.

- :class:`SweepRecord` (kind ``sweep_record``): one line of ``results.jsonl``. Every line is validated
  with it on read, so a hand-edited or foreign line (a list where a string belongs, no label or
  mode, a ``result`` that is not the result its mode produces) is skipped with a warning instead of
  reaching the report or the resume logic. Lines written before kinds existed (schema 1: no
  ``kind``, ``repeat`` or ``repeats``) load as repeat 0 of 1.
- :class:`SweepPlan` (kind ``sweep_plan``): ``sweep --dry-run --json``.
- :class:`SweepSummary` (kind ``sweep``): what a sweep returns (``sweep --json``, ``api.sweep``).
- :class:`SweepSubmission` (kind ``sweep_submission``): a sweep handed to Slurm as a job array.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from scaletool.results import count, decode, estimate, profile, train  # noqa: F401  (the kinds a sweep's modes produce)
from scaletool.results.base import Result, ResultLoadError, kinds_of, load_among, register

#: the commands a sweep runs, in the order a sweep file may list them
MODES = ("estimate", "count", "train", "decode", "profile")
Mode = Literal["estimate", "count", "train", "decode", "profile"]
#: modes whose figures are timings: they run ``repeats`` times; estimate and count are exact
TIMED_MODES = ("train", "decode", "profile")
Status = Literal["ok", "skipped", "oom", "timeout", "error"]
STATUSES: tuple[str, ...] = ("ok", "skipped", "oom", "timeout", "error")
#: the result kind each mode's command produces (typed checking applies once that kind is registered)
MODE_KIND = {"estimate": "estimate", "count": "count", "train": "train", "decode": "decode", "profile": "profile"}


def check_result(mode: str, result: Any, source: str) -> None:
    """Raise :class:`ResultLoadError` if ``result`` is not what ``mode`` produces.

    A document with a ``kind`` loads as that kind; one without (written before kinds existed) loads as
    its mode's kind when that kind is registered, and is accepted as plain JSON otherwise.
    """
    if result is None:
        return
    if not isinstance(result, dict):
        raise ResultLoadError(f"{source}: a result is a JSON object, got {type(result).__name__}")
    kinds = kinds_of(*MODE_KIND.values())
    if "kind" in result:
        load_among(kinds, result, source)
    elif MODE_KIND.get(mode) in kinds:
        load_among(kinds, {**result, "kind": MODE_KIND[mode]}, source)


@register
class SweepRecord(Result):
    """One finished (point, mode, repeat) of a sweep: what ran, how it ended, and the command's result."""

    SCHEMA_VERSION: ClassVar[int] = 2
    kind: Literal["sweep_record"] = "sweep_record"
    schema_version: int = 2

    key: str = Field(description="identity of the run: resolved recipe, mode, mode arguments, repeat")
    point_id: str
    mode: Mode
    sweep: str
    index: int = Field(description="the point's position in the sweep")
    label: str
    status: Status
    values: dict[str, Any] = Field(default_factory=dict)
    match_params: dict[str, Any] | None = None
    recipe: dict[str, Any] | None = None
    reason: str | None = None
    error: str | None = None
    result: dict[str, Any] | None = Field(None, description="the command's typed result (its --result-file)")
    returncode: int | None = None
    wall_s: float | None = None
    started_at: str | None = None
    run_dir: str | None = None
    argv: list[str] | None = None
    repeat: int = Field(0, ge=0, description="0-based repeat of a timed mode")
    repeats: int = Field(1, ge=1, description="how many repeats the sweep asked for when this one ran")
    threads: int | None = Field(None, description="CPU intra-op threads each process of the run was given")
    gpus: str | None = Field(None, description="CUDA_VISIBLE_DEVICES given to the run (None: inherited)")
    slurm_job: str | None = Field(None, description="JOBID_TASK when a Slurm array task ran it")

    @classmethod
    def migrate(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Schema 1 (no kind, no repeats): one run per (point, mode)."""
        return {**data, "kind": "sweep_record", "repeat": data.get("repeat", 0), "repeats": data.get("repeats", 1)}

    @field_validator("result")
    @classmethod
    def _result_matches_mode(cls, result: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if "mode" in info.data:  # a bad mode is reported on its own
            try:
                check_result(info.data["mode"], result, "result")
            except ResultLoadError as e:  # "result: params: ..." -> located at result, saying "params: ..."
                raise ValueError(e.problems[0].removeprefix("result: ")) from None
        return result


def load_record(data: Any, source: str = "record") -> SweepRecord:
    """A results line (parsed JSON) as a :class:`SweepRecord`; old lines without ``kind`` included."""
    if isinstance(data, dict) and "kind" not in data:
        data = {**data, "kind": "sweep_record"}
    if isinstance(data, dict) and isinstance(data["kind"], str) and data["kind"] != "sweep_record":
        raise ResultLoadError(f"{source}: a {data['kind'][:40]} result, not a sweep record")
    return load_among({"sweep_record": SweepRecord}, data, source)


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlannedRun(_Row):
    """One run of the plan as ``--dry-run`` shows it."""

    task: int = Field(description="position in the full plan: the Slurm array index of this run")
    index: int = Field(description="the point's position in the sweep")
    label: str
    mode: Mode
    repeat: int
    repeats: int
    key: str
    state: Literal["pending", "done", "failed", "skipped"]
    will_run: bool
    previous_status: Status | None = None
    reason: str | None = None
    match_params: dict[str, Any] | None = None
    point_dir: str
    gpus_needed: int = 0


@register
class SweepPlan(Result):
    """``sweep --dry-run``: every run of the sweep, what the results directory already holds, what would run."""

    kind: Literal["sweep_plan"] = "sweep_plan"
    sweep: str
    results_dir: str
    warnings: list[str] = Field(default_factory=list)
    runs: list[PlannedRun]


class RunRow(_Row):
    key: str
    label: str
    mode: Mode
    repeat: int = 0
    status: Literal["ok", "skipped", "oom", "timeout", "error", "pending"]
    wall_s: float | None = None
    error: str | None = None


@register
class SweepSummary(Result):
    """What a sweep did: every run's latest status, and how many ran in this invocation."""

    kind: Literal["sweep"] = "sweep"
    sweep: str
    results_dir: str
    points: int
    runs: int
    ran_now: int
    parallel: int = 1
    status_counts: dict[str, int]
    warnings: list[str] = Field(default_factory=list)
    results: list[RunRow]


@register
class SweepSubmission(Result):
    """A sweep handed to Slurm: the array script and which plan tasks its array indices are."""

    kind: Literal["sweep_submission"] = "sweep_submission"
    sweep: str
    results_dir: str
    job_id: str | None = Field(None, description="None for --dry-run")
    script: str = Field(description="the script's path, or its text for --dry-run")
    tasks: list[int] = Field(description="array indices = positions in the full plan")
    keys: list[str]
    skipped_live: int = Field(0, description="runs left out because a queued or running array task has them")
    warnings: list[str] = Field(default_factory=list)
