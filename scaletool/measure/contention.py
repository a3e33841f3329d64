"""Contention: whether a timed step got the machine it was timed on.

Another process taking the cores for a while moves a step time as much as any change under test, and
interleaving repeats does not remove it. Between two marks the probe reads what Linux says of the
interval: the process's CPU time against wall × threads (``cpu_share``), how long its threads were
runnable but waited for a CPU (``run_delay_share``, ``/proc/self/task/*/schedstat``, over wall ×
threads), the share of the interval in which some task of the machine waited for a CPU
(``psi_some_share``, ``/proc/pressure/cpu``), the VM's steal time (``steal_share``, ``/proc/stat``) and
the 1-minute load average. A source the kernel does not offer is None, never a guess.

The rule (:data:`RULE`): a step is contended when its threads waited for a CPU for more than
:data:`RUN_DELAY_MAX` of wall × threads, or steal took more than :data:`STEAL_MAX` of the CPU time, or
(where schedstat is absent) the process got under :data:`CPU_SHARE_MIN` of wall × threads while some
task waited for a CPU more than :data:`PSI_MIN` of the time. A run is contended when more than
:data:`RUN_STEPS_MAX` of its measured steps are, or another process held its GPU
(:mod:`scaletool.measure.nvml`). Throttling (power cap, heat) is recorded beside it but is not
contention: a busy H100 runs at its power cap as a property of the workload, not of another job.
Contended steps are flagged, not dropped.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

RUN_DELAY_MAX = 0.10
STEAL_MAX = 0.10
CPU_SHARE_MIN = 0.5
PSI_MIN = 0.5
RUN_STEPS_MAX = 0.10
STEAL_MIN_JIFFIES = 100
RULE = (f"a step is contended when its threads waited for a CPU more than {RUN_DELAY_MAX:.0%} of wall × threads "
        f"(schedstat), or steal exceeded {STEAL_MAX:.0%}, or (without schedstat) the process got under "
        f"{CPU_SHARE_MIN:.0%} of wall × threads while some task waited for a CPU over {PSI_MIN:.0%} of the time "
        f"(/proc/pressure/cpu); a run is contended when more than {RUN_STEPS_MAX:.0%} of its measured steps are, "
        f"or (NVML) another process held its GPU; throttling (power, heat) is recorded, not counted")
KEYS = ("cpu_share", "run_delay_share", "psi_some_share", "steal_share", "loadavg_1m")


#: a /proc file the probe reads is a line or two; past this it is not the kernel's file
MAX_PROC_BYTES = 1 << 16
#: the largest counter accepted (the kernel's are 64-bit); past it a figure is garbage, not a reading
MAX_COUNTER = 1 << 64


def _read(path: str) -> str | None:
    """The text of a /proc file, or None when it cannot be read (absent, unreadable, not text). Opened
    without blocking and read bounded: whatever is mounted there, the probe never waits or fills memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            return f.read(MAX_PROC_BYTES).decode("ascii")
    except (OSError, ValueError):
        return None


def _counter(text: str) -> int | None:
    """A kernel counter: ASCII digits, at most 64 bits; None for anything else."""
    if not (text.isascii() and text.isdigit() and len(text) <= 20):
        return None
    value = int(text)
    return value if value < MAX_COUNTER else None


def run_delay_ns(task_dir: str = "/proc/self/task") -> int | None:
    """Nanoseconds this process's threads have waited on a run queue (None without schedstat)."""
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return None
    total, seen = 0, False
    for t in tasks:
        text = _read(f"{task_dir}/{t}/schedstat")
        if text:
            parts = text.split()
            delay = _counter(parts[1]) if len(parts) >= 2 else None
            if delay is not None:
                total += delay
                seen = True
    return total if seen else None


def _psi_some(text: str | None) -> dict[str, str]:
    """The ``some`` line of ``/proc/pressure/cpu`` as its key=value fields ({} where absent)."""
    text = _read("/proc/pressure/cpu") if text is None else text
    for line in (text or "").splitlines():
        if line.startswith("some "):
            return dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
    return {}


def psi_some_total_us(text: str | None = None) -> int | None:
    """Microseconds in which some task waited for a CPU (``/proc/pressure/cpu``), None where absent."""
    return _counter(_psi_some(text).get("total", ""))


def psi_some_avg10(text: str | None = None) -> float | None:
    """The kernel's 10-second average of the share of time some task waited for a CPU, in percent."""
    try:
        value = float(_psi_some(text)["avg10"])
    except (KeyError, ValueError):
        return None
    return value if 0 <= value <= 100 else None  # a percentage; NaN fails both


