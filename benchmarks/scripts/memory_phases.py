"""Training memory by phase, measured beside the analytic estimate (scaletool.analytic.training_memory).

Usage (from the repository root):

    python benchmarks/scripts/memory_phases.py run OUT            # GPU: the full grid, 1 and 2 GPUs
    python benchmarks/scripts/memory_phases.py run OUT --smoke    # CPU: tiny recipe, gloo, figures null
    python benchmarks/scripts/memory_phases.py table OUT|RESULT.json   # the table, with the current estimate

A cell is one (recipe, engine, GPUs, micro_batch_size, activation_checkpointing). Each is built with
``scaletool.engines.make_engine`` (the API ``scaletool train`` uses), run for one warm-up step (AdamW
creates its state lazily) and ``--steps`` measured steps, then deleted. In every step the CUDA
peak-allocation counter is read and reset at the optimizer step's boundaries: torch optimizers through
``register_step_pre_hook`` / ``register_step_post_hook``, DeepSpeed by wrapping its engine's ``step()``
(the ZeRO optimizer's gradient copies happen there, outside the client AdamW). So ``backward`` is the
peak of forward + backward (+ gradient clipping's norm), ``optimizer_step`` the peak of the step, and
``peak`` the larger, each the largest over the measured steps (``per_step`` keeps every step).

Bytes are measured above what was allocated before the engine was built (``baseline_bytes``), after
allocations settle. One process runs the cells of one engine and GPU count, and each DDP and ZeRO-3
cell gets its own (their memory outlives the engine: see OWN_PROCESS), so that no cell runs on top of
memory another could free mid-measurement; ``left_bytes`` records what each engine left behind.

The one-GPU processes run on both GPUs at once (``CUDA_VISIBLE_DEVICES``); the two-GPU cells then run in
torchrun jobs of two ranks (NCCL), each rank reporting its own peaks (the table shows the larger). On a
machine without CUDA, ``--smoke`` runs the same code path on the tiny recipe over gloo with memory
figures null: the end-to-end check of this driver in tests/measure/test_memory_phases.py.

Writes OUT/cells/<cell>.json (one per cell, as it completes), OUT/summary.json and OUT/table.md
(measured vs estimated per phase, with relative errors). Progress goes to stderr. ``--deadline-s``
bounds the whole run: cells that would start after it are recorded as skipped.
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {"single": ("single", 1), "ddp": ("ddp", 1), "fsdp": ("fsdp", 1),
           "zero1": ("deepspeed", 1), "zero2": ("deepspeed", 2), "zero3": ("deepspeed", 3)}
GIB = 2**30


@dataclass(frozen=True)
class Cell:
    recipe: str  # a name under recipes/ (without .yaml)
    label: str  # a key of ENGINES
    world_size: int
    micro_batch_size: int
    activation_checkpointing: str

    @property
    def name(self) -> str:
        return f"{self.recipe}-{self.label}-n{self.world_size}-mb{self.micro_batch_size}-{self.activation_checkpointing}"

    def overrides(self) -> list[str]:
        engine, stage = ENGINES[self.label]
        return [f"parallel.engine={engine}", f"parallel.zero_stage={stage}", "train.compile=false",
                f"train.micro_batch_size={self.micro_batch_size}",
                f"train.activation_checkpointing={self.activation_checkpointing}", "train.grad_accum_steps=1"]


def grid(recipes, engines, micro_batches, checkpointing, worlds) -> list[Cell]:
    """Every cell, regime-major (micro-batch 1 with full checkpointing first: where the optimizer step
    can set the peak), so that a run cut short by its deadline still covers every engine there."""
    regimes = sorted(((mb, ac) for mb in micro_batches for ac in checkpointing),
                     key=lambda r: (r[1] == "none", r[0]))
    return [Cell(r, e, n, mb, ac) for mb, ac in regimes for e in engines for n in worlds for r in recipes
            if not (e == "single" and n > 1)]


# -- measuring (inside a worker) -------------------------------------------------------------------


class PhaseMeter:
    """Reads and resets the device's peak-allocation counter at phase boundaries (None on CPU)."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch, self.device = torch, device
        self.peaks: dict[str, int | None] = {}

    def allocated(self) -> int | None:
        return self.torch.cuda.memory_allocated(self.device) if self.cuda else None

    def settled(self, quiet_s: float = 0.5, timeout_s: float = 5.0) -> int | None:
        """Allocated bytes once they have not changed for ``quiet_s`` (a collective's tensors can be
        released a moment after it completes), or after ``timeout_s``."""
        if not self.cuda:
            return None
        gc.collect()
        self.torch.cuda.synchronize(self.device)
        prev, since, end = self.allocated(), time.time(), time.time() + timeout_s
        while time.time() < end and time.time() - since < quiet_s:
            time.sleep(0.1)
            gc.collect()
            now = self.allocated()
            if now != prev:
                prev, since = now, time.time()
        self.torch.cuda.empty_cache()
        return self.allocated()

    def start(self) -> None:
        self.peaks = {}
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def mark(self, phase: str) -> None:
        """Close ``phase``: its peak is the larger of what was recorded for it and the counter now."""
        if not self.cuda:
            self.peaks.setdefault(phase, None)
            return
        self.torch.cuda.synchronize(self.device)
        peak = self.torch.cuda.max_memory_allocated(self.device)
        self.peaks[phase] = max(peak, self.peaks.get(phase) or 0)
        self.torch.cuda.reset_peak_memory_stats(self.device)


