"""Findings: short sentences computed from the results, never written by hand.

Each function returns zero or more sentences; one that lacks its data returns none. A throughput or
latency finding compares medians by the noise rule (:func:`scaletool.stats.compare`): a difference is
stated only where the p10–p90 ranges of both sides are disjoint and each side has n ≥ 3; otherwise it
is "within noise (±x%)", or, with no spread recorded (results written before timing statistics, a
single run with too few steps), the finding says so and states no difference. Where a compared run
was contended (another process took the CPUs during its timed steps: ``scaletool.measure.contention``),
no difference is called ("not called: N of M runs contended") and the finding says that it rests on
contended runs. Findings from CPU timings say that they do not predict GPU behaviour.
"""
from __future__ import annotations

from collections import defaultdict

from scaletool.fmt import pct
from scaletool.report.claims import claim_findings
from scaletool.report.data import ResultsSet, Row
from scaletool.report.dynamics_findings import dynamics_findings
from scaletool.report.prediction import prediction_findings
from scaletool.report.tables import (
    count_table,
    decode_points,
    decode_table,
    fmt,
    scaling_groups,
    train_analytic_memory,
    train_table,
)
from scaletool.stats import Comparison, Spread, compare, rel_error

CPU_CAVEAT = "These are CPU timings: they do not predict GPU behaviour."
NO_SPREAD = ("not judged: fewer than 3 timing samples on a side (results written before timing statistics, or too "
             "few measured steps or runs), so no difference is stated; the tables list the medians")


def _rate(s: Spread, unit: str = "tokens/s") -> str:
    """'67,830 tokens/s (p10–p90 66,900–68,100, n=8)'."""
    if s.n < 2:
        return f"{fmt(s.median, 'rate')} {unit}, n=1"
    return f"{fmt(s.median, 'rate')} {unit}, p10–p90 {fmt(s, 'range')}, n={s.n}"


def _kv(rs: ResultsSet, r: Row) -> str:
    """'kv_lora_rank 64 (40.00× vs same-dims MHA, 32.00× vs the MHA point)'."""
    point = rs.kv_vs_mha_point(r)
    return (f"kv_lora_rank {r.kv_lora_rank} ({r.compression_ratio:.2f}× vs same-dims MHA"
            + (f", {point:.2f}× vs the MHA point" if point else "") + ")")


def _rate_of(t) -> Spread | None:
    return t.rate


def contended(*rows: Row) -> tuple[int, int]:
    """(contended runs, runs) over ``rows``' repeats."""
    counts = [r.contended_runs() for r in rows]
    return sum(c for c, _ in counts), sum(n for _, n in counts)


def gated(c: Comparison, *rows: Row) -> Comparison:
    """``c``, or no difference called where any of ``rows``' runs was contended (contention explains it)."""
    n, m = contended(*rows)
    if not n:
        return c
    return c.model_copy(update={"significant": False, "reason": f"not called: {n} of {m} runs contended"})


def contention_note(*rows: Row) -> str:
    """' This finding rests on contended runs: ...' where any of ``rows``' runs was contended, else ''."""
    n, m = contended(*rows)
    if not n:
        return ""
    return (f" This finding rests on contended runs ({n} of {m}: another process took the CPUs during their timed "
            "steps); no difference involving them is called.")


def _crossover(cmps: list[tuple[Row, Comparison]]) -> str:
    """Where MLA (in ascending compression ratio) differs from MHA beyond the noise."""
    slower = [r for r, c in cmps if c.significant and c.rel_diff < 0]
    faster = [r for r, c in cmps if c.significant and c.rel_diff > 0]
    order = [r for r, _ in cmps]
    if not slower and not faster:
        if any(c.reason.startswith("not called") for _, c in cmps):
            return "no difference called: contended runs at " + ", ".join(
                f"{r.compression_ratio:.2f}×" for r, c in cmps if c.reason.startswith("not called"))
        return "no difference beyond the noise at any compression ratio measured"
    if len(slower) == len(order) or len(faster) == len(order):
        return f"MLA is {'slower' if slower else 'faster'} than MHA beyond the noise at every compression ratio measured"
    parts = []
    if slower and slower == order[-len(slower):]:
        parts.append(f"MLA falls below MHA beyond the noise at compression ratios ≥ {slower[0].compression_ratio:.2f}× "
                     f"(kv_lora_rank ≤ {slower[0].kv_lora_rank})")
    elif slower and slower == order[:len(slower)]:
        parts.append(f"MLA falls below MHA beyond the noise at compression ratios ≤ {slower[-1].compression_ratio:.2f}× "
                     f"(kv_lora_rank ≥ {slower[-1].kv_lora_rank})")
    elif slower:
        parts.append("MLA is slower than MHA beyond the noise at "
                     + ", ".join(f"{r.compression_ratio:.2f}×" for r in slower) + " (no single crossover)")
    if faster:
        parts.append("faster beyond the noise at " + ", ".join(f"{r.compression_ratio:.2f}×" for r in faster))
    if len(slower) + len(faster) < len(order):
        parts.append("within noise elsewhere")
    return "; ".join(parts)


