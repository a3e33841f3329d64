"""The one place metrics leave the process: TensorBoard scalars, ``metrics.jsonl``, the console and
``summary.json``.

Keys carry a namespace and a unit: ``loss/train``, ``time/step_s``, ``throughput/tokens_per_s``,
``memory/peak_allocated_bytes``. Only rank 0 writes; other ranks get a writer that drops everything,
so callers never branch on the rank.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console

from scaletool.fmt import clean


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key.endswith("_bytes"):
        return f"{v / 2**30:.2f}GiB"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class MetricsWriter:
    """Write scalars per step and the run summary into ``out_dir``.

    ``console_keys`` picks the scalars echoed on the console line (all go to TensorBoard and JSONL);
    ``log`` appends free text to ``train.log`` and echoes it on stderr.
    """

    def __init__(self, out_dir: Path, *, enabled: bool, tensorboard: bool = True, quiet: bool = False,
                 console_keys: tuple[str, ...] = ("loss/train", "time/step_s", "throughput/tokens_per_s", "lr/lr")):
        self.out_dir, self.enabled, self.quiet = Path(out_dir), enabled, quiet
        self.console = Console(stderr=True, highlight=False)
        self.console_keys = console_keys
        self._tb = None
        self._jsonl = None
        self._log = None
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.out_dir / "metrics.jsonl", "a")
            self._log = open(self.out_dir / "train.log", "a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))

    def log(self, message: str, *, style: str | None = None) -> None:
        if not self.enabled:
            return
        self._log.write(message + "\n")
        self._log.flush()
        if not self.quiet:
            self.console.print(message, style=style, markup=False)

    def scalars(self, step: int, values: dict[str, float | None], *, echo: bool = True) -> None:
        """One row of scalars at ``step`` (None values are skipped in TensorBoard)."""
        if not self.enabled:
            return
        row = clean({"step": step, **values})
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if v is not None and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if echo:
            parts = [f"{k.split('/')[-1] if k != 'loss/train' else 'loss'}={_fmt(k, values[k])}"
                     for k in self.console_keys if k in values]
            self.log(f"step {step:>6}  " + "  ".join(parts))

    def summary(self, summary: dict) -> Path | None:
        """Write ``summary.json`` (sorted keys, NaN as null) and return its path."""
        if not self.enabled:
            return None
        path = self.out_dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(clean(summary), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        if self._tb is not None:
            for k, v in summary.get("metrics", {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"summary/{k}", v, summary.get("steps_completed", 0))
        return path

    def close(self) -> None:
        for f in (self._jsonl, self._log):
            if f is not None:
                f.close()
        if self._tb is not None:
            self._tb.close()
        self._jsonl = self._log = self._tb = None
