"""``torch.profiler`` over training steps, as a training-loop callback.

:class:`ProfilerCallback` profiles the ranks in ``profile.ranks`` on the schedule
``wait → warmup → active`` (× ``repeat``), and writes:

- ``<run dir>/profile/traces/rank<R>.<timestamp>.pt.trace.json.gz`` through
  ``tensorboard_trace_handler``: the layout the TensorBoard profiler plugin reads
  (``tensorboard --logdir <run dir>``), and Chrome traces that Perfetto (ui.perfetto.dev) and
  chrome://tracing open as they are;
- ``<run dir>/profile/memory_snapshot_rank<R>.pickle`` with ``profile.memory_snapshot`` on CUDA
  (``torch.cuda.memory._record_memory_history`` from the start of training to the end of the first
  active window; open it at pytorch.org/memory_viz). There is no CPU equivalent: on CPU the run
  records a note instead;
- ``<run dir>/profile/breakdown.json``: the operator breakdown of every profiled rank
  (:mod:`scaletool.profile.breakdown`), written by rank 0, schema in :func:`aggregate`.

While profiling, attention, FFN and norm modules are wrapped in ``scaletool::<region>`` ranges
(forward hooks) so the breakdown can tell FFN matmuls from the others; they are left off under
``train.compile``, where hooks inside compiled regions would break the graphs.
"""
from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import ProfilerAction, ProfilerActivity, record_function, schedule, tensorboard_trace_handler

from scaletool.config import ProfileConfig
from scaletool.fmt import clean, write_atomic
from scaletool.profile.breakdown import ALL_CATEGORIES, ALL_MODULES, REGION_PREFIX, SCHEMA_VERSION, analyze, load_trace
from scaletool.results.train import TrainResult
from scaletool.stats import spread
from scaletool.train.callbacks import Callback, StepState, TrainInfo

BREAKDOWN_FILE = "breakdown.json"


def profile_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "profile"


_BLOCK_PARTS = {"attn": "attention", "ffn": "ffn"}  # Block's attributes: any attention type, dense FFN or MoE


def _region(name: str, mod: nn.Module) -> str | None:
    if isinstance(mod, (nn.RMSNorm, nn.LayerNorm, nn.BatchNorm1d)):
        return "norm"
    return _BLOCK_PARTS.get(name.rsplit(".", 1)[-1])


def annotate_modules(model: nn.Module) -> list:
    """Wrap every block's attention and FFN (dense or MoE) and every norm in a ``scaletool::<region>``
    profiler range.

    Returns the hook handles (``.remove()`` them to undo). Works through DDP, FSDP2, DeepSpeed and
    checkpoint wrappers, which all keep the original modules reachable by ``named_modules()``.
    """
    handles = []
    for name, mod in model.named_modules():
        region = _region(name, mod)
        if region is None:
            continue
        open_ranges: list = []  # a stack: recomputation under activation checkpointing re-enters

        def pre(_m, _args, _name=REGION_PREFIX + region, _open=open_ranges):
            rf = record_function(_name)
            rf.__enter__()
            _open.append(rf)

        def post(_m, _args, _out, _open=open_ranges):
            if _open:
                _open.pop().__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    return handles


def selected(cfg: ProfileConfig, rank: int) -> bool:
    return cfg.ranks == "all" or rank in cfg.ranks


