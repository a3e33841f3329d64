"""StepTimer: one sample per step, read at the end."""
from __future__ import annotations

import time

import pytest
import torch

from scaletool.measure.timing import StepTimer


def test_step_timer_times_each_step_on_its_own():
    timer = StepTimer(torch.device("cpu"))
    assert timer.seconds() == []
    for d in (0.05, 0.0, 0.1):
        with timer.step():
            time.sleep(d)
    got = timer.seconds()
    assert len(got) == 3 and got[0] >= 0.05 and got[1] < 0.05 and got[2] >= 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_are_device_time_between_event_pairs():
    timer = StepTimer(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    for n in (1, 8):
        with timer.step():
            for _ in range(n):
                x = x @ x / 64
    small, big = timer.seconds()
    assert 0 < small < big  # eight matmuls take longer than one, though the host never waited
