"""Findings: short sentences computed from the results, never written by hand.

Each function returns zero or more sentences; one that lacks its data returns none.
"""
from __future__ import annotations

from collections import defaultdict

from scaletool.report.data import ResultsSet, Row
from scaletool.report.tables import (
    CLAIM_STATED,
    claim_figures,
    claim_rows,
    claim_table,
    count_table,
    decode_table,
    rel,
    scaling_groups,
    train_table,
)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _where(rs: ResultsSet, r: Row) -> str:
    return f"{r.source}: {r.label}" if rs.multi else r.label


def throughput_crossover(rs: ResultsSet) -> list[str]:
    """Where MLA's training tokens/s falls below MHA's, per results dir and FFN width.

    Points are compared within one FFN width, unless the sweep matched parameter counts (then the
    width is the solver's and every point of the results dir is compared).
    """
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rs.ok("train"):
        if r.result.get("tokens_per_s"):
            width = None if r.record.get("match_params") else r.intermediate_size
            groups[(r.source, width, r.engine, r.world_size)].append(r)
    engines = {k[2:] for k in groups}
    out = []
    for (source, width, engine, n), rows in groups.items():
        mha = [r for r in rows if r.attention == "mha"]
        mla = sorted((r for r in rows if r.attention == "mla"), key=lambda r: r.compression_ratio)
        if not mha or not mla:
            continue
        ref = mha[0].result["tokens_per_s"]
        where = (f"{source}, " if rs.multi else "") + (f"intermediate_size {width}" if width else "equal parameters")
        if len(engines) > 1:
            where += f", {engine} on {n} GPU(s)"
        below = [r for r in mla if r.result["tokens_per_s"] < ref]
        detail = ", ".join(f"{r.compression_ratio:.2f}× (kv_lora_rank {r.kv_lora_rank}): "
                           f"{_pct(rel(r.result['tokens_per_s'], ref))}" for r in mla)
        head = f"Training throughput, MLA against MHA ({ref:,.0f} tokens/s; {where}): "
        if not below:
            out.append(head + f"MLA stays at or above MHA at every compression ratio measured ({detail}).")
        elif len(below) == len(mla):
            out.append(head + f"MLA is below MHA at every compression ratio measured ({detail}).")
        elif below == mla[:len(below)]:
            r = below[-1]
            out.append(head + f"MLA falls below MHA at compression ratios ≤ {r.compression_ratio:.2f}× "
                       f"(kv_lora_rank ≥ {r.kv_lora_rank}) ({detail}).")
        elif below == mla[-len(below):]:
            r = below[0]
            out.append(head + f"MLA falls below MHA at compression ratios ≥ {r.compression_ratio:.2f}× "
                       f"(kv_lora_rank ≤ {r.kv_lora_rank}) ({detail}).")
        else:
            out.append(head + f"no single crossover; MLA is below MHA at "
                       f"{', '.join(f'{r.compression_ratio:.2f}×' for r in below)} ({detail}).")
    return out


def scaling(rs: ResultsSet) -> list[str]:
    """Scaling efficiency per engine and attention type, from the scaling table's groups."""
    out = []
    for (attention, rank, _width, engine), by_n in sorted(scaling_groups(rs).items(), key=lambda kv: str(kv[0])):
        base = by_n[1].result["tokens_per_s"]
        eff = ", ".join(f"{n} GPUs {by_n[n].result['tokens_per_s'] / n / base:.0%}" for n in sorted(by_n) if n > 1)
        name = attention + (f" (kv_lora_rank {rank})" if rank else "")
        out.append(f"Scaling efficiency of {name} under {engine} (per-GPU tokens/s against one GPU): {eff}.")
    return out


def rule_of_thumb(rs: ResultsSet) -> list[str]:
    """The error of 12·d²·L against the exact non-embedding count, per FFN width."""
    rows = rs.ok("estimate") or rs.ok("count")
    by_width: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        err = r.result.get("params", {}).get("rule_of_thumb_rel_error")
        if err is not None:
            by_width[(r.intermediate_size, r.recipe.model.d_model)].append(err)
    if not by_width:
        return []
    parts = []
    for (width, d), errs in sorted(by_width.items()):
        lo, hi = min(errs), max(errs)
        span = _pct(lo) if abs(hi - lo) < 5e-4 else f"{_pct(lo)} to {_pct(hi)}"
        parts.append(f"intermediate_size {width} ({width / d:.2g}·d): {span}")
    return ["12·d²·L against the exact non-embedding parameter count (across attention types): "
            + "; ".join(parts) + ". The rule assumes a 4·d GELU FFN and full MHA; SwiGLU, other widths, "
            "GQA and MLA move it."]


