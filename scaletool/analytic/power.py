"""What a lower power limit leaves of a card's sustained clock, and so of its compute-bound rates.

Measured on the GH100 die (H200, 700 W limit, torch 2.11, 2026-11-28; benchmarks/results/power/): a bf16 GEMM
on n of the 132 SMs (CUDA green contexts) runs at the top clock, 1,980 MHz, while the board draws under its
limit (n <= 48: 220-613 W) and, once the limit binds, at a clock that falls with n (1,470-1,485 MHz at 132
SMs; FP8 operands, drawing more a SM, 1,365). Fitted to the 30 points of two calls
(``benchmarks/scripts/power_fit.py``), ``P = P0 + c_w * n**0.72 * (f / f_max)**k`` with ``P0`` held at or above
the card's idle draw (81.8 W, measured): k = 1.8, P0 = 81.8 W (rms 18.5 W; the 48 fits within 10% of that rms
give the ratio below within 0.77-0.82 at 500 W). A workload held by its limit draws ``P0 + D * (f / f_max)**k``
at that limit whatever its demand ``D``, so its clock under another limit is ``f * ((L' - P0) / (L - P0)) **
(1 / k)`` (the draw taken at the measured 98.5% of the limit). Training is such a workload: torchtitan's
Llama-3.1-8B shape on the H200 ran power-capped in 92-100% of its samples at 1,545-1,575 MHz median.

What it scales: GEMMs and attention (their rate follows the SM clock: the bf16 GEMM's TFLOP/s per SM per GHz
stayed within 3.19-3.53 over 1,470-1,980 MHz, FP8's within 6.51-6.91 over 1,365-1,980), not memory-bound work
or the interconnect. It applies to a profile that names the die's curve (``power_curve: gh100``) with a limit
(``power_limit_w``) below the one its datasheet-default rates were measured at (the H100 SXM at 700 W).
"""
from __future__ import annotations

import math

#: GH100's fitted curve: static draw (W), the clock exponent of the dynamic draw, the draw at the limit
#: as a share of it (the controller holds 690 of 700 W), the limit the reference rates were measured at
GH100 = {"static_w": 81.8, "exponent": 1.8, "draw_share": 0.985, "reference_limit_w": 700.0}
CURVES = {"gh100": GH100}


def clock_ratio(limit_w: float, curve: str = "gh100", reference_w: float | None = None) -> float:
    """The sustained clock of a power-capped workload under ``limit_w`` over its clock under the curve's
    reference limit (1.0 at or above it: a card never clocks higher than its reference for a higher limit here).

    >>> round(clock_ratio(500.0), 3)
    0.804
    >>> clock_ratio(700.0)
    1.0
    """
    c = CURVES[curve]
    ref = c["reference_limit_w"] if reference_w is None else reference_w
    if not (math.isfinite(limit_w) and limit_w > 0 and math.isfinite(ref) and ref > 0):
        raise ValueError(f"power limit must be a positive finite number of watts, got {limit_w!r} (reference {ref!r})")
    if limit_w >= ref:
        return 1.0
    p0, share = c["static_w"], c["draw_share"]
    low = limit_w * share - p0
    if low <= 0:
        raise ValueError(f"a {limit_w:g} W limit is at or below the die's static draw ({p0:g} W): no sustained clock")
    return (low / (ref * share - p0)) ** (1.0 / c["exponent"])


def profile_clock_ratio(profile) -> float:
    """:func:`clock_ratio` for a hardware profile's ``power_limit_w`` and ``power_curve`` (1.0 where either
    is missing: its datasheet-default rates are taken at the limit they were measured at)."""
    limit = getattr(profile, "power_limit_w", None)
    curve = getattr(profile, "power_curve", None)
    if not limit or not curve:
        return 1.0
    return clock_ratio(float(limit), curve)
