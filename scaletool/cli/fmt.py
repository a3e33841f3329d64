"""Human-readable numbers for tables."""
from __future__ import annotations


def si(x: float | None, unit: str = "", digits: int = 3) -> str:
    """1.23e9 -> '1.23 G'."""
    if x is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g} {prefix}{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()


def gib(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 2**30:
        return f"{x / 2**30:.2f} GiB"
    if abs(x) >= 2**20:
        return f"{x / 2**20:.1f} MiB"
    return f"{x / 2**10:.1f} KiB"


def pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:+.{digits}f}%"
