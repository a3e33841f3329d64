"""The typed result of a training run, built from what the trainer measured.

Throughput comes from the median step time of the measured steps (warm-up excluded by the rule in
:func:`scaletool.results.train.timing_of`), so one slow step (a checkpoint flush elsewhere on the
machine, a page fault) does not move it; the window's mean rate (tokens over the measured wall time)
is kept beside it as ``throughput/tokens_per_s_window``. MFU uses the analytic training FLOPs per
token (:func:`scaletool.analytic.flops_per_token`: 6·N + attention) in both conventions: causal
attention (Megatron's and ours, ``mfu``) and full attention (torchtitan's, ``mfu_full_attention``,
which counts the masked half of the score matrix too); for MoE also the FLOPs the capacity dispatch
computes (``*_computed``) beside the useful ones.

A run resumed from a checkpoint is several segments (one per process); each keeps its own
measurement, and the headline figures come from the latest segment that measured a step.
"""
from __future__ import annotations

import importlib
import os
import platform
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from scaletool.analytic.memory import recipe_memory
from scaletool.config import Recipe
from scaletool.engines import DistEnv
from scaletool.engines.base import engine_kind
from scaletool.measure.contention import RULE, summarize
from scaletool.measure.hardware import Peak
from scaletool.measure.nvml import NvmlSampler
from scaletool.results.train import History, Segment, Timing, TrainResult, timing_of
from scaletool.stats import rel_error


def device_uuid(device: torch.device) -> str | None:
    """The NVML UUID of a CUDA device (``GPU-...``), or None."""
    u = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if u is None:
        return None
    s = str(u)
    return s if s.startswith("GPU-") else f"GPU-{s}"


def rank_report(env: DistEnv, sampler: NvmlSampler, since: float | None, resident: int | None,
                threads: int | None, before_window_peak: int | None = None) -> dict:
    """This rank's own figures: device, allocator peaks, NVML samples, CPU threads.

    ``peak_allocated_bytes`` is the measured window's peak (the steps after warm-up);
    ``run_peak_allocated_bytes`` the whole run's, model build and warm-up steps included
    (``before_window_peak``: the allocator's peak when the window opened)."""
    cuda = env.device.type == "cuda"
    window = torch.cuda.max_memory_allocated(env.device) if cuda else None
    return {
        "rank": env.rank,
        "device_name": torch.cuda.get_device_name(env.device) if cuda else platform.processor() or "cpu",
        "peak_allocated_bytes": window,
        "run_peak_allocated_bytes": max(window, before_window_peak or 0) if cuda else None,
        "resident_bytes": resident,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(env.device) if cuda else None,
        # the run's cudaMalloc retries: the allocator found the card full, freed its cache and tried again (slow)
        "alloc_retries": int(torch.cuda.memory_stats(env.device).get("num_alloc_retries", 0)) if cuda else None,
        "nvml": sampler.summary(since),
        "threads": threads,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    }


def gather_reports(report: dict, env: DistEnv, collective: bool) -> list[dict]:
    """Every rank's report on every rank (only this rank's when the peers may be gone)."""
    if not (collective and dist.is_initialized() and env.world_size > 1):
        return [report]
    reports = [None] * env.world_size
    dist.all_gather_object(reports, report)
    return reports


@dataclass
class RunRecord:
    """What the trainer hands over at the end (or at a failure) of a process's run."""

    recipe: Recipe
    env: DistEnv
    out: Path
    status: str
    message: str | None
    history: dict[str, list]
    segments: list[dict]  # {start_step, end_step, resumed_from, world_size, threads}; the last is this process's
    measure_start: int  # first step of this process's measured window
    tokens_per_step: int
    measure: bool
    window_s: float | None
    checkpoint_s: float
    unmeasured_s: float
    reports: list[dict]
    peak: Peak
    flops: dict
    threads: int | None
    contention: dict[int, dict] = field(default_factory=dict)  # step -> the probe's sample (this rank's)
    peak_fp8_tflops: float | None = None  # train.float8: the card's dense FP8 peak (a second MFU beside bf16's)


def _segment(r: RunRecord, seg: dict, current: bool) -> Segment:
    minimum = r.recipe.train.measure_warmup_steps
    if current and not r.measure:  # no per-step times: the window's mean rate
        steps = seg["end_step"] - r.measure_start
        rate = steps * r.tokens_per_step / r.window_s if r.window_s and steps > 0 else None
        timing = timing_of([None] * (seg["end_step"] - seg["start_step"]), minimum, r.tokens_per_step)
        return Segment(**seg, measured_steps=max(steps, 0) if rate else 0, tokens_per_s=rate, timing=timing)
    times = [t for s, t in zip(r.history["step"], r.history["step_time_s"]) if seg["start_step"] <= s < seg["end_step"]]
    timing = timing_of(times, minimum, r.tokens_per_step)
    return Segment(**seg, measured_steps=timing.step_s.n if timing.step_s else 0, timing=timing,
                   tokens_per_s=timing.tokens_per_s.median if timing.tokens_per_s else None)


