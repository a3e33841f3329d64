"""Report tables: raw values plus a kind per column, so markdown, HTML and tests share one source.

Every relative error is (value − reference) / reference, with the reference named in the column.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scaletool import analytic
from scaletool.fmt import gib, pct, si
from scaletool.report.data import ResultsSet, Row

# The price-prediction design document's claim (SEEDS.md §1), for the check in :func:`claim_table`.
CLAIM_CONFIG = {"n_heads": 8, "seq_len": 180, "head_dim": 64, "kv_lora_rank": 256}
CLAIM_STATED = {"traditional": 663_552_000, "mla": 46_592, "saving": 14_000}


@dataclass
class Column:
    name: str
    kind: str = "text"  # text | int | float | pct | share | bytes | flops | ratio | rate


@dataclass
class Table:
    key: str
    title: str
    columns: list[Column]
    rows: list[list[Any]] = field(default_factory=list)
    note: str = ""

    def formatted(self) -> list[list[str]]:
        return [[fmt(v, c.kind) for v, c in zip(row, self.columns)] for row in self.rows]

    def column(self, name: str) -> list[Any]:
        i = [c.name for c in self.columns].index(name)
        return [r[i] for r in self.rows]


def fmt(v: Any, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "int":
        return f"{int(v):,}"
    if kind == "float":
        return f"{v:.4g}"
    if kind == "pct":
        return pct(v)
    if kind == "share":
        return f"{100 * v:.1f}%"
    if kind == "bytes":
        return gib(v)
    if kind == "flops":
        return si(v, "FLOP", 4)
    if kind == "ratio":
        return f"{v:.2f}×"
    if kind == "rate":
        return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
    return str(v)


def rel(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return (value - reference) / reference


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def _table(rs: ResultsSet, key: str, title: str, cols: list[Column], rows: list[Row],
           cells: Callable[[Row], list[list[Any]]], note: str = "") -> Table | None:
    """Rows sorted by source then point order; a ``source`` column when several results dirs are shown."""
    if not rows:
        return None
    lead = [Column("source")] if rs.multi else []
    t = Table(key, title, lead + [Column("point")] + cols, note=note)
    for r in sorted(rows, key=lambda r: ([s["label"] for s in rs.sources].index(r.source), r.record["index"])):
        for cell_row in cells(r):
            t.rows.append(([r.source] if rs.multi else []) + [r.label] + cell_row)
    return t


def estimate_table(rs: ResultsSet) -> Table | None:
    def cells(r: Row):
        e = r.result
        p, kv, f = e.get("params", {}), e.get("kv_cache", {}), _get(e, "flops", "per_token") or {}
        return [[r.attention, r.kv_lora_rank, r.intermediate_size, p.get("total"), p.get("non_embedding"),
                 p.get("rule_of_thumb_12d2L"), p.get("rule_of_thumb_rel_error"), kv.get("bytes_per_token"),
                 kv.get("compression_ratio"), f.get("train"), f.get("dense_6N"), rel(f.get("dense_6N"), f.get("train")),
                 _get(e, "memory", "recipe", "total_bytes")]]
    cols = [Column("attention"), Column("kv_lora_rank", "int"), Column("intermediate_size", "int"),
            Column("params (exact)", "int"), Column("non-embedding", "int"), Column("12·d²·L", "int"),
            Column("12·d²·L vs non-emb.", "pct"), Column("KV bytes/token", "int"), Column("KV compression", "ratio"),
            Column("train FLOPs/token", "flops"), Column("6·N FLOPs/token", "flops"), Column("6·N vs train", "pct"),
            Column("memory/GPU (analytic)", "bytes")]
    return _table(rs, "estimate", "Analytic estimate", cols, rs.ok("estimate"), cells,
                  "train FLOPs/token includes attention (causal for lm, full for regression); "
                  "KV compression is the MHA-equivalent cache over the cached elements.")


def count_table(rs: ResultsSet) -> Table | None:
    def cells(r: Row):
        c = r.result
        p, f = c.get("params", {}), c.get("flops", {})
        a, fc, fv = f.get("analytic", {}), f.get("flop_counter", {}), f.get("fvcore", {})
        return [[p.get("measured"), p.get("analytic"), rel(p.get("measured"), p.get("analytic")),
                 p.get("rule_of_thumb_rel_error"), fc.get("train"), a.get("train_full"),
                 rel(fc.get("train"), a.get("train_full")), fv.get("forward"), a.get("forward_full"),
                 rel(fv.get("forward"), a.get("forward_full")), a.get("train_6N"), rel(a.get("train_6N"), fc.get("train"))]]
    cols = [Column("params measured", "int"), Column("params exact", "int"), Column("measured vs exact", "pct"),
            Column("12·d²·L vs non-emb.", "pct"), Column("FlopCounterMode fwd+bwd", "flops"),
            Column("analytic fwd+bwd (full)", "flops"), Column("FlopCounterMode vs analytic", "pct"),
            Column("fvcore fwd", "flops"), Column("analytic fwd (full)", "flops"), Column("fvcore vs analytic", "pct"),
            Column("6·N·T", "flops"), Column("6·N·T vs measured", "pct")]
    return _table(rs, "count", "Measured parameters and FLOPs", cols, rs.ok("count"), cells,
                  "FLOPs for one batch; the counters see all T² attention scores, so the analytic column "
                  "uses the full convention. 6·N·T leaves attention out.")


def train_analytic_memory(r: Row) -> int | None:
    """The analytic peak the train run compared itself with, else the recipe's own estimate."""
    m = _get(r.result, "metrics", "memory/analytic_bytes")
    if m is not None:
        return m
    ws = _get(r.result, "environment", "world_size") or r.recipe.parallel.world_size
    return analytic.recipe_memory(r.recipe, ws)["total_bytes"]


