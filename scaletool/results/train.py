"""The result of ``scaletool train``: what ``summary.json``, ``--json`` and ``--result-file`` carry.

Schema version 2 keeps every key of version 1 (``status``, ``tokens_per_s``, ``mfu``, ``metrics``,
``history``, ``memory``, ``environment``, ``recipe``, ...) and adds the timing statistics
(``timing``: the per-step time and rate as median/p10/p90/n with the warm-up the rule excluded),
``tokens_per_s_spread``, ``mfu_full_attention``, ``threads``, ``segments`` (one per process that
trained the run: a resumed run keeps the measurement of each) and ``failures`` (one line per failed
rank, root cause first). ``tokens_per_s`` and ``mfu`` come from the median step time.

Version-1 documents (``summary.json`` files written before, without ``kind``) load through
:meth:`TrainResult.migrate` (or :func:`load_train_summary` for kind-less ones): where they kept
their per-step times, ``timing`` is derived by today's warm-up rule (marked as derived in
``timing.rule``) and ``tokens_per_s`` and MFU follow the median step like new results; the recorded
mean-based rate stays as ``metrics["throughput/tokens_per_s_window"]``.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from scaletool.results.base import Result, load_among, register
from scaletool.stats import Spread, settled_start, spread

#: the warm-up rule's wording, shared by live runs and migrated documents
RULE = ("the first {minimum} steps (train.measure_warmup_steps), then every leading step slower than "
        "1.25x the settled median (scaletool.stats.settled_start)")


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class History(_Part):
    """Per-step records of the whole run (every segment), in step order."""

    step: list[int] = Field(default_factory=list)
    loss: list[float | None] = Field(default_factory=list)
    grad_norm: list[float | None] = Field(default_factory=list)
    lr: list[float | None] = Field(default_factory=list)
    step_time_s: list[float | None] = Field(default_factory=list)  # None where per-step timing was off
    contended: list[bool | None] = Field(default_factory=list)  # by scaletool.measure.contention's rule; None: unknown


class Timing(_Part):
    """Per-step time and rate of the measured steps (warm-up excluded by rule)."""

    step_s: Spread | None = None  # None without per-step times (measure off, or no step measured)
    tokens_per_s: Spread | None = None  # global tokens per step / step time
    warmup_steps_excluded: int = 0  # leading steps of the segment left out
    rule: str = ""


class Segment(_Part):
    """One process's share of a run: steps [start_step, end_step) and how they measured."""

    start_step: int
    end_step: int
    resumed_from: str | None = None
    world_size: int | None = None
    threads: int | None = None
    measured_steps: int = 0
    tokens_per_s: float | None = None  # from the median step (the window's mean where per-step timing was off)
    timing: Timing | None = None


def timing_of(step_times: list[float | None], minimum: int, tokens_per_step: int | None) -> Timing:
    """Timing of one segment from its per-step times (in step order, the segment's first step first)."""
    rule = RULE.format(minimum=minimum)
    if not step_times or any(t is None for t in step_times):
        return Timing(warmup_steps_excluded=min(minimum, len(step_times)),
                      rule="no per-step times (per-step timing off): " + rule)
    start = settled_start(step_times, minimum)
    s = spread(step_times[start:])
    rate = s.inverse(tokens_per_step) if s is not None and tokens_per_step and s.p10 > 0 else None
    return Timing(step_s=s, tokens_per_s=rate, warmup_steps_excluded=start, rule=rule)