def instrument(engine, meter: PhaseMeter) -> list:
    """Mark the optimizer step's boundaries; returns the handles (torch) or undo callables (DeepSpeed)."""
    if engine.name == "deepspeed":
        ds, original = engine.engine, engine.engine.step

        def step(*args, **kwargs):
            meter.mark("backward")
            out = original(*args, **kwargs)
            meter.mark("optimizer_step")
            return out

        ds.step = step
        return [lambda: delattr(ds, "step")]
    opt = engine.optimizer
    return [opt.register_step_pre_hook(lambda *_: meter.mark("backward")),
            opt.register_step_post_hook(lambda *_: meter.mark("optimizer_step"))]


def measure_cell(cell: Cell, env, steps: int) -> dict:
    """Build the cell's engine, run 1 + ``steps`` steps, return its measured phases (this rank).

    Figures are bytes above ``baseline_bytes`` (allocated before the engine was built). ``phases`` is
    the larger over the measured steps; ``per_step`` keeps every step, the warm-up step first."""
    import torch

    from scaletool.analytic.memory import recipe_memory
    from scaletool.analytic.timeline import PHASES
    from scaletool.config import load_recipe
    from scaletool.engines import make_engine

    recipe = load_recipe(ROOT / "recipes" / f"{cell.recipe}.yaml", cell.overrides())
    meter = PhaseMeter(env.device)
    baseline = meter.settled()
    engine = make_engine(recipe, env)
    built = meter.allocated()
    undo = instrument(engine, meter)
    gen = torch.Generator().manual_seed(recipe.train.seed + env.rank)
    tokens = torch.randint(0, recipe.model.vocab_size, (cell.micro_batch_size, recipe.seq_len + 1), generator=gen)
    batch = [(tokens[:, :-1].to(env.device), tokens[:, 1:].to(env.device))]
    per_step = []
    for _ in range(1 + steps):
        meter.start()
        engine.train_step(batch, recipe.train.lr)
        meter.mark("optimizer_step")  # zero_grad and what follows the step belong to it
        per_step.append(dict(meter.peaks))
    resident = meter.allocated()
    for h in undo:
        h() if callable(h) else h.remove()
    est = recipe_memory(recipe, env.world_size)
    marks = list(per_step[-1])
    if engine.name == "deepspeed" and hasattr(engine.engine, "destroy"):
        engine.engine.destroy()
    del engine, batch, tokens, undo
    left = meter.settled()

    def above(x):
        return None if x is None or baseline is None else x - baseline

    per_step = [{phase: above(s.get(phase)) for phase in PHASES} for s in per_step]
    measured = {phase: max(s[phase] for s in per_step[1:]) if meter.cuda else None for phase in PHASES}
    peaks = [v for v in measured.values() if v is not None]
    return {"rank": env.rank, "baseline_bytes": baseline, "built_bytes": above(built), "resident_bytes": above(resident),
            # what the deleted engine left allocated: the next cell runs in a fresh process when this is not 0
            "left_bytes": above(left), "phases": measured, "per_step": per_step,
            "peak_bytes": max(peaks) if peaks else None,
            "marks": marks,  # the phase boundaries the hooks saw, in order
            "estimate": {k: est[k] for k in ("phases", "phase", "total_bytes", "backward_peak_at")}}


