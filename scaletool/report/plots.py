"""Report plots, PNG bytes from matplotlib's Agg canvas (no pyplot state, no display needed).

A plot is drawn only when its data has at least two distinct x values; otherwise it is left out.
"""
from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

from scaletool.report.data import ResultsSet, Row
from scaletool.report.tables import decode_points, train_analytic_memory


@dataclass
class Plot:
    key: str
    title: str
    png: bytes


def _mpl_text(s: str) -> str:
    """matplotlib reads $...$ as mathtext and hides legend labels starting with '_'."""
    s = s.replace("$", r"\$")
    return " " + s if s.startswith("_") else s


def line_plot(key: str, title: str, xlabel: str, ylabel: str, points: list[tuple[str, float, float]], *,
              logx: bool = False, logy: bool = False, percent: bool = False) -> Plot | None:
    """One line per series name through its (x, y) points, sorted by x."""
    points = [(s, x, y) for s, x, y in points if x is not None and y is not None]
    if len({x for _, x, _ in points}) < 2:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    fig = Figure(figsize=(6.4, 4.0), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    series: dict[str, list[tuple[float, float]]] = {}
    for s, x, y in points:
        series.setdefault(s, []).append((x, y))
    for name, xy in series.items():
        xy = sorted(set(xy))
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=_mpl_text(name))
    ax.set_title(_mpl_text(title))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if percent:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.grid(alpha=0.3)
    if len(series) > 5:  # many series: the legend goes beside the axes, not over the data
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return Plot(key, title, buf.getvalue())


def _name(rs: ResultsSet, r: Row, *parts) -> str:
    bits = ([r.source] if rs.multi else []) + [str(p) for p in parts if p is not None and p != ""]
    return " · ".join(bits)


def _varies(rows: list[Row], attr: Callable[[Row], object]) -> bool:
    return len({attr(r) for r in rows}) > 1


def all_plots(rs: ResultsSet) -> list[Plot]:
    plots: list[Plot | None] = []
    est = rs.ok("estimate") or rs.ok("count")
    if est:
        width = _varies(est, lambda r: r.intermediate_size)
        kv = [(_name(rs, r, r.series_key), r.compression_ratio, r.result["kv_cache"]["bytes_per_token"])
              for r in rs.ok("estimate")]
        plots.append(line_plot("kv_vs_compression", "KV-cache bytes per token vs compression ratio",
                               "KV compression ratio (MHA-equivalent / cached)", "bytes per token (all layers)", kv))
        params = [(_name(rs, r, r.series_key, f"ffn={r.intermediate_size}" if width else None), r.compression_ratio,
                   _params(r)) for r in est]
        plots.append(line_plot("params_vs_compression", "Parameters vs compression ratio",
                               "KV compression ratio", "parameters", params))
    train = rs.ok("train")
    if train:
        width = _varies(train, lambda r: r.intermediate_size)

        def by_ratio(r: Row) -> str:
            return _name(rs, r, r.series_key, f"ffn={r.intermediate_size}" if width else None)

        def by_width(r: Row) -> str:
            return _name(rs, r, r.series_key, f"kv_lora_rank={r.kv_lora_rank}" if r.kv_lora_rank else None)

        for metric, label, pct_axis in (("tokens_per_s", "tokens/s", False), ("mfu", "MFU", True)):
            plots.append(line_plot(f"{metric}_vs_compression", f"Training {label} vs compression ratio",
                                   "KV compression ratio", label,
                                   [(by_ratio(r), r.compression_ratio, r.result.get(metric)) for r in train],
                                   percent=pct_axis))
            plots.append(line_plot(f"{metric}_vs_ffn", f"Training {label} vs FFN width", "intermediate_size", label,
                                   [(by_width(r), r.intermediate_size, r.result.get(metric)) for r in train],
                                   percent=pct_axis))
        mem = [(by_width(r), r.intermediate_size, r.result.get("peak_memory_bytes")) for r in train]
        mem += [(by_width(r) + " (analytic)", r.intermediate_size, train_analytic_memory(r)) for r in train
                if r.result.get("peak_memory_bytes") is not None]
        plots.append(line_plot("memory_vs_ffn", "Peak training memory vs FFN width", "intermediate_size",
                               "bytes", mem))
    dec = rs.ok("decode")
    if dec:
        pts = [(r, p) for r in dec for p in decode_points(r)]
        # One line per run, unless a run measured several batches at one context; with `--batch max`
        # each context has its own (largest) batch, which the table lists.
        per_context: dict[tuple, set] = {}
        for r, p in pts:
            per_context.setdefault((id(r), p.get("context")), set()).add(p.get("batch"))
        batches = any(len(b) > 1 for b in per_context.values())
        plots.append(line_plot(
            "decode_vs_context", "Decode tokens/s vs context length", "context (tokens)", "decode tokens/s",
            [(_name(rs, r, r.label, f"batch={p.get('batch')}" if batches else None), p.get("context"),
              p.get("decode_tokens_per_s")) for r, p in pts], logx=True, logy=True))
    return [p for p in plots if p is not None]


def _params(r: Row) -> int | None:
    p = r.result.get("params", {})
    return p.get("total") if r.mode == "estimate" else p.get("measured")