def _flops_metrics(rate: float | None, world: int, flops: dict, peak: Peak) -> dict[str, float | None]:
    """Achieved TFLOP/s per GPU and MFU in both attention conventions (and computed FLOPs for MoE)."""
    per_gpu = rate / world if rate else None
    conv = flops["convention"]
    keys = {"": "train", "_full_attention": "train_full"}
    if "moe" in flops:
        keys.update({"_computed": f"train_{conv}_computed", "_full_attention_computed": "train_full_computed"})
    out: dict[str, float | None] = {"throughput/tokens_per_s": rate, "throughput/tokens_per_s_per_gpu": per_gpu}
    for suffix, key in keys.items():
        tflops = per_gpu * flops[key] / 1e12 if per_gpu else None
        out[f"flops/achieved_tflops_per_gpu{suffix}"] = tflops
        out[f"flops/mfu{suffix}"] = tflops / peak.tflops if tflops and peak.tflops else None
    return out


def _memory(r: RunRecord) -> tuple[dict, dict]:
    """(metrics, the summary's memory section): measured peaks against the analytic estimate."""
    def most(key):
        vals = [x.get(key) for x in r.reports if x.get(key) is not None]  # reports of older peers may lack a key
        return max(vals) if vals else None

    peak_alloc, run_peak = most("peak_allocated_bytes"), most("run_peak_allocated_bytes")
    # the one estimate of this layout (compiled as the engine compiles it), the figure estimate and plan give:
    # under pipeline stages the largest stage's, and each rank beside its own stage's
    stages, dp = [], 1
    if r.recipe.parallel.pipeline_parallel > 1:
        from scaletool.analytic.pipeline_time import pipeline_estimate
        est, block = pipeline_estimate(r.recipe, r.env.world_size)
        stages = block["stages"]
        dp = r.env.world_size // r.recipe.parallel.pipeline_parallel  # ranks pipeline-outermost: stage rank // dp
    else:
        est = recipe_memory(r.recipe, r.env.world_size)

    def rel(x):
        return rel_error(x or None, est["total_bytes"])

    metrics = {"memory/peak_allocated_bytes": peak_alloc, "memory/peak_reserved_bytes": most("peak_reserved_bytes"),
               "memory/resident_bytes": most("resident_bytes"), "memory/analytic_bytes": est["total_bytes"],
               "memory/analytic_rel_error": rel(peak_alloc),
               # the whole run's peak (build and warm-up steps too), which is what the estimate models
               "memory/run_peak_allocated_bytes": run_peak, "memory/analytic_rel_error_run": rel(run_peak),
               "memory/alloc_retries": most("alloc_retries")}
    section = {"measured_peak_allocated_bytes": peak_alloc, "measured_run_peak_allocated_bytes": run_peak,
               "alloc_retries": most("alloc_retries"),
               "analytic": est, "rel_error": rel(peak_alloc), "rel_error_run": rel(run_peak),
               "per_rank": [{**{k: x.get(k) for k in ("rank", "peak_allocated_bytes", "run_peak_allocated_bytes",
                                                     "peak_reserved_bytes", "resident_bytes", "alloc_retries")},
                             **({"stage_estimate_bytes": stages[x["rank"] // dp]["total_bytes"]}
                                if stages and x.get("rank") is not None else {})}
                            for x in r.reports]}
    return metrics, section


def _prediction(r: RunRecord, measured: float | None) -> tuple[dict, dict]:
    """(metrics, the summary's prediction section): the step-time model for this layout and device,
    with the calibration that matches the device (the CPU's is a placeholder), against the measured rate."""
    from scaletool.errors import RecipeError, describe
    from scaletool.measure.hardware import load_profiles
    from scaletool.predict.prediction import calibration_for_device, predict

    keys = ("predict/step_s", "predict/tokens_per_s", "predict/tokens_per_s_per_gpu", "predict/mfu",
            "predict/rel_error_tokens_per_s")
    try:
        profile = next((p for p in load_profiles() if p.name == r.peak.profile), None)
        calib = calibration_for_device(r.env.device.type, profile)
        pred = predict(r.recipe, calib, r.env.world_size, r.env.local_world_size)
    except Exception as e:  # noqa: BLE001 - the run has finished: its summary is written whatever the prediction hits
        return dict.fromkeys(keys), {"unavailable": "; ".join(e.problems) if isinstance(e, RecipeError) else describe(e)}
    err = rel_error(pred["tokens_per_s"], measured)
    metrics = dict(zip(keys, (pred["step_s"], pred["tokens_per_s"], pred["tokens_per_s_per_gpu"], pred["mfu"], err)))
    section = {k: pred[k] for k in ("step_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "hfu", "bound", "terms",
                                    "assumptions")}
    section.update(calibration=calib.name, calibration_source=calib.source, calibration_file=calib.file or None,
                   rel_error_tokens_per_s=err,
                   meaningful=r.env.device.type != "cpu")
    return metrics, section


def _step_stats(timing: Timing | None) -> dict[str, float | None]:
    s = timing.step_s if timing else None
    return {"median": s.median if s else None, "p10": s.p10 if s else None, "p90": s.p90 if s else None}


def build_result(r: RunRecord) -> TrainResult:
    """The run's :class:`TrainResult` (rank 0's view; every rank builds the same from gathered reports)."""
    segments = [_segment(r, seg, i == len(r.segments) - 1) for i, seg in enumerate(r.segments)]
    chosen = next((i for i in reversed(range(len(segments))) if segments[i].tokens_per_s), len(segments) - 1)
    seg = segments[chosen]
    timing = seg.timing
    flops = _flops_metrics(seg.tokens_per_s, seg.world_size or r.env.world_size, r.flops, r.peak)
    if r.peak_fp8_tflops and flops["flops/achieved_tflops_per_gpu"]:
        # the same model FLOPs over the FP8 peak: what FP8 tensor cores could reach (flops/mfu stays bf16's)
        flops["flops/mfu_fp8_peak"] = flops["flops/achieved_tflops_per_gpu"] / r.peak_fp8_tflops
    mem_metrics, memory = _memory(r)
    pred_metrics, prediction = _prediction(r, seg.tokens_per_s)
    hist = History(**r.history)
    losses = hist.loss
    steps_done = hist.step[-1] + 1 if hist.step else r.segments[-1]["start_step"]
    window_steps = steps_done - r.measure_start
    stats = _step_stats(timing)
    rate_spread = timing.tokens_per_s if timing else None
    metrics = {
        **flops,
        "throughput/tokens_per_s_window": (window_steps * r.tokens_per_step / r.window_s
                                           if r.window_s and window_steps > 0 else None),
        **mem_metrics,
        **pred_metrics,
        "time/step_s_median": stats["median"], "time/step_s_p10": stats["p10"], "time/step_s_p90": stats["p90"],
        "time/step_s_mean": _mean(_measured_times(hist, seg)),
        "time/measured_s": r.window_s, "time/checkpoint_s": r.checkpoint_s, "time/unmeasured_s": r.unmeasured_s,
        "loss/first": losses[0] if losses else None, "loss/last": losses[-1] if losses else None,
    }
    measured = _measured_times(hist, seg)
    first = seg.start_step + (seg.timing.warmup_steps_excluded if seg.timing else 0)
    samples = [c for st, c in sorted(r.contention.items()) if first <= st < seg.end_step]
    contention = summarize(samples) if samples else {}
    gpu = [x.get("nvml") or {} for x in r.reports]
    others = [g["contention/gpu_other_processes_max"] for g in gpu if g.get("contention/gpu_other_processes_max") is not None]
    throttled = [g["contention/gpu_throttled_share"] for g in gpu if g.get("contention/gpu_throttled_share") is not None]
    if others or throttled:  # a card shared with another process is contended; throttling is only recorded
        contention["contention/gpu_other_processes_max"] = max(others, default=None)
        contention["contention/gpu_throttled_share"] = max(throttled, default=None)
        if max(others, default=0) > 0:
            contention["contention/contended"] = True
    metrics.update({k: float(v) if isinstance(v, bool) else v for k, v in contention.items()})
    return TrainResult(
        status=r.status, message=r.message,
        tokens_per_s=seg.tokens_per_s, tokens_per_s_spread=rate_spread.ratio_spread if rate_spread else None,
        mfu=flops["flops/mfu"], mfu_full_attention=flops["flops/mfu_full_attention"],
        peak_memory_bytes=mem_metrics["memory/peak_allocated_bytes"],
        loss_first=metrics["loss/first"], loss_last=metrics["loss/last"], metrics=metrics,
        timing=timing, threads=r.threads, history=hist,
        steps_completed=steps_done, start_step=r.segments[-1]["start_step"], measured_steps=seg.measured_steps,
        measure_warmup_steps=r.recipe.train.measure_warmup_steps, tokens_per_step=r.tokens_per_step,
        resumed_from=r.segments[-1]["resumed_from"], segments=segments, measured_segment=chosen,
        out_dir=str(r.out), engine=r.recipe.parallel.engine, measure=r.measure,
        step_time_s={"mean": _mean(measured), "median": stats["median"], "min": min(measured, default=None),
                     "max": max(measured, default=None)},
        flops_per_token=r.flops,
        hardware={"profile": r.peak.profile, "peak_tflops": r.peak.tflops, "source": r.peak.source,
                  "warning": r.peak.warning, "dtype": r.recipe.model.dtype},
        memory=memory, prediction=prediction, nvml={"per_rank": [dict(x["nvml"], rank=x["rank"]) for x in r.reports]},
        environment=environment(r.env, r.reports, r.recipe.parallel.engine, r.recipe), elastic=elastic(r.reports),
        recipe=r.recipe.to_dict(),
        contention={"contended": bool(contention.get("contention/contended")),
                    "contended_steps": contention.get("contention/contended_steps"),
                    "sampled_steps": contention.get("contention/sampled_steps"), "rule": RULE} if contention else None,
    )


def _measured_times(hist: History, seg: Segment) -> list[float]:
    """The step times the segment's timing counts (after its warm-up)."""
    first = seg.start_step + (seg.timing.warmup_steps_excluded if seg.timing else 0)
    return [t for s, t in zip(hist.step, hist.step_time_s) if first <= s < seg.end_step and t is not None]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def elastic(reports: list[dict]) -> dict | None:
    """torchrun restarts of this run's worker group (None when not started by torchrun).

    The count is the largest over ranks: a node whose workers failed counts the restart, while the
    others restart for the new membership with their count unchanged.
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    return {"restart_count": max(r["restart_count"] for r in reports),
            "max_restarts": int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}


def environment(env: DistEnv, reports: list[dict], engine: str, recipe: Recipe | None = None) -> dict:
    cuda = env.device.type == "cuda"
    out = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "python": platform.python_version(), "hostname": socket.gethostname(),
        "device_type": env.device.type, "gpu_names": [r["device_name"] for r in reports] if cuda else [],
        "world_size": env.world_size, "local_world_size": env.local_world_size, "backend": env.backend,
        "launched": env.launched, "threads_per_rank": [r["threads"] for r in reports],
    }
    package = engine_kind(engine).package  # the engine's own library, when it has one
    if package:
        out[package] = importlib.import_module(package).__version__
    kind = engine_kind(engine)  # the engine library's configuration (DeepSpeed's config)
    if kind.has("config_record") and recipe is not None:
        out.update(kind.part("config_record")(recipe, env.world_size))
    return out


def headline(s: TrainResult) -> str:
    """``done: 10 steps; loss 5.56 -> 4.91; 21,000 tokens/s (p10-p90 20,100-22,300, n=8); ...``."""
    m = s.metrics
    parts = [f"done: {s.steps_completed} steps"]
    if s.loss_first is not None and s.loss_last is not None:
        parts.append(f"loss {s.loss_first:.4g} -> {s.loss_last:.4g}")
    rate = s.timing.tokens_per_s if s.timing else None
    mark = " CONTENDED" if (s.contention or {}).get("contended") else ""  # on the figure, not only at the end
    if rate is not None:
        parts.append(f"{rate.median:,.0f} tokens/s{mark} (p10-p90 {rate.p10:,.0f}-{rate.p90:,.0f}, n={rate.n})")
    elif s.tokens_per_s:
        parts.append(f"{s.tokens_per_s:,.0f} tokens/s{mark}")
    if m.get("flops/achieved_tflops_per_gpu"):
        # per rank: a GPU, or on the CPU a process (its threads)
        parts.append(f"{m['flops/achieved_tflops_per_gpu']:.3g} TFLOP/s per {'process' if s.threads else 'GPU'}")
    if s.mfu is not None:
        parts.append(f"MFU {100 * s.mfu:.1f}% causal, {100 * (s.mfu_full_attention or 0):.1f}% full attention")
    if s.peak_memory_bytes:
        parts.append(f"peak {s.peak_memory_bytes / 2**30:.2f} GiB (analytic {m['memory/analytic_bytes'] / 2**30:.2f}"
                     f" GiB, {100 * m['memory/analytic_rel_error']:+.1f}%)")
    if s.threads:
        parts.append(f"{s.threads} CPU thread{'s' if s.threads > 1 else ''}")
    c = s.contention or {}
    if c.get("contended"):
        why = (f"{c['contended_steps']} of {c['sampled_steps']} measured steps waited for a CPU another process held"
               if c.get("contended_steps") else "another process on the GPU, or the GPU throttled")
        parts.append(f"CONTENDED: {why} (compare no figure of this run)")
    return "; ".join(parts)


def failed_result(recipe: Recipe, out: Path | None, message: str, failures: list[str] | None = None) -> TrainResult:
    """The result of a run that failed before its trainer could say more (or whose rank 0 died)."""
    return TrainResult(status="failed", message=message, failures=failures or [], out_dir=str(out) if out else None,
                       engine=recipe.parallel.engine, recipe=recipe.to_dict(),
                       measure_warmup_steps=recipe.train.measure_warmup_steps)
