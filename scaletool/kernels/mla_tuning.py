"""The committed table of tuned launch configurations of the fused MLA decode kernel.

``mla_decode_tuned.json`` beside this file (written by ``benchmarks/scripts/decode_tune.py
--write-table scaletool/kernels/mla_decode_tuned.json``, named on purpose and committed) holds, per card
name and attention shape (heads, kv_lora_rank, rope width, dtype),
the fastest configuration measured at each (context, batch) point of the sweep. :func:`lookup`
answers a call with the entry of the nearest context, then the nearest batch, both on a log2 scale;
no table, another card or another shape answers None and the kernel keeps its heuristic. Pure
Python (no torch): the table is data.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

TABLE = Path(__file__).with_name("mla_decode_tuned.json")
CONFIG_KEYS = ("block_s", "num_warps", "num_stages", "programs_per_sm", "min_split", "max_splits", "n_splits",
               "direct", "max_registers")
TABLE_VERSION = 1


@functools.cache
def load(path: str = str(TABLE)) -> tuple[dict, ...]:
    """The table's shape groups (one per card and shape); empty when the file is absent or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return ()
    if not isinstance(data, dict) or data.get("version") != TABLE_VERSION or not isinstance(data.get("tables"), list):
        return ()
    return tuple(t for t in data["tables"] if isinstance(t, dict) and isinstance(t.get("entries"), list))


def _nearest(values, want: int):
    return min(values, key=lambda v: (abs(math.log2(v) - math.log2(max(want, 1))), v))


def lookup(card: str, heads: int, kv_lora_rank: int, rope: int, dtype: str, batch: int, context: int,
           path: str = str(TABLE)) -> dict | None:
    """The tuned configuration (keyword arguments of ``KernelConfig``) for this call, or None."""
    for t in load(path):
        if (t.get("card"), t.get("heads"), t.get("kv_lora_rank"), t.get("rope"), t.get("dtype")) != \
                (card, heads, kv_lora_rank, rope, dtype):
            continue
        entries = [e for e in t["entries"] if isinstance(e.get("context"), int) and isinstance(e.get("batch"), int)
                   and e["context"] > 0 and e["batch"] > 0 and isinstance(e.get("config"), dict)]
        if not entries:
            return None
        ctx = _nearest({e["context"] for e in entries}, context)
        row = [e for e in entries if e["context"] == ctx]
        b = _nearest({e["batch"] for e in row}, batch)
        cfg = next(e["config"] for e in row if e["batch"] == b)
        return {k: v for k, v in cfg.items() if k in CONFIG_KEYS}
    return None


def table_from_sweep(sweep: dict) -> dict:
    """The table (``TABLE``'s format) from a ``decode_tune.py`` result: each point's best configuration."""
    c = sweep["card"]
    shape = sweep["shape"]
    entries = [{"context": p["context"], "batch": p["batch"], "config": p["best"]["config"],
                "hbm_fraction_of_copy": p["best"].get("hbm_fraction_of_copy"),
                "median_s": p["best"]["time_s"]["median"], "swept": sweep.get("date")}
               for p in sweep["points"] if p.get("best")]
    return {"version": TABLE_VERSION,
            "source": f"benchmarks/scripts/decode_tune.py --write-table, from a sweep of {sweep.get('date', '?')}",
            "tables": [{"card": c["name"], "heads": shape["heads"], "kv_lora_rank": shape["kv_lora_rank"],
                        "rope": shape["rope"], "dtype": shape["dtype"], "versions": c.get("versions", {}),
                        "entries": sorted(entries, key=lambda e: (e["context"], e["batch"]))}]}


def merge_tables(old: dict | None, new: dict) -> dict:
    """``new``'s entries replace those of ``old`` at the same card, shape, context and batch; the other
    entries and shape groups stay (a sweep of some points keeps the rest). A group's ``versions`` are the
    newest sweep's; each entry says when it was swept."""
    key = lambda t: tuple(t.get(k) for k in ("card", "heads", "kv_lora_rank", "rope", "dtype"))  # noqa: E731
    point = lambda e: (e.get("context"), e.get("batch"))  # noqa: E731
    groups = {key(t): t for t in (old or {}).get("tables", []) if isinstance(t, dict)} \
        if (old or {}).get("version") == TABLE_VERSION else {}
    for t in new["tables"]:
        prev = groups.get(key(t))
        if prev is not None and isinstance(prev.get("entries"), list):
            fresh = {point(e) for e in t["entries"]}
            kept = [e for e in prev["entries"] if isinstance(e, dict) and point(e) not in fresh]
            t = {**t, "entries": sorted(kept + t["entries"], key=lambda e: (e["context"], e["batch"]))}
        groups[key(t)] = t
    return {**new, "tables": list(groups.values())}
