"""StepTimer: one sample per step, read at the end."""
from __future__ import annotations

import pytest
import torch

from scaletool.measure.timing import StepTimer


def test_step_timer_times_each_step_on_its_own(fake_clock):
    """On a fake clock: each sample is exactly its own block; what ran between blocks is no step's."""
    timer = StepTimer(torch.device("cpu"))
    assert timer.seconds() == []
    for d in (0.05, 0.0, 0.1):
        fake_clock.advance(7.0)  # between steps: counted in none
        with timer.step():
            fake_clock.advance(d)
    assert timer.seconds() == [pytest.approx(0.05), 0.0, pytest.approx(0.1)]
    timer.restart()
    fake_clock.advance(2.0)
    timer.mark()
    fake_clock.advance(3.0)
    timer.mark()
    # a mark-to-mark step (the training loop's) counts all that ran between
    assert timer.seconds() == [pytest.approx(2.0), pytest.approx(3.0)]


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
