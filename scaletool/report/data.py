"""Results directories read back for the report, through typed models.

A sweep record is validated as a :class:`Record`; its ``result`` is read as the typed result of its
mode (:mod:`scaletool.results`, one schema per result, migrations there), so the report shows what
each run recorded. Where a figure was not recorded and the report computes it with this scaletool's
closed forms, it adds a warning saying so (:meth:`Row.recomputed`).

Records of one point and mode make one :class:`Row`. With a sweep's ``repeats: N`` the row holds the N
runs, and a timed figure is the median across the repeats with p10/p90 over the repeats' medians
(n = repeats); a single run gives its own per-step spread. A failed run is a row of its own, holding the
partial result it wrote, if any (a diverged train run's losses and monitors).
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from scaletool.analytic.kv import kv_cache
from scaletool.config import Recipe, RecipeError, recipe_from_dict
from scaletool.errors import validation_lines
from scaletool.kinds.engines import ENGINE_KEYS, engine_kind
from scaletool.results import Result, load_result
from scaletool.results.count import CountResult
from scaletool.results.decode import DecodeResult
from scaletool.results.estimate import EstimateResult
from scaletool.results.train import TrainResult
from scaletool.stats import Spread, spread
from scaletool.sweep.runner import SWEEP_META
from scaletool.sweep.store import RESULTS_FILE, read_records

# Written by the profiler into a train run directory; see :func:`breakdown_of`.
BREAKDOWN_FILE = Path("profile") / "breakdown.json"


def one(x: float | None) -> Spread | None:
    """A single figure as a spread of one sample (no p10-p90 to judge a difference by)."""
    return Spread.of_one(x)


#: the typed result each sweep mode records (scaletool.results)
MODES: dict[str, type[Result]] = {"estimate": EstimateResult, "count": CountResult, "train": TrainResult,
                                  "decode": DecodeResult}


def read_result(mode: str, doc: Any, source: str) -> Result:
    """The typed result of one record (raises RecipeError): its ``kind``'s model, an older schema
    migrated; a document without a ``kind`` is read as version 1 of the mode's result."""
    return load_result(doc, source, kind=MODES[mode].model_fields["kind"].default)


# --- records and rows ---------------------------------------------------------------------------


class _Read(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), frozen=True)


class MatchParams(_Read):
    key: str
    base_value: float
    value: float
    target: int
    achieved: int
    rel_error: float
    params: str = "total"


class Record(_Read):
    """One line of results.jsonl: a finished (point, mode[, repeat]) of a sweep."""

    key: str
    mode: str
    status: str
    label: str
    point_id: str | None = None
    sweep: str | None = None
    index: int = 0
    values: dict[str, Any] = {}
    match_params: MatchParams | None = None
    recipe: dict[str, Any] | None = None
    result: Any = None
    reason: str | None = None
    error: str | None = None
    run_dir: str | None = None
    repeat: int = 0
    repeats: int = 1