def train_table(rs: ResultsSet) -> Table | None:
    def cells(r: Row):
        s = r.result
        peak, est = s.get("peak_memory_bytes"), train_analytic_memory(r)
        return [[r.attention, r.kv_lora_rank, r.intermediate_size, r.engine, r.world_size, s.get("tokens_per_s"),
                 s.get("mfu"), peak, est, rel(peak, est), s.get("loss_first"), s.get("loss_last"),
                 s.get("measured_steps")]]
    cols = [Column("attention"), Column("kv_lora_rank", "int"), Column("intermediate_size", "int"), Column("engine"),
            Column("GPUs", "int"), Column("tokens/s", "rate"), Column("MFU", "share"), Column("peak memory", "bytes"),
            Column("analytic memory", "bytes"), Column("peak vs analytic", "pct"), Column("loss first", "float"),
            Column("loss last", "float"), Column("measured steps", "int")]
    return _table(rs, "train", "Training", cols, rs.ok("train"), cells,
                  "Warm-up steps are excluded from tokens/s and MFU; MFU is blank where the device has no "
                  "known peak (CPU). Peak memory is the allocator's peak.")


def scaling_groups(rs: ResultsSet) -> dict[tuple, dict[int, Row]]:
    """Train runs of the same model and engine at several world sizes: {(attention, kv_lora_rank,
    intermediate_size, engine): {world_size: row}}; only groups with a one-rank baseline and more."""
    groups: dict[tuple, dict[int, Row]] = {}
    for r in rs.ok("train"):
        if r.world_size and r.result.get("tokens_per_s"):
            key = (r.attention, r.kv_lora_rank, r.intermediate_size, r.engine)
            groups.setdefault(key, {})[r.world_size] = r
    return {k: v for k, v in groups.items() if 1 in v and len(v) > 1}


def scaling_table(rs: ResultsSet) -> Table | None:
    """Per-GPU throughput at N ranks against one rank of the same engine: the scaling efficiency."""
    groups = scaling_groups(rs)
    if not groups:
        return None
    t = Table("scaling", "Scaling across GPUs",
              [Column("attention"), Column("kv_lora_rank", "int"), Column("intermediate_size", "int"),
               Column("engine"), Column("GPUs", "int"), Column("tokens/s", "rate"), Column("tokens/s per GPU", "rate"),
               Column("MFU", "share"), Column("scaling efficiency", "share")],
              note="Scaling efficiency is per-GPU tokens/s at N GPUs over the same engine's tokens/s on one GPU "
                   "(1.0 = linear). Compare only runs from the same machine.")
    for (attention, rank, width, engine), by_n in sorted(groups.items(), key=lambda kv: str(kv[0])):
        base = by_n[1].result["tokens_per_s"]
        for n in sorted(by_n):
            s = by_n[n].result
            t.rows.append([attention, rank, width, engine, n, s["tokens_per_s"], s["tokens_per_s"] / n, s.get("mfu"),
                           s["tokens_per_s"] / n / base])
    return t


