"""The one place metrics leave the process: ``metrics.jsonl``, TensorBoard, Weights & Biases, the
console and ``summary.json``.

Keys carry a namespace and a unit: ``loss/train``, ``time/step_s``, ``throughput/tokens_per_s``,
``memory/peak_allocated_bytes``. Only rank 0 writes; other ranks get a writer that drops everything,
so callers never branch on the rank.

Nothing is lost to a crash: every ``metrics.jsonl`` row and ``train.log`` line is flushed as it is
written (a ``kill -9`` leaves every row up to the last logged step on disk), and a resumed run
first drops the rows from its start step on (atomically: the file is rewritten and renamed), so the
file continues without gaps or duplicates. TensorBoard purges its events from that step likewise.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from scaletool.errors import RecipeError
from scaletool.fmt import CONTENDED_MARK, clean, open_state, write_atomic

METRICS_FILE = "metrics.jsonl"


def console_line(step: int, values: dict) -> str:
    """The per-step console line, as torchtitan prints it: ``step 10  loss 5.4321  memory 12.34 GiB (15.4%)
    tok/s 12,345  mfu 41.2%  step 0.123 s  lr 3e-04``; a figure not in ``values`` (or None) is left out; a
    contended step's rate carries :data:`~scaletool.fmt.CONTENDED_MARK`."""
    def has(key):
        return values.get(key) is not None

    parts = []
    if has("loss/train"):
        parts.append(f"loss {values['loss/train']:.4f}")
    if has("memory/max_allocated_bytes"):
        mem = f"memory {values['memory/max_allocated_bytes'] / 2**30:.2f} GiB"
        if has("memory/max_allocated_fraction"):
            mem += f" ({100 * values['memory/max_allocated_fraction']:.1f}%)"
        parts.append(mem)
    if has("memory/max_rss_bytes"):
        parts.append(f"rss {values['memory/max_rss_bytes'] / 2**30:.2f} GiB")
    if has("throughput/tokens_per_s"):
        # a step that waited for a CPU another process held says so on its rate (scaletool.measure.contention)
        mark = f" {CONTENDED_MARK}" if values.get("contention/contended") else ""
        parts.append(f"tok/s {values['throughput/tokens_per_s']:,.0f}{mark}")
    if has("flops/mfu"):
        parts.append(f"mfu {100 * values['flops/mfu']:.1f}%")
    if has("time/step_s"):
        parts.append(f"step {values['time/step_s']:.3g} s")
    if has("lr/lr"):
        parts.append(f"lr {values['lr/lr']:.3g}")
    return f"step {step:>6}  " + "  ".join(parts)


def _finite(values: dict) -> dict[str, float]:
    return {k: v for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def truncate_rows(path: Path, start_step: int) -> int:
    """Keep only the rows of ``path`` before ``start_step`` (and no torn line); return how many were dropped.
    Atomic: the kept rows go to a temporary file that replaces the original."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1  # a line cut by a kill mid-write
            continue
        if step < start_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        write_atomic(path, "".join(line + "\n" for line in kept))
    return dropped


@dataclass(frozen=True)
class WandbOptions:
    """Weights & Biases logging: ``mode`` offline (files under the run directory, no network) or online."""

    mode: str = "offline"
    project: str = "scaletool"

    def __post_init__(self):
        if self.mode not in ("offline", "online"):
            raise RecipeError(f"wandb mode {self.mode!r}: expected offline or online")


def import_wandb():
    """The ``wandb`` module, or a one-line RecipeError saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise RecipeError("wandb logging needs the wandb package: pip install 'scaletool[wandb]'") from None
    return wandb


class _WandbLogger:
    """Feeds one W&B run from the writer: the same scalars as TensorBoard, the summary's metrics at the end.

    The run id is derived from the run directory, so a resumed run continues the same W&B run."""

    def __init__(self, out_dir: Path, opts: WandbOptions, config: dict | None):
        wandb = import_wandb()
        run_id = hashlib.sha1(str(out_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=opts.project, name=out_dir.name, id=run_id, resume="allow", dir=str(out_dir),
                              mode=opts.mode, config=config or {})

    def log(self, step: int, values: dict) -> None:
        self.run.log(_finite(values), step=step)

    def summary(self, metrics: dict) -> None:
        self.run.summary.update(_finite(metrics))

    def close(self) -> None:
        self.run.finish()


class MetricsWriter:
    """Write scalars per step and the run summary into ``out_dir``.

    The console line (:func:`console_line`) shows loss, peak memory, tokens/s, MFU, step time and learning
    rate where present (all scalars go to the files and loggers);
    ``log`` appends free text to ``train.log`` and echoes it on stderr. ``start_step`` > 0 continues a
    run: rows and TensorBoard events from that step on are dropped first. ``wandb`` adds a W&B run
    (``config`` is its run configuration, e.g. the recipe).
    """

    def __init__(self, out_dir: Path, *, enabled: bool, tensorboard: bool = True, quiet: bool = False,
                 start_step: int = 0, wandb: WandbOptions | None = None, config: dict | None = None):
        self.out_dir, self.enabled, self.quiet = Path(out_dir), enabled, quiet
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)  # log lines stay whole when piped
        self._tb = self._jsonl = self._log = self._wandb = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        truncate_rows(self.out_dir / METRICS_FILE, start_step)
        self._jsonl = open(open_state(self.out_dir / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")
        self._log = open(open_state(self.out_dir / "train.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"), purge_step=start_step or None)
        if wandb is not None:
            self._wandb = _WandbLogger(self.out_dir, wandb, config)

    def log(self, message: str, *, style: str | None = None, echo: bool = True) -> None:
        """A line in ``train.log``, and on stderr unless quiet or ``echo=False``."""
        if not self.enabled:
            return
        self._log.write(message + "\n")
        self._log.flush()
        if echo and not self.quiet:
            self.console.print(message, style=style, markup=False)

    def scalars(self, step: int, values: dict[str, float | None], *, echo: bool = True) -> None:
        """One row of scalars at ``step`` (None values are skipped by TensorBoard and W&B)."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(clean({"step": step, **values})) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in _finite(values).items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(step, values)
        if echo:
            self.log(console_line(step, values))

    def summary(self, summary) -> Path | None:
        """Write ``summary.json`` atomically (a result model or a dict; sorted keys, NaN as null)."""
        if not self.enabled:
            return None
        data = summary.model_dump(mode="json") if hasattr(summary, "model_dump") else summary
        path = self.out_dir / "summary.json"
        write_atomic(path, json.dumps(clean(data), indent=2, sort_keys=True) + "\n")
        metrics = data.get("metrics") or {}
        if self._tb is not None:
            for k, v in _finite(metrics).items():
                self._tb.add_scalar(f"summary/{k}", v, data.get("steps_completed", 0))
        if self._wandb is not None:
            self._wandb.summary(metrics)
        return path

    def close(self) -> None:
        for f in (self._jsonl, self._log):
            if f is not None:
                f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        self._jsonl = self._log = self._tb = self._wandb = None