def environment(env) -> dict:
    import torch

    out = {"torch": torch.__version__, "device_type": env.device.type, "world_size": env.world_size,
           "backend": env.backend, "gpu": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None}
    try:  # the version without importing it (a second or more on a CPU)
        out["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        out["deepspeed"] = None
    out["zero3_settings"] = "derived"  # scaletool's block-sized ZeRO-3 settings (scaletool.analytic.zero3)
    return out


def worker(out: Path, cells: list[Cell], steps: int, deadline: float, tag: str) -> None:
    """Run ``cells`` in this process (one rank of a job of ``world_size`` ranks); rank 0 writes each cell."""
    import warnings

    import torch.distributed as dist

    from scaletool.engines import init_distributed
    from scaletool.engines.dist import leave_distributed
    from scaletool.errors import describe
    from scaletool.threads import pin_threads

    # DeepSpeed's ZeRO-3 calls deprecated torch APIs on every step; nothing here can act on them
    warnings.simplefilter("ignore", FutureWarning)
    env = init_distributed("ddp", timeout_s=300)  # a process group even for one rank: ddp/fsdp/ZeRO need it
    if env.device.type == "cpu":
        pin_threads(env.local_world_size)
    meta = environment(env)
    for n, cell in enumerate(cells, 1):
        stop = [time.time() > deadline]
        if env.world_size > 1:
            dist.broadcast_object_list(stop, src=0)  # every rank skips or runs the same cell
        t0 = time.time()
        if stop[0]:
            rec = {"status": "skipped", "message": "deadline reached", "per_rank": []}
        else:
            try:
                ranks = [measure_cell(cell, env, steps)]
                status, message = "ok", None
            except Exception as e:  # noqa: BLE001 (a failed cell is recorded; the next one still runs)
                ranks, message = [{"rank": env.rank}], describe(e)
                status = "oom" if message.startswith("out of memory") else "error"
            if env.world_size > 1:
                gathered = [None] * env.world_size
                dist.all_gather_object(gathered, (status, message, ranks[0]))
                statuses = [g[0] for g in gathered]
                status = next((s for s in statuses if s != "ok"), "ok")
                message = next((g[1] for g in gathered if g[1]), None)
                ranks = [g[2] for g in gathered]
            rec = {"status": status, "message": message, "per_rank": ranks}
        rec.update(cell=asdict(cell), name=cell.name, seconds=round(time.time() - t0, 2), environment=meta)
        if env.rank == 0:
            (out / "cells" / f"{cell.name}.json").write_text(json.dumps(rec, indent=1, sort_keys=True))
            print(f"[{tag}] {n}/{len(cells)} {progress_line(rec)}", file=sys.stderr, flush=True)
    leave_distributed()


# -- reading results -----------------------------------------------------------------------------------


def cell_view(rec: dict, estimate: dict | None = None) -> dict:
    """One cell's measured phases (the larger over ranks) beside an estimate (the stored one unless given)."""
    ranks = [r for r in rec.get("per_rank", []) if "phases" in r]
    est = estimate or (ranks[0]["estimate"] if ranks else None)

    def worst(key):
        vals = [r[key] for r in ranks if r.get(key) is not None]
        return max(vals) if vals else None

    view = {"name": rec["name"], "status": rec["status"], **rec["cell"], "peak": worst("peak_bytes")}
    for phase in ("backward", "optimizer_step"):
        vals = [r["phases"][phase] for r in ranks if r["phases"].get(phase) is not None]
        view[phase] = max(vals) if vals else None
        view[f"{phase}_estimate"] = sum(est["phases"][phase].values()) if est else None
    view["peak_estimate"] = est["total_bytes"] if est else None
    view["estimate_phase"] = est["phase"] if est else None
    for key in ("backward", "optimizer_step", "peak"):
        m, e = view[key], view[f"{key}_estimate"]
        view[f"{key}_rel_error"] = (e - m) / m if m and e is not None else None
    return view


def progress_line(rec: dict) -> str:
    v = cell_view(rec)
    if rec["status"] != "ok":
        return f"{rec['name']}: {rec['status']} {rec.get('message') or ''}"

    def g(x):
        return "-" if x is None else f"{x / GIB:.2f}"

    return (f"{rec['name']}: backward {g(v['backward'])} (est {g(v['backward_estimate'])}) GiB, step "
            f"{g(v['optimizer_step'])} (est {g(v['optimizer_step_estimate'])}) GiB, {rec['seconds']} s")


def recompute_estimate(cell: dict, deepspeed_defaults: bool = False) -> dict:
    """The current analytic estimate for a cell (so the table follows the model without re-measuring).
    ``deepspeed_defaults``: the cell ran under DeepSpeed's own ZeRO settings (recorded before scaletool
    derived them from the model), and is estimated with those."""
    from scaletool.analytic.memory import recipe_memory
    from scaletool.analytic.zero3 import deepspeed_as_ran
    from scaletool.config import load_recipe

    c = Cell(**cell)
    recipe = load_recipe(ROOT / "recipes" / f"{c.recipe}.yaml", c.overrides())
    if deepspeed_defaults and recipe.parallel.engine == "deepspeed":
        ds = deepspeed_as_ran(recipe.parallel.deepspeed, recipe.parallel.zero_stage)
        recipe = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"deepspeed": ds})})
    est = recipe_memory(recipe, c.world_size)
    return {k: est[k] for k in ("phases", "phase", "total_bytes", "backward_peak_at")}