def kv_savings(rs: ResultsSet) -> list[str]:
    mla = [r for r in rs.ok("estimate") if r.attention == "mla"]
    if not mla:
        return []
    ratios = sorted({round(r.compression_ratio, 2) for r in mla})
    ranks = sorted({r.kv_lora_rank for r in mla})
    return [f"MLA's KV cache per token is {ratios[0]:.2f}×" + (f" to {ratios[-1]:.2f}×" if len(ratios) > 1 else "")
            + " smaller than the MHA with the same heads and head dims (kv_lora_rank "
            + ", ".join(map(str, ranks)) + ")."]


def worst_errors(rs: ResultsSet) -> list[str]:
    """The worst relative error of each measured-against-analytic comparison in the tables."""
    checks = [(count_table, "measured vs exact", "parameters, measured against the exact count"),
              (count_table, "FlopCounterMode vs analytic", "FlopCounterMode FLOPs against the analytic (full)"),
              (count_table, "fvcore vs analytic", "fvcore FLOPs against the analytic (full)"),
              (count_table, "6·N·T vs measured", "6·N·T against the measured training FLOPs"),
              (decode_table, "measured vs analytic", "measured KV-cache bytes against the analytic"),
              (train_table, "peak vs analytic", "peak training memory against the analytic estimate")]
    out = []
    tables = {}
    for build, col, what in checks:
        t = tables.setdefault(build, build(rs))
        if t is None:
            continue
        errs = t.column(col)
        idx = [i for i, e in enumerate(errs) if e is not None]
        if not idx:
            continue
        i = max(idx, key=lambda j: abs(errs[j]))
        if errs[i] == 0:
            out.append(f"Exact in all {len(idx)} compared: {what}.")
            continue
        where = (f"{t.column('source')[i]}: " if rs.multi else "") + t.column("point")[i]
        out.append(f"Worst {what}: {_pct(errs[i])} ({where}; {len(idx)} compared).")
    return out


def claim_check(rs: ResultsSet) -> list[str]:
    if claim_table(rs) is None:
        return []
    out = []
    for r in claim_rows(rs):
        c = claim_figures(r)
        m = r.recipe.model
        stated = ""
        if c["is_document_config"]:
            stated = (f"The design document states {CLAIM_STATED['traditional']:,} vs {CLAIM_STATED['mla']:,}, "
                      f"a {CLAIM_STATED['saving']:,}× saving; its own formula n_heads·seq²·head_dim gives "
                      f"{c['claim_traditional']:,}, and kv_lora_rank·seq + n_heads·head_dim gives "
                      f"{c['claim_mla']:,}. ")
        where = (f"{r.source}: " if rs.multi else "") + f"kv_lora_rank={r.kv_lora_rank}"
        out.append(f"{where}: {stated}The comparison mixes an attention-score count with a cache size. "
                   f"Real figures at seq_len {r.recipe.seq_len}, {m.n_layers} layers: the KV cache is "
                   f"{c['mla_cache']:,} elements for MLA against {c['mha_cache']:,} for the MHA-equivalent, a "
                   f"{c['real_saving']:.2f}× saving, not {c['claim_saving']:,.0f}×; the naive score matrix "
                   f"(H·T² = {c['scores']:,} elements per layer) is the same for both and fused SDPA never stores it.")
    return out


def budget(rs: ResultsSet) -> list[str]:
    mps = [r.record["match_params"] for r in rs.rows if r.record.get("match_params")]
    if not mps:
        return []
    worst = max(mps, key=lambda m: abs(m["rel_error"]))
    values = sorted({m["value"] for m in mps})
    return [f"Equal budget: {worst['key']} solved per point to {', '.join(map(str, values))}; every point is within "
            f"{100 * abs(worst['rel_error']):.2f}% of the target {worst['target']:,} {worst['params']} parameters."]


def all_findings(rs: ResultsSet) -> list[str]:
    out: list[str] = []
    for f in (kv_savings, rule_of_thumb, throughput_crossover, scaling, budget, worst_errors, claim_check):
        out += f(rs)
    n_bad = sum(r.status not in ("ok", "skipped") for r in rs.rows)
    if n_bad:
        out.append(f"{n_bad} run(s) failed (error, oom or timeout); see the last table.")
    return out