class ProfilerCallback(Callback):
    """Training callback (see :mod:`scaletool.train.callbacks`) that profiles steps and writes the breakdown."""

    def __init__(self, cfg: ProfileConfig):
        self.cfg = cfg
        self.prof = None
        self.traces: list[Path] = []
        self.notes: list[str] = []
        self._hooks: list = []
        self._snapshot_path: Path | None = None

    # -- loop hooks ------------------------------------------------------------------------------

    def on_train_start(self, info: TrainInfo) -> None:
        self.info, c = info, self.cfg
        env = info.env
        self.dir = profile_dir(info.out_dir)
        self.on = selected(c, env.rank)
        if not self.on:
            return
        cuda = env.device.type == "cuda"
        self.trace_dir = self.dir / "traces"
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self._handler = tensorboard_trace_handler(str(self.trace_dir), worker_name=f"rank{env.rank}", use_gzip=True)
        self._schedule = schedule(wait=c.wait, warmup=c.warmup, active=c.active, repeat=c.repeat)
        if info.recipe.train.compile:
            self.notes.append("train.compile is on: module regions are not annotated, so FFN matmuls are "
                              "counted with the other matmuls")
        else:
            self._hooks = annotate_modules(info.engine.model)
        if c.memory_snapshot:
            if cuda:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
                self._snapshot_path = self.dir / f"memory_snapshot_rank{env.rank}.pickle"
            else:
                self.notes.append("profile.memory_snapshot: CUDA only (torch.cuda.memory._record_memory_history); "
                                  "nothing recorded on CPU (profile.profile_memory puts allocation events in the "
                                  "trace)")
        self.prof = torch.profiler.profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
            schedule=self._schedule, on_trace_ready=self._ready, record_shapes=c.record_shapes,
            with_stack=c.with_stack, with_flops=c.with_flops, profile_memory=c.profile_memory)
        self.prof.start()

    def on_step_end(self, step: int, state: StepState) -> None:
        if self.prof is None:
            return None
        saves = self._schedule(self.prof.step_num) == ProfilerAction.RECORD_AND_SAVE
        # writing the trace takes a while: keep it out of the measured time
        with self.info.unmeasured() if saves else nullcontext():
            self.prof.step()
        return None

    def on_train_end(self, result: TrainResult) -> None:
        if self.prof is not None:
            self.prof.stop()  # flushes a window still open (a run shorter than the schedule)
            self.prof = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._dump_snapshot()
        env = self.info.env
        local = self._local_breakdown(result) if self.on else None
        gathered = [local]
        if dist.is_initialized() and env.world_size > 1:
            gathered = [None] * env.world_size
            dist.all_gather_object(gathered, local)
        if not env.is_main:
            return
        per_rank = [b for b in gathered if b is not None]
        section = {"dir": str(self.dir), "notes": self.notes}
        if per_rank:
            report = aggregate(per_rank)
            report["recipe"] = _recipe_digest(self.info.recipe)
            report["notes"] = self.notes
            path = self.dir / BREAKDOWN_FILE
            write_atomic(path, json.dumps(clean(report), indent=2, sort_keys=True) + "\n")  # read by report
            section.update(breakdown=str(path), step_time_s=report["step_time_s"],
                           shares={k: v["share"] for k, v in report["categories"].items()})
            shares = sorted(section["shares"].items(), key=lambda kv: -(kv[1] or 0))
            self.info.writer.log(f"profile: {', '.join(f'{k} {100 * (v or 0):.1f}%' for k, v in shares)} of a "
                                 f"{1e3 * report['step_time_s']:.1f} ms step; breakdown {path}, traces in "
                                 f"{self.dir / 'traces'}")
        for note in self.notes:
            self.info.writer.log(f"note: {note}")
        result.profile = section

    # -- internals -------------------------------------------------------------------------------

    def _ready(self, prof) -> None:
        mine = f"rank{self.info.env.rank}.*.pt.trace.json.gz"  # other ranks write into the same directory
        before = set(self.trace_dir.glob(mine))
        self._handler(prof)
        self.traces += sorted(set(self.trace_dir.glob(mine)) - before)
        self._dump_snapshot()

    def _dump_snapshot(self) -> None:
        if self._snapshot_path is None:
            return
        torch.cuda.memory._dump_snapshot(str(self._snapshot_path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.notes.append(f"memory snapshot: {self._snapshot_path} (open at https://pytorch.org/memory_viz)")
        self._snapshot_path = None

    def _local_breakdown(self, result: TrainResult) -> dict | None:
        if not self.traces:
            self.notes.append(f"rank {self.info.env.rank}: no trace written (train.steps too few for the schedule "
                              f"wait={self.cfg.wait} warmup={self.cfg.warmup} active={self.cfg.active}?)")
            return None
        b = analyze(load_trace(self.traces[0]))
        if len(self.traces) > 1:
            self.notes.append(f"rank {self.info.env.rank}: the breakdown reads the first of {len(self.traces)} "
                              "profiling cycles (profile.repeat); every cycle's trace is kept")
        b["rank"] = self.info.env.rank
        b["trace"] = str(self.traces[0])
        b["traces"] = [str(t) for t in self.traces]
        # the loop's own clock for the same steps (it includes the profiler's overhead, as the trace does)
        times = dict(zip(result.history.step, result.history.step_time_s))
        start = result.start_step
        measured = [times.get(start + s) for s in b["steps"]]
        measured = [t for t in measured if t is not None]
        b["loop_step_time_s"] = sum(measured) / len(measured) if measured else None
        return b


def _recipe_digest(recipe) -> dict:
    m, p = recipe.model, recipe.parallel
    return {"attention": m.attention, "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
            "kv_lora_rank": m.kv_lora_rank, "intermediate_size": m.intermediate_size, "ffn": m.ffn,
            "dtype": m.dtype, "seq_len": recipe.seq_len, "micro_batch_size": recipe.train.micro_batch_size,
            "engine": p.engine, "compile": recipe.train.compile}


def aggregate(per_rank: list[dict]) -> dict:
    """``breakdown.json``: the mean over profiled ranks, and every rank's own breakdown.

    Schema (version 1; times are seconds per step, shares are fractions of ``step_time_s``; the typed
    model is :class:`scaletool.results.profile.ProfileResult`)::

        kind: "profile", schema: "scaletool.profile.breakdown", schema_version: 1
        device: "cuda" | "cpu";  ranks: [int];  n_steps: int (profiled steps per rank)
        step_time_s: float            # mean profiled step, from the trace; loop_step_time_s: the loop's clock
        step_s: {median, p10, p90, n} # every profiled step of every rank, from the trace
        categories: {optimizer, attention, norm, ffn_matmul, other_matmul, other, communication, idle:
                     {time_s, share}}  # add up to step_time_s; communication = exposed part
        modules:    {optimizer, attention, ffn, norm, other, communication, idle: {time_s, share}}
        communication_overlap: {communication_s, overlapped_s, exposed_s, overlap_ratio}
        ffn_matmul_fraction_of_matmul: float | null
        top_ops: [{name, category, calls, time_s, share}]   # lowest profiled rank, by self time
        per_rank: [the same fields for each rank, plus rank, trace, traces, steps, step_times_s]
        recipe: {attention, d_model, n_layers, n_heads, kv_lora_rank, intermediate_size, ffn, dtype,
                 seq_len, micro_batch_size, engine, compile}
        notes: [str]
    """
    per_rank = sorted(per_rank, key=lambda b: b["rank"])
    n = len(per_rank)

    def mean(get):
        vals = [get(b) for b in per_rank]
        vals = [v for v in vals if v is not None]
        return sum(vals) / len(vals) if vals else None

    step = mean(lambda b: b["step_time_s"])

    def table(key, labels):
        out = {}
        for c in labels:
            t = mean(lambda b, c=c: b[key][c]["time_s"])
            out[c] = {"time_s": t, "share": t / step if step else None}
        return out

    overlap = {k: mean(lambda b, k=k: b["communication_overlap"][k])
               for k in ("communication_s", "overlapped_s", "exposed_s")}
    overlap["overlap_ratio"] = (overlap["overlapped_s"] / overlap["communication_s"]
                                if overlap["communication_s"] else None)
    pooled = spread([t for b in per_rank for t in b.get("step_times_s") or []])
    return {
        "kind": "profile", "schema": "scaletool.profile.breakdown", "schema_version": SCHEMA_VERSION,
        "device": per_rank[0]["device"], "ranks": [b["rank"] for b in per_rank],
        "n_steps": min(b["n_steps"] for b in per_rank),
        "step_time_s": step, "step_s": pooled.model_dump() if pooled else None,
        "loop_step_time_s": mean(lambda b: b.get("loop_step_time_s")),
        "categories": table("categories", ALL_CATEGORIES),
        "modules": table("modules", ALL_MODULES),
        "communication_overlap": overlap,
        "ffn_matmul_fraction_of_matmul": mean(lambda b: b["ffn_matmul_fraction_of_matmul"]),
        "top_ops": per_rank[0]["top_ops"],
        "per_rank": per_rank,
        "n_ranks": n,
    }
