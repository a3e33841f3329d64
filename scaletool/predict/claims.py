"""What the step-time model claims, and what it does not: the layouts and runs kept out of its error figures.

:func:`outside` names why a run of ``calibrate --validate`` is not counted (docs/prediction.md's failure list);
:func:`outside_layout` asks the same of a layout ``estimate`` or ``plan`` predicts, so a figure the model does not
stand behind is said where it is printed.
"""
from __future__ import annotations

#: below this predicted step an eager step is the host's kernel launches, which the model does not charge
HOST_BOUND_S = 0.02

#: why a run is outside what the model claims (docs/prediction.md's failure list), in the order checked
OUTSIDE = {
    "host": f"a step predicted under {HOST_BOUND_S * 1e3:.0f} ms: the host's kernel launches, not charged, set it",
    "float8": "FP8: no calibration has an FP8 GEMM rate",
    "capacity": "MoE's capacity dispatch: its gathers and scatters are not modelled",
    "async_tp": "async tensor parallelism: not modelled (predicted as plain TP)",
    "tp_local_ops": "parallel.tp_local_ops: charged the DTensor plan's host dispatch",
    "pipeline_tp": ("TP inside pipeline stages: host-bound slots set by one host's DTensor issue time (hosts "
                    "differ up to 1.6x); a host-bound stage's fill and drain not modelled"),
    "allocator": "the card full: the allocator freed its cache and retried (recorded cudaMalloc retries), not modelled",
}


def outside(row: dict) -> str | None:
    """The key of :data:`OUTSIDE` that keeps this run out of the model's claims, or None."""
    checks = (("host", row["predicted_step_s"] < HOST_BOUND_S), ("float8", row["float8"] != "none"),
              ("capacity", row["moe_dispatch"] == "capacity"), ("async_tp", row["async_tp"]),
              ("tp_local_ops", row["tp_local_ops"]), ("pipeline_tp", row.get("pipeline_tp", False)),
              ("allocator", bool(row.get("alloc_retries"))))
    return next((key for key, hit in checks if hit), None)


def layout_fields(recipe) -> dict:
    """The recipe's settings :func:`outside` reads (a validated run's row carries them)."""
    moe = bool(recipe.model.n_moe_layers)
    p = recipe.parallel
    return {"moe_dispatch": recipe.model.moe_dispatch if moe else None, "async_tp": p.async_tp,
            "tp_local_ops": p.tp_local_ops, "pipeline_tp": p.pipeline_parallel > 1 and p.tensor_parallel > 1,
            "float8": recipe.train.float8}


def outside_layout(recipe, step_s: float | None) -> str | None:
    """The key of :data:`OUTSIDE` for a layout predicted at ``step_s`` seconds a step (None: not predicted)."""
    if step_s is None:
        return None
    return outside({**layout_fields(recipe), "predicted_step_s": step_s})


def by_reason(rows, name) -> dict[str, list[str]]:
    """The rows marked outside (their ``outside`` key), by reason: ``name(row)`` of each, in the rows' order."""
    out: dict[str, list[str]] = {}
    for row in rows:
        if row.get("outside"):
            out.setdefault(row["outside"], []).append(name(row))
    return out
