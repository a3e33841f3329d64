"""``results.csv``: one row per point and mode (a decode run: one per measured point), from the typed rows.

Columns are named like metric keys, namespace and unit (``throughput/tokens_per_s``); a timed figure
is its median with ``_p10``, ``_p90`` and ``_n`` beside it. The identity columns come first, then the
sweep's varied keys (``values.model.kv_lora_rank``), then each mode's figures in the order first seen.
Text that a spreadsheet would run as a formula is quoted.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from scaletool.fmt import write_atomic
from scaletool.report.data import ResultsSet, Row
from scaletool.report.tables import decode_points, flops, train_analytic_memory
from scaletool.stats import Spread

IDENTITY = ["source", "point", "mode", "status", "reason", "repeat", "runs", "attention", "n_kv_heads", "kv_lora_rank",
            "intermediate_size", "engine", "world_size", "kv_cache/compression_vs_same_dims_mha",
            "kv_cache/compression_vs_mha_point"]


def _spread(name: str, s: Spread | None) -> dict[str, Any]:
    if s is None:
        return {}
    return {name: s.median, f"{name}_p10": s.p10, f"{name}_p90": s.p90, f"{name}_n": s.n}


def _identity(rs: ResultsSet, r: Row) -> dict[str, Any]:
    from scaletool.sweep.runner import headline

    rec = r.record
    out = {"source": r.source, "point": r.label, "mode": r.mode, "status": r.status,
           "reason": headline(rec.model_dump()) or None, "repeat": rec.repeat if r.status != "ok" else None,
           "runs": r.repeats if r.ok else None}
    if r.recipe is not None:
        out.update({"attention": r.attention, "n_kv_heads": r.recipe.model.n_kv_heads if r.attention == "gqa" else None,
                    "kv_lora_rank": r.kv_lora_rank, "intermediate_size": r.intermediate_size, "engine": r.engine,
                    "world_size": r.world_size, "kv_cache/compression_vs_same_dims_mha": r.compression_ratio,
                    "kv_cache/compression_vs_mha_point": rs.kv_vs_mha_point(r)})
    for k, v in rec.values.items():
        out[f"values.{k}"] = json.dumps(v) if isinstance(v, (dict, list)) else v
    return out


def _estimate(r: Row) -> dict[str, Any]:
    e = r.result
    p, f = e.params, e.flops.per_token
    return {"params/total": p.total, "params/non_embedding": p.non_embedding,
            "params/rule_of_thumb_12d2L": p.rule_of_thumb_12d2L, "params/rule_of_thumb_rel_error": p.rule_of_thumb_rel_error,
            "kv_cache/bytes_per_token": e.kv_cache.bytes_per_token, "flops/train_per_token": flops(f.get("train")),
            "flops/dense_6N_per_token": flops(f.get("dense_6N")), "memory/analytic_total_bytes": e.memory.recipe.total_bytes}


def _count(r: Row) -> dict[str, Any]:
    p, f = r.result.params, r.result.flops
    return {"params/measured": p.measured, "params/exact": p.total, "flops/flop_counter_train": f.flop_counter.train,
            "flops/analytic_train_full": f.analytic.get("train_full"), "flops/train_6N": f.analytic.get("train_6N"),
            "flops/fvcore_forward": f.fvcore.forward if f.fvcore else None,
            "flops/analytic_forward_full": f.analytic.get("forward_full")}


def _train(r: Row) -> dict[str, Any]:
    s = r.result
    return {**_spread("throughput/tokens_per_s", r.across(lambda t: t.rate)),
            "flops/mfu_causal": r.median(lambda t: t.mfu), "flops/mfu_full_attention": r.median(lambda t: t.mfu_full_attention),
            "memory/peak_allocated_bytes": s.peak_memory_bytes, "memory/analytic_bytes": train_analytic_memory(r),
            "loss/first": s.loss_first, "loss/last": s.loss_last, "steps/measured": s.steps_measured,
            "steps/warmup_excluded": s.warmup_steps_excluded, "threads": s.threads}


def csv_rows(rs: ResultsSet) -> list[dict[str, Any]]:
    """One row per (results dir, point, mode); a decode run gives one row per measured point."""
    rows = []
    for r in sorted(rs.rows, key=rs.order):
        base = _identity(rs, r)
        if not r.ok:
            rows.append(base)
        elif r.mode == "decode":
            for m in decode_points(r):
                p = m.point
                rows.append({**base, "decode/batch": p.batch, "decode/context": p.context,
                             "kv_cache/measured_bytes": p.kv_cache_bytes_measured,
                             "kv_cache/analytic_bytes": p.kv_cache_bytes_analytic,
                             **_spread("decode/tokens_per_s", m.decode), **_spread("prefill/tokens_per_s", m.prefill)})
        else:
            figures = {"estimate": _estimate, "count": _count, "train": _train}.get(r.mode)
            rows.append({**base, **(figures(r) if figures else {})})
    return rows


def _csv_safe(v: object) -> object:
    """Quote text a spreadsheet would run as a formula."""
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return v


def write_csv(rs: ResultsSet, path: Path) -> int:
    rows = csv_rows(rs)
    rest: dict[str, None] = {}
    for row in rows:
        rest.update((k, None) for k in row if k not in IDENTITY)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=IDENTITY + list(rest))
    w.writeheader()
    for row in rows:
        w.writerow({k: _csv_safe(v) for k, v in row.items()})
    write_atomic(path, buf.getvalue().encode())  # bytes: the csv module's \r\n line ends as written
    return len(rows)
