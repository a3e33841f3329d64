"""Measure prefill and decoding: KV-cache bytes against the analytic model, speed, memory bandwidth.

Per (context N, batch B) point: allocate caches for every position the run uses and read their size
from the tensors and the allocator, beside the analytic bytes; time ``1 + prefill_repeats`` prefills
of one prompt (leading runs excluded by ``scaletool.stats.settled_start``) and copy its cache rows to
the batch; time each decode step of the whole batch (CUDA events, or wall clock on CPU; a CUDA graph
unless turned off; ``torch.compile`` of the step with ``compile``; on CUDA after replaying the first
step untimed for ``spin_up_s``, as clocks settle), excluding warm-up by the same rule;
derive tokens/s and the bandwidth of the bytes a step must read (weights and cache) from the median
step, and the step's bound against the floors of ``scaletool.decode.bounds``.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

import torch

from scaletool.analytic.flops import decode_flops_per_token
from scaletool.analytic.kv import kv_cache
from scaletool.config import ModelConfig
from scaletool.decode.bounds import Floors, kernel_breakdown, measure_floors, point_bound, step_kernels
from scaletool.decode.generate import prefill, require_lm
from scaletool.decode.sizing import (
    cache_bytes_per_token,
    cache_label,
    cache_positions,
    memory_fit,
    weight_bytes,
    weight_bytes_per_step,
)
from scaletool.decode.steps import make_steps
from scaletool.errors import RecipeError
from scaletool.kernels.mla_decode import triton_supports
from scaletool.kinds.attention import attention_kind
from scaletool.measure.contention import RULE as CONTENTION_RULE
from scaletool.measure.contention import Probe, summarize
from scaletool.measure.hardware import profile_for
from scaletool.measure.timing import StepTimer
from scaletool.model.attention import DecodeMode
from scaletool.model.cache import cache_bytes, make_caches, replicate_first_row
from scaletool.results.decode import DecodePoint, DecodeResult
from scaletool.stats import settled_start, spread

WARMUP_RULE = ("the first {w} decode steps and the first prefill run always; further leading samples while slower "
               "than 1.25x the median of the later half (scaletool.stats.settled_start); on CUDA the first step is "
               "first replayed untimed for {spin} s")


@dataclass(frozen=True)
class DecodeSettings:
    batches: tuple[int | None, ...]  # None: the largest batch that fits the memory budget at each context
    contexts: tuple[int, ...]
    new_tokens: int
    mode: DecodeMode = DecodeMode()
    cuda_graph: bool = False
    compile: bool = False  # torch.compile the static step (then captured in the CUDA graph with cuda_graph)
    compile_tuning: bool = False  # with compile: Inductor's coordinate-descent tuning of its kernels
    join: bool = True  # projections reading one input as one GEMM (Transformer.join_projections)
    gemv: bool = False  # the graphed step's projections through the Triton GEMV where it can run (CUDA, 16-bit)
    split: int = 1  # the batch as this many parts on their own CUDA streams in the one graphed step
    pdl: bool = False  # the step's Triton kernels under programmatic dependent launch (Hopper and newer)
    spin_up_s: float = 0.5  # CUDA: replay the first step this long, untimed, before the timed steps (clocks settle)
    prefill_chunk: int = 4096
    warmup_steps: int = 3
    prefill_repeats: int = 3
    seed: int = 0

    @property
    def extra_positions(self) -> int:
        return cache_positions(0, self.warmup_steps, self.new_tokens)


def versions() -> dict[str, str | None]:
    """What ran: torch, the CUDA it was built for (None on a CPU build), Triton (None where absent)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version}


def peak_bandwidth(device: torch.device) -> tuple[float | None, str]:
    """Peak HBM bytes/s of this device and where the figure comes from (None on CPU or unknown GPUs)."""
    if device.type != "cuda":
        return None, "no peak bandwidth is assumed for CPUs"
    name = torch.cuda.get_device_name(device)
    prof = profile_for("cuda", name)
    if prof is None or prof.peak_bandwidth_bytes_per_s is None:
        return None, f"unknown accelerator '{name}': no HBM peak known, bandwidth fraction is null"
    return prof.peak_bandwidth_bytes_per_s, f"datasheet peak for profile {prof.source}"