def throughput_crossover(rs: ResultsSet) -> list[str]:
    """Where MLA's training tokens/s differs from MHA's, per results dir, FFN width, engine and world size.

    Points are compared within one FFN width, unless the sweep matched parameter counts (then the
    width is the solver's and every point of the results dir is compared).
    """
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in sorted(rs.ok("train"), key=rs.order):
        if r.across(_rate_of) is not None:
            width = None if r.record.match_params else r.intermediate_size
            groups[(r.source, width, r.setup, r.world_size)].append(r)
    engines = {k[2:] for k in groups}
    out = []
    for (source, width, engine, n), rows in groups.items():
        mha = [r for r in rows if r.attention == "mha"]
        mla = sorted((r for r in rows if r.attention == "mla"), key=lambda r: r.compression_ratio)
        if not mha or not mla:
            continue
        ref = mha[0].across(_rate_of)
        where = (f"{source}, " if rs.multi else "") + (f"intermediate_size {width}" if width else "equal parameters")
        if len(engines) > 1:
            where += f", {engine} on {n} GPU(s)"
        raw = [(r, compare(r.across(_rate_of), ref)) for r in mla]
        cmps = [(r, gated(c, r, mha[0])) for r, c in raw]
        head = f"Training throughput, MLA against MHA ({_rate(ref)}; {where}): "
        if all(c.reason for _, c in raw):
            text = head + NO_SPREAD + "."
        else:
            detail = "; ".join(f"{_kv(rs, r)}: {c.describe('faster', 'slower')}" for r, c in cmps)
            text = head + _crossover(cmps) + f" ({detail})."
        text += contention_note(mha[0], *mla)
        out.append(text + (" " + CPU_CAVEAT if any(r.result.on_cpu for r in rows) else ""))
    out += _grouped_heads_vs_mha(rs, groups, len(engines) > 1)
    return out


def _grouped_heads_vs_mha(rs: ResultsSet, groups: dict[tuple, list[Row]], engines: bool) -> list[str]:
    """GQA and MQA points against the MHA point of their group, by the same noise rule as MLA's: the
    attention kinds a sweep sets beside MLA are judged too, not only the one the sweep is named after."""
    out = []
    for (source, width, engine, n), rows in groups.items():
        mha = [r for r in rows if r.attention == "mha"]
        others = sorted((r for r in rows if r.attention in ("gqa", "mqa")), key=lambda r: r.compression_ratio)
        if not mha or not others:
            continue
        ref = mha[0].across(_rate_of)
        where = (f"{source}, " if rs.multi else "") + (f"intermediate_size {width}" if width else "equal parameters")
        if engines:
            where += f", {engine} on {n} GPU(s)"
        raw = [(r, compare(r.across(_rate_of), ref)) for r in others]
        kinds = " and ".join(dict.fromkeys(r.attention.upper() for r in others))
        head = f"Training throughput, {kinds} against MHA ({_rate(ref)}; {where}): "
        if all(c.reason for _, c in raw):
            text = head + NO_SPREAD + "."
        else:
            text = head + "; ".join(
                f"{r.attention.upper()} with {r.recipe.model.n_kv_heads} KV head{'s' if r.recipe.model.n_kv_heads > 1 else ''} "
                f"({r.compression_ratio:.2f}× less KV cache): {gated(c, r, mha[0]).describe('faster', 'slower')}"
                for r, c in raw) + "."
        text += contention_note(mha[0], *others)
        out.append(text + (" " + CPU_CAVEAT if any(r.result.on_cpu for r in rows) else ""))
    return out


def scaling(rs: ResultsSet) -> list[str]:
    """Scaling efficiency per engine and attention type, with the per-GPU rate judged against one GPU's."""
    out = []
    for (attention, rank, _width, setup), by_n in sorted(scaling_groups(rs).items(), key=lambda kv: str(kv[0])):
        base = by_n[1].across(_rate_of)
        parts = []
        for n in sorted(by_n):
            if n > 1:
                s = by_n[n].across(_rate_of)
                c = gated(compare(s.scaled(1 / n), base), by_n[n], by_n[1])
                share = s.median / n / base.median if base.median else None  # a rate of 0 on one GPU: no share
                parts.append(f"{n} GPUs {pct(share, 0, signed=False)} "
                             f"({c.describe('above linear', 'below linear')})")
        name = attention + (f" (kv_lora_rank {rank})" if rank else "")
        out.append(f"Scaling efficiency of {name} under {setup} (per-GPU tokens/s against one GPU, medians): "
                   f"{', '.join(parts)}." + contention_note(*by_n.values()))
    return out