def moe_table(rs: ResultsSet) -> Table | None:
    """Mixture-of-experts points: total vs active parameters (analytic, from the recipe) beside the
    training throughput and expert load of the point's train run, where there is one."""
    trained = {(r.source, r.record["point_id"]): r.result for r in rs.ok("train")}
    seen, rows = set(), []
    for r in rs.rows:
        key = (r.source, r.record["point_id"])
        if r.ok and r.recipe.model.ffn == "moe" and key not in seen:
            seen.add(key)
            rows.append(r)

    def cells(r: Row):
        m, p = r.recipe.model, analytic.param_counts(r.recipe.model)
        t = trained.get((r.source, r.record["point_id"]), {})
        return [[m.n_routed_experts, m.num_experts_per_tok, p["total"], p["active"], p["active"] / p["total"],
                 analytic.flops_per_token(m, r.recipe.seq_len)["train"], t.get("tokens_per_s"), t.get("mfu"),
                 _get(t, "metrics", "moe/imbalance_ratio_max"), _get(t, "metrics", "moe/dropped_fraction")]]
    cols = [Column("n_routed_experts", "int"), Column("top-k", "int"), Column("params total", "int"),
            Column("params active", "int"), Column("active share", "share"), Column("train FLOPs/token", "flops"),
            Column("tokens/s", "rate"), Column("MFU", "pct"), Column("expert imbalance (max/mean)", "float"),
            Column("dropped fraction", "share")]
    return _table(rs, "moe", "Mixture of experts: active vs total parameters", cols, rows, cells,
                  "Active = the parameters one token uses (its top-k routed experts, shared experts, router and "
                  "dense parts); FLOPs/token count the active experts (the MFU convention). Imbalance and drops "
                  "are the last training step's, over all ranks.")


def decode_points(r: Row) -> list[dict]:
    """The measured (batch, context) points of a decode result."""
    res = r.record.get("result")
    pts = res if isinstance(res, list) else (res or {}).get("points", [])
    return [p for p in pts if isinstance(p, dict)]


def decode_table(rs: ResultsSet) -> Table | None:
    def cells(r: Row):
        out = []
        for p in decode_points(r):
            meas, ana = p.get("kv_cache_bytes_measured"), p.get("kv_cache_bytes_analytic")
            # the cache is allocated for the prompt plus the decoded tokens (max_len)
            tokens = (p.get("batch") or 0) * (p.get("max_len") or p.get("context") or 0)
            out.append([p.get("attention", r.attention), p.get("batch"), p.get("context"), meas, ana, rel(meas, ana),
                        meas / tokens if meas is not None and tokens else None, p.get("decode_tokens_per_s")])
        return out
    cols = [Column("attention"), Column("batch", "int"), Column("context", "int"), Column("KV cache measured", "bytes"),
            Column("KV cache analytic", "bytes"), Column("measured vs analytic", "pct"),
            Column("KV bytes/token measured", "int"), Column("decode tokens/s", "rate")]
    return _table(rs, "decode", "Decoding", cols, rs.ok("decode"), cells)


def budget_table(rs: ResultsSet) -> Table | None:
    seen, rows = set(), []
    for r in rs.rows:
        if r.record.get("match_params") and (r.source, r.record["point_id"]) not in seen:
            seen.add((r.source, r.record["point_id"]))
            rows.append(r)

    def cells(r: Row):
        mp = r.record["match_params"]
        return [[mp["key"], mp["base_value"], mp["value"], mp["target"], mp["achieved"], mp["rel_error"]]]
    cols = [Column("adjusted key"), Column("base value", "int"), Column("solved value", "int"),
            Column("target params", "int"), Column("achieved params", "int"), Column("achieved vs target", "pct")]
    return _table(rs, "budget", "Equal parameter budget", cols, rows, cells)


def failures_table(rs: ResultsSet) -> Table | None:
    from scaletool.sweep.runner import headline

    def cells(r: Row):
        return [[r.mode, r.status, headline(r.record)]]
    rows = [r for r in rs.rows if r.status != "ok"]
    return _table(rs, "failures", "Skipped and failed runs", [Column("mode"), Column("status"), Column("reason")],
                  rows, cells)


