"""Results directories read back for the report, through typed models.

A sweep record is validated as a :class:`Record`; its ``result`` is read as the typed result of its
mode. A document that carries a ``kind`` goes through :func:`scaletool.results.load_result` first (the
producer's model: validation, and migration of an older ``schema_version``); a document written
before results had a kind (``tests/report/fixtures``, ``recipes/benchmarks/sweep-results``) goes
through the view's :meth:`View.legacy`. Either way the report reads one small *view* per mode, the
fields it shows, by attribute: the report depends on the result contract, not on how a producer
nests its classes.

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

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from scaletool import analytic
from scaletool.config import Recipe, RecipeError, recipe_from_dict
from scaletool.kinds.engines import engine_kind
from scaletool.results import load_result, registered
from scaletool.results.train import TrainResult
from scaletool.stats import Spread, spread
from scaletool.sweep.runner import SWEEP_META
from scaletool.sweep.store import RESULTS_FILE, read_records

# Written by the profiler into a train run directory; see :func:`breakdown_of`.
BREAKDOWN_FILE = Path("profile") / "breakdown.json"


def one(x: float | None) -> Spread | None:
    """A single figure as a spread of one sample (no p10-p90 to judge a difference by)."""
    return None if x is None else Spread(median=x, p10=x, p90=x, n=1)


class View(BaseModel):
    """The part of a result the report reads. Other keys stay in results.jsonl, untouched."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A producer may write null for a section it did not fill (no environment on a run that
        failed early, no metrics): that reads as the view's default, not as an error."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields
                or cls.model_fields[k].default is None}

    @classmethod
    def legacy(cls, doc: Any) -> Any:
        """A document written before results had a ``kind``, in this view's shape (default: as is)."""
        return doc


# --- estimate and count -----------------------------------------------------------------------


class Params(View):
    total: int | None = None
    non_embedding: int | None = None
    measured: int | None = None  # count: the built model's parameters
    analytic: int | None = None  # count: the exact closed form
    active: int | None = None
    rule_of_thumb_12d2L: int | None = None
    rule_of_thumb_rel_error: float | None = None

    @property
    def exact(self) -> int | None:
        """The closed-form total: ``total`` (estimate, and count since schema 2), else count's old ``analytic``."""
        return self.total if self.total is not None else self.analytic


class KVCache(View):
    bytes_per_token: int | None = None
    mha_equivalent_bytes_per_token: int | None = None
    compression_ratio: float | None = None  # against the MHA with the same heads and head dims


class FlopsPerToken(View):
    train: float | None = None
    train_causal: float | None = None
    train_causal_computed: float | None = None  # MoE: every capacity slot, not only the top-k
    dense_6N: float | None = None


class EstimateFlops(View):
    per_token: FlopsPerToken = FlopsPerToken()


class MemoryTotal(View):
    total_bytes: int | None = None


class EstimateMemory(View):
    recipe: MemoryTotal = MemoryTotal()


class EstimateView(View):
    params: Params = Params()
    kv_cache: KVCache = KVCache()
    flops: EstimateFlops = EstimateFlops()
    memory: EstimateMemory = EstimateMemory()


class AnalyticFlops(View):
    train_full: float | None = None
    forward_full: float | None = None
    train_6N: float | None = None


class CountedFlops(View):
    forward: float | None = None
    train: float | None = None


class CountFlops(View):
    analytic: AnalyticFlops = AnalyticFlops()
    flop_counter: CountedFlops = CountedFlops()
    fvcore: CountedFlops = CountedFlops()


class CountView(View):
    params: Params = Params()
    flops: CountFlops = CountFlops()


# --- train --------------------------------------------------------------------------------------


class Timing(View):
    step_s: Spread | None = None
    tokens_per_s: Spread | None = None
    warmup_steps_excluded: int | None = None
    rule: str | None = None


class Environment(View):
    world_size: int | None = None
    device_type: str | None = None


class Hardware(View):
    profile: str | None = None


class TrainHistory(View):
    """Per-step records (``history``): losses are null where they were not finite."""

    step: list[int] = []
    loss: list[float | None] = []
    grad_norm: list[float | None] = []  # null where clipping was off (the engine did not compute it)
    lr: list[float | None] = []


class DynamicsSection(View):
    """What the training-dynamics monitors recorded (``dynamics``; :mod:`scaletool.profile.monitors`)."""

    every: int | None = None
    entropy_threshold_nats: float | None = None
    rank_threshold: float | None = None
    # {"step": s, "dynamics/<metric>/layer_NN": value, ...}; read leniently (a value that is no number is missing)
    history: list[dict[str, Any]] = []