def decode_speed(rs: ResultsSet) -> list[str]:
    """MLA's decode tokens/s against MHA's, per results dir and FFN width, context by context (at equal
    batch where MHA measured it, else at each side's own batch, which the sentence names)."""
    by: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for r in sorted(rs.ok("decode"), key=rs.order):
        width = None if r.record.match_params else r.intermediate_size
        for m in decode_points(r):
            if m.decode is not None:
                by[(r.source, width)][m.point.context].append((r, m))
    out = []
    for (source, width), contexts in by.items():
        parts, judged, cpu, rows_seen = [], False, False, {}
        kinds: dict[str, None] = {}
        for context, items in contexts.items():
            mha = {m.point.batch: m for r, m in items if r.attention == "mha"}
            # MLA, and GQA and MQA where the sweep set them beside it: each against MHA
            mla = sorted(((r, m) for r, m in items if r.attention != "mha"), key=lambda x: x[0].compression_ratio)
            if not mha or not mla:
                continue
            cpu |= any(r.result.device.type == "cpu" for r, _ in items)
            cmps = [(r, m, mha.get(m.point.batch) or mha[max(mha)]) for r, m in mla]
            mha_rows = {m.point.batch: r for r, m in items if r.attention == "mha"}
            cmps = [(r, m, ref, compare(m.decode, ref.decode), mha_rows[ref.point.batch]) for r, m, ref in cmps]
            judged |= not all(c.reason for *_, c, _ in cmps)
            cmps = [(r, m, ref, gated(c, r, ref_row)) for r, m, ref, c, ref_row in cmps]
            rows_seen.update({id(x[0]): x[0] for x in items})
            refs = "; ".join(f"batch {b:,}: {_rate(mha[b].decode)}" for b in sorted({ref.point.batch for *_, ref, _ in cmps}))
            parts.append(f"context {context:,} (MHA {refs}): " + "; ".join(
                _kind(r) + (f" at batch {m.point.batch:,}" if m.point.batch != ref.point.batch else "")
                + f": {c.describe('faster', 'slower')}" for r, m, ref, c in cmps))
            kinds.update(dict.fromkeys(r.attention.upper() for r, *_ in cmps))
        if not parts:
            continue
        where = ", ".join(([source] if rs.multi else []) + ([f"intermediate_size {width}"] if width else []))
        head = f"Decode throughput, {' and '.join(kinds)} against MHA" + (f" ({where})" if where else "") + ": "
        text = head + (". ".join(parts) if judged else NO_SPREAD) + "." + contention_note(*rows_seen.values())
        out.append(text + (" " + CPU_CAVEAT if cpu else ""))
    return out


def _kind(r: Row) -> str:
    """How a finding names a point beside MHA: 'kv_lora_rank 64' (MLA), 'GQA with 2 KV heads', 'MQA'."""
    if r.attention == "mla":
        return f"kv_lora_rank {r.kv_lora_rank}"
    if r.attention == "gqa":
        return f"GQA with {r.recipe.model.n_kv_heads} KV heads"
    return r.attention.upper()


def rule_of_thumb(rs: ResultsSet) -> list[str]:
    """The error of 12·d²·L against the exact non-embedding count, per FFN width."""
    rows = rs.ok("estimate") or rs.ok("count")
    by_width: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        err = r.result.params.rule_of_thumb_rel_error
        if err is not None:
            by_width[(r.intermediate_size, r.recipe.model.d_model)].append(err)
    if not by_width:
        return []
    parts = []
    for (width, d), errs in sorted(by_width.items()):
        lo, hi = min(errs), max(errs)
        span = pct(lo, 1) if abs(hi - lo) < 5e-4 else f"{pct(lo, 1)} to {pct(hi, 1)}"
        parts.append(f"intermediate_size {width} ({width / d:.2g}·d): {span}")
    return ["12·d²·L against the exact non-embedding parameter count (across attention types): "
            + "; ".join(parts) + ". The rule assumes a 4·d GELU FFN and full MHA; SwiGLU, other widths, "
            "GQA and MLA move it."]


