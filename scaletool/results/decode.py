"""``scaletool decode``'s result: one :class:`DecodePoint` per (context, batch) measured.

Timed figures carry their spread (:class:`~scaletool.stats.Spread` of per-step seconds, warm-up
excluded by ``scaletool.stats.settled_start``); rates and bandwidth derive from the median step.
Schema versions: 1 is the untyped dict scaletool wrote before typed results (whole-loop times,
``prefill_seconds`` and ``decode_seconds``, no per-step samples); 2 adds ``kind``, the spreads, the
CUDA-graph flag and the thread count.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from scaletool.results.base import Result, register
from scaletool.stats import Spread


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class DecodePoint(_Part):
    """One (context, batch) point; ``error`` set (and the measurements absent) when it could not run."""

    attention: str  # mha | gqa | mqa | mla, a mode other than the default named: mla-naive, mla-expand, mla-per_head(-naive)
    batch: int
    context: int
    error: str | None = None
    max_len: int | None = None  # cache positions: context + warm-up steps + new tokens
    new_tokens: int | None = None
    rope_extended_to: int | None = None
    attention_kernel: str | None = None
    cuda_graph: bool | None = None
    compiled: bool | None = None  # the step ran through torch.compile
    compile_tuning: bool | None = None  # compiled with Inductor's coordinate-descent tuning
    compile_s: float | None = None  # seconds of the first compiled call (trace + code generation)
    gemv_linears: int | None = None  # linear layers through the Triton GEMV at decode's few rows (0: cuBLAS)
    decode_host_issue_s_per_step: float | None = None  # host seconds per step to issue the timed steps (CUDA: asynchronous)
    split_streams: int | None = None  # the batch's parts, each on its own CUDA stream in the step (1: one)
    pdl: bool | None = None  # the step's Triton kernels under programmatic dependent launch
    spin_up_replays: int | None = None  # untimed replays of the first step before timing (CUDA: clocks settle)
    compile_graph_breaks: int | None = None
    kv_cache_bytes_per_token_analytic: int | None = None
    kv_cache_bytes_analytic: int | None = None
    kv_cache_bytes_measured: int | None = None
    kv_cache_bytes_allocator: int | None = None
    kv_cache_rel_error: float | None = None
    prefill_s: Spread | None = None  # seconds per prefill of ONE prompt of `context` tokens (rows 1.. are copies)
    prefill_runs_excluded: int | None = None
    prefill_tokens_per_s: float | None = None  # context / median prefill (not batch × context)
    decode_step_s: Spread | None = None  # seconds per decode step of the whole batch
    warmup_steps_excluded: int | None = None
    decode_tokens_per_s: float | None = None  # batch / median step
    decode_tokens_per_s_spread: float | None = None  # p90/p10 - 1 of the per-step rate
    decode_ms_per_token: float | None = None  # median step, ms
    decode_bytes_per_step: int | None = None
    decode_bandwidth_bytes_per_s: float | None = None
    decode_bandwidth_fraction_of_peak: float | None = None
    # the step against its floors (scaletool.decode.bounds): bytes at the measured copy bandwidth, FLOPs at
    # the datasheet peak, kernels × a replayed graph's per-kernel time; the bound is the largest floor
    decode_hbm_fraction_of_copy: float | None = None
    decode_floor_memory_s: float | None = None
    decode_floor_compute_s: float | None = None
    decode_floor_launch_s: float | None = None
    decode_kernels_per_step: int | None = None
    decode_flops_per_step: float | None = None
    decode_bound: str | None = None  # memory | compute | launch
    decode_step_over_floor: float | None = None  # median step / the bound's floor
    # one uncaptured step's GPU time (scaletool.decode.bounds.kernel_breakdown): busy_s, groups_s, top kernels
    decode_kernel_time: dict | None = None
    memory_peak_allocated_bytes: int | None = None
    # the timed steps' contention: {contended, contended_steps, sampled_steps, contention/... medians}
    contention: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def contended(self) -> bool | None:
        """Whether the timed steps were contended (None: not recorded)."""
        c = self.contention
        return None if not c or c.get("contended") is None else bool(c["contended"])

    @property
    def decode_rate(self) -> Spread | None:
        """Decode tokens/s with the per-step spread, else the recorded rate as one sample."""
        if self.decode_step_s is not None and self.batch and self.decode_step_s.p10 > 0:  # a 0 s step is no rate
            return self.decode_step_s.inverse(self.batch)
        return Spread.of_one(self.decode_tokens_per_s)

    @property
    def prefill_rate(self) -> Spread | None:
        if self.prefill_s is not None and self.context and self.prefill_s.p10 > 0:
            return self.prefill_s.inverse(self.context)
        return Spread.of_one(self.prefill_tokens_per_s)


class DecodeDevice(_Part):
    type: str
    name: str
    peak_bandwidth_bytes_per_s: float | None = None
    peak_bandwidth_source: str = ""
    copy_bandwidth_bytes_per_s: float | None = None  # measured in the run (scaletool.decode.bounds)
    graph_kernel_s: float | None = None
    peak_flops: float | None = None
    peak_flops_source: str | None = None
    versions: dict[str, str | None] = {}  # torch, its CUDA, Triton: what ran (empty in results from before)


class DecodeTiming(_Part):
    clock: str  # what measured each step
    rule: str  # which samples were excluded as warm-up
    contention: str | None = None  # the rule that flags a contended step (scaletool.measure.contention)


class MemoryFitRow(_Part):
    attention: str
    context: int
    kv_cache_bytes_per_token: int
    weights_bytes: int
    max_batch: int
    max_batch_x_context: int
    kv_cache_bytes_at_max_batch: int


class MemoryFit(_Part):
    budget_bytes: int
    reserve_bytes: int
    basis: str
    rows: list[MemoryFitRow]


@register
class DecodeResult(Result):
    """The decode benchmark of one recipe on one device.

    ``scaletool decode`` fills every field; those describing the run (attention, dtype, settings,
    weights, kv_cache, timing) default to empty so that partial documents (hand-written, or another
    tool's) still load and are read for their points.
    """

    SCHEMA_VERSION: ClassVar[int] = 2
    kind: Literal["decode"] = "decode"
    schema_version: int = 2
    points: list[DecodePoint]
    device: DecodeDevice
    attention: str | None = None
    mla_mode: str | None = None
    dtype: str | None = None
    settings: dict[str, Any] = {}
    weights_bytes: int | None = None
    weights_bytes_read_per_step: int | None = None
    kv_cache: dict[str, Any] = {}  # scaletool estimate's kv_cache section
    memory_fit: MemoryFit | None = None
    timing: DecodeTiming | None = None
    recipe: str | None = None
    checkpoint: str | None = None
    cuda_graph: bool = False  # decode steps replayed from a CUDA graph
    compiled: bool = False  # decode steps through torch.compile
    threads: int | None = None  # CPU intra-op threads (None on GPU)
    notes: list[str] = []

    @property
    def contended(self) -> bool | None:
        flags = [p.contended for p in self.points if p.contended is not None]
        return any(flags) if flags else None

    @classmethod
    def migrate(cls, data: Any) -> Any:
        """Version 1: no ``kind`` (the first ones the bare list of points, the device a name); the timing
        a sentence; whole-loop times per point, no per-step samples, so the spreads stay null and the
        rates are kept as they were measured."""
        if isinstance(data, list):
            data = {"points": data}
        if not isinstance(data, dict):
            return data
        data = {**data, "kind": "decode"}
        device = data.get("device")
        if device is None or isinstance(device, str):
            data["device"] = {"type": device or "unknown", "name": device or "unknown"}
        timing = data.get("timing")
        if not isinstance(timing, dict):
            data["timing"] = {"clock": str(timing or "unknown"),
                              "rule": "schema 1: one time around the whole loop, no per-step samples"}
        if isinstance(data.get("points"), list):
            data["points"] = [{k: v for k, v in p.items() if k not in ("prefill_seconds", "decode_seconds")}
                              if isinstance(p, dict) else p for p in data["points"]]
        return data
