"""The trainer: data -> engine step -> measurement, with callbacks, checkpoints and a typed result.

Shaped like torchtitan's ``Trainer``: ``__init__`` decides where the run starts and builds the parts
(metrics writer, data, engine, clock, checkpointer, callbacks); :meth:`Trainer.train` reads top to
bottom; one step, the loss flush, checkpointing and the summary are named methods, and the result is
built in :mod:`scaletool.train.summary`.

Measurement rules: the first ``train.measure_warmup_steps`` steps of a process
(compilation, allocator warm-up) are never measured, and :func:`scaletool.stats.settled_start`
excludes further leading steps until the step time settles. The host synchronises only at
measurement boundaries: the start and end of the measured window, every ``train.log_every`` steps
(where the losses of those steps, kept on the device until then, are fetched in one transfer and
averaged over ranks) and at checkpoints (left out of the step times and the window). NaN/Inf
losses are found at those boundaries and stop the run, naming the step.

On CPU the process first takes its share of the cores (:func:`scaletool.threads.pin_threads`, divided
among the ranks on this node); the result records the thread count.
"""
from __future__ import annotations

import gc
import math
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from scaletool.analytic.flops import flops_per_token
from scaletool.config import Recipe, RecipeError
from scaletool.engines import DistEnv, agree, data_parallel, make_engine, startup_notes
from scaletool.errors import cannot_write, describe
from scaletool.kinds.float8 import float8_warnings
from scaletool.measure.contention import Probe, is_contended
from scaletool.measure.hardware import peak_for
from scaletool.measure.nvml import NvmlSampler
from scaletool.results.train import TrainResult
from scaletool.threads import pin_threads
from scaletool.train.callbacks import Callback, StepState, TrainInfo
from scaletool.train.checkpoint import Checkpointer
from scaletool.train.clock import Clock, synchronize
from scaletool.train.data import make_source
from scaletool.train.metrics import MetricsWriter, WandbOptions
from scaletool.train.progress import StepProgress
from scaletool.train.resume import Resume, Start, load_checkpoint, plan_start
from scaletool.train.schedule import lr_at
from scaletool.train.summary import RunRecord, build_result, device_uuid, gather_reports, headline, rank_report


class TrainFailed(RuntimeError):
    """Training ended by an exception or a failed rank. ``result`` is the partial result (also in
    summary.json when rank 0 could write it); ``lines`` say what failed, root cause first."""

    def __init__(self, result: TrainResult, lines: list[str]):
        super().__init__(lines[0] if lines else "training failed")
        self.result, self.lines = result, lines


class Stopped(Exception):
    """A stop signal (SIGTERM: a scheduler's time limit, ``kill``; SIGINT: Ctrl-C) ended training (see
    :func:`stop_on_signals`). ``signum`` is the signal; the exit status is 128 + signum (143, 130)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


#: the stop signals this process handles: a scheduler's SIGTERM and a terminal's Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Set while a failing run writes its partial result: the process is ending anyway, and a stop signal
# then (torchrun stops every rank as soon as one fails) must not cut that write short. Process-wide,
# as signal handlers are.
_ENDING = threading.Event()


# Set while a section runs that a stop must not cut short (a checkpoint write: DCP wraps whatever is
# raised inside it into a CheckpointException, and a half-written directory helps nobody); a signal then
# is held in _HELD and raised as Stopped when the section ends (see :func:`uninterrupted`).
_DEFER = threading.Event()
_HELD: list[int] = []

# Set while the trainer's loop asks between steps whether to stop (from its first finished step on): a
# signal then is only recorded, and the run stops at the end of the step, a checkpoint written when one is
# due, instead of wherever the signal found the main thread (inside a compile, a collective, an optimizer step).
_POLLED = threading.Event()
_RECEIVED: list[int] = []  # the stop signals this run received, in order


def stop_signal() -> int | None:
    """The first stop signal this run received, or None."""
    return _RECEIVED[0] if _RECEIVED else None


@contextmanager
def stop_on_signals(signals=STOP_SIGNALS):
    """Stop the run on SIGTERM or SIGINT. Before the trainer's first step (imports, the model's build, the
    first step's compile) the signal raises :class:`Stopped` at once: nothing is lost. From then on the
    trainer polls between steps (:data:`_POLLED`) and stops at the end of the step; the same signal again
    raises at once (a second Ctrl-C). Signals while a failing run writes its partial result, or another
    kind of signal while a stop is under way (torchrun's SIGTERM after a terminal's Ctrl-C), are ignored;
    one inside :func:`uninterrupted` waits for the section's end."""
    _HELD.clear()
    _RECEIVED.clear()

    def handler(signum, _frame):
        if _ENDING.is_set():
            return
        repeat = signum in _RECEIVED
        _RECEIVED.append(signum)
        if _DEFER.is_set():
            if not _HELD:
                _HELD.append(signum)
            return
        if len(_RECEIVED) > 1 and not repeat:
            return
        if _POLLED.is_set() and not repeat:
            return
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def uninterrupted():
    """Hold a stop signal until the body has finished, then raise it as :class:`Stopped` (or, while the
    trainer polls between steps, leave it for the poll)."""
    _DEFER.set()
    try:
        yield
    finally:
        _DEFER.clear()
    if _HELD:
        signum = _HELD.pop()
        if not _POLLED.is_set():
            raise Stopped(signum)