@dataclass
class Row:
    """One point in one mode with the axes every table and plot groups by; its runs are the repeats."""

    source: str  # the results dir's label
    record: Record  # the newest record of the point (its recipe and identity)
    recipe: Recipe | None
    run_dir: Path | None
    # one typed result per ok repeat, in repeat order; a failed row: the partial result its run wrote, if any
    runs: list[Result] = field(default_factory=list)
    sink: dict[str, list[str]] = field(default_factory=dict)  # the results set's `recomputed`
    estimate: Row | None = None  # the estimate of the same point, if one was recorded

    @property
    def mode(self) -> str:
        return self.record.mode

    @property
    def status(self) -> str:
        return self.record.status

    @property
    def label(self) -> str:
        return self.record.label

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.recipe is not None and bool(self.runs)

    @property
    def diverged(self) -> bool:
        """A train run that stopped on a non-finite loss (the sweep records it as an error; its result says so)."""
        return self.mode == "train" and bool(self.runs) and self.runs[0].status == "diverged"

    @property
    def result(self) -> Any:
        """The first repeat's result: the figures that do not change between repeats (counts, memory, loss)."""
        return self.runs[0]

    @property
    def attention(self) -> str | None:
        return self.recipe.model.attention if self.recipe else None

    @property
    def intermediate_size(self) -> int | None:
        return self.recipe.model.intermediate_size if self.recipe else None

    @property
    def kv_lora_rank(self) -> int | None:
        return self.recipe.model.kv_lora_rank if self.recipe and self.attention == "mla" else None

    @cached_property
    def kv(self) -> dict:
        """The point's KV cache (bytes/token, the same-head-dims ratio) as its estimate recorded it, else
        computed by this scaletool's closed form (and said so)."""
        est = self if self.mode == "estimate" and self.runs else self.estimate
        if est is not None:
            return est.result.kv_cache.model_dump()
        self.recomputed("KV cache figures (no estimate of the point recorded)")
        return kv_cache(self.recipe.model)

    def recomputed(self, what: str) -> None:
        """Note that ``what`` of this point was computed by this scaletool's closed forms, not read from
        a result: the report lists it under "Computed, not recorded"."""
        points = self.sink.setdefault(what, [])
        if (name := f"{self.source}: {self.label}") not in points:
            points.append(name)

    @property
    def compression_ratio(self) -> float:
        """KV compression against the MHA with the same heads and head dims (estimate's kv_cache.compression_ratio)."""
        return self.kv["compression_ratio"]

    @property
    def series_key(self) -> str:
        """The attention variant without the swept width: 'mha', 'gqa kv=4', 'mla'."""
        m = self.recipe.model
        return f"gqa kv={m.n_kv_heads}" if m.attention == "gqa" else m.attention

    @property
    def engine(self) -> str | None:
        """'single', 'ddp', 'fsdp' or 'zero<stage>'."""
        if not self.recipe:
            return None
        p = self.recipe.parallel
        return engine_kind(p.engine).label(p.zero_stage)

    @property
    def setup(self) -> str | None:
        """The engine with what else changes its speed: 'fsdp', 'fsdp compiled', 'zero3 +config'
        (a DeepSpeed passthrough), 'fsdp tp2'; runs compare across GPU counts only within one setup."""
        if not self.recipe:
            return None
        p, words = self.recipe.parallel, [self.engine]
        if p.tensor_parallel > 1:
            words.append(f"tp{p.tensor_parallel}")
        if self.recipe.train.compile:
            words.append("compiled")
        if p.deepspeed and ENGINE_KEYS.get("deepspeed") == p.engine:  # the engine that reads parallel.deepspeed
            words.append("+config")
        return " ".join(words)

    @property
    def world_size(self) -> int | None:
        """Ranks a train run really had (its summary), else None."""
        return self.result.world_size if self.mode == "train" and self.runs else None

    @property
    def repeats(self) -> int:
        return len(self.runs)

    def across(self, figure: Callable[[Any], Spread | None]) -> Spread | None:
        """A timed figure of the point: one run's own spread, or, over repeats, the spread of the
        repeats' medians (n = repeats)."""
        got = [s for s in (figure(r) for r in self.runs) if s is not None]
        if len(got) <= 1:
            return got[0] if got else None
        return spread([s.median for s in got])

    def contended_runs(self) -> tuple[int, int]:
        """(runs whose timed steps were contended, runs) of this point."""
        return sum(bool(getattr(r, "contended", None)) for r in self.runs), len(self.runs)

    def median(self, figure: Callable[[Any], float | None]) -> float | None:
        """A scalar figure of the point: its median across the repeats."""
        got = [x for x in (figure(r) for r in self.runs) if x is not None]
        return statistics.median(got) if got else None

    def breakdown(self) -> dict[str, float] | None:
        return breakdown_of(self.run_dir) if self.run_dir else None


@dataclass
class ResultsSet:
    rows: list[Row] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)  # {label, path, name, description, base_recipe}
    warnings: list[str] = field(default_factory=list)
    #: figures the report computed by this scaletool's closed forms where no result recorded them: {what: points}
    recomputed: dict[str, list[str]] = field(default_factory=dict)

    def recomputed_lines(self) -> list[str]:
        return [f"{what}, by this scaletool's closed forms: {', '.join(points)}" for what, points in self.recomputed.items()]

    def ok(self, mode: str) -> list[Row]:
        return [r for r in self.rows if r.mode == mode and r.ok]

    @property
    def multi(self) -> bool:
        return len(self.sources) > 1

    def order(self, r: Row) -> tuple[int, int]:
        """Rows sort by results dir, then by the sweep's point order."""
        return [s["label"] for s in self.sources].index(r.source), r.record.index

    def mha_point(self, r: Row) -> Row | None:
        """The MHA point of ``r``'s results dir whose cache ``r`` is compared with: same layers, width,
        heads and dtype (the FFN does not change the cache). None when there is none, or several differ."""
        return self._mha_points.get(_kv_shape(r))

    @cached_property
    def _mha_points(self) -> dict[tuple, Row]:
        same: dict[tuple, list[Row]] = {}
        for x in self.rows:
            if x.recipe is not None and x.attention == "mha":
                same.setdefault(_kv_shape(x), []).append(x)
        return {k: xs[0] for k, xs in same.items() if len({x.kv["bytes_per_token"] for x in xs}) == 1}

    def kv_vs_mha_point(self, r: Row) -> float | None:
        """The MHA point's KV bytes per token over ``r``'s: MLA's compression against what was swept."""
        ref = self.mha_point(r)
        if ref is None or not r.kv.get("bytes_per_token") or ref.kv.get("bytes_per_token") is None:
            return None  # no MHA point, or a record with no bytes per token to divide by
        return ref.kv["bytes_per_token"] / r.kv["bytes_per_token"]


