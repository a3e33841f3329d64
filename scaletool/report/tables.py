"""Report tables: raw values plus a kind per column, so markdown, HTML and tests share one source.

Every relative error is :func:`scaletool.stats.rel_error`, (value − reference) / reference, with the
reference named in the column. A timed figure is three columns: its median, its p10–p90 range (shown
where n > 1) and n (the measured steps of one run, or the repeats of a point that ran several times).
Columns carry a group, which HTML shows as a header above them and markdown folds into the name.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scaletool.analytic.flops import flops_per_token
from scaletool.analytic.params import param_counts
from scaletool.analytic.pipeline import peak_bytes  # a pipeline's largest stage, as estimate and plan say
from scaletool.fmt import CONTENDED_MARK, gib, pct, si
from scaletool.kinds.engines import engine_kind
from scaletool.report.data import ResultsSet, Row
from scaletool.results.decode import DecodePoint
from scaletool.stats import Spread, rel_error

#: columns that name the point's model; one is left out when every row's sweep values set it (the
#: point label then says it) or leave it empty
IDENTITY = ("attention", "kv_lora_rank", "intermediate_size")


@dataclass
class Column:
    name: str
    kind: str = "text"  # text | int | float | pct | share | bytes | flops | ratio | rate | range
    group: str = ""  # a header over consecutive columns of the same group (HTML); a name prefix in markdown

    @property
    def full(self) -> str:
        """The name with its group: markdown's header, and the name tests and findings look a column up by."""
        return f"{self.group} {self.name}" if self.group else self.name


CONTENDED_NOTE = (f"{CONTENDED_MARK}: a contended figure: during its timed steps another process held a CPU the run "
                  "waited for (or shared its GPU); it is shown, and no difference involving it is called. ")


@dataclass
class Table:
    key: str
    title: str
    columns: list[Column]
    rows: list[list[Any]] = field(default_factory=list)
    note: str = ""
    #: (row, column) indices of cells shown with :data:`CONTENDED_MARK`
    marked: set[tuple[int, int]] = field(default_factory=set)

    def formatted(self) -> list[list[str]]:
        return [[fmt(v, c.kind) + (f" {CONTENDED_MARK}" if (i, j) in self.marked and v is not None else "")
                 for j, (v, c) in enumerate(zip(row, self.columns))] for i, row in enumerate(self.rows)]

    def mark_row(self, i: int, columns: tuple[str, ...]) -> None:
        """Mark row ``i``'s figures in ``columns`` (a column's group or its full name) as contended; counts
        (a spread's n) are not figures the contention bends, and stay unmarked."""
        self.marked |= {(i, j) for j, c in enumerate(self.columns)
                        if (c.group in columns or c.full in columns) and c.kind != "int"}

    def column(self, name: str) -> list[Any]:
        i = [c.full for c in self.columns].index(name)
        return [r[i] for r in self.rows]

    def groups(self) -> list[tuple[str, int]]:
        """Consecutive columns of one group: (group, span); ungrouped columns are spans of one."""
        out: list[tuple[str, int]] = []
        for c in self.columns:
            if c.group and out and out[-1][0] == c.group:
                out[-1] = (c.group, out[-1][1] + 1)
            else:
                out.append((c.group, 1))
        return out


def _contended_cell(r) -> str | None:
    """'2 of 3' contended runs of the point, 'none', or None (shown '-') where no run recorded contention
    (older runs)."""
    if all(getattr(run, "contended", None) is None for run in r.runs):
        return None
    n, m = r.contended_runs()
    return f"{n} of {m}" if n else "none"


def is_contended(r) -> bool:
    """Whether any run of the point was contended (its timed figures are marked)."""
    return r.contended_runs()[0] > 0


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
        return pct(v, 1, signed=False)
    if kind == "bytes":
        return gib(v)
    if kind == "flops":
        return si(v, "FLOP", 4)
    if kind == "ratio":
        return f"{v:.2f}×"
    if kind == "rate":
        return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
    if kind == "range":
        return f"{fmt(v.p10, 'rate')}–{fmt(v.p90, 'rate')}"
    return str(v)


def spread_columns(group: str) -> list[Column]:
    return [Column("median", "rate", group), Column("p10–p90", "range", group), Column("n", "int", group)]


def spread_cells(s: Spread | None) -> list[Any]:
    """Median, the p10–p90 range where there is one (n > 1), and n."""
    if s is None:
        return [None, None, None]
    return [s.median, s if s.n > 1 else None, s.n]