class Trainer:
    """Train ``recipe`` in the run directory ``out`` on this rank; :meth:`train` returns the result."""

    def __init__(self, recipe: Recipe, out: Path, env: DistEnv, *, resume: Resume | str | bool = Resume.NEVER,
                 peak_tflops: float | None = None, measure: bool = True, quiet: bool = False,
                 callbacks: list[Callback] | tuple = (), wandb: WandbOptions | None = None):
        self.recipe, self.t, self.env, self.out = recipe, recipe.train, env, Path(out)
        self.measure, self.quiet = measure, quiet
        self.checkpointer = Checkpointer(self.out, env)
        # decided before anything is written: a refused resume leaves no run directory behind
        start = agree(self._plan(Resume.parse(resume)) if env.is_main else None, env)
        if isinstance(start, list):
            raise RecipeError(start)
        self.start, self.start_step = start, start.step
        self.result: TrainResult | None = start.finished
        if start.finished is not None:
            return
        self.threads = pin_threads(env.local_world_size) if env.device.type == "cpu" else None
        with cannot_write(self.out, "the run directory"):  # a file where it should be, no permission, a full disk
            self.writer = MetricsWriter(self.out, enabled=env.is_main, tensorboard=measure, quiet=quiet,
                                        start_step=self.start_step, wandb=wandb, config=recipe.to_dict())
        try:
            self._build(peak_tflops, callbacks)
        except BaseException:
            self.writer.close()
            raise

    def _plan(self, resume: Resume) -> Start | list[str]:
        try:
            return plan_start(self.out, self.t.steps, resume)
        except RecipeError as e:  # its lines go to every rank, so all of them stop with it
            return e.problems

    def _build(self, peak_tflops: float | None, callbacks) -> None:
        r, env, t, cuda = self.recipe, self.env, self.t, self.env.device.type == "cuda"
        for line in self.start.warnings:
            self.writer.log(line, style="yellow")
        state = self.start.state
        self.history: dict[str, list] = state.get("history") or {k: [] for k in
                                                                   ("step", "loss", "grad_norm", "lr", "step_time_s")}
        # whether each step was contended (None: not known, as in a checkpoint from before contention was recorded)
        self.history.setdefault("contended", [None] * len(self.history["step"]))
        self.contention_samples: dict[int, dict] = {}
        # earlier processes' segments; a checkpoint from before segments were recorded is one segment
        self.segments = state.get("segments") or ([{"start_step": 0, "end_step": self.start_step}] if state else [])
        self.segment = {"start_step": self.start_step, "end_step": self.start_step,
                        "resumed_from": str(self.start.checkpoint) if self.start.checkpoint else None,
                        "world_size": env.world_size, "threads": self.threads}
        # a tensor-parallel group computes one data-parallel rank's batch together
        dp_rank, dp_size = data_parallel(env, r.parallel.tensor_parallel, r.parallel.pipeline_parallel)
        self.source = make_source(r, dp_rank, dp_size)
        for note in startup_notes(r, env):
            self.writer.log(note)
        self.engine = make_engine(r, env)
        if self.start.checkpoint is not None:
            if state.get("engine") != r.parallel.engine:
                raise RecipeError(f"{self.start.checkpoint} was written by engine={state.get('engine')}, this run "
                                  f"uses parallel.engine={r.parallel.engine}")
            load_checkpoint(self.engine, self.start.checkpoint)
            self.writer.log(f"resumed from {self.start.checkpoint} at step {self.start_step}")
        T = r.seq_len
        self.tokens_per_step = t.micro_batch_size * t.grad_accum_steps * dp_size * T
        self.flops = flops_per_token(r.model, T, tokens=t.micro_batch_size * T)
        self.device_name = torch.cuda.get_device_name(env.device) if cuda else "cpu"
        self.peak = peak_for(env.device.type, self.device_name, r.model.dtype, peak_tflops)
        if self.peak.warning:
            self.writer.log(f"warning: {self.peak.warning}", style="yellow")
        # train.float8: MFU against the FP8 peak too (the bf16 one stays the headline, comparable across runs)
        self.peak_fp8 = peak_for(env.device.type, self.device_name, "fp8").tflops if t.float8 != "none" else None
        self._float8_notes()
        casts = getattr(self.engine, "weight_casts", None)
        if casts is not None:
            experts = f" and {casts.experts} stacked expert weights" if casts.experts else ""
            self.writer.log(f"weight_cast step: {len(casts.pairs) - casts.experts} linear weights{experts} keep a "
                            f"16-bit copy for the whole optimizer step ({casts.params / 1e6:,.1f} M parameters, "
                            f"{casts.bytes / 2**20:,.1f} MiB)")
        on = cuda and self.measure
        self.sampler = NvmlSampler(env.device.index if on else None, device_uuid(env.device) if on else None)
        if cuda and not self.measure:
            self.sampler.note = "measurement off: NVML sampling off"
        self.clock = Clock(env.device, per_step=self.measure, probe=Probe(self.threads))
        self.measure_start = self.start_step + t.measure_warmup_steps
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor | None, float]] = []
        self.resident: int | None = None  # allocated between steps once warm: states and engine buffers
        self.before_window_peak: int | None = None  # allocator peak before the measured window (build, warm-up)
        self.nvml_since: float | None = None
        self.checkpoint_s = 0.0
        self.frozen = False  # gc.freeze() at the measured window (undone when the run ends)
        # the recipe's (scaletool.profile.recipe_callbacks: MoE, profiler, monitors), then the caller's
        self.callbacks: list[Callback] = list(callbacks)
        self.info = TrainInfo(r, self.out, env, self.engine, self.writer, self.clock.unmeasured)
        self.progress = StepProgress(self.writer.console, t.steps, self.start_step,
                                     enabled=env.is_main and not self.quiet)

    # -- the run -----------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Run steps ``start_step .. train.steps - 1``; return the result (also in ``summary.json``)."""
        if self.start.finished is not None:
            if self.env.is_main and not self.quiet:
                say(finished_note(self.out, self.start.finished, self.t.steps))
            return self.start.finished
        status, message = "completed", None
        self.sampler.start()
        try:
            for cb in self.callbacks:
                cb.on_train_start(self.info)
            self.writer.log(self._banner())
            with self.progress:
                self.clock.restart()
                for step in range(self.start_step, self.t.steps):
                    if step == self.measure_start:
                        self._open_window()
                    self.train_step(step)
                    done = step + 1
                    _POLLED.set()  # a stop signal from here on ends the run at a step's end
                    if self._at_boundary(done):
                        bad = self.flush()
                        if bad is not None:
                            status, message = "diverged", self._divergence(bad)
                            break
                    if self.t.checkpoint_every and done % self.t.checkpoint_every == 0:
                        self.checkpoint(done)
                    self.progress.advance()
                    if self._stop_now():
                        self._stop(done)
            self.flush()
            synchronize(self.env.device, self.env.world_size)
            self.clock.stop_window()
        except BaseException as e:
            sig = e.signum if isinstance(e, Stopped) else stop_signal()  # a library may wrap what the handler raised
            message = (f"stopped by {signal.Signals(sig).name} after {self.segment['end_step']} of {self.t.steps} steps"
                       if sig is not None else describe(e))
            _ENDING.set()
            try:
                self.result = self._finish("failed", message, collective=False)
            finally:
                _ENDING.clear()
            raise
        finally:
            _POLLED.clear()
            self.sampler.stop()
            if self.frozen:
                gc.unfreeze()
                self.frozen = False
        self.result = self._finish(status, message, collective=True)
        return self.result

    def train_step(self, step: int) -> None:
        """One optimizer step over this rank's micro-batches; the loss stays on the device."""
        for cb in self.callbacks:
            cb.on_step_start(step)
        torch.manual_seed(self.t.seed + 1_000_003 * step + self.env.rank)  # dropout: a function of the step
        batches = [_to_device(self.source.batch(step, m), self.env.device) for m in range(self.t.grad_accum_steps)]
        lr = lr_at(step, self.t)
        loss, norm = self.engine.train_step(batches, lr)
        self.clock.mark()
        self.pending.append((step, loss, norm, lr))
        self.segment["end_step"] = step + 1
        state = StepState(step, loss, norm, lr, self.tokens_per_step, self.engine)
        extra: dict = {}
        for cb in self.callbacks:
            extra.update(cb.on_step_end(step, state) or {})
        if extra:
            self.writer.scalars(step, extra, echo=False)

    def flush(self) -> int | None:
        """Fetch the pending losses (averaged over ranks) and write their rows; the first non-finite step."""
        if not self.pending:
            return None
        losses = torch.stack([p[1].float() for p in self.pending])
        if dist.is_initialized() and self.env.world_size > 1:
            # one more element: whether any rank was asked to stop, so that every rank stops after the same step
            asked = torch.tensor([float(stop_signal() is not None)], device=losses.device)
            both = torch.cat([losses, asked])
            dist.all_reduce(both)
            losses, self.stop_agreed = both[:-1] / self.env.world_size, bool(both[-1].item() > 0)
        norms = [p[2] for p in self.pending]
        norm_vals = (torch.stack([n.float() for n in norms]).tolist() if all(n is not None for n in norms)
                     else [None] * len(norms))
        times = self.clock.fetch(len(self.pending))
        samples = self.clock.contention
        samples = samples if len(samples) == len(times) else [None] * len(times)
        bad = None
        for (s, _, _, lr), loss, norm, dt, c in zip(self.pending, losses.tolist(), norm_vals, times, samples):
            flag = None if c is None else is_contended(c)
            if c is not None:
                self.contention_samples[s] = c
            for key, value in (("step", s), ("loss", loss), ("grad_norm", norm), ("lr", lr), ("step_time_s", dt),
                               ("contended", flag)):
                self.history[key].append(value)
            if self.measure:
                last = s == self.pending[-1][0]
                row = {"loss/train": loss, "grad/norm": norm, "lr/lr": lr, "time/step_s": dt,
                       "throughput/tokens_per_s": self.tokens_per_step / dt if dt else None,
                       **self._step_figures(dt, last)}
                if c is not None:
                    row.update({f"contention/{k}": v for k, v in c.items()}, **{"contention/contended": float(flag)})
                self.writer.scalars(s, row, echo=last)
            if bad is None and not math.isfinite(loss):
                bad = s
        self.pending.clear()
        self.clock.skip()  # the next step is timed from here, without this bookkeeping
        return bad

    def checkpoint(self, done: int) -> None:
        """Save after step ``done - 1``; left out of the step times and the measured window."""
        state = {"step": done, "history": self.history, "engine": self.recipe.parallel.engine,
                 "world_size": self.env.world_size, "recipe_digest": self.recipe.digest(),
                 "segments": [*self.segments, self.segment]}
        t0 = time.perf_counter()
        with self.clock.unmeasured(), uninterrupted():
            path = self.checkpointer.save(self.engine, done, state)
        self.checkpoint_s += time.perf_counter() - t0
        self.writer.log(f"checkpoint {path}")

    # -- helpers -----------------------------------------------------------------------------------

    def _open_window(self) -> None:
        synchronize(self.env.device, self.env.world_size)
        # what the warm-up built (modules, compiled graphs, DTensor specs) lives for the run: out of the
        # collector's reach, a full collection no longer walks it, a pause of tens of ms in a step that
        # a host-bound run (tensor parallelism at 1B) pays in full (torchtitan disables the collector for this)
        gc.collect()
        gc.freeze()
        self.frozen = True
        if self.env.device.type == "cuda":
            # the warm-up steps' peak, kept before the window's own: DDP's second step holds two sets of gradient
            # buckets (it rebuilds them), a peak the run has and the measured steps do not
            self.before_window_peak = torch.cuda.max_memory_allocated(self.env.device)
            torch.cuda.reset_peak_memory_stats(self.env.device)
            self.resident = torch.cuda.memory_allocated(self.env.device)
        self.clock.start_window()
        self.clock.skip()  # the synchronisation above is no step's time
        self.nvml_since = time.perf_counter()

    def _step_figures(self, dt: float | None, last: bool) -> dict[str, float]:
        """MFU of a step where the card's peak is known (none is assumed for a CPU), and, for the last step
        before a log line, the peak memory so far: CUDA's allocator peak (since the measured window opened)
        and its share of the card, or on a CPU the process's peak resident set."""
        out: dict[str, float] = {}
        if dt and self.peak.tflops:
            per_gpu = self.tokens_per_step / dt / self.env.world_size
            out["flops/mfu"] = per_gpu * self.flops["train"] / 1e12 / self.peak.tflops
        if dt and self.peak_fp8:
            per_gpu = self.tokens_per_step / dt / self.env.world_size
            out["flops/mfu_fp8_peak"] = per_gpu * self.flops["train"] / 1e12 / self.peak_fp8
        if not last:
            return out
        dev = self.env.device
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev)
            out["memory/max_allocated_bytes"] = peak
            out["memory/max_allocated_fraction"] = peak / torch.cuda.get_device_properties(dev).total_memory
        elif dev.type == "cpu":
            import resource

            out["memory/max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return out

    def _float8_notes(self) -> None:
        """train.float8: the compile warning and which linear layers run in FP8."""
        swap = getattr(self.engine, "float8", None)
        if swap is None:
            return
        for line in float8_warnings(self.recipe):
            self.writer.log(f"warning: {line}", style="yellow")
        kept = ", ".join(swap["kept"][:6]) + (", ..." if len(swap["kept"]) > 6 else "")
        self.writer.log(f"float8 {self.t.float8}: {len(swap['swapped'])} linear layers in FP8, "
                        f"{len(swap['kept'])} kept in bf16{f' ({kept})' if kept else ''}")
        if not swap["swapped"]:
            self.writer.log("warning: train.float8: no linear layer has both dimensions divisible by 16; "
                            "every GEMM stays bf16", style="yellow")

    def _at_boundary(self, done: int) -> bool:
        """Where the host synchronises: the losses are fetched there, and ranks agree there on a stop. Several
        ranks meet every train.log_every steps even without --measure, so a stop waits at most that long."""
        saves = self.t.checkpoint_every and done % self.t.checkpoint_every == 0
        every = self.measure or self.env.world_size > 1
        return bool(saves or done == self.t.steps or (every and (done - self.start_step) % self.t.log_every == 0))

    def _stop_now(self) -> bool:
        """Whether to stop after this step: a stop signal here (one process), or on any rank as agreed at the
        boundary just passed (several; :meth:`flush`)."""
        if self.env.world_size > 1:
            agreed, self.stop_agreed = getattr(self, "stop_agreed", False), False
            return agreed
        return stop_signal() is not None

    def _stop(self, done: int) -> None:
        """End the run after step ``done - 1`` on a stop signal: the pending rows written, a checkpoint where
        one is due (train.checkpoint_every set and this step not saved yet), then :class:`Stopped`."""
        self.flush()
        if self.t.checkpoint_every and done % self.t.checkpoint_every:
            self.checkpoint(done)
        raise Stopped(stop_signal() or signal.SIGTERM)  # agreed from another rank: the scheduler's signal

    def _divergence(self, bad: int) -> str:
        loss = self.history["loss"][self.history["step"].index(bad)]
        return f"loss is {loss} at step {bad}: training stopped (lower train.lr, keep train.grad_clip on, or use fp32)"

    def _banner(self) -> str:
        threads = f", {self.threads} CPU thread{'s' if self.threads != 1 else ''} per rank" if self.threads else ""
        tp = self.recipe.parallel.tensor_parallel
        layout = f" ({self.env.world_size // tp} data × {tp} tensor parallel)" if tp > 1 else ""
        pp = self.recipe.parallel.pipeline_parallel
        if pp > 1:  # engines.pipeline
            tensor = f" × {tp} tensor" if tp > 1 else ""
            layout = (f" ({pp} pipeline × {self.env.world_size // (pp * tp)} data{tensor} parallel, "
                      f"{self.recipe.parallel.pipeline_schedule})")
        return (f"{self.recipe.parallel.engine}{layout} on {self.env.world_size}× {self.device_name}{threads}: steps "
                f"{self.start_step}..{self.t.steps - 1}, {self.tokens_per_step:,} tokens/step, run directory {self.out}")

    def _finish(self, status: str, message: str | None, *, collective: bool) -> TrainResult:
        """Build the result, let callbacks add to it (not after a failure), write summary.json, close."""
        report = rank_report(self.env, self.sampler, self.nvml_since, self.resident, self.threads,
                             before_window_peak=self.before_window_peak)
        record = RunRecord(
            recipe=self.recipe, env=self.env, out=self.out, status=status, message=message, history=self.history,
            segments=[*self.segments, self.segment], measure_start=self.measure_start,
            tokens_per_step=self.tokens_per_step, measure=self.measure, window_s=self.clock.window_s,
            checkpoint_s=self.checkpoint_s, unmeasured_s=self.clock.excluded_s,
            reports=gather_reports(report, self.env, collective), peak=self.peak, flops=self.flops,
            threads=self.threads, contention=getattr(self, "contention_samples", {}),
            peak_fp8_tflops=getattr(self, "peak_fp8", None))
        result = build_result(record)
        if collective:
            for cb in self.callbacks:
                cb.on_train_end(result)
        self.writer.summary(result)
        unavailable = (result.prediction or {}).get("unavailable")
        if unavailable:  # the run is recorded whole; only the prediction beside it is missing
            self.writer.log(f"warning: no step-time prediction for this run: {unavailable}", style="yellow")
        if status == "completed":
            self.writer.log(headline(result))
        else:  # the caller reports it (once): here it goes to train.log only
            self.writer.log(f"error: {message}", echo=False)
        self.writer.close()
        return result


def finished_note(out: Path, finished: TrainResult, steps: int) -> str:
    return (f"nothing to do: {out} already completed {finished.steps_completed} steps (train.steps={steps}); "
            "its summary.json is kept")


def say(line: str) -> None:
    """A line on stderr, whole (no wrapping at the console width when piped)."""
    Console(stderr=True, highlight=False, soft_wrap=True).print(line, markup=False)


def _to_device(batch, device: torch.device):
    return tuple(x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x for x in batch)