def _kv_shape(r: Row) -> tuple:
    m = r.recipe.model
    return r.source, m.n_layers, m.d_model, m.n_heads, m.dtype


def load(dirs: list[Path]) -> ResultsSet:
    """Read every results dir; labels come from the sweep's ``label`` or the dir name, made unique."""
    out = ResultsSet()
    used: set[str] = set()
    for d in map(Path, dirs):
        if not (d / RESULTS_FILE).is_file():
            raise RecipeError(f"{d}: no {RESULTS_FILE} here; is it a results directory of `scaletool sweep`?")
        meta = _read_meta(d, out.warnings)
        label = meta.get("label") or d.resolve().name
        base, n = label, 2
        while label in used:
            label, n = f"{base} ({n})", n + 1
        used.add(label)
        out.sources.append({"label": label, "path": str(d), "name": meta.get("name"),
                            "description": meta.get("description"), "base_recipe": meta.get("base_recipe")})
        raw, warnings = read_records(d)
        out.warnings += warnings
        records = []
        for rec in raw:
            rec = _tamed(rec, d, out.warnings)
            try:
                records.append(Record.model_validate(rec))
            except ValidationError as e:
                where = rec.get("label") if isinstance(rec.get("label"), str) else rec.get("key")
                out.warnings.append(f"{d / RESULTS_FILE}: record {str(where)[:80]!r} is not a sweep record, "
                                    f"left out: {_first_error(e)}")
        out.rows += _rows(d, label, records, out.warnings)
    estimates = {(r.source, r.record.sweep, r.label): r for r in out.rows if r.mode == "estimate" and r.ok}
    for r in out.rows:
        r.sink, r.estimate = out.recomputed, estimates.get((r.source, r.record.sweep, r.label))
    return out


def _rows(d: Path, source: str, records: list[Record], warnings: list[str]) -> list[Row]:
    """One row per (sweep, point, mode) of the newest recipe, its ok repeats together; one row per
    failed repeat (for the failures table)."""
    groups: dict[tuple, list[Record]] = {}
    for rec in records:
        groups.setdefault((rec.sweep, rec.label, rec.mode), []).append(rec)
    rows, superseded = [], 0
    for recs in groups.values():
        newest = recs[-1]
        # A changed recipe (an edited base, a new recipe field) changes point_id: only the newest counts.
        current = [r for r in recs if r.point_id == newest.point_id]
        superseded += len({r.key for r in recs} - {r.key for r in current})
        by_repeat = {r.repeat: r for r in current}  # later lines win (a retried repeat)
        recipe = _recipe(d, newest, warnings)
        if newest.recipe is not None and recipe is None:
            continue
        ok = [by_repeat[k] for k in sorted(by_repeat) if by_repeat[k].status == "ok"]
        runs = [v for v in (_view(d, r, warnings) for r in ok) if v is not None] if newest.mode in MODES else []
        if ok and (runs or newest.mode not in MODES):
            rows.append(Row(source, ok[-1], recipe, _run_dir(d, ok[0]), runs))
        # A failed run keeps the result it wrote (a diverged train's history and monitors): its row carries it.
        rows += [Row(source, r, recipe, _run_dir(d, r), _failed_runs(d, r, warnings))
                 for k, r in sorted(by_repeat.items()) if r.status != "ok"]
    if superseded:
        warnings.append(f"{d}: {superseded} older result(s) of the same points under an earlier recipe "
                        "(a changed sweep or recipe schema) left out")
    return rows


def _recipe(d: Path, rec: Record, warnings: list[str]) -> Recipe | None:
    if rec.recipe is None:
        return None
    try:
        return recipe_from_dict(rec.recipe, f"{d}: {rec.label}")
    except RecipeError as e:
        warnings.append(f"{d}: {rec.label} ({rec.mode}): recorded recipe no longer validates, left out: {e.problems[0]}")
        return None


