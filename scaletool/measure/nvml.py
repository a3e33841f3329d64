"""Background NVML sampler: GPU utilisation, memory used and power, read by a daemon thread.

Uses nvidia-ml-py (``import pynvml``). Where there is no GPU or no NVML the sampler is a no-op whose
summary says why; it never raises into the training loop. Sampling costs no CUDA synchronisation:
NVML queries the driver, not the CUDA stream.
"""
from __future__ import annotations

import threading
import time


class NvmlSampler:
    """Sample one GPU every ``interval_s`` between :meth:`start` and :meth:`stop`.

    ``uuid`` selects the device robustly under ``CUDA_VISIBLE_DEVICES``; ``index`` is the fallback.
    """

    def __init__(self, index: int | None, uuid: str | None = None, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float, float]] = []  # (t, util %, mem bytes, power W)
        self.note: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        self._nvml = None
        if index is None:
            self.note = "no GPU: NVML sampling off"
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            try:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else None
            except pynvml.NVMLError:
                self._handle = None
            if self._handle is None:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as e:  # no driver, no library, no permission: telemetry is optional
            self.note = f"NVML unavailable ({type(e).__name__}: {e}); sampling off"
            self._handle = None

    @property
    def active(self) -> bool:
        return self._handle is not None

    def _read(self) -> tuple[float, float, float, float]:
        n, h = self._nvml, self._handle
        util = n.nvmlDeviceGetUtilizationRates(h).gpu
        mem = n.nvmlDeviceGetMemoryInfo(h).used
        power = n.nvmlDeviceGetPowerUsage(h) / 1000.0
        return time.perf_counter(), float(util), float(mem), power

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(self._read())
            except Exception as e:  # a driver hiccup ends sampling, never the run
                self.note = f"NVML read failed ({e}); sampling stopped early"
                return

    def start(self) -> NvmlSampler:
        if self.active and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def summary(self, since: float | None = None) -> dict:
        """Mean and max of each series over the samples taken after ``since`` (a perf_counter time)."""
        rows = [s for s in self.samples if since is None or s[0] >= since]
        out: dict = {"samples": len(rows), "interval_s": self.interval_s, "note": self.note}
        if not rows:
            return out
        for i, key in ((1, "utilization_pct"), (2, "memory_used_bytes"), (3, "power_w")):
            vals = [r[i] for r in rows]
            out[f"{key}_mean"] = sum(vals) / len(vals)
            out[f"{key}_max"] = max(vals)
        return out
