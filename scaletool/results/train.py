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

from scaletool.results.base import Result, load_result, register
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

    @classmethod
    def migrate(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Schema 1 -> 2. Where the per-step history was kept, ``timing`` is derived from it by today's
        warm-up rule and the headline figures follow today's convention: ``tokens_per_s`` from the median
        step, MFU scaled with it (it is proportional to tokens/s); the recorded mean-based figure is kept
        as ``metrics["throughput/tokens_per_s_window"]``, which is what it measured."""
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
    return load_result(data, source)