def kv_savings(rs: ResultsSet) -> list[str]:
    """MLA's KV-cache saving per results dir, against the same-head-dims MHA and against the MHA point swept."""
    out = []
    for src in rs.sources:
        mla, seen = [], set()
        for r in sorted(rs.rows, key=rs.order):
            if r.source == src["label"] and r.recipe is not None and r.attention == "mla" and r.record.point_id not in seen:
                seen.add(r.record.point_id)
                mla.append(r)
        if not mla:
            continue
        ranks = sorted({r.kv_lora_rank for r in mla})
        text = ((f"{src['label']}: " if rs.multi else "") + "MLA's KV cache per token is "
                + _span([r.compression_ratio for r in mla]) + " smaller than the MHA with the same heads and head dims "
                f"(kv_lora_rank {', '.join(map(str, ranks))})")
        vs_point = [x for x in (rs.kv_vs_mha_point(r) for r in mla) if x is not None]
        if vs_point and len(vs_point) == len(mla):
            mha = rs.mha_point(mla[0])
            text += (f", and {_span(vs_point)} smaller than the MHA point of these results "
                     f"({mha.kv['bytes_per_token']:,} bytes/token)")
        else:
            text += "; these results have no MHA point with the same layers, width and heads to compare with"
        out.append(text + ".")
    return out


def _span(xs: list[float]) -> str:
    lo, hi = round(min(xs), 2), round(max(xs), 2)
    return f"{lo:.2f}×" + (f" to {hi:.2f}×" if hi != lo else "")


def worst_errors(rs: ResultsSet) -> list[str]:
    """The worst relative error of each measured-against-analytic comparison in the tables."""
    checks = [(count_table, "parameters measured vs exact", "parameters, measured against the exact count"),
              (count_table, "FLOPs fwd+bwd FlopCounterMode vs analytic", "FlopCounterMode FLOPs against the analytic (full)"),
              (count_table, "FLOPs fwd fvcore vs analytic", "fvcore FLOPs against the analytic (full)"),
              (count_table, "FLOPs fwd+bwd 6·N·T vs measured", "6·N·T against the measured training FLOPs"),
              (decode_table, "KV cache measured vs analytic", "measured KV-cache bytes against the analytic"),
              (train_table, "peak memory measured vs analytic", "peak training memory against the analytic estimate")]
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
        out.append(f"Worst {what}: {pct(errs[i], 1)} ({where}; {len(idx)} compared).")
        if build is train_table:
            out += _compiled_memory(rs)
    return out


def _compiled_memory(rs: ResultsSet) -> list[str]:
    """Compiled runs' peak memory apart from eager ones': the estimate counts what the compiled graph keeps
    (Inductor recomputes cheap element-wise results in the backward; a whole-model compile keeps the 16-bit
    logits, not log_softmax's fp32 output), a count less tested than the eager one."""
    errs: dict[bool, list[tuple[float, Row]]] = {True: [], False: []}
    for r in rs.ok("train"):
        e = rel_error(r.result.peak_memory_bytes, train_analytic_memory(r))
        if e is not None:
            errs[bool(r.recipe.train.compile)].append((e, r))
    if not errs[True]:
        return []
    lo, hi = min(e for e, _ in errs[True]), max(e for e, _ in errs[True])
    text = (f"Compiled runs' peak memory against the estimate: {pct(lo, 1)}" + (f" to {pct(hi, 1)}" if hi != lo else "")
            + f" ({len(errs[True])} runs): the estimate counts what the compiled graph keeps (Inductor recomputes "
              "element-wise results in the backward).")
    if errs[False]:
        e, r = max(errs[False], key=lambda x: abs(x[0]))
        where = (f"{r.source}: " if rs.multi else "") + r.label
        text += f" Eager runs alone: worst {pct(e, 1)} ({where}; {len(errs[False])} compared)."
    return [text]


def budget(rs: ResultsSet) -> list[str]:
    mps = [r.record.match_params for r in rs.rows if r.record.match_params]
    if not mps:
        return []
    worst = max(mps, key=lambda m: abs(m.rel_error))
    values = sorted({m.value for m in mps})
    return [f"Equal budget: {worst.key} solved per point to {', '.join(f'{v:g}' for v in values)}; every point is "
            f"within {pct(abs(worst.rel_error), 2, signed=False)} of the target {worst.target:,} {worst.params} parameters."]


def all_findings(rs: ResultsSet) -> list[str]:
    out: list[str] = []
    for f in (kv_savings, rule_of_thumb, throughput_crossover, scaling, decode_speed, budget, worst_errors,
              prediction_findings, claim_findings, dynamics_findings):
        out += f(rs)
    bad = [r for r in rs.rows if r.status not in ("ok", "skipped")]
    n_diverged = sum(r.diverged for r in bad)
    if n_diverged:  # an outcome of training, not a broken run
        out.append(f"{n_diverged} train run(s) diverged (a non-finite loss stopped them); see the last table.")
    if len(bad) > n_diverged:
        out.append(f"{len(bad) - n_diverged} run(s) failed (error, oom or timeout); see the last table.")
    return out
