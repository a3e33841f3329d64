"""The CPU thread rule: shares from the affinity mask or the parent, divided among ranks; explicit OMP wins."""
from __future__ import annotations

import os
import subprocess
import sys

from scaletool import threads


def test_share_divides_among_ranks_and_never_reaches_zero():
    assert threads.threads_per_process(1, {threads.SHARE_ENV: "6"}) == 6
    assert threads.threads_per_process(2, {threads.SHARE_ENV: "6"}) == 3
    assert threads.threads_per_process(4, {threads.SHARE_ENV: "2"}) == 1


def test_explicit_omp_wins_and_garbage_is_ignored():
    assert threads.threads_per_process(2, {"OMP_NUM_THREADS": "5", threads.SHARE_ENV: "8"}) == 5
    cores = threads.available_cores()
    assert threads.threads_per_process(1, {threads.SHARE_ENV: "zero"}) == cores
    assert threads.threads_per_process(1, {threads.SHARE_ENV: "-3", "OMP_NUM_THREADS": "0"}) == cores


def test_affinity_mask_bounds_the_share():
    """A process pinned to one core gets one thread, whatever os.cpu_count() says."""
    code = "import os; os.sched_setaffinity(0, {0}); from scaletool import threads; print(threads.pin_threads())"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", threads.SHARE_ENV)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "1"


def test_child_env_hands_down_the_share():
    env = threads.child_env(3)
    assert env == {threads.SHARE_ENV: "3", "OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}
