"""How many GPUs of one card each engine needs before a recipe's training step fits.

A model that does not fit one GPU is better told "needs at least 16 GPUs under FSDP" than "9.8 TiB per
GPU". Per engine of the estimate's table (with and without full activation checkpointing), the smallest
world size whose peak per GPU (:func:`~scaletool.analytic.memory.training_memory`, the same figure as the
memory table) fits the card with the allocator's reserve (:func:`~scaletool.analytic.step.fits`).
Sharded memory only falls as the world grows, so a doubling search then a bisection finds it; an engine
that replicates the model states (DDP) either fits at 2 GPUs or never does.
"""
from __future__ import annotations

from scaletool.analytic.memory import table_layouts, training_memory
from scaletool.analytic.step import fits

#: the largest world size searched; an engine that needs more is reported as not fitting
MAX_GPUS = 2**16


def gpus_needed(recipe, card_bytes: float, max_gpus: int = MAX_GPUS) -> list[dict]:
    """Per distributed engine of the table and checkpointing (``none``, ``full``): ``{"label",
    "activation_checkpointing", "gpus"}``, ``gpus`` the smallest world size that fits, or None past
    ``max_gpus``."""
    out = []
    for label, engine, kind, ac, inp, settings in table_layouts(recipe):
        if not kind.distributed:
            continue

        def ok(n: int, engine=engine, settings=settings, inp=inp) -> bool:
            return fits(training_memory(recipe.model, engine, n, inp, settings)["total_bytes"], card_bytes)[0]

        out.append({"label": label, "activation_checkpointing": ac, "gpus": _smallest(ok, max_gpus)})
    return out


def _smallest(ok, limit: int) -> int | None:
    """The smallest n in [2, limit] with ok(n), assuming ok stays true once true; None if ok(limit) is false."""
    hi = 2
    while not ok(hi):
        if hi >= limit:
            return None
        hi = min(2 * hi, limit)
    lo = hi // 2  # ok(lo) is false (or lo < 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid >= 2 and ok(mid):
            hi = mid
        else:
            lo = mid
    return hi