@register
class TrainResult(Result):
    """A training run: status, the measurement (throughput, MFU, memory), the loss curve and context."""

    SCHEMA_VERSION: ClassVar[int] = 2
    kind: Literal["train"] = "train"
    schema_version: int = 2

    status: Literal["completed", "diverged", "failed"]
    message: str | None = None
    tokens_per_s: float | None = None  # global, from the median step time
    tokens_per_s_spread: float | None = None  # p90/p10 - 1 of the per-step rate
    mfu: float | None = None  # causal-attention FLOPs (Megatron's convention, ours)
    mfu_full_attention: float | None = None  # full-attention FLOPs (torchtitan's convention)
    peak_memory_bytes: int | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    metrics: dict[str, float | None] = Field(default_factory=dict)
    timing: Timing | None = None
    threads: int | None = None  # CPU intra-op threads of rank 0 (None on GPU)
    history: History = Field(default_factory=History)
    steps_completed: int = 0
    start_step: int = 0
    measured_steps: int = 0
    measure_warmup_steps: int | None = None
    tokens_per_step: int | None = None
    resumed_from: str | None = None
    segments: list[Segment] = Field(default_factory=list)
    measured_segment: int | None = None  # the segment the headline figures come from
    failures: list[str] = Field(default_factory=list)  # one line per failed rank, root cause first
    out_dir: str | None = None
    engine: str | None = None
    measure: bool | None = None
    # {contended, contended_steps, sampled_steps, rule} over the measured steps (scaletool.measure.contention)
    contention: dict[str, Any] | None = None
    step_time_s: dict[str, float | None] | None = None  # mean/median/min/max of the measured steps
    flops_per_token: dict[str, Any] | None = None
    hardware: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    #: the step-time model's prediction for this layout on this device (scaletool.analytic.step): step_s,
    #: tokens_per_s, mfu, bound, terms, the calibration and its assumptions; rel_error_tokens_per_s is
    #: (predicted - measured) / measured. On the CPU the calibration is a placeholder (not meaningful).
    prediction: dict[str, Any] | None = None
    nvml: dict[str, Any] | None = None
    environment: dict[str, Any] | None = None
    elastic: dict[str, Any] | None = None
    recipe: dict[str, Any] | None = None
    # sections the training callbacks add (profiler, monitors, MoE)
    profile: dict[str, Any] | None = None
    dynamics: dict[str, Any] | None = None
    moe: dict[str, Any] | None = None

    @property
    def rate(self) -> Spread | None:
        """Training tokens/s with its spread over the measured steps (one sample where none was kept)."""
        if self.timing is not None and self.timing.tokens_per_s is not None:
            return self.timing.tokens_per_s
        step_s = self.timing.step_s if self.timing is not None else None
        if step_s is not None and self.tokens_per_step and step_s.p10 > 0:  # a step of 0 s is no rate
            return step_s.inverse(self.tokens_per_step)
        return Spread.of_one(self.tokens_per_s)

    @property
    def steps_measured(self) -> int | None:
        """The steps behind the timing (after the warm-up rule), else the steps the run says it measured."""
        return self.timing.step_s.n if self.timing is not None and self.timing.step_s is not None else self.measured_steps

    @property
    def warmup_steps_excluded(self) -> int | None:
        return self.timing.warmup_steps_excluded if self.timing is not None else None

    @property
    def world_size(self) -> int | None:
        """Ranks the run had (``environment.world_size``), None where not recorded."""
        v = (self.environment or {}).get("world_size")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def device_type(self) -> str | None:
        v = (self.environment or {}).get("device_type")
        return v if isinstance(v, str) else None

    @property
    def hardware_profile(self) -> str | None:
        v = (self.hardware or {}).get("profile")
        return v if isinstance(v, str) else None

    @property
    def on_cpu(self) -> bool:
        if self.device_type:
            return self.device_type == "cpu"
        return self.threads is not None or (self.hardware_profile or "").lower() == "cpu"

    @property
    def contended(self) -> bool | None:
        """Whether the measured steps were contended (None: not recorded)."""
        if self.contention and self.contention.get("contended") is not None:
            return bool(self.contention["contended"])
        v = self.metrics.get("contention/contended")
        return None if v is None else bool(v)

    def metric(self, name: str) -> float | None:
        """A scalar of the namespaced ``metrics`` (``moe/imbalance_ratio_max``), if it is a number."""
        v = self.metrics.get(name)
        return float(v) if _number(v) else None

    @classmethod
    def migrate(cls, data: Any) -> Any:
        """Schema 1 -> 2. Where the per-step history was kept, ``timing`` is derived from it by today's
        warm-up rule and the headline figures follow today's convention: ``tokens_per_s`` from the median
        step, MFU scaled with it (it is proportional to tokens/s); the recorded mean-based figure is kept
        as ``metrics["throughput/tokens_per_s_window"]``, which is what it measured."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        metrics = dict(data["metrics"]) if isinstance(data.get("metrics"), dict) else {}
        data.setdefault("mfu_full_attention", metrics.get("flops/mfu_full_attention"))
        hist = data["history"] if isinstance(data.get("history"), dict) else {}
        start = data.get("start_step") if _number(data.get("start_step")) else 0
        steps, step_times = hist.get("step"), hist.get("step_time_s")
        pairs = zip(steps, step_times) if isinstance(steps, list) and isinstance(step_times, list) else ()
        times = [t for s, t in pairs if _number(s) and s >= start]
        tokens = data.get("tokens_per_step")
        tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else None
        recorded = data.get("tokens_per_s")
        warmup = int(data["measure_warmup_steps"]) if _number(data.get("measure_warmup_steps")) else 0
        if data.get("timing") is None and times and all(t is None or _number(t) for t in times):
            t = timing_of(times, warmup, tokens)
            t.rule = "derived on load from a schema-1 summary's step times: " + t.rule
            data["timing"] = t.model_dump(mode="json")
            if t.tokens_per_s is not None:
                rate = t.tokens_per_s.median
                metrics.setdefault("throughput/tokens_per_s_window", recorded)
                for key in ("mfu", "mfu_full_attention"):
                    if _number(data.get(key)) and _number(recorded) and data[key] and recorded:
                        data[key] *= rate / recorded
                data.update(tokens_per_s=rate, tokens_per_s_spread=t.tokens_per_s.ratio_spread,
                            measured_steps=t.step_s.n)
        data["metrics"] = metrics
        return data


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def load_train_summary(data: Any, source: str = "summary.json") -> TrainResult:
    """A train result from a parsed ``summary.json`` of any schema version (kind-less ones are version 1)."""
    from scaletool.results.base import ResultLoadError

    if isinstance(data, dict) and "kind" not in data and "status" in data and "history" in data:
        data = {**data, "kind": "train"}
    if isinstance(data, dict) and isinstance(data.get("kind"), str) and data["kind"] != "train":
        raise ResultLoadError(f"{source}: a {data['kind'][:40]} result, not a train summary")
    return load_among({"train": TrainResult}, data, source)
