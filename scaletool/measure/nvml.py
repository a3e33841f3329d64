"""Background NVML sampler: GPU utilisation, memory used and power, read by a daemon thread.

Uses nvidia-ml-py (``import pynvml``). Where there is no GPU or no NVML the sampler is a no-op whose
summary says why; it never raises into the training loop. Sampling costs no CUDA synchronisation:
NVML queries the driver, not the CUDA stream. Alongside, what NVML can see of contention on the card:
other processes holding a context on it, the SM clock below the card's default (base) application
clock (its MHz kept: ``sm_clock_mhz_*``), and throttle reasons other than idle (power cap, thermal, hardware
slowdown), read every tenth sample (listing the card's processes is NVML's slowest query); the summary gives them as
``contention/gpu_*`` keys, and what the reads cost the sampling thread (``read_ms_*``).
"""
from __future__ import annotations

import os
import threading
import time

# throttle reasons that slow a busy card: power cap, hardware slowdown, thermal (software and hardware),
# power brake; idle, the application-clock setting and sync boost are not contention
_THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


class NvmlSampler:
    """Sample one GPU every ``interval_s`` between :meth:`start` and :meth:`stop`.

    ``uuid`` selects the device robustly under ``CUDA_VISIBLE_DEVICES``; ``index`` is the fallback.
    """

    def __init__(self, index: int | None, uuid: str | None = None, interval_s: float = 0.1, contention_every: int = 10):
        self.interval_s = interval_s
        # the contention reads (the card's process list above all) are the slow ones: every ``contention_every``
        # samples, so that a host-bound run (tensor parallelism at 1B) is not slowed by its own telemetry
        self.contention_every = max(1, contention_every)
        self.read_s: list[float] = []  # seconds each sample's NVML reads took (the sampler's own cost)
        self._parents: dict[int, int | None] = {}
        # who the other processes were (pid, command, parent), the first few seen: a run flagged for them says
        # which process it shared the card with, so a false flag (a job's own process) can be told apart
        self.others_seen: dict[int, str] = {}
        self.samples: list[tuple[float, float, float, float]] = []  # (t, util %, mem bytes, power W)
        # (t, other processes on the card, throttled by power/thermal/slowdown, SM clock below base), None: unseen
        self.contention: list[tuple[float, int | None, bool | None, bool | None]] = []
        self._base_mhz: int | None = None
        self.clocks: list[tuple[float, int]] = []  # (t, SM MHz) at each contention read: what the power limit left
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

    def _query(self, fn, *args):
        try:
            return getattr(self._nvml, fn)(self._handle, *args)
        except Exception:  # not supported on this card or driver: that figure is unseen
            return None

    def _read_contention(self) -> tuple[float, int | None, bool | None, bool | None]:
        n = self._nvml
        procs = self._query("nvmlDeviceGetComputeRunningProcesses")
        # in a container NVML reports host PIDs: where this process is not among them, it is one of them
        others = None if procs is None else foreign_processes([p.pid for p in procs], parents=self._parents)
        if others and len(self.others_seen) < 8:
            me = os.getpid()
            for p in procs:
                if p.pid != me and p.pid not in self.others_seen and len(self.others_seen) < 8:
                    self.others_seen[p.pid] = f"{p.pid}:{_command(p.pid)}(parent {_parent(p.pid)})"
        reasons = self._query("nvmlDeviceGetCurrentClocksThrottleReasons")
        throttled = None if reasons is None else bool(reasons & _THROTTLE_MASK)
        if self._base_mhz is None:
            self._base_mhz = self._query("nvmlDeviceGetDefaultApplicationsClock", n.NVML_CLOCK_SM)
        sm = self._query("nvmlDeviceGetClockInfo", n.NVML_CLOCK_SM)
        below = None if sm is None or not self._base_mhz else sm < self._base_mhz
        t = time.perf_counter()
        if sm is not None:
            self.clocks.append((t, int(sm)))
        return t, others, throttled, below

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(self.interval_s):
            try:
                t0 = time.perf_counter()
                self.samples.append(self._read())
                if i % self.contention_every == 0:
                    self.contention.append(self._read_contention())
                self.read_s.append(time.perf_counter() - t0)
                i += 1
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
        if self.read_s:  # what the sampling cost its thread (a host-bound step shares the interpreter with it)
            out["read_ms_mean"] = 1e3 * sum(self.read_s) / len(self.read_s)
            out["read_ms_max"] = 1e3 * max(self.read_s)
        for i, key in ((1, "utilization_pct"), (2, "memory_used_bytes"), (3, "power_w")):
            vals = [r[i] for r in rows]
            out[f"{key}_mean"] = sum(vals) / len(vals)
            out[f"{key}_max"] = max(vals)
        out.update(contention_summary([c for c in self.contention if since is None or c[0] >= since]))
        mhz = sorted(m for t, m in self.clocks if since is None or t >= since)
        if mhz:  # the sustained SM clock (a power-capped card's is below its top: analytic.power)
            out["sm_clock_mhz_median"] = mhz[len(mhz) // 2]
            out["sm_clock_mhz_min"], out["sm_clock_mhz_max"] = mhz[0], mhz[-1]
        if self.others_seen:
            me = os.getpid()
            seen = ", ".join(self.others_seen.values())
            out["other_processes_seen"] = f"from {me}:{_command(me)}(parent {_parent(me)}): {seen}"
        return out


def _command(pid: int) -> str:
    """The process's command name (``/proc/PID/comm``), or ``?`` where this namespace cannot see it."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read(64).strip().encode("ascii", "backslashreplace").decode() or "?"
    except OSError:
        return "?"


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def foreign_processes(pids: list[int], me: int | None = None, parents: dict[int, int | None] | None = None) -> int:
    """How many of the processes NVML lists on our GPU belong to someone else: not this process and
    not a sibling rank of the same job (a process with our parent, the launcher that started every
    local rank; NCCL's peer-to-peer transport opens each peer rank's context on our GPU), and not one of our
    ancestors (torchrun's elastic agent, ``pt_elastic``, holds a context on every GPU of its ranks: seen on
    4 H200s under torch 2.11). A PID this
    namespace cannot see counts as foreign; NVML listing PIDs of another namespace only (ours absent)
    counts all but one as foreign. ``parents``: a cache of the parents already read (a PID's parent is
    fixed while the PID lives)."""
    me = os.getpid() if me is None else me
    if me not in pids:
        return max(0, len(pids) - 1)
    cache = {} if parents is None else parents

    def parent_of(pid: int) -> int | None:
        if pid not in cache:
            cache[pid] = _parent(pid)
        return cache[pid]
    parent = parent_of(me)
    own = _ancestors(me, parent_of)  # the launcher that started this rank (torchrun's agent may hold a context too)
    return sum(1 for pid in pids if pid != me and pid not in own
               and (parent is None or parent <= 1 or parent_of(pid) != parent))


def _ancestors(pid: int, parent_of, limit: int = 64) -> set[int]:
    """This process's ancestors below PID 1 (its launcher, the launcher's launcher, ...)."""
    out: set[int] = set()
    p = parent_of(pid)
    while p is not None and p > 1 and p not in out and len(out) < limit:
        out.add(p)
        p = parent_of(p)
    return out


def contention_summary(rows: list[tuple]) -> dict:
    """``contention/gpu_*`` figures of the samples: the most other processes seen, and the share of
    samples throttled or clocked below base (None where NVML never told)."""
    def share(i):
        seen = [r[i] for r in rows if r[i] is not None]
        return sum(seen) / len(seen) if seen else None
    others = [r[1] for r in rows if r[1] is not None]
    return {"contention/gpu_other_processes_max": max(others) if others else None,
            "contention/gpu_throttled_share": share(2), "contention/gpu_clock_below_base_share": share(3)}
