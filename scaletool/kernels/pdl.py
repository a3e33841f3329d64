"""Programmatic dependent launch (PDL) for scaletool's Triton kernels, off unless enabled.

On Hopper and newer a kernel launched with PDL may be scheduled while the kernel before it on the stream
is still running; it executes ``griddepcontrol.wait`` before touching anything that kernel wrote, and
signals (``griddepcontrol.launch_dependents``) that the kernel after it may be scheduled in turn. What it
can save is the launch and ramp-up between two short kernels: a batch-1 decode step runs about 240 of
them. :func:`enable` (or the :func:`enabled` block) turns it on for the kernels of :mod:`scaletool.kernels`
(the latent attention, its merges, the GEMV); :func:`launch` gives a launch its ``USE_PDL`` and
``launch_pdl`` arguments. A CUDA graph keeps the launches' attribute when it captures them.
``scaletool decode --pdl`` turns it on for the step, Inductor's kernels included
(``torch._inductor.config.triton.enable_pdl`` while the step compiles).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: no kernels to launch
    triton = None

_enabled = False


def enable(flag: bool) -> bool:
    """Turn PDL on or off for the kernels launched from now on; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


@contextmanager
def enabled(flag: bool):
    """PDL on (or off) for the kernels launched inside the block; the previous setting after it."""
    previous = enable(flag)
    try:
        yield
    finally:
        enable(previous)


def supported(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer."""
    device = torch.device(device)
    return device.type == "cuda" and _capability(device.index or 0) >= (9, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def launch(device: torch.device) -> dict:
    """The keyword arguments a kernel launch on ``device`` takes: PDL on where enabled and supported."""
    on = _enabled and supported(device)
    return {"USE_PDL": on, "launch_pdl": on}


if triton is not None:
    @triton.jit
    def start(USE_PDL: tl.constexpr):
        """Inside a kernel launched under :func:`launch`: wait for the kernel before this one (whose outputs it
        may read from here on), then let the one after be scheduled (it waits for this one in turn)."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