def cpu_jiffies(text: str | None = None) -> tuple[int, int] | None:
    """(all CPU time, steal time) of the machine in jiffies, from the first line of ``/proc/stat``."""
    text = _read("/proc/stat") if text is None else text
    if not text or not text.startswith("cpu "):
        return None
    vals = [_counter(v) for v in text.split("\n", 1)[0].split()[1:]]
    if len(vals) < 4 or None in vals:
        return None
    # user nice system idle iowait irq softirq steal guest guest_nice: guest time is already in user
    return sum(vals[:8]), vals[7] if len(vals) > 7 else 0


@dataclass(frozen=True)
class Snapshot:
    wall: float
    cpu: float
    run_delay_ns: int | None
    psi_us: int | None
    jiffies: tuple[int, int] | None


def snapshot() -> Snapshot:
    return Snapshot(time.perf_counter(), time.process_time(), run_delay_ns(), psi_some_total_us(), cpu_jiffies())


def _share(x: float) -> float | None:
    """A share of an interval: a counter that went backwards or jumped (a garbage reading) is None."""
    return x if 0 <= x < 1e6 else None


def loadavg_1m() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def interval(a: Snapshot, b: Snapshot, threads: int) -> dict[str, float | None]:
    """What the kernel says of the interval from ``a`` to ``b`` for a process running ``threads`` threads."""
    wall = b.wall - a.wall
    threads = max(1, threads)
    if wall <= 0:
        return dict.fromkeys(KEYS)
    out: dict[str, float | None] = {"cpu_share": (b.cpu - a.cpu) / (wall * threads)}
    out["run_delay_share"] = (None if a.run_delay_ns is None or b.run_delay_ns is None
                              else _share((b.run_delay_ns - a.run_delay_ns) / 1e9 / (wall * threads)))
    out["psi_some_share"] = (None if a.psi_us is None or b.psi_us is None
                             else _share((b.psi_us - a.psi_us) / 1e6 / wall))
    steal = None  # jiffies are coarse (10 ms): judged only over a second of CPU time or more
    if a.jiffies and b.jiffies and b.jiffies[0] - a.jiffies[0] >= STEAL_MIN_JIFFIES:
        steal = _share((b.jiffies[1] - a.jiffies[1]) / (b.jiffies[0] - a.jiffies[0]))
    out["steal_share"] = steal
    out["loadavg_1m"] = loadavg_1m()
    return out


def is_contended(sample: dict) -> bool:
    """The step rule of the module docstring, on one interval's figures."""
    delay, steal = sample.get("run_delay_share"), sample.get("steal_share")
    if steal is not None and steal > STEAL_MAX:
        return True
    if delay is not None:
        return delay > RUN_DELAY_MAX
    cpu, psi = sample.get("cpu_share"), sample.get("psi_some_share")
    return cpu is not None and psi is not None and cpu < CPU_SHARE_MIN and psi > PSI_MIN


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def summarize(samples: list[dict]) -> dict[str, float | int | bool | None]:
    """Run-level metrics (namespaced keys) from the measured steps' samples: medians, counts and the run flag."""
    flags = [is_contended(s) for s in samples]
    out: dict = {f"contention/{k}": _median([s[k] for s in samples if s.get(k) is not None]) for k in KEYS}
    out["contention/contended_steps"] = sum(flags)
    out["contention/sampled_steps"] = len(flags)
    out["contention/contended"] = bool(flags) and sum(flags) > RUN_STEPS_MAX * len(flags)
    try:
        out["contention/psi_some_avg10"] = psi_some_avg10()
    except Exception:  # noqa: BLE001 - as Probe.snap: recording contention never ends a run
        out["contention/psi_some_avg10"] = None
    return out


class Probe:
    """Snapshots taken at a timer's marks; :meth:`between` turns two of them into an interval's figures."""

    def __init__(self, threads: int | None = None):
        if threads is None:
            import torch
            threads = torch.get_num_threads()
        self.threads = threads

    def snap(self) -> Snapshot:
        """Never raises: recording contention must not end a run (an unexpected failure is no reading)."""
        try:
            return snapshot()
        except Exception:  # noqa: BLE001 - a probe that fails records nothing; the run goes on
            return Snapshot(time.perf_counter(), time.process_time(), None, None, None)

    def between(self, a: Snapshot, b: Snapshot) -> dict[str, float | None]:
        try:
            return interval(a, b, self.threads)
        except Exception:  # noqa: BLE001 - as snap
            return dict.fromkeys(KEYS)