def load_records(src: Path) -> list[dict]:
    """Cell records from a run directory (``cells/*.json``) or from a JSON list of them (a committed result)."""
    if src.is_dir():
        return [json.loads(p.read_text()) for p in sorted((src / "cells").glob("*.json"))]
    return json.loads(src.read_text())


def render_table(recs: list[dict], recompute: bool = True) -> tuple[list[dict], str]:
    """(views, markdown): measured vs estimated per phase, one row per cell, errors as (est − meas) / meas."""
    views = [cell_view(r, recompute_estimate(r["cell"], deepspeed_defaults="zero3_settings" not in (r.get("environment") or {}))
                       if recompute else None) for r in recs]
    order = {label: i for i, label in enumerate(ENGINES)}
    views.sort(key=lambda v: (v["recipe"], v["world_size"], order[v["label"]], v["micro_batch_size"],
                              v["activation_checkpointing"]))
    env = next((r["environment"] for r in recs if r.get("environment")), {})

    def g(x):
        return "–" if x is None else f"{x / GIB:.2f}"

    def p(x):
        return "–" if x is None else f"{100 * x:+.1f}%"

    lines = [f"Measured on {env.get('gpu') or env.get('device_type', '?')} (torch {env.get('torch')}, "
             f"DeepSpeed {env.get('deepspeed')}); GiB per GPU (the larger rank); error = (estimate − measured) / "
             "measured; the estimate's phase in parentheses.", "",
             "| recipe | engine | GPUs | micro-batch | ckpt | backward | est. | err | step | est. | err | peak | est. "
             "(phase) | err |", "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for v in views:
        label = v["label"]
        if v["status"] not in ("ok", "contaminated"):
            lines.append(f"| {v['recipe']} | {label} | {v['world_size']} | {v['micro_batch_size']} | "
                         f"{v['activation_checkpointing']} | {v['status']} |" + " |" * 8)
            continue
        if v["status"] == "contaminated":
            label += " †"
            msg = next(r.get("message") for r in recs if r["name"] == v["name"])
            if msg and ("† " + msg.split(" (")[0]) not in notes:
                notes.append("† " + msg.split(" (")[0])
        phase = {"backward": "bwd", "optimizer_step": "step"}.get(v["estimate_phase"], "?")
        lines.append(f"| {v['recipe']} | {label} | {v['world_size']} | {v['micro_batch_size']} | "
                     f"{v['activation_checkpointing']} | {g(v['backward'])} | {g(v['backward_estimate'])} | "
                     f"{p(v['backward_rel_error'])} | {g(v['optimizer_step'])} | {g(v['optimizer_step_estimate'])} | "
                     f"{p(v['optimizer_step_rel_error'])} | {g(v['peak'])} | {g(v['peak_estimate'])} ({phase}) | "
                     f"{p(v['peak_rel_error'])} |")
    ok = [v for v in views if v["status"] == "ok" and v["peak_rel_error"] is not None]
    if ok:
        within = sum(abs(v["peak_rel_error"]) <= 0.10 for v in ok)
        worst = max(ok, key=lambda v: abs(v["peak_rel_error"]))
        lines += ["", f"Peak within ±10% in {within} of {len(ok)} valid cells; largest error "
                      f"{p(worst['peak_rel_error'])} ({worst['name']})."]
    lines += [""] + notes if notes else []
    return views, "\n".join(lines) + "\n"


def write_table(out: Path, recompute: bool = True) -> list[dict]:
    """OUT/summary.json and OUT/table.md from OUT/cells/*.json."""
    views, md = render_table(load_records(out), recompute)
    (out / "summary.json").write_text(json.dumps(views, indent=1, sort_keys=True))
    (out / "table.md").write_text(md)
    return views


# -- orchestrating ------------------------------------------------------------------------------------


#: engines whose memory outlives the engine: each of their cells runs in a process of its own. ZeRO-3
#: stays allocated after ``destroy()`` (DeepSpeed's per-module autograd Functions keep its optimizer
#: state); DDP's buckets are freed only some time later, in the middle of the next cell's measurement.
OWN_PROCESS = ("ddp", "zero3")


def jobs(cells: list[Cell]) -> list[list[Cell]]:
    """The processes to run, each a list of cells of one GPU count: one per engine, one per cell for the
    engines of :data:`OWN_PROCESS`, so that no cell measures on top of memory another may free."""
    groups: dict[tuple[str, int], list[Cell]] = {}
    alone = []
    for c in cells:
        if c.label in OWN_PROCESS:
            alone.append([c])
        else:
            groups.setdefault((c.label, c.world_size), []).append(c)
    return list(groups.values()) + alone


def _run_queue(queue: list[list[Cell]], out: Path, gpu: int, env: dict, args: list[str]) -> int:
    """Run one GPU's one-rank jobs one after another; returns the worst exit status."""
    worst = 0
    for k, job in enumerate(queue):
        path = out / "jobs" / f"gpu{gpu}-{k}.json"
        path.write_text(json.dumps([asdict(c) for c in job]))
        code = subprocess.call([sys.executable, __file__, "worker", str(out), "--cells", str(path),
                                "--tag", f"gpu{gpu}", *args], env=env, cwd=ROOT)
        worst = worst or code
    return worst


def run(a: argparse.Namespace) -> int:
    import threading

    import torch

    from scaletool.threads import child_env

    out = Path(a.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    (out / "jobs").mkdir(exist_ok=True)
    gpus = torch.cuda.device_count()
    need = max(a.worlds)
    if not a.smoke and gpus < need:
        print(f"error: cells on {need} GPUs need {need}, this machine shows {gpus}; use --worlds 1, or --smoke "
              "on a CPU", file=sys.stderr)
        return 2
    recipes = ["tiny"] if a.smoke else a.recipes
    cells = grid(recipes, a.engines, a.micro_batches, a.checkpointing, a.worlds)
    start = time.time()
    # DeepSpeed's op builder rejects the image's default arch list (9.0a); CPU workers get one core each
    common = {**os.environ, "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")}
    if gpus == 0:
        common.update(child_env(1))
    ones = [j for j in jobs(cells) if j[0].world_size == 1]
    twos = [j for j in jobs(cells) if j[0].world_size == 2]
    n1, n2 = sum(map(len, ones)), sum(map(len, twos))
    print(f"{n1} one-GPU cells in {len(ones)} processes, then {n2} two-GPU cells in {len(twos)} torchrun jobs",
          file=sys.stderr, flush=True)
    # the one-GPU phase gets its share of the time by cell count (each of two GPUs runs about half)
    share = n1 / 2 / max(1, n1 / 2 + n2) if n2 else 1.0
    queues: list[list[list[Cell]]] = [[] for _ in range(min(2, gpus) or 2)]  # CPU smoke: two workers too
    for job in ones:  # balance the GPUs by cell count
        min(queues, key=lambda q: sum(map(len, q))).append(job)
    codes = [0] * len(queues)
    threads = [threading.Thread(target=lambda i=i: codes.__setitem__(i, _run_queue(
        queues[i], out, i, {**common, **({"CUDA_VISIBLE_DEVICES": str(i)} if gpus else {})},
        ["--steps", str(a.steps), "--deadline", str(start + share * a.deadline_s)]))) for i in range(len(queues))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, job in enumerate(twos):
        path = out / "jobs" / f"2gpu-{k}.json"
        path.write_text(json.dumps([asdict(c) for c in job]))
        codes.append(subprocess.call(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
             "worker", str(out), "--cells", str(path), "--tag", "2gpu", "--steps", str(a.steps),
             "--deadline", str(start + a.deadline_s)], env=common, cwd=ROOT))
    views = write_table(out)
    bad = [v["name"] for v in views if v["status"] != "ok"]
    print(f"{len(views)} cells in {time.time() - start:.0f} s, {len(bad)} not ok{': ' + ', '.join(bad) if bad else ''}; "
          f"{out / 'table.md'}", file=sys.stderr)
    return 0 if not any(codes) and not bad else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure the grid (GPU), or the tiny smoke grid on CPU")
    r.add_argument("out")
    r.add_argument("--smoke", action="store_true", help="tiny recipe on CPU over gloo; memory figures null")
    r.add_argument("--recipes", nargs="+", default=["mha-1b", "mla-1b"])
    r.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    r.add_argument("--micro-batches", nargs="+", type=int, default=[1, 8])
    r.add_argument("--checkpointing", nargs="+", default=["none", "full"], choices=["none", "full", "selective"])
    r.add_argument("--worlds", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    r.add_argument("--steps", type=int, default=3, help="measured steps per cell, after one warm-up step")
    r.add_argument("--deadline-s", type=float, default=540, help="no cell starts after this many seconds")
    w = sub.add_parser("worker", help="(internal) run cells in this process")
    w.add_argument("out")
    w.add_argument("--cells", required=True)
    w.add_argument("--steps", type=int, default=3)
    w.add_argument("--deadline", type=float, required=True)
    w.add_argument("--tag", default="worker")
    t = sub.add_parser("table", help="print the markdown table of a run directory or a committed JSON result, "
                                      "with the current estimate")
    t.add_argument("src", help="a run directory (OUT) or a JSON list of cell records")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        return run(a)
    if a.cmd == "worker":
        cells = [Cell(**c) for c in json.loads(Path(a.cells).read_text())]
        worker(Path(a.out), cells, a.steps, a.deadline, a.tag)
        from scaletool.engines.dist import end_worker_process

        end_worker_process()  # every cell is written and the group is gone (a CI run aborted in the teardown)
    sys.stdout.write(render_table(load_records(Path(a.src)))[1])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing
    sys.exit(main())
