"""The training loop: data -> engine step -> measurement, with callbacks.

Measurement rules (STYLE.md §7): the first ``train.measure_warmup_steps`` steps of a process
(compilation, allocator warm-up) are excluded; the host synchronises only at measurement
boundaries: the start and end of the measured window, every ``train.log_every`` steps (where the
losses of those steps, kept on the device until then, are fetched in one transfer and averaged
over ranks) and at checkpoints (whose duration is left out of the measured time). Per-step times
come from CUDA events recorded on the stream (no sync) or, on the CPU, the wall clock. NaN/Inf
losses are found at those boundaries and stop the run, naming the step.

Throughput is tokens over the measured window's wall time; MFU uses the analytic training FLOPs
per token (:func:`scaletool.analytic.flops_per_token`, causal attention, 6·N + attention) over the
accelerator's dense peak (:mod:`scaletool.measure.hardware`); the full-attention MFU is reported
beside it.

Callbacks
---------
``run(..., callbacks=[...])`` takes any objects with some of these methods; each is optional, so a
profiler or a training-dynamics monitor plugs in without touching the loop:

- ``on_train_start(info: TrainInfo)``: once, after the engine is built (``info`` has the recipe,
  the run directory, the :class:`~scaletool.engines.DistEnv` and the engine, whose ``.model`` is
  the module being trained; ``writer`` for log lines, and ``unmeasured()``, a context for work
  between steps, such as monitors, that must not count in throughput or step times).
- ``on_step_start(step: int)``: before the step's data are built.
- ``on_step_end(step: int, state: StepState) -> dict | None``: after the optimizer step. ``state``
  holds device tensors (``loss``, ``grad_norm``): reading them synchronises, so do it sparingly. A
  returned dict of namespaced scalars (``{"monitor/attention_entropy_nats": 2.1}``) is written with
  the step's metrics (TensorBoard and metrics.jsonl).
- ``on_train_end(summary: dict)``: once, on every rank, before ``summary.json`` is written; keys it
  adds to ``summary`` are saved with it.
"""
from __future__ import annotations

import math
import os
import platform
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from scaletool import analytic
from scaletool.config import Recipe, RecipeError
from scaletool.engines import DistEnv, Engine, agree, make_engine
from scaletool.errors import describe
from scaletool.measure.hardware import peak_for
from scaletool.measure.metrics import MetricsWriter
from scaletool.measure.nvml import NvmlSampler
from scaletool.profile import recipe_callbacks
from scaletool.train.checkpoint import latest_checkpoint, save_checkpoint
from scaletool.train.data import make_source
from scaletool.train.moe import moe_callbacks
from scaletool.train.schedule import lr_at


@dataclass
class TrainInfo:
    recipe: Recipe
    out_dir: Path
    env: DistEnv
    engine: Engine
    writer: MetricsWriter  # log() for messages; scalars go back through on_step_end's return value
    unmeasured: Callable[[], AbstractContextManager]  # work between steps left out of every timing


@dataclass
class StepState:
    step: int
    loss: torch.Tensor  # this rank's mean micro-batch loss, on the device (not yet fetched)
    grad_norm: torch.Tensor | None
    lr: float
    tokens: int  # global tokens in this step
    engine: Engine