def attention_kernel(cfg: ModelConfig, mode: DecodeMode, device: torch.device, dtype: torch.dtype,
                     cuda_graph: bool) -> str:
    """Which kernel a decode step's attention runs, in words (docs/decode.md)."""
    path = attention_kind(cfg).decode_path(cfg, mode.mla)
    if path != "absorbed":
        where = "the whole static cache, positions past the current one masked" if cuda_graph else "the cached K/V"
        first = ", cuDNN first (the fastest single-query kernel measured on H200)" if device.type == "cuda" else ""
        expand = "K/V up-projected from every cached latent each step, then " if path == "expand" else ""
        return f"{expand}sdpa over {where}{first}"
    why = triton_supports(device, dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    if mode.kernel == "torch" or (mode.kernel == "auto" and why is not None):
        return "torch reference: two bmm over the latent cache (reads it twice)" + (f"; {why}" if why else "")
    return "triton fused split-KV latent attention (reads the latent cache once)"


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _timed(device: torch.device, runs: int, fn, samples: list | None = None, after=None,
           host: list | None = None) -> list[float]:
    """Per-run seconds of ``runs`` calls of ``fn``; ``samples`` receives each call's contention sample (on a
    CPU) or one sample of the whole span (on CUDA, see below) and ``after(k)`` is called between runs, outside
    the timing; ``host`` receives the host's seconds from the first call to the return of the last, before
    waiting for the device (on CUDA: the time to issue the runs).

    On CUDA the runs are asynchronous, so a per-run host sample says nothing of its run, and reading the
    probe's files (every thread's scheduler statistics, ``/proc/stat``) took about 1 ms a snapshot on a
    16-core GPU host after a compile: two per step made batch-1 steps wait on the host."""
    probe = Probe()
    cuda = device.type == "cuda"
    timer = StepTimer(device, None if cuda else probe)
    t0, first = time.perf_counter(), probe.snap() if cuda and samples is not None else None
    for k in range(runs):
        with timer.step():
            fn()
        if after is not None:
            after(k + 1)
    if host is not None:
        host.append(time.perf_counter() - t0)
    out = timer.seconds()
    if samples is not None:
        samples.extend([probe.between(first, probe.snap())] if cuda else timer.contention)
    return out


def _kept(samples: list[dict], times: list[float], start: int) -> list[dict]:
    """The contention samples of the runs kept from ``start``: per run on a CPU, the one whole-span sample
    on CUDA (:func:`_timed`)."""
    return samples[start:] if len(samples) == len(times) else samples


def spin_up(steps, seconds: float) -> int:
    """On CUDA, replay the stepper's current step for ``seconds``, untimed, putting its token and position
    back after each (every replay rewrites the same cache row, which the first timed step rewrites again):
    a steps-long warm-up is milliseconds at batch 1, too short for the card's clocks to settle. Returns
    the replays run (0 off CUDA or with ``seconds`` 0)."""
    device = steps.token.device
    if device.type != "cuda" or seconds <= 0:
        return 0
    mark = steps.mark()
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(8):
            steps.step()
            steps.rewind(mark)
        n += 8
        torch.cuda.synchronize(device)
        if time.perf_counter() - t0 >= seconds:
            return n


def _ready_steps(model, caches, s: DecodeSettings, first: torch.Tensor, context: int, profile: bool):
    """The point's stepper, built (compiled, captured), its kernels profiled over one step (with ``profile``;
    None where unknown) and spun up (:func:`spin_up`, the replays kept as ``spin_up_replays``)."""
    steps = make_steps(model, caches, s.mode, first, context, s.cuda_graph, compile=s.compile,
                       tuning=s.compile_tuning, gemv=s.gemv, split=s.split, pdl=s.pdl)
    found = step_kernels(steps) if profile else None
    steps.spin_up_replays = spin_up(steps, s.spin_up_s)
    return steps, found


def _stepper_fields(steps, cfg: ModelConfig, mode: DecodeMode, device: torch.device, dtype: torch.dtype) -> dict:
    """What ran a point's steps: the attention kernel, the CUDA graph, the compile and its graph breaks."""
    return {"attention_kernel": attention_kernel(cfg, mode, device, dtype, steps.cuda_graph),
            "cuda_graph": steps.cuda_graph, "compiled": steps.compiled, "compile_tuning": steps.tuning,
            "gemv_linears": steps.gemv_linears, "split_streams": steps.split, "pdl": steps.pdl,
            "compile_s": steps.compile_s,
            "compile_graph_breaks": steps.graph_breaks}


def _decode_steps(steps, s: DecodeSettings, device: torch.device, tick, at: float):
    """The point's timed decode steps: (seconds per step, contention samples, the host's seconds per step to
    issue them; on CUDA near the step's time when the host, not the device, sets the pace)."""
    probe: list[dict] = []
    host: list[float] = []
    n_steps = s.warmup_steps + s.new_tokens
    tick(at, f"decode steps ({n_steps}, {s.warmup_steps} of them warm-up)")
    times = _timed(device, n_steps, steps.step, probe,
                   None if device.type == "cuda" else lambda k: tick(at + (1 - at) * k / n_steps,
                                                                      f"decode step {k}/{n_steps}"), host)
    return times, probe, host[0] / n_steps


#: the share of a point's progress each part takes (allocation, prefill runs, decode steps)
POINT_SHARES = (0.05, 0.45, 0.5)


def measure_point(model, cfg: ModelConfig, s: DecodeSettings, batch: int, context: int,
                  peak_bytes_per_s: float | None, tick=None, floors: Floors | None = None) -> DecodePoint:
    """One context length at one batch size (see the module docstring for the procedure). ``tick(fraction,
    what)`` hears of its parts: the allocation, each prefill run and, on a CPU, each decode step (on CUDA
    the steps are not interrupted: the host must keep ahead of the card)."""
    tick = tick or (lambda fraction, what: None)
    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    max_len = cache_positions(context, s.warmup_steps, s.new_tokens)
    extended = model.extend_positions(max_len)
    per_token = cache_bytes_per_token(cfg, s.mode.mla)
    point = {"attention": cache_label(cfg, s.mode.mla), "batch": batch, "context": context, "max_len": max_len,
             "new_tokens": s.new_tokens, "rope_extended_to": extended,
             "kv_cache_bytes_per_token_analytic": per_token, "kv_cache_bytes_analytic": per_token * batch * max_len}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    a, p, _ = POINT_SHARES
    tick(0.0, f"allocating the KV cache ({per_token * batch * max_len / 2**20:,.1f} MiB)")
    before = _allocated(device)
    caches = make_caches(cfg, batch, max_len, dtype=dtype, device=device, mla_mode=s.mode.mla)
    after = _allocated(device)
    point["kv_cache_bytes_measured"] = measured = cache_bytes(caches)
    point["kv_cache_bytes_allocator"] = None if before is None else after - before
    point["kv_cache_rel_error"] = (measured - point["kv_cache_bytes_analytic"]) / point["kv_cache_bytes_analytic"]

    gen = torch.Generator(device=device).manual_seed(s.seed)
    prompt = torch.randint(cfg.vocab_size, (1, context), device=device, generator=gen)
    out = {}
    probe: list[dict] = []
    runs = 1 + s.prefill_repeats
    tick(a, f"prefill 1/{runs} (warm-up)")
    times = _timed(device, runs, lambda: out.update(logits=prefill(model, prompt, caches, chunk=s.prefill_chunk,
                                                                   mode=s.mode)), probe,
                   lambda k: tick(a + p * k / runs, f"prefill {min(k + 1, runs)}/{runs}"))
    start = settled_start(times, 1)
    timed_samples = _kept(probe, times, start)
    prefill_s = spread(times[start:])
    point.update(prefill_s=prefill_s, prefill_runs_excluded=start, prefill_tokens_per_s=context / prefill_s.median)

    replicate_first_row(caches, context, batch)
    first = out["logits"].argmax(-1).expand(batch).contiguous()  # (B,)
    if s.compile:
        tick(a + p, "compiling the decode step (torch.compile)")
    steps, found = _ready_steps(model, caches, s, first, context, floors is not None)
    times, probe, point["decode_host_issue_s_per_step"] = _decode_steps(steps, s, device, tick, a + p)
    start = settled_start(times, s.warmup_steps)
    timed_samples += _kept(probe, times, start)
    summary = summarize(timed_samples) if timed_samples else {}
    step_s = spread(times[start:])
    # The step at position context + i reads the cache up to and including it: context + i + 1 tokens.
    measured_steps = range(start, len(times))
    mean_positions = context + sum(i + 1 for i in measured_steps) / len(measured_steps)
    bytes_per_step = weight_bytes_per_step(cfg) + batch * per_token * mean_positions
    bw = bytes_per_step / step_s.median
    flops = batch * decode_flops_per_token(cfg, round(mean_positions), s.mode.mla, batch)["total"]
    point.update(point_bound(floors, step_s.median, bytes_per_step, flops, found and len(found)) if floors else {})
    point["decode_kernel_time"] = None if found is None else kernel_breakdown(found)
    point.update(_stepper_fields(steps, cfg, s.mode, device, dtype), spin_up_replays=steps.spin_up_replays)
    point.update({
        "decode_step_s": step_s,
        "warmup_steps_excluded": start,
        "decode_tokens_per_s": batch / step_s.median,
        "decode_tokens_per_s_spread": step_s.inverse(batch).ratio_spread,
        "decode_ms_per_token": 1e3 * step_s.median,
        "decode_bytes_per_step": int(bytes_per_step),
        "decode_bandwidth_bytes_per_s": bw,
        "decode_bandwidth_fraction_of_peak": None if peak_bytes_per_s is None else bw / peak_bytes_per_s,
        "memory_peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "contention": {"contended": summary.get("contention/contended"),
                       "contended_steps": summary.get("contention/contended_steps"),
                       "sampled_steps": summary.get("contention/sampled_steps"),
                       **{k: v for k, v in summary.items() if k.endswith(("_share", "_1m", "_avg10"))}} if summary else None,
    })
    return DecodePoint(**point)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def plan_points(cfg: ModelConfig, s: DecodeSettings, fit: dict | None) -> list[tuple[int, int]]:
    """(context, batch) per point, contexts outermost; a 'max' batch (None) resolved from ``fit``."""
    label = cache_label(cfg, s.mode.mla)
    fit_batch = {r["context"]: r["max_batch"] for r in (fit or {"rows": []})["rows"] if r["attention"] == label}
    if None in s.batches and fit is None:
        raise RecipeError("batch 'max' needs a memory budget, and none is known for this device (no GPU): give one")
    return [(n, fit_batch[n] if b is None else b) for n in s.contexts for b in dict.fromkeys(s.batches)]


