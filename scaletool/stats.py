"""Measurement statistics: the spread every timed figure carries, the warm-up rule, the noise rule.

One place for all of it, so train steps, decode steps, prefill, profiles, sweep repeats and report
findings use the same definitions (as pytest-benchmark, hyperfine and ``torch.utils.benchmark``
report a median with its spread rather than a mean):

- :class:`Spread`: median, p10, p90 and n of a sample. Percentiles interpolate linearly between
  order statistics (numpy's default ``linear`` method), so n=1 gives p10 = p90 = the value.
- :func:`settled_start`: how many leading samples a warm-up rule excludes: at least ``minimum``,
  then every further leading sample slower than the settled level by more than ``tolerance``.
- :func:`rel_error`: (value - reference) / reference, the one relative error every table and finding uses.
- :func:`compare`: a difference between two spreads is stated only when their p10-p90 ranges do
  not overlap and each side has at least :data:`MIN_SAMPLES` samples; otherwise it is noise.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from scaletool.fmt import pct

#: fewer samples than this on either side and no difference is claimed: no spread to judge it by
MIN_SAMPLES = 3


class Spread(BaseModel):
    """Median, 10th and 90th percentiles, and the number of samples."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    median: float
    p10: float
    p90: float
    n: int

    @property
    def rel_halfwidth(self) -> float:
        """Half the p10-p90 range relative to the median: the ``±x%`` a figure is good to."""
        return (self.p90 - self.p10) / 2 / abs(self.median) if self.median else math.inf

    @property
    def ratio_spread(self) -> float:
        """p90 / p10 - 1 (0 for a constant sample)."""
        return self.p90 / self.p10 - 1 if self.p10 > 0 else math.inf

    @classmethod
    def of_one(cls, x: float | None) -> Spread | None:
        """A single figure as a spread of one sample (no p10-p90 to judge a difference by)."""
        return None if x is None else cls(median=x, p10=x, p90=x, n=1)

    def scaled(self, factor: float) -> Spread:
        """The spread of ``factor · x`` (a negative factor swaps the percentiles)."""
        lo, hi = sorted((self.p10 * factor, self.p90 * factor))
        return Spread(median=self.median * factor, p10=lo, p90=hi, n=self.n)

    def inverse(self, numerator: float = 1.0) -> Spread:
        """The spread of ``numerator / x`` (a rate from durations): the percentiles swap."""
        return Spread(median=numerator / self.median, p10=numerator / self.p90, p90=numerator / self.p10, n=self.n)

    def __str__(self) -> str:
        return f"{self.median:.4g} (p10 {self.p10:.4g}, p90 {self.p90:.4g}, n={self.n})"


def quantile(sorted_xs: Sequence[float], q: float) -> float:
    """The q-quantile of an ascending sample, linear between order statistics."""
    if not sorted_xs:
        raise ValueError("quantile of an empty sample")
    pos = (len(sorted_xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def spread(xs: Sequence[float | None]) -> Spread | None:
    """The :class:`Spread` of the finite values in ``xs`` (None when there are none)."""
    s = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not s:
        return None
    return Spread(median=quantile(s, 0.5), p10=quantile(s, 0.1), p90=quantile(s, 0.9), n=len(s))


def settled_start(times: Sequence[float], minimum: int, tolerance: float = 0.25) -> int:
    """Index of the first sample to measure: warm-up excluded by rule.

    The first ``minimum`` samples are always excluded. The settled level is the median of the second
    half of the rest; further leading samples slower than ``(1 + tolerance) ×`` that level are excluded
    too (a cold cache, a lazy allocation, an autotuner), but never more than half of the rest, so a
    steadily slowing run is measured rather than discarded.
    """
    start = min(max(minimum, 0), len(times))
    rest = list(times[start:])
    if len(rest) < 4:
        return start
    level = quantile(sorted(rest[len(rest) // 2:]), 0.5)
    extra = 0
    while extra < len(rest) // 2 and rest[extra] > level * (1 + tolerance):
        extra += 1
    return start + extra


def rel_error(value: float | None, reference: float | None) -> float | None:
    """(value - reference) / reference; None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return (value - reference) / reference


class Comparison(BaseModel):
    """How ``a`` relates to ``b``: their medians' relative difference and whether it beats the noise."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rel_diff: float  # (a - b) / b, medians
    significant: bool  # p10-p90 ranges disjoint and both sides have MIN_SAMPLES samples
    noise: float  # the larger relative half-width of the two sides: the "±x%" of "within noise"
    reason: str  # why not significant ("" when it is)

    def describe(self, more: str = "higher", less: str = "lower") -> str:
        """``+12.3% higher`` or ``within noise (±4.1%)``."""
        if self.reason.startswith("not called"):
            return self.reason
        if not self.significant:
            return f"within noise (±{pct(self.noise, 1, signed=False)})" if not self.reason else f"not compared: {self.reason}"
        return f"{pct(self.rel_diff, 1)} ({more if self.rel_diff > 0 else less})"


def compare(a: Spread, b: Spread) -> Comparison:
    """Compare two measured spreads by the noise rule (see the module docstring)."""
    noise = max(a.rel_halfwidth, b.rel_halfwidth)
    rel = (a.median - b.median) / b.median if b.median else math.inf
    if min(a.n, b.n) < MIN_SAMPLES:
        return Comparison(rel_diff=rel, significant=False, noise=noise,
                          reason=f"n={min(a.n, b.n)} < {MIN_SAMPLES} samples, no spread to judge by")
    disjoint = a.p10 > b.p90 or b.p10 > a.p90
    return Comparison(rel_diff=rel, significant=disjoint, noise=noise, reason="")