class StepClock:
    """Per-step durations without host synchronisation: CUDA events on the stream, else wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._prev = None
        self._marks: list = []
        self._skipped: set[int] = set()

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            ev = time.perf_counter()
        if self._prev is None:
            self._prev = ev
        else:
            self._marks.append(ev)

    def skip(self) -> None:
        """Time the next step from here: what ran since the last mark belongs to no step."""
        self.mark()
        self._skipped.add(len(self._marks) - 1)

    def fetch(self) -> list[float]:
        """Seconds of each step marked since the last fetch (call at a boundary: it may wait)."""
        out, prev = [], self._prev
        if self.cuda and self._marks:
            self._marks[-1].synchronize()
        for i, ev in enumerate(self._marks):
            if i not in self._skipped:
                out.append(prev.elapsed_time(ev) / 1e3 if self.cuda else ev - prev)
            prev = ev
        self._prev, self._marks, self._skipped = prev, [], set()
        return out


def _sync(env: DistEnv) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    if dist.is_initialized() and env.world_size > 1:
        dist.barrier()


def _to_device(batch, device):
    return tuple(x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x for x in batch)


def _call(callbacks, hook: str, *args) -> list:
    return [getattr(cb, hook)(*args) for cb in callbacks if hasattr(cb, hook)]


def _rank_report(env: DistEnv, sampler: NvmlSampler, since: float | None, resident: int | None) -> dict:
    cuda = env.device.type == "cuda"
    return {
        "rank": env.rank,
        "device_name": torch.cuda.get_device_name(env.device) if cuda else platform.processor() or "cpu",
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(env.device) if cuda else None,
        "resident_bytes": resident,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(env.device) if cuda else None,
        "nvml": sampler.summary(since),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    }


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "median": None, "min": None, "max": None}
    s = sorted(xs)
    return {"mean": sum(xs) / len(xs), "median": s[len(s) // 2], "min": s[0], "max": s[-1]}


def run(recipe: Recipe, out: Path, env: DistEnv, *, resume: bool | str = False, peak_tflops: float | None = None,
        measure: bool = True, quiet: bool = False, callbacks: list | tuple = ()) -> dict:
    """Train ``recipe`` in ``out``; return the summary (also written to ``out/summary.json`` by rank 0).

    ``measure=False`` turns off per-step timing, NVML sampling, TensorBoard and intermediate loss
    fetches (losses are fetched once at the end); throughput is measured the same way either way.
    """
    t, out = recipe.train, Path(out)
    # the recipe's profile section (profiler, monitors), then MoE load metrics and router-bias updates
    callbacks = [*recipe_callbacks(recipe), *moe_callbacks(recipe), *callbacks]
    writer = MetricsWriter(out, enabled=env.is_main, tensorboard=measure, quiet=quiet)
    history: dict[str, list] = {"step": [], "loss": [], "grad_norm": [], "lr": [], "step_time_s": []}
    start_step, resumed_from = 0, None
    # resume="auto" (--auto-resume, what `scaletool launch` passes) starts at step 0 when there is no
    # checkpoint yet; rank 0's view decides, so all ranks continue from the same step.
    found = agree(latest_checkpoint(out), env) if resume else None
    if resume is True and found is None:
        raise RecipeError(f"--resume: no complete checkpoint under {out / 'checkpoints'}")
    if found is not None:
        resumed_from, state = found
        if state["engine"] != recipe.parallel.engine:
            raise RecipeError(f"--resume: {resumed_from} was written by engine={state['engine']}, "
                              f"this run uses parallel.engine={recipe.parallel.engine}")
        start_step, history = state["step"], state["history"]
    source = make_source(recipe, env.rank, env.world_size)
    engine = make_engine(recipe, env)
    if resumed_from is not None:
        engine.load(resumed_from)
        writer.log(f"resumed from {resumed_from} at step {start_step}")

    cfg, T = recipe.model, recipe.seq_len
    flops = analytic.flops_per_token(cfg, T)
    cuda = env.device.type == "cuda"
    device_name = torch.cuda.get_device_name(env.device) if cuda else "cpu"
    peak = peak_for(env.device.type, device_name, cfg.dtype, peak_tflops)
    if peak.warning:
        writer.log(f"warning: {peak.warning}", style="yellow")
    sampler = NvmlSampler(env.device.index if cuda and measure else None,
                          _uuid(env.device) if cuda and measure else None)
    if cuda and not measure:
        sampler.note = "--no-measure: NVML sampling off"
    sampler.start()
    clock = StepClock(env.device) if measure else None
    tokens_per_step = t.micro_batch_size * t.grad_accum_steps * env.world_size * T
    measure_start = start_step + t.measure_warmup_steps
    excluded = 0.0  # seconds inside the measured window that are not training (checkpoints, unmeasured())
    t_begin = None

    @contextmanager
    def unmeasured():
        """For callbacks: synchronise, run, synchronise, and leave the time out of throughput and step times."""
        nonlocal excluded
        if cuda:
            torch.cuda.synchronize(env.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(env.device)
            if t_begin is not None:
                excluded += time.perf_counter() - t0
            if clock:
                clock.skip()

    _call(callbacks, "on_train_start", TrainInfo(recipe, out, env, engine, writer, unmeasured))
    writer.log(f"{recipe.parallel.engine} on {env.world_size}× {device_name}: steps {start_step}..{t.steps - 1}, "
               f"{tokens_per_step:,} tokens/step, run directory {out}")

    pending: list[tuple[int, torch.Tensor, torch.Tensor | None, float]] = []
    status, message = "completed", None
    nvml_since = None
    resident = None  # bytes allocated between steps once warm: model and optimizer states, engine buffers
    step = start_step - 1

    def flush() -> int | None:
        """Fetch pending losses (averaged over ranks), write their scalars; the first bad step or None."""
        if not pending:
            return None
        losses = torch.stack([p[1].float() for p in pending])
        if dist.is_initialized() and env.world_size > 1:
            dist.all_reduce(losses)
            losses = losses / env.world_size
        norms = [p[2] for p in pending]
        norm_vals = torch.stack([n.float() for n in norms]).tolist() if all(n is not None for n in norms) \
            else [None] * len(norms)
        loss_vals = losses.tolist()
        times = clock.fetch() if clock else [None] * len(pending)
        bad = None
        for (s, _, _, lr), lv, gn, dt in zip(pending, loss_vals, norm_vals, times):
            history["step"].append(s)
            history["loss"].append(lv)
            history["grad_norm"].append(gn)
            history["lr"].append(lr)
            history["step_time_s"].append(dt)
            if measure:
                writer.scalars(s, {"loss/train": lv, "grad/norm": gn, "lr/lr": lr, "time/step_s": dt,
                                   "throughput/tokens_per_s": tokens_per_step / dt if dt else None},
                               echo=s == pending[-1][0])
            if bad is None and not math.isfinite(lv):
                bad = s
        pending.clear()
        return bad

    progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        console=writer.console, transient=True,
                        disable=not (env.is_main and not quiet and writer.console.is_terminal))
    try:
        with progress:
            task = progress.add_task("train", total=t.steps, completed=start_step)
            if clock:
                clock.mark()
            for step in range(start_step, t.steps):
                if step == measure_start:
                    _sync(env)
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(env.device)
                        resident = torch.cuda.memory_allocated(env.device)
                    t_begin = nvml_since = time.perf_counter()
                _call(callbacks, "on_step_start", step)
                torch.manual_seed(t.seed + 1_000_003 * step + env.rank)  # dropout: a function of the step
                batches = [_to_device(source.batch(step, m), env.device) for m in range(t.grad_accum_steps)]
                lr = lr_at(step, t)
                loss, norm = engine.train_step(batches, lr)
                if clock:
                    clock.mark()
                pending.append((step, loss, norm, lr))
                extra: dict = {}
                for r in _call(callbacks, "on_step_end", step, StepState(step, loss, norm, lr, tokens_per_step, engine)):
                    extra.update(r or {})
                if extra:
                    writer.scalars(step, extra, echo=False)
                progress.advance(task)
                done = step + 1
                save = t.checkpoint_every and done % t.checkpoint_every == 0
                if save or done == t.steps or (measure and (done - start_step) % t.log_every == 0):
                    bad = flush()
                    if bad is not None:
                        status = "diverged"
                        message = (f"loss is {history['loss'][history['step'].index(bad)]} at step {bad}: "
                                   "training stopped (lower train.lr, keep train.grad_clip on, or use fp32)")
                        writer.log(f"error: {message}", style="red")
                        break
                if save:
                    t0 = time.perf_counter()
                    path = save_checkpoint(engine, out, done, {"step": done, "history": history,
                                                               "engine": recipe.parallel.engine,
                                                               "world_size": env.world_size,
                                                               "recipe_digest": recipe.digest()}, env.is_main)
                    if t_begin is not None:
                        excluded += time.perf_counter() - t0
                    writer.log(f"checkpoint {path}")
        flush()
        _sync(env)
        t_end = time.perf_counter()
    except BaseException as e:
        status, message = "failed", describe(e)  # one line: the cause (out of memory, communication, ...)
        writer.log(f"error: {message}", style="red")
        _write_partial(writer, recipe, env, history, status, message, start_step)
        raise
    finally:
        sampler.stop()

    steps_done = (history["step"][-1] + 1) if history["step"] else start_step
    measured_steps = steps_done - measure_start if t_begin is not None else 0
    report = _rank_report(env, sampler, nvml_since, resident)
    reports = [report]
    if dist.is_initialized() and env.world_size > 1:
        reports = [None] * env.world_size
        dist.all_gather_object(reports, report)

    tokens_per_s = None
    if measured_steps > 0:
        tokens_per_s = measured_steps * tokens_per_step / (t_end - t_begin - excluded)
    per_gpu = tokens_per_s / env.world_size if tokens_per_s else None
    tflops = per_gpu * flops["train"] / 1e12 if per_gpu else None
    tflops_full = per_gpu * flops["train_full"] / 1e12 if per_gpu else None
    mfu = tflops / peak.tflops if tflops and peak.tflops else None
    mfu_full = tflops_full / peak.tflops if tflops_full and peak.tflops else None
    peaks = [r["peak_allocated_bytes"] for r in reports if r["peak_allocated_bytes"] is not None]
    peak_alloc = max(peaks) if peaks else None
    reserved = [r["peak_reserved_bytes"] for r in reports if r["peak_reserved_bytes"] is not None]
    residents = [r["resident_bytes"] for r in reports if r["resident_bytes"] is not None]
    est = analytic.recipe_memory(recipe, env.world_size)
    rel = (peak_alloc - est["total_bytes"]) / est["total_bytes"] if peak_alloc else None
    measured_times = [dt for s, dt in zip(history["step"], history["step_time_s"])
                      if s >= measure_start and dt is not None]
    metrics = {
        "throughput/tokens_per_s": tokens_per_s,
        "throughput/tokens_per_s_per_gpu": per_gpu,
        "flops/achieved_tflops_per_gpu": tflops,
        "flops/achieved_tflops_per_gpu_full_attention": tflops_full,
        "flops/mfu": mfu,
        "flops/mfu_full_attention": mfu_full,
        "memory/peak_allocated_bytes": peak_alloc,
        "memory/peak_reserved_bytes": max(reserved) if reserved else None,
        "memory/resident_bytes": max(residents) if residents else None,
        "memory/analytic_bytes": est["total_bytes"],
        "memory/analytic_rel_error": rel,
        "time/step_s_mean": _stats(measured_times)["mean"],
        "time/step_s_median": _stats(measured_times)["median"],
        "time/measured_s": (t_end - t_begin - excluded) if t_begin is not None else None,
        "time/checkpoint_s": excluded,
        "loss/first": history["loss"][0] if history["loss"] else None,
        "loss/last": history["loss"][-1] if history["loss"] else None,
    }
    summary = {
        "status": status, "message": message,
        "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_memory_bytes": peak_alloc,
        "loss_first": metrics["loss/first"], "loss_last": metrics["loss/last"],
        "metrics": metrics,
        "steps_completed": steps_done, "start_step": start_step,
        "measured_steps": measured_steps, "measure_warmup_steps": t.measure_warmup_steps,
        "tokens_per_step": tokens_per_step,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "elastic": _elastic(reports),
        "out_dir": str(out),
        "history": history,
        "step_time_s": _stats(measured_times),
        "flops_per_token": flops,
        "hardware": {"profile": peak.profile, "peak_tflops": peak.tflops, "source": peak.source,
                     "warning": peak.warning, "dtype": cfg.dtype},
        "memory": {"measured_peak_allocated_bytes": peak_alloc, "analytic": est, "rel_error": rel,
                   "per_rank": [{k: r[k] for k in ("rank", "peak_allocated_bytes", "peak_reserved_bytes",
                                                   "resident_bytes")}
                                for r in reports]},
        "nvml": {"per_rank": [dict(r["nvml"], rank=r["rank"]) for r in reports]},
        "environment": _environment(env, reports, recipe.parallel.engine),
        "engine": recipe.parallel.engine,
        "recipe": recipe.to_dict(),
        "measure": measure,
    }
    _call(callbacks, "on_train_end", summary)
    writer.summary(summary)
    if status == "completed":
        writer.log(_headline(summary))
    writer.close()
    return summary


def _headline(s: dict) -> str:
    m = s["metrics"]
    parts = [f"done: {s['steps_completed']} steps", f"loss {s['loss_first']:.4g} -> {s['loss_last']:.4g}"]
    if s["tokens_per_s"]:
        parts.append(f"{s['tokens_per_s']:,.0f} tokens/s")
    if m["flops/achieved_tflops_per_gpu"]:
        parts.append(f"{m['flops/achieved_tflops_per_gpu']:.3g} TFLOP/s/GPU")
    if s["mfu"] is not None:
        parts.append(f"MFU {100 * s['mfu']:.1f}%")
    if s["peak_memory_bytes"]:
        parts.append(f"peak {s['peak_memory_bytes'] / 2**30:.2f} GiB (analytic {m['memory/analytic_bytes'] / 2**30:.2f}"
                     f" GiB, {100 * m['memory/analytic_rel_error']:+.1f}%)")
    return "; ".join(parts)


def _elastic(reports: list[dict]) -> dict | None:
    """torchrun restarts of this run's worker group (None when not started by torchrun).

    The count is the largest over ranks: a node whose workers failed counts the restart, while the
    others restart for the new membership with their count unchanged.
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    return {"restart_count": max(r["restart_count"] for r in reports),
            "max_restarts": int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}