def _view(d: Path, rec: Record, warnings: list[str]) -> Result | None:
    where = f"{d}: {rec.label} ({rec.mode}" + (f", repeat {rec.repeat}" if rec.repeats > 1 else "") + ")"
    try:
        return read_result(rec.mode, rec.result, where)
    except RecipeError as e:
        warnings.append(f"{where}: result left out: {e.problems[0]}")
    except ValidationError as e:
        warnings.append(f"{where}: result left out: {_first_error(e)}")
    return None


def _failed_runs(d: Path, rec: Record, warnings: list[str]) -> list[Result]:
    """The partial result a failed run wrote, as its row's one run (none when it wrote none)."""
    if rec.result is None or rec.mode not in MODES:
        return []
    view = _view(d, rec, warnings)
    return [view] if view is not None else []


def _first_error(e: ValidationError) -> str:
    return validation_lines(e, "", root="record", show_input=lambda err: False, limit=1)[0].removeprefix(": ")


def _run_dir(d: Path, rec: Record) -> Path | None:
    return d / rec.run_dir if rec.run_dir else None


#: no figure of a run comes near this (FLOPs of a whole training run are ~1e25): beyond it, or not finite,
#: a number is a corrupt or hostile record and would overflow the tables' and plots' arithmetic
MAX_MAGNITUDE = 1e30


def _tamed(rec: Any, d: Path, warnings: list[str]) -> Any:
    """``rec`` with every number beyond :data:`MAX_MAGNITUDE` (or not finite) replaced by None, and one
    warning naming the first such key."""
    bad: list[str] = []

    def tame(obj: Any, where: str) -> Any:
        if isinstance(obj, (int, float)) and not isinstance(obj, bool):
            if not -MAX_MAGNITUDE <= obj <= MAX_MAGNITUDE:  # NaN fails both comparisons too
                bad.append(where)
                return None
            return obj
        if isinstance(obj, dict):
            return {k: tame(v, f"{where}.{k}" if where else str(k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [tame(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return obj

    out = tame(rec, "")
    if bad:
        who = rec.get("key") if isinstance(rec, dict) and isinstance(rec.get("key"), str) else "a record"
        warnings.append(f"{d / RESULTS_FILE}: {who[:80]}: {len(bad)} number(s) out of range (first: {bad[0][:80]}), "
                        "left out")
    return out


def _read_meta(d: Path, warnings: list[str]) -> dict:
    """sweep.json's text fields (label, name, description, base_recipe); anything unreadable or not text is
    left out with a warning, and the directory name labels the results."""
    path = d / SWEEP_META
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, OSError, RecursionError):  # not JSON, not UTF-8, unreadable
        warnings.append(f"{path}: unreadable, using the directory name as label")
        return {}
    if not isinstance(meta, dict):
        warnings.append(f"{path}: not a JSON object, using the directory name as label")
        return {}
    wrong = [k for k in ("label", "name", "description", "base_recipe") if meta.get(k) is not None
             and not isinstance(meta[k], str)]
    if wrong:
        warnings.append(f"{path}: {', '.join(wrong)} not text, ignored")
    return {k: v for k, v in meta.items() if k not in wrong}


def breakdown_of(run_dir: Path) -> dict[str, float] | None:
    """Category time shares from ``<run dir>/profile/breakdown.json``, if the run was profiled.

    The hook: ``scaletool train``/``profile`` with ``profile.enabled`` write that file
    (:mod:`scaletool.profile.trace`); the report reads its ``categories`` mapping,
    ``{name: {"share": fraction of the profiled step, ...}}`` (attention, ffn_matmul, other_matmul,
    norm, optimizer, communication, idle, ...). Anything else in the file is ignored.
    """
    path = run_dir / BREAKDOWN_FILE
    if not path.is_file():
        return None
    try:
        cats = json.loads(path.read_bytes().decode("utf-8")).get("categories")
    except (ValueError, OSError, RecursionError, AttributeError):  # not JSON or not UTF-8, unreadable, not an object
        return None
    if not isinstance(cats, dict):
        return None
    shares = {str(k): float(v["share"]) for k, v in cats.items()
              if isinstance(v, dict) and isinstance(v.get("share"), (int, float)) and not isinstance(v["share"], bool)
              and 0 <= v["share"] <= 1}
    return shares or None