def run_decode(cfg: ModelConfig, model, s: DecodeSettings, *, budget_bytes: int | None, progress=None) -> DecodeResult:
    """Measure every (context, batch) point of ``s``; ``progress(done, total, description, detail=None)``
    hears of each point and, with fractional ``done`` and a ``detail``, of the parts within one. With
    ``s.join`` the model's projections are joined first (``Transformer.join_projections``), in place."""
    require_lm(cfg)
    s = replace(s, mode=s.mode.resolved(cfg))  # the default mode named, so labels and the result say which ran
    joined = model.join_projections() if s.join else 0  # in place: the caller's model keeps its joined layers
    device = next(model.parameters()).device
    peak, peak_source = peak_bandwidth(device)
    floors = measure_floors(device, cfg.dtype)
    _free(device)  # the copy's buffers
    fit = None if budget_bytes is None else memory_fit(cfg, budget_bytes, s.contexts, s.extra_positions)
    label = cache_label(cfg, s.mode.mla)
    plan = plan_points(cfg, s, fit)
    points = []
    for i, (n, batch) in enumerate(plan):
        desc = f"[{i + 1}/{len(plan)}] decode {label}: batch {batch} × context {n}"
        if progress is not None:
            progress(i, len(plan), desc)
        if batch < 1:
            points.append(DecodePoint(attention=label, batch=0, context=n, error="no batch fits the memory budget"))
            continue
        try:
            tick = None if progress is None else (
                lambda fraction, what, i=i, desc=desc: progress(i + fraction, len(plan), desc, detail=what))
            points.append(measure_point(model, cfg, s, batch, n, peak, tick, floors))
        except torch.cuda.OutOfMemoryError:
            points.append(DecodePoint(attention=label, batch=batch, context=n, error="out of memory"))
        _free(device)
    if progress is not None:
        progress(len(plan), len(plan), f"decode {label}: {len(plan)} point{'s' if len(plan) > 1 else ''} done")
    clock = ("CUDA events, one pair per step, read after one synchronisation; contention sampled once over the "
             "timed steps (they are issued asynchronously)" if device.type == "cuda"
             else "perf_counter around each step")
    return DecodeResult(
        attention=label, mla_mode=s.mode.mla,
        device={"type": device.type, "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "peak_bandwidth_bytes_per_s": peak, "peak_bandwidth_source": peak_source, **floors.as_dict(),
                "versions": versions()},
        dtype=cfg.dtype,
        settings={"new_tokens": s.new_tokens, "prefill_chunk": s.prefill_chunk, "warmup_steps": s.warmup_steps,
                  "prefill_repeats": s.prefill_repeats, "seed": s.seed, "kernel": s.mode.kernel,
                  "batch": ["max" if b is None else b for b in s.batches], "cuda_graph": s.cuda_graph,
                  "compile": s.compile, "compile_tuning": s.compile and s.compile_tuning,
                  "spin_up_s": s.spin_up_s, "join_projections": joined, "gemv": s.gemv, "split": s.split,
                  "pdl": s.pdl},
        weights_bytes=weight_bytes(cfg), weights_bytes_read_per_step=weight_bytes_per_step(cfg),
        kv_cache=kv_cache(cfg), points=points, memory_fit=fit,
        timing={"clock": clock, "rule": WARMUP_RULE.format(w=s.warmup_steps, spin=s.spin_up_s), "contention": CONTENTION_RULE},
        cuda_graph=any(p.cuda_graph for p in points), compiled=any(p.compiled for p in points))