def _table(rs: ResultsSet, key: str, title: str, cols: list[Column], rows: list[Row],
           cells: Callable[[Row], list[list[Any]]], note: str = "", timed: tuple[str, ...] = ()) -> Table | None:
    """Rows in results-dir then point order, led by the point (and its results dir when several are
    shown) and the identity columns its label does not already give. ``timed``: the columns (groups or
    full names) whose cells are marked where the point's runs were contended; the note then says what
    the mark means."""
    if not rows:
        return None
    rows = sorted(rows, key=rs.order)
    ident = [name for name in IDENTITY if any(getattr(r, name) is not None and f"model.{name}" not in r.record.values
                                               for r in rows)]
    lead = [Column("point")] + ([Column("source")] if rs.multi else [])
    lead += [Column(name, "text" if name == "attention" else "int") for name in ident]
    t = Table(key, title, lead + cols, note=note)
    for r in rows:
        head = [r.label] + ([r.source] if rs.multi else []) + [getattr(r, name) for name in ident]
        for cell_row in cells(r):
            t.rows.append(head + cell_row)
            if timed and is_contended(r):
                t.mark_row(len(t.rows) - 1, timed)
    if t.marked:
        t.note = CONTENDED_NOTE + t.note
    return t


def estimate_table(rs: ResultsSet) -> Table | None:
    def cells(r: Row):
        e = r.result
        p, f = e.params, e.flops.per_token
        train, dense = flops(f.get("train")), flops(f.get("dense_6N"))
        return [[p.total, p.non_embedding, p.rule_of_thumb_12d2L, p.rule_of_thumb_rel_error, e.kv_cache.bytes_per_token,
                 e.kv_cache.compression_ratio, rs.kv_vs_mha_point(r), train, dense, rel_error(dense, train),
                 e.memory.recipe.total_bytes]]
    cols = [Column("exact", "int", "parameters"), Column("non-embedding", "int", "parameters"),
            Column("12·d²·L", "int", "parameters"), Column("12·d²·L vs non-emb.", "pct", "parameters"),
            Column("bytes/token", "int", "KV cache"), Column("vs same-dims MHA", "ratio", "KV cache"),
            Column("vs MHA point", "ratio", "KV cache"), Column("train", "flops", "FLOPs/token"),
            Column("6·N", "flops", "FLOPs/token"), Column("6·N vs train", "pct", "FLOPs/token"),
            Column("memory/GPU (analytic)", "bytes")]
    return _table(rs, "estimate", "Analytic estimate", cols, rs.ok("estimate"), cells,
                  "train FLOPs/token includes attention (causal for lm, full for regression). " + KV_NOTE)


KV_NOTE = ("KV cache vs same-dims MHA: the cache of an MHA with this point's heads and head dims over the "
           "point's (estimate's kv_cache.compression_ratio); vs MHA point: the MHA point of these results over "
           "this point's, blank where the results have none.")


def count_table(rs: ResultsSet) -> Table | None:
    def cells(r: Row):
        p, f = r.result.params, r.result.flops
        a, fc, fv = f.analytic, f.flop_counter, f.fvcore.forward if f.fvcore else None
        return [[p.measured, p.total, rel_error(p.measured, p.total), p.rule_of_thumb_rel_error, fc.train,
                 a.get("train_full"), rel_error(fc.train, a.get("train_full")), a.get("train_6N"),
                 rel_error(a.get("train_6N"), fc.train), fv, a.get("forward_full"), rel_error(fv, a.get("forward_full"))]]
    g1, g2, g3 = "parameters", "FLOPs fwd+bwd", "FLOPs fwd"
    cols = [Column("measured", "int", g1), Column("exact", "int", g1), Column("measured vs exact", "pct", g1),
            Column("12·d²·L vs non-emb.", "pct", g1), Column("FlopCounterMode", "flops", g2),
            Column("analytic (full)", "flops", g2), Column("FlopCounterMode vs analytic", "pct", g2),
            Column("6·N·T", "flops", g2), Column("6·N·T vs measured", "pct", g2), Column("fvcore", "flops", g3),
            Column("analytic (full)", "flops", g3), Column("fvcore vs analytic", "pct", g3)]
    return _table(rs, "count", "Measured parameters and FLOPs", cols, rs.ok("count"), cells,
                  "FLOPs for one batch; the counters see all T² attention scores, so the analytic column "
                  "uses the full convention. 6·N·T leaves attention out.")