def _uuid(device: torch.device) -> str | None:
    u = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if u is None:
        return None
    s = str(u)
    return s if s.startswith("GPU-") else f"GPU-{s}"


def _environment(env: DistEnv, reports: list[dict], engine: str) -> dict:
    out = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if env.device.type == "cuda" else None,
        "python": platform.python_version(), "hostname": socket.gethostname(),
        "device_type": env.device.type, "gpu_names": [r["device_name"] for r in reports] if env.device.type == "cuda" else [],
        "world_size": env.world_size, "local_world_size": env.local_world_size, "backend": env.backend,
        "launched": env.launched,
    }
    if engine == "deepspeed":
        import deepspeed
        out["deepspeed"] = deepspeed.__version__
    return out


def _write_partial(writer, recipe, env, history, status, message, start_step) -> None:
    """On an exception: keep what is known (the loss curve so far) in summary.json."""
    writer.summary({"status": status, "message": message, "tokens_per_s": None, "mfu": None,
                    "peak_memory_bytes": None,
                    "loss_first": history["loss"][0] if history["loss"] else None,
                    "loss_last": history["loss"][-1] if history["loss"] else None,
                    "steps_completed": (history["step"][-1] + 1) if history["step"] else start_step,
                    "history": history, "recipe": recipe.to_dict(), "engine": recipe.parallel.engine,
                    "environment": {"torch": torch.__version__, "world_size": env.world_size}})
    writer.close()
