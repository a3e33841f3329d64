"""Contention detection on the kernel's own figures: the step rule on chosen samples (it cannot flake),
the parsing of real /proc files, and the run flag. A real CPU hog is in tests/report/test_contended_report.py."""
from __future__ import annotations

import os

import pytest

from scaletool.measure import contention as c
from scaletool.measure.contention import Snapshot, interval, is_contended, summarize

PSI = ("some avg10=79.07 avg60=53.31 avg300=21.31 total=85153611\n"
       "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
STAT = "cpu  40426 0 10405 213091 319 0 207 332 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"


@pytest.mark.parametrize(("sample", "expected"), [
    ({"run_delay_share": 0.0, "cpu_share": 0.9, "psi_some_share": 0.0, "steal_share": 0.0}, False),  # quiet
    ({"run_delay_share": 0.6, "cpu_share": 0.2, "psi_some_share": 0.9, "steal_share": 0.0}, True),  # a hog beside it
    ({"run_delay_share": 0.1, "cpu_share": 0.9, "psi_some_share": 0.0}, False),  # at the threshold: not above it
    ({"run_delay_share": 0.11}, True),
    # threads idle (a small model) but never waiting: schedstat says not contended, whatever the CPU share
    ({"run_delay_share": 0.01, "cpu_share": 0.2, "psi_some_share": 0.9}, False),
    ({"run_delay_share": 0.0, "steal_share": 0.3}, True),  # the VM's host took the CPUs
    # without schedstat: a low CPU share counts only while some task waited for a CPU
    ({"run_delay_share": None, "cpu_share": 0.3, "psi_some_share": 0.8}, True),
    ({"run_delay_share": None, "cpu_share": 0.3, "psi_some_share": 0.1}, False),
    ({"run_delay_share": None, "cpu_share": 0.3, "psi_some_share": None}, False),  # nothing to tell by: not flagged
])
def test_the_step_rule(sample, expected):
    assert is_contended(sample) is expected


def test_an_interval_divides_by_wall_times_threads():
    a = Snapshot(wall=10.0, cpu=5.0, run_delay_ns=1_000_000_000, psi_us=2_000_000, jiffies=(1000, 10))
    b = Snapshot(wall=12.0, cpu=6.0, run_delay_ns=3_000_000_000, psi_us=3_000_000, jiffies=(1400, 50))
    got = interval(a, b, threads=2)
    assert got["cpu_share"] == pytest.approx(0.25)  # 1 s of CPU in 2 s × 2 threads
    assert got["run_delay_share"] == pytest.approx(0.5)  # 2 s waited in 2 s × 2 threads
    assert got["psi_some_share"] == pytest.approx(0.5)  # 1 s of some-stall in 2 s
    assert got["steal_share"] == pytest.approx(0.1)  # 40 of 400 jiffies
    assert is_contended(got)
    short = interval(a, Snapshot(10.01, 5.0, 1_000_000_000, 2_000_000, (1002, 11)), threads=2)
    assert short["steal_share"] is None  # two jiffies say nothing: steal is judged over a second of CPU time or more
    blind = interval(a, Snapshot(12.0, 6.0, None, None, None), threads=2)
    assert blind["run_delay_share"] is None and blind["psi_some_share"] is None and blind["steal_share"] is None


def test_proc_files_parse_and_the_real_ones_read():
    assert c.psi_some_total_us(PSI) == 85153611 and c.psi_some_avg10(PSI) == pytest.approx(79.07)
    assert c.psi_some_total_us("") is None and c.psi_some_avg10("garbage") is None
    assert c.cpu_jiffies(STAT) == (40426 + 10405 + 213091 + 319 + 207 + 332, 332)
    assert c.cpu_jiffies("intr 1 2") is None
    # the real files of this machine: figures where the kernel offers them, None where it does not
    first, second = c.snapshot(), c.snapshot()
    assert second.wall >= first.wall and second.cpu >= first.cpu
    for a, b in ((first.run_delay_ns, second.run_delay_ns), (first.psi_us, second.psi_us)):
        assert (a is None) == (b is None) and (a is None or b >= a >= 0)
    if os.path.exists("/proc/self/schedstat"):
        assert first.run_delay_ns is not None
    if os.path.exists("/proc/pressure/cpu") and os.access("/proc/pressure/cpu", os.R_OK):
        assert first.psi_us is not None
    assert set(c.Probe(2).between(first, second)) == set(c.KEYS)


def test_a_run_is_contended_when_more_than_a_tenth_of_its_steps_are():
    quiet = {"run_delay_share": 0.0, "cpu_share": 0.95, "psi_some_share": 0.0}
    busy = {"run_delay_share": 0.5, "cpu_share": 0.3, "psi_some_share": 0.9}
    one_in_ten = summarize([busy] + [quiet] * 9)
    assert one_in_ten["contention/contended_steps"] == 1 and not one_in_ten["contention/contended"]
    two_in_ten = summarize([busy] * 2 + [quiet] * 8)
    assert two_in_ten["contention/contended"] and two_in_ten["contention/sampled_steps"] == 10
    assert two_in_ten["contention/run_delay_share"] == 0.0  # the median step's figure
    assert summarize([])["contention/contended"] is False


def test_gpu_contention_figures_from_nvml_samples():
    from scaletool.measure.nvml import contention_summary

    rows = [(0.0, 0, False, False), (0.1, 2, True, None), (0.2, 1, None, True), (0.3, None, False, False)]
    got = contention_summary(rows)
    assert got == {"contention/gpu_other_processes_max": 2, "contention/gpu_throttled_share": pytest.approx(1 / 3),
                   "contention/gpu_clock_below_base_share": pytest.approx(1 / 3)}
    assert set(contention_summary([]).values()) == {None}


def test_sibling_ranks_of_one_launcher_are_not_other_processes_but_a_stranger_is(tmp_path):
    import subprocess
    import sys

    from scaletool.measure.nvml import foreign_processes
    code = ("import subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) for _ in range(2)]\n"
            "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
            "time.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    kids: list[int] = []
    try:
        kids = [int(x) for x in launcher.stdout.readline().split()]
        a, b = kids
        assert foreign_processes([a, b], me=a) == 0  # the job's own ranks
        assert foreign_processes([a, b, stranger.pid], me=a) == 1
        assert foreign_processes([b, stranger.pid], me=a) == 1  # we are not listed: all but one
        assert foreign_processes([a, 999_999_999], me=a) == 1  # a PID this namespace cannot see
        assert foreign_processes([a, b, launcher.pid], me=a) == 0  # the launcher holding a context is the job's own
        cache: dict = {}
        assert foreign_processes([a, b, stranger.pid], me=a, parents=cache) == 1
        assert {a, b, stranger.pid} <= set(cache)  # each parent read once (ancestors too), then reused
        assert foreign_processes([a, b, stranger.pid], me=a, parents=cache) == 1
    finally:
        import os
        import signal
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
        stranger.kill()
        launcher.kill()
        launcher.wait()
        stranger.wait()


class _FakeNvml:
    """pynvml's calls the sampler makes, counted; the card lists one process, this one."""
    NVML_CLOCK_SM = 1

    def __init__(self):
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        if not name.startswith("nvmlDevice"):
            raise AttributeError(name)
        import os
        from types import SimpleNamespace as NS
        values = {"nvmlDeviceGetUtilizationRates": NS(gpu=50), "nvmlDeviceGetMemoryInfo": NS(used=2**30),
                  "nvmlDeviceGetPowerUsage": 300_000, "nvmlDeviceGetComputeRunningProcesses": [NS(pid=os.getpid())],
                  "nvmlDeviceGetCurrentClocksThrottleReasons": 0, "nvmlDeviceGetDefaultApplicationsClock": 1500,
                  "nvmlDeviceGetClockInfo": 1700}

        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return values[name]
        return call


def test_the_sampler_reads_the_slow_contention_queries_at_a_tenth_of_its_rate():
    import threading

    from scaletool.measure.nvml import NvmlSampler
    s = NvmlSampler(None, interval_s=0.001, contention_every=5)
    s._nvml, s._handle, s.note = _FakeNvml(), object(), None
    done = threading.Event()
    s.start()
    for _ in range(10_000):  # until 23 samples, however long the machine takes (no time is asserted)
        if len(s.read_s) >= 23:
            break
        done.wait(0.01)
    s.stop()
    n = len(s.samples)
    assert n >= 23 and len(s.read_s) == n
    assert len(s.contention) == (n + 4) // 5  # samples 0, 5, 10, ...
    assert s._nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == len(s.contention)
    assert s._nvml.calls["nvmlDeviceGetUtilizationRates"] == n
    summary = s.summary()
    assert summary["samples"] == n and 0 <= summary["read_ms_mean"] <= summary["read_ms_max"]
    assert summary["contention/gpu_other_processes_max"] == 0 and summary["contention/gpu_throttled_share"] == 0
    assert summary["sm_clock_mhz_median"] == summary["sm_clock_mhz_min"] == 1700  # the clock each contention read saw


def test_the_sampler_names_the_other_processes_it_saw_on_the_card():
    import os
    import subprocess
    import sys
    from types import SimpleNamespace as NS

    from scaletool.measure.nvml import NvmlSampler
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        s = NvmlSampler(None)
        fake = _FakeNvml()
        procs = [NS(pid=os.getpid()), NS(pid=stranger.pid)]
        fake.nvmlDeviceGetComputeRunningProcesses = lambda h: procs
        s._nvml, s._handle, s.note = fake, object(), None
        s.contention.append(s._read_contention())
        s.samples.append(s._read())
        summary = s.summary()
        assert summary["contention/gpu_other_processes_max"] == 1
        seen = summary["other_processes_seen"]
        assert seen.startswith(f"from {os.getpid()}:") and f"{stranger.pid}:python" in seen
        assert f"(parent {os.getpid()})" in seen  # the stranger is our child here: its parent is named
    finally:
        stranger.kill()
        stranger.wait()