def breakdown_table(rs: ResultsSet, top: int = 12) -> Table | None:
    """Category time shares of the runs that were profiled (see data.breakdown_of)."""
    runs = [(r, b) for r in rs.rows if r.status == "ok" for b in [r.breakdown()] if b]
    if not runs:
        return None
    names: dict[str, float] = {}
    for _, b in runs:
        for k, v in b.items():
            names[k] = max(names.get(k, 0.0), v)
    order = sorted(names, key=lambda k: -names[k])[:top]
    heads = [f"{r.source}: {r.label} ({r.mode})" if rs.multi else f"{r.label} ({r.mode})" for r, _ in runs]
    t = Table("breakdown", "Profiler time breakdown", [Column("category")] + [Column(h, "share") for h in heads],
              note="Share of the profiled step time per category (profile/breakdown.json of each run).")
    for name in order:
        t.rows.append([name] + [b.get(name) for _, b in runs])
    return t


def claim_table(rs: ResultsSet) -> Table | None:
    """SEEDS.md §1's "663,552,000 vs 46,592, a 14,000× saving" set against the real figures.

    The claim's formulas are n_heads·seq²·head_dim ("traditional") and kv_lora_rank·seq +
    n_heads·head_dim ("MLA"). The real figures per sequence, all layers: the KV cache MLA keeps
    (latent + shared RoPE key), the MHA-equivalent cache, and the H·T² score matrix a naive attention
    materialises per layer (the same for MLA and MHA).
    """
    rows = claim_rows(rs)
    if not rows:
        return None
    t = Table("claim", "The price transformer's attention-memory claim, checked",
              ([Column("source")] if rs.multi else []) + [Column("point"), Column("quantity"),
                                                          Column("claim's formula"), Column("real")],
              note="Real figures per sequence at the recipe's seq_len and dtype, all layers unless marked.")
    for r in rows:
        c = claim_figures(r)
        stated = f" (document: {CLAIM_STATED['traditional']:,})" if c["is_document_config"] else ""
        b = r.recipe.model.dtype_bytes
        t.rows += [([r.source] if rs.multi else []) + [f"kv_lora_rank={r.kv_lora_rank}"] + row for row in (
            ["traditional: n_heads·seq²·head_dim", f"{c['claim_traditional']:,}{stated}", ""],
            ["MLA: kv_lora_rank·seq + n_heads·head_dim", f"{c['claim_mla']:,}", ""],
            ["saving", f"{c['claim_saving']:,.0f}×", f"{c['real_saving']:.2f}× (KV cache)"],
            ["MLA KV cache (latent + RoPE key)", "", f"{c['mla_cache']:,} elements, {gib(c['mla_cache'] * b)}"],
            ["MHA-equivalent KV cache", "", f"{c['mha_cache']:,} elements, {gib(c['mha_cache'] * b)}"],
            ["naive score matrix H·T², one layer (MLA = MHA)", "", f"{c['scores']:,} elements, {gib(c['scores'] * b)}"],
        )]
    return t


def claim_rows(rs: ResultsSet) -> list[Row]:
    """One MLA regression estimate per distinct attention shape: the claim's figures do not depend on
    the FFN or anything else a sweep may vary alongside."""
    seen, out = set(), []
    for r in rs.ok("estimate"):
        m = r.recipe.model if r.recipe else None
        if r.attention != "mla" or m.task != "regression":
            continue
        key = (r.source, m.n_heads, m.n_layers, r.recipe.seq_len, m.head_dim, m.kv_lora_rank, m.qk_nope_head_dim,
               m.qk_rope_head_dim, m.v_head_dim, m.dtype)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def claim_figures(r: Row) -> dict:
    m, T = r.recipe.model, r.recipe.seq_len
    kv = analytic.kv_cache(m)
    trad = m.n_heads * T * T * m.head_dim
    mla = m.kv_lora_rank * T + m.n_heads * m.head_dim
    mla_cache = kv["elements_per_token_per_layer"] * T * m.n_layers
    mha_cache = kv["mha_equivalent_bytes_per_token"] // m.dtype_bytes * T
    cfg = {"n_heads": m.n_heads, "seq_len": T, "head_dim": m.head_dim, "kv_lora_rank": m.kv_lora_rank}
    return {"claim_traditional": trad, "claim_mla": mla, "claim_saving": trad / mla, "mla_cache": mla_cache,
            "mha_cache": mha_cache, "real_saving": mha_cache / mla_cache, "scores": m.n_heads * T * T,
            "is_document_config": cfg == CLAIM_CONFIG}


def all_tables(rs: ResultsSet) -> list[Table]:
    builders = (estimate_table, count_table, train_table, scaling_table, moe_table, decode_table, budget_table, claim_table,
                breakdown_table, failures_table)
    return [t for t in (b(rs) for b in builders) if t is not None]