def flops(x: object) -> float | None:
    """A recorded FLOP figure as a float (FLOPs are floats however a writer spelled them)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _moe_figures(r: Row, t: Row | None) -> tuple[dict, dict]:
    """(parameters, FLOPs/token) of a MoE point as recorded (its estimate; the train run's FLOPs/token), else
    computed by this scaletool's closed forms (and said so)."""
    est = r if r.mode == "estimate" else r.estimate
    p = est.result.params.model_dump() if est is not None else None
    f = est.result.flops.per_token if est is not None else None
    if t is not None and t.result.flops_per_token and "train_causal_computed" in t.result.flops_per_token:
        f = t.result.flops_per_token
    if p is None or f is None or "train_causal_computed" not in f:
        r.recomputed("MoE parameters and FLOPs/token (no estimate of the point recorded)")
        p, f = param_counts(r.recipe.model), flops_per_token(r.recipe.model, r.recipe.seq_len)
    return p, f


def train_analytic_memory(r: Row) -> int | None:
    """The analytic peak the train run compared itself with, else the recipe's, computed (and said so)."""
    m = r.result.metric("memory/analytic_bytes")
    if m is not None:
        return int(m)
    r.recomputed("analytic memory of train runs (the run recorded none)")
    return int(peak_bytes(r.recipe, r.world_size or r.recipe.parallel.world_size))


TIMING_NOTE = ("Timed figures are medians: over the measured steps of one run, or, where a point ran several "
               "times (runs > 1), across the runs, with p10/p90 over the runs' medians and n = runs. ")


def train_table(rs: ResultsSet) -> Table | None:
    def cells(r: Row):
        s = r.result
        peak, est = s.peak_memory_bytes, train_analytic_memory(r)
        return [[r.engine, r.world_size, s.threads, r.repeats, _contended_cell(r), *spread_cells(r.across(lambda t: t.rate)),
                 r.median(lambda t: t.mfu), r.median(lambda t: t.mfu_full_attention), peak, est, rel_error(peak, est),
                 s.loss_first, s.loss_last, s.steps_measured, s.warmup_steps_excluded]]
    # the contended runs beside the runs, before the figures they taint (a reader meets the mark first)
    cols = [Column("engine"), Column("GPUs", "int"), Column("threads", "int"), Column("runs", "int"),
            Column("contended", "text", "runs"), *spread_columns("tokens/s"), Column("causal (Megatron)", "share", "MFU"),
            Column("full attention (torchtitan)", "share", "MFU"), Column("measured", "bytes", "peak memory"),
            Column("analytic", "bytes", "peak memory"), Column("measured vs analytic", "pct", "peak memory"),
            Column("first", "float", "loss"), Column("last", "float", "loss"), Column("measured", "int", "steps"),
            Column("warm-up excluded", "int", "steps")]
    return _table(rs, "train", "Training", cols, rs.ok("train"), cells, timed=("tokens/s", "MFU"), note=
                  TIMING_NOTE + "Warm-up steps are excluded by rule (at least measure_warmup_steps, then until the "
                  "step time settles). MFU causal counts half the T² attention scores (Megatron's convention, ours); "
                  "full attention counts all of them (torchtitan's); blank where the device has no known peak "
                  "(CPU). Threads: CPU intra-op threads. Peak memory is the allocator's peak. Contended runs: runs whose "
                  "timed steps waited for a CPU that another process held (no difference involving them is called).")


def scaling_groups(rs: ResultsSet) -> dict[tuple, dict[int, Row]]:
    """Train runs of the same model and setup at several world sizes: {(attention, kv_lora_rank,
    intermediate_size, setup): {world_size: row}}; only groups with a one-rank baseline and more. The
    setup is the engine with compilation and a DeepSpeed passthrough (:attr:`Row.setup`), so compiled and
    eager runs, or tuned and default ZeRO, never stand in for each other."""
    groups: dict[tuple, dict[int, Row]] = {}
    for r in rs.ok("train"):
        if r.world_size and r.across(lambda t: t.rate) is not None:
            key = (r.attention, r.kv_lora_rank, r.intermediate_size, r.setup)
            groups.setdefault(key, {})[r.world_size] = r
    return {k: v for k, v in groups.items() if 1 in v and len(v) > 1}


def single_baselines(rs: ResultsSet) -> dict[tuple, Row]:
    """One-GPU runs of engine ``single``: {(attention, kv_lora_rank, intermediate_size, compiled): row},
    the plain-PyTorch reference every engine's per-GPU rate is also set against."""
    return {(r.attention, r.kv_lora_rank, r.intermediate_size, r.recipe.train.compile): r for r in rs.ok("train")
            if r.recipe is not None and not engine_kind(r.recipe.parallel.engine).distributed and r.world_size == 1
            and r.across(lambda t: t.rate) is not None}


def scaling_table(rs: ResultsSet) -> Table | None:
    """Per-GPU throughput at N ranks against one rank of the same setup (the scaling efficiency) and
    against ``single`` on one GPU (what the engine costs over plain PyTorch)."""
    groups, singles = scaling_groups(rs), single_baselines(rs)
    if not groups:
        return None
    t = Table("scaling", "Scaling across GPUs",
              [Column("attention"), Column("kv_lora_rank", "int"), Column("intermediate_size", "int"),
               Column("setup"), Column("GPUs", "int"), *spread_columns("tokens/s"),
               Column("tokens/s per GPU", "rate"), Column("MFU causal", "share"), Column("peak memory", "bytes"),
               Column("memory vs estimate", "pct"), Column("scaling efficiency", "share"),
               Column("per GPU vs single", "share")],
              note="Scaling efficiency is per-GPU tokens/s at N GPUs over the same setup's tokens/s on one GPU "
                   "(100% = linear), medians; 'per GPU vs single' sets it against engine single (plain PyTorch, "
                   "same compilation) on one GPU. Compare only runs from the same machine.")
    for (attention, rank, width, setup), by_n in sorted(groups.items(), key=lambda kv: str(kv[0])):
        base = by_n[1].across(lambda t: t.rate).median
        single = singles.get((attention, rank, width, by_n[1].recipe.train.compile))
        ref = single.across(lambda t: t.rate).median if single else None
        for n in sorted(by_n):
            rate, peak = by_n[n].across(lambda t: t.rate), by_n[n].result.peak_memory_bytes
            t.rows.append([attention, rank, width, setup, n, *spread_cells(rate), rate.median / n,
                           by_n[n].median(lambda s: s.mfu), peak, rel_error(peak, train_analytic_memory(by_n[n])),
                           rate.median / n / base if base else None, rate.median / n / ref if ref else None])
            # a ratio is as contended as either side of it
            if is_contended(by_n[n]) or is_contended(by_n[1]) or (single is not None and is_contended(single)):
                t.mark_row(len(t.rows) - 1, ("tokens/s", "tokens/s per GPU", "MFU causal", "scaling efficiency",
                                             "per GPU vs single"))
    if t.marked:
        t.note = CONTENDED_NOTE + t.note
    return t


def moe_table(rs: ResultsSet) -> Table | None:
    """Mixture-of-experts points: total vs active parameters (analytic, from the recipe) beside the
    training throughput, both MFU conventions of expert FLOPs and expert load of the point's train run."""
    trained = {(r.source, r.record.point_id): r for r in rs.ok("train")}
    seen, rows = set(), []
    for r in sorted(rs.rows, key=rs.order):
        key = (r.source, r.record.point_id)
        if r.ok and r.recipe.model.ffn == "moe" and key not in seen:
            seen.add(key)
            rows.append(r)

    def cells(r: Row):
        m, t = r.recipe.model, trained.get((r.source, r.record.point_id))
        p, f = _moe_figures(r, t)
        mfu = t.median(lambda s: s.mfu) if t else None
        computed = mfu * f["train_causal_computed"] / f["train_causal"] if mfu is not None and f["train_causal"] else None
        return [[m.n_routed_experts, m.num_experts_per_tok, p["total"], p["active"],
                 p["active"] / p["total"] if p["total"] else None,
                 f["train_causal"], f["train_causal_computed"], *spread_cells(t.across(lambda s: s.rate) if t else None),
                 mfu, computed, t.median(lambda s: s.metric("moe/imbalance_ratio_max")) if t else None,
                 t.median(lambda s: s.metric("moe/dropped_fraction")) if t else None]]
    cols = [Column("n_routed_experts", "int", "experts"), Column("top-k", "int", "experts"),
            Column("total", "int", "parameters"), Column("active", "int", "parameters"),
            Column("active share", "share", "parameters"), Column("useful", "flops", "train FLOPs/token"),
            Column("computed", "flops", "train FLOPs/token"), *spread_columns("tokens/s"),
            Column("useful", "share", "MFU"), Column("computed", "share", "MFU"),
            Column("imbalance (max/mean)", "float", "expert load"), Column("dropped fraction", "share", "expert load")]
    return _table(rs, "moe", "Mixture of experts: active vs total parameters", cols, rows, cells,
                  "Active = the parameters one token uses (its top-k routed experts, shared experts, router and "
                  "dense parts). Useful FLOPs count the top-k experts a token is routed to (the MFU convention); "
                  "computed FLOPs count every capacity slot the dispatch runs (dropped and padded ones too). "
                  "Imbalance and drops are the last training step's, over all ranks.")


@dataclass
class DecodeMeasure:
    """One (batch, context) point of a decode row, its timed figures across the row's repeats."""

    point: DecodePoint  # the first repeat's (the untimed figures)
    decode: Spread | None  # decode tokens/s
    prefill: Spread | None  # prefill tokens/s


def decode_points(r: Row) -> list[DecodeMeasure]:
    """The measured (batch, context) points of a decode row, in measuring order, each with its timed
    figures across the row's repeats (a repeat that lacks the point adds nothing)."""
    def figure(p: DecodePoint, name: str):
        def of(run) -> Spread | None:
            same = next((q for q in run.points if (q.batch, q.context) == (p.batch, p.context)), None)
            return getattr(same, name) if same is not None else None
        return of

    return [DecodeMeasure(p, r.across(figure(p, "decode_rate")), r.across(figure(p, "prefill_rate")))
            for p in r.result.points]


def decode_table(rs: ResultsSet) -> Table | None:
    def cells(r: Row):
        out = []
        for m in decode_points(r):
            p = m.point
            meas, ana = p.kv_cache_bytes_measured, p.kv_cache_bytes_analytic
            tokens = (p.batch or 0) * (p.max_len or p.context or 0)  # the cache holds prompt + decoded tokens
            out.append([p.batch, p.context, meas, ana, rel_error(meas, ana), meas / tokens if meas is not None and tokens
                        else None, rs.kv_vs_mha_point(r), *spread_cells(m.decode), *spread_cells(m.prefill)])
        return out
    cols = [Column("batch", "int"), Column("context", "int"), Column("measured", "bytes", "KV cache"),
            Column("analytic", "bytes", "KV cache"), Column("measured vs analytic", "pct", "KV cache"),
            Column("bytes/token measured", "int", "KV cache"), Column("vs MHA point", "ratio", "KV cache"),
            *spread_columns("decode tokens/s"), *spread_columns("prefill tokens/s")]
    return _table(rs, "decode", "Decoding", cols, rs.ok("decode"), cells, timed=("decode tokens/s", "prefill tokens/s"),
                  note=
                  TIMING_NOTE + "Decode tokens/s: batch over the decode step time; prefill tokens/s: batch × "
                  "context over the prefill time. KV cache vs MHA point: the analytic bytes/token of the MHA point of "
                  "these results over this point's, blank where the results have none.")


def budget_table(rs: ResultsSet) -> Table | None:
    seen, rows = set(), []
    for r in rs.rows:
        if r.record.match_params and (r.source, r.record.point_id) not in seen:
            seen.add((r.source, r.record.point_id))
            rows.append(r)

    def cells(r: Row):
        mp = r.record.match_params
        return [[mp.key, mp.base_value, mp.value, mp.target, mp.achieved, mp.rel_error]]
    cols = [Column("adjusted key"), Column("base value", "int"), Column("solved value", "int"),
            Column("target params", "int"), Column("achieved params", "int"), Column("achieved vs target", "pct")]
    return _table(rs, "budget", "Equal parameter budget", cols, rows, cells)


def failures_table(rs: ResultsSet) -> Table | None:
    from scaletool.sweep.runner import headline

    def cells(r: Row):
        rec = r.record
        return [[r.mode, f"{rec.repeat + 1}/{rec.repeats}" if rec.repeats > 1 else "",
                 "diverged" if r.diverged else r.status, headline(rec.model_dump())]]
    rows = [r for r in rs.rows if r.status != "ok"]
    return _table(rs, "failures", "Skipped and failed runs",
                  [Column("mode"), Column("repeat"), Column("status"), Column("reason")], rows, cells)


def breakdown_table(rs: ResultsSet, top: int = 12) -> Table | None:
    """Category time shares of the runs that were profiled (see data.breakdown_of)."""
    runs = [(r, b) for r in sorted(rs.rows, key=rs.order) if r.status == "ok" for b in [r.breakdown()] if b]
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