class TrainView(View):
    status: str | None = None
    message: str | None = None
    tokens_per_s: float | None = None
    tokens_per_step: int | None = None
    mfu: float | None = None  # causal attention FLOPs (Megatron's convention, ours)
    mfu_full_attention: float | None = None  # every T² score counted (torchtitan's)
    peak_memory_bytes: int | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    measured_steps: int | None = None
    threads: int | None = None  # CPU intra-op threads; None on GPU
    timing: Timing = Timing()
    metrics: dict[str, Any] = {}
    environment: Environment = Environment()
    hardware: Hardware = Hardware()
    flops_per_token: FlopsPerToken = FlopsPerToken()
    history: TrainHistory = TrainHistory()
    dynamics: DynamicsSection | None = None
    prediction: dict[str, Any] | None = None  # the step-time model's prediction the run recorded
    contention: dict[str, Any] | None = None  # {contended, contended_steps, sampled_steps, rule}

    @property
    def contended(self) -> bool | None:
        """Whether the run's measured steps were contended (None: not recorded, as before it was)."""
        if self.contention and self.contention.get("contended") is not None:
            return bool(self.contention["contended"])
        v = self.metrics.get("contention/contended")
        return None if v is None else bool(v)

    @classmethod
    def legacy(cls, doc: Any) -> Any:
        """Schema-1 summaries (no ``kind``) go through the train result's own migration
        (:meth:`scaletool.results.train.TrainResult.migrate`): timing rebuilt from the per-step history by
        the warm-up rule new runs use, tokens/s and MFU from the median step."""
        return TrainResult.migrate(doc) if isinstance(doc, dict) else doc

    @property
    def rate(self) -> Spread | None:
        """Training tokens/s with its spread over the measured steps (n = 1 where none was kept)."""
        if self.timing.tokens_per_s is not None:
            return self.timing.tokens_per_s
        if self.timing.step_s is not None and self.tokens_per_step:
            return self.timing.step_s.inverse(self.tokens_per_step)
        return one(self.tokens_per_s)

    @property
    def steps_measured(self) -> int | None:
        """The steps behind the timing (after the warm-up rule), else what the summary says it measured."""
        return self.timing.step_s.n if self.timing.step_s is not None else self.measured_steps

    @property
    def on_cpu(self) -> bool:
        if self.environment.device_type:
            return self.environment.device_type == "cpu"
        return self.threads is not None or (self.hardware.profile or "").lower() == "cpu"

    def metric(self, name: str) -> float | None:
        """A scalar of the namespaced ``metrics`` (``moe/imbalance_ratio_max``), if it is a number."""
        v = self.metrics.get(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# --- decode -------------------------------------------------------------------------------------


class DecodePoint(View):
    attention: str | None = None
    batch: int | None = None
    context: int | None = None
    max_len: int | None = None
    kv_cache_bytes_measured: int | None = None
    kv_cache_bytes_analytic: int | None = None
    decode_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_step_s: Spread | None = None  # one step decodes one token of every sequence in the batch
    prefill_s: Spread | None = None  # one prompt of `context` tokens (the batch's other rows are copies)
    contention: dict[str, Any] | None = None  # the timed steps' contention (scaletool.measure.contention)

    @property
    def contended(self) -> bool | None:
        return None if not self.contention or self.contention.get("contended") is None else bool(self.contention["contended"])

    @property
    def decode_rate(self) -> Spread | None:
        if self.decode_step_s is not None and self.batch:
            return self.decode_step_s.inverse(self.batch)
        return one(self.decode_tokens_per_s)

    @property
    def prefill_rate(self) -> Spread | None:
        if self.prefill_s is not None and self.context:
            return self.prefill_s.inverse(self.context)
        return one(self.prefill_tokens_per_s)


class Device(View):
    type: str | None = None


class DecodeView(View):
    points: list[DecodePoint] = []
    device: Device = Device()

    @property
    def contended(self) -> bool | None:
        flags = [p.contended for p in self.points if p.contended is not None]
        return any(flags) if flags else None

    @field_validator("device", mode="before")
    @classmethod
    def _device_by_name(cls, v: Any) -> Any:
        return {"type": v} if isinstance(v, str) else v

    @classmethod
    def legacy(cls, doc: Any) -> Any:
        """The first decode results were the bare list of points."""
        return {"points": doc} if isinstance(doc, list) else doc


VIEWS: dict[str, type[View]] = {"estimate": EstimateView, "count": CountView, "train": TrainView, "decode": DecodeView}


def read_result(mode: str, doc: Any, source: str) -> View:
    """The typed view of one record's result (raises RecipeError or pydantic's ValidationError)."""
    cls = VIEWS[mode]
    if isinstance(doc, dict) and "kind" in doc:
        # A kind this scaletool has no model for (a newer writer's) is still read by the contract.
        if doc["kind"] in registered():
            doc = load_result(doc, source).model_dump(mode="json")
        return cls.model_validate(doc)
    return cls.model_validate(cls.legacy(doc))


# --- records and rows ---------------------------------------------------------------------------


class MatchParams(View):
    key: str
    base_value: float
    value: float
    target: int
    achieved: int
    rel_error: float
    params: str = "total"


class Record(View):
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
    runs: list[View] = field(default_factory=list)

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
        """The analytic KV cache of the point's model (bytes/token, the same-head-dims ratio)."""
        return analytic.kv_cache(self.recipe.model)

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
        if p.deepspeed and "deepspeed" in engine_kind(p.engine).keys:  # the DeepSpeed passthrough
            words.append("+config")
        return " ".join(words)

    @property
    def world_size(self) -> int | None:
        """Ranks a train run really had (its summary), else None."""
        return self.result.environment.world_size if self.mode == "train" and self.runs else None

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
        return ref.kv["bytes_per_token"] / r.kv["bytes_per_token"] if ref is not None else None


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
        runs = [v for v in (_view(d, r, warnings) for r in ok) if v is not None] if newest.mode in VIEWS else []
        if ok and (runs or newest.mode not in VIEWS):
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


def _view(d: Path, rec: Record, warnings: list[str]) -> View | None:
    where = f"{d}: {rec.label} ({rec.mode}" + (f", repeat {rec.repeat}" if rec.repeats > 1 else "") + ")"
    try:
        return read_result(rec.mode, rec.result, where)
    except RecipeError as e:
        warnings.append(f"{where}: result left out: {e.problems[0]}")
    except ValidationError as e:
        warnings.append(f"{where}: result left out: {_first_error(e)}")
    return None


def _failed_runs(d: Path, rec: Record, warnings: list[str]) -> list[View]:
    """The partial result a failed run wrote, as its row's one run (none when it wrote none)."""
    if rec.result is None or rec.mode not in VIEWS:
        return []
    view = _view(d, rec, warnings)
    return [view] if view is not None else []


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc']) or 'record'}: {err['msg']}"


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
