"""Report plots, PNG bytes from matplotlib's Agg canvas (no pyplot state, no display needed).

A plot is drawn only when its data has at least two distinct x values; otherwise it is left out.
Timed figures carry p10–p90 error bars; a y axis (throughput, bytes, parameters) whose values span
more than :data:`LOG_SPAN` turns logarithmic, so one outlier cannot flatten the rest (the caption
says so).
The title lives beside the image (report heading, figure caption), not inside it; legends sit below
the axes, never over the data or the y axis.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

from scaletool.fmt import gib, si
from scaletool.report.data import ResultsSet, Row
from scaletool.report.tables import decode_points, is_contended, train_analytic_memory
from scaletool.stats import Spread

#: max/min of a throughput plot's values beyond which its y axis is logarithmic
LOG_SPAN = 4.0
BARS = "Bars: p10–p90 of the point (over its measured steps, or over its runs where it ran several times)."
RATIO_X = "x: KV compression against the MHA with the same heads and head dims."

Value = Spread | float | int | None

#: a contended point's ring: red, hollow, over the point's own marker, in the legend and the caption
CONTENDED_LABEL = "contended"
CONTENDED_CAPTION = ("Red rings: contended points (another process held a CPU or the GPU during their timed steps); "
                     "no difference involving them is called.")


def ring_contended(ax, xs: list[float], ys: list[float]) -> None:
    """Draw a red ring around each contended point (x, y) of ``ax``, with one legend entry."""
    if xs:
        ax.scatter(xs, ys, s=120, facecolors="none", edgecolors="red", linewidths=1.6, zorder=5,
                   label=CONTENDED_LABEL)


@dataclass
class Plot:
    key: str
    title: str
    caption: str  # what the title does not say: bars, scales, reference lines
    png: bytes
    group: str = ""  # the report section the plot belongs to ("" for the general plots)


@dataclass
class Curve:
    """One run's values against the step: a line of :func:`curve_plot`."""

    xs: list[float]
    ys: list[float | None]  # None (not measured, or not finite) leaves a gap
    colour: str = ""  # legend entry of the line's colour (``lr 0.03``); curves with one colour key share it
    style: str = ""  # legend entry of its line style (``warm-up 10, clipping on``)
    panel: str = ""  # one subplot per panel, side by side, sharing the y axis
    end: bool = False  # mark its last finite value with a cross (the run diverged there)


def _mpl_text(s: str) -> str:
    """matplotlib reads $...$ as mathtext and hides legend labels starting with '_'."""
    s = s.replace("$", r"\$")
    return " " + s if s.startswith("_") else s


def _tick(v: float, _pos=None) -> str:
    return si(v)


def _minor_tick(v: float, _pos=None) -> str:
    """Log-axis minor ticks labelled at 2 and 5 times a power of ten only."""
    return si(v) if v > 0 and round(v / 10 ** math.floor(math.log10(v)), 6) in (2, 5) else ""


def _bounds(v: Value) -> tuple[float, float, float]:
    if isinstance(v, Spread):
        return v.median, v.p10, v.p90
    return float(v), float(v), float(v)


def line_plot(key: str, title: str, xlabel: str, ylabel: str, points: list[tuple[str, float | None, Value]], *,
              caption: str = "", logx: bool = False, autolog: bool = False, percent: bool = False, nbytes: bool = False,
              hlines: list[tuple[str, float]] = (), contended: list[tuple[float, Value]] = ()) -> Plot | None:
    """One line per series name through its (x, y) points, sorted by x; y may be a Spread (error bars).
    ``autolog``: a logarithmic y axis when the values span more than LOG_SPAN; ``percent``/``nbytes``:
    y tick labels as percentages or as bytes (KiB, MiB, GiB); ``contended``: (x, y) points ringed red."""
    points = [(s, x, _bounds(y)) for s, x, y in points if x is not None and y is not None]
    rings = [(x, _bounds(y)[0]) for x, y in contended if x is not None and y is not None]
    if len({x for _, x, _ in points}) < 2:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter, PercentFormatter, ScalarFormatter

    fig = Figure(figsize=(6.4, 3.6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    series: dict[str, dict[float, tuple[float, float, float]]] = {}
    for s, x, y in points:
        series.setdefault(s, {}).setdefault(x, y)
    for i, (name, by_x) in enumerate(series.items()):
        xs = sorted(by_x)
        mid, lo, hi = ([by_x[x][k] for x in xs] for k in range(3))
        bars = [[m - low for m, low in zip(mid, lo)], [high - m for m, high in zip(mid, hi)]]
        # past the 10 colours of the cycle, the line style tells series of the same colour apart
        ax.errorbar(xs, mid, yerr=bars if any(map(any, bars)) else None, marker="os^D"[i // 10 % 4], markersize=4,
                    capsize=3, linestyle=("-", "--", ":", "-.")[i // 10 % 4], label=_mpl_text(name))
    for name, y in hlines:
        ax.axhline(y, linestyle="--", linewidth=1, color="0.35", label=_mpl_text(name))
    ring_contended(ax, [x for x, _ in rings], [y for _, y in rings])
    values = [v for _, _, b in points for v in b if v > 0] + [y for _, y in hlines if y > 0]
    notes = [caption] if caption else []
    if rings:
        notes.append(CONTENDED_CAPTION)
    span = max(values) / min(values) if values else 1.0
    if autolog and span > LOG_SPAN:
        ax.set_yscale("log")
        notes.append(f"Log y axis: the values span {span:.0f}×.")
        # within two decades the intermediate ticks are labelled too, or the axis has one or two labels
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_tick) if span < 100 else NullFormatter())
    if percent:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    else:  # 25.6 k rather than 25600 or a "1e7" offset; no mathtext to parse either
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: gib(v)) if nbytes else FuncFormatter(_tick))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.grid(alpha=0.3, which="both" if autolog else "major")
    # Below the axes, in as many columns as the labels allow: never over the data or the y axis.
    longest = max(len(n) for n in list(series) + [n for n, _ in hlines] + ([CONTENDED_LABEL] if rings else []))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7, frameon=False,
              ncol=3 if longest <= 24 else 2 if longest <= 40 else 1)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return Plot(key, title, " ".join(notes), buf.getvalue())


STYLES = ("-", "--", ":", "-.")
VLINES = (":", "-.")
BAND = {"color": "black", "linewidth": 3, "alpha": 0.25, "linestyle": "-"}


def curve_plot(key: str, title: str, xlabel: str, ylabel: str, curves: list[Curve], *, caption: str = "",
               end_label: str = "", hlines: list[tuple[str, float]] = (), vlines: list[tuple[str, float]] = (),
               ymax: float | None = None, group: str = "") -> Plot | None:
    """Many runs' curves in one figure, legible: a colour per ``colour`` key, a line style per ``style``
    key, one legend entry per key (not per curve), a subplot per ``panel``. None unless some curve has two
    finite values. ``ymax`` cuts the y axis (a spike of 10× the loss would flatten every other curve);
    the caption then says so."""
    def finite(c: Curve) -> list[tuple[float, float]]:
        return [(x, y) for x, y in zip(c.xs, c.ys) if y is not None and math.isfinite(y)]
    if not any(len(finite(c)) >= 2 for c in curves):
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    panels = list(dict.fromkeys(c.panel for c in curves))
    colours = list(dict.fromkeys(c.colour for c in curves))
    styles = list(dict.fromkeys(c.style for c in curves))
    fig = Figure(figsize=(6.4 if len(panels) == 1 else 4.2 * len(panels), 3.6), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    palette = [f"C{i % 10}" for i in range(len(colours))]
    # past four styles the marker tells styles apart too
    dash = {s: (STYLES[i % 4], "" if i < 4 else "os^D"[i // 4 % 4]) for i, s in enumerate(styles)}
    top = max(y for c in curves for _, y in finite(c))
    for ax, panel in zip(axes, panels):
        for c in (c for c in curves if c.panel == panel):
            colour, (ls, marker) = palette[colours.index(c.colour)], dash[c.style]
            n = min(len(c.xs), len(c.ys))
            ax.plot(c.xs[:n], [math.nan if y is None else y for y in c.ys[:n]], color=colour, linestyle=ls,
                    marker=marker, markersize=3, linewidth=1.2)
            if c.end and finite(c):
                x, y = finite(c)[-1]
                ax.plot([x], [min(y, ymax) if ymax else y], color=colour, marker="x", markersize=8, mew=2)
        for _, y in hlines:  # a faint band, unlike any run's line style
            ax.axhline(y, **BAND)
        for i, (_, x) in enumerate(vlines):
            ax.axvline(x, linestyle=VLINES[i % 2], linewidth=1, color="0.35")
        if panel:
            ax.set_title(_mpl_text(panel), fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[0].yaxis.set_major_formatter(FuncFormatter(_tick))
    notes = [caption] if caption else []
    if ymax is not None and top > ymax:
        low = min(y for c in curves for _, y in finite(c))
        axes[0].set_ylim(low - 0.05 * (ymax - low), ymax)
        notes.append(f"The y axis is cut at {ymax:.3g}: values up to {top:.3g} run off the top.")
    handles = [Line2D([], [], color=palette[i], label=_mpl_text(k)) for i, k in enumerate(colours) if k]
    handles += [Line2D([], [], color="0.3", linestyle=dash[k][0], marker=dash[k][1], label=_mpl_text(k))
                for k in styles if k]
    if end_label and any(c.end for c in curves):
        handles.append(Line2D([], [], color="0.3", marker="x", linestyle="none", mew=2, label=_mpl_text(end_label)))
    handles += [Line2D([], [], **BAND, label=_mpl_text(n)) for n, _ in hlines]
    handles += [Line2D([], [], color="0.35", linestyle=VLINES[i % 2], label=_mpl_text(n)) for i, (n, _) in enumerate(vlines)]
    if handles:  # below the axes, never over the data
        longest = max(len(h.get_label()) for h in handles)
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=7, frameon=False,
                   ncol=4 if longest <= 18 else 3 if longest <= 26 else 2 if longest <= 40 else 1)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return Plot(key, title, " ".join(notes), buf.getvalue(), group)


def _name(rs: ResultsSet, r: Row, *parts) -> str:
    bits = ([r.source] if rs.multi else []) + [str(p) for p in parts if p is not None and p != ""]
    return " · ".join(bits)


def _varies(rows: list[Row], attr) -> bool:
    return len({attr(r) for r in rows}) > 1


def analytic_plots(rs: ResultsSet) -> list[Plot | None]:
    est = rs.ok("estimate") or rs.ok("count")
    if not est:
        return []
    width = _varies(est, lambda r: r.intermediate_size)
    estimates = rs.ok("estimate")
    kv = [(_name(rs, r, r.series_key), r.compression_ratio, r.result.kv_cache.bytes_per_token) for r in estimates]
    refs = {}
    for r in estimates:
        mha = rs.mha_point(r) if r.attention == "mla" else None
        if mha is not None:
            refs[_name(rs, mha, f"MHA point ({mha.kv['bytes_per_token']:,} B/token)")] = mha.kv["bytes_per_token"]
    params = [(_name(rs, r, r.series_key, f"ffn={r.intermediate_size}" if width else None), r.compression_ratio,
               r.result.params.total if r.mode == "estimate" else r.result.params.measured) for r in est]
    return [line_plot("kv_vs_compression", "KV-cache bytes per token vs compression ratio",
                      "KV compression ratio vs same-dims MHA", "bytes per token (all layers)", kv, hlines=list(refs.items()),
                      autolog=True,
                      caption=RATIO_X + (" Dashed: the MHA point of these results; MLA's ratio against it is the line "
                                         "over the point." if refs else "")),
            line_plot("params_vs_compression", "Parameters vs compression ratio", "KV compression ratio vs same-dims MHA",
                      "parameters", params, caption=RATIO_X, autolog=True)]


def train_plots(rs: ResultsSet) -> list[Plot | None]:
    train = rs.ok("train")
    if not train:
        return []
    width = _varies(train, lambda r: r.intermediate_size)

    def by_ratio(r: Row) -> str:
        return _name(rs, r, r.series_key, f"ffn={r.intermediate_size}" if width else None)

    def by_width(r: Row) -> str:
        return _name(rs, r, r.series_key, f"kv_lora_rank={r.kv_lora_rank}" if r.kv_lora_rank else None)

    def rate(r: Row) -> Spread | None:
        return r.across(lambda t: t.rate)

    def mfu(r: Row) -> float | None:
        return r.median(lambda t: t.mfu)

    def ringed(x, figure) -> list[tuple[float, Value]]:
        return [(x(r), figure(r)) for r in train if is_contended(r)]

    # MHA's tokens/s as a reference line across the ratios MLA, GQA and MQA span (MHA is one point at 1×)
    mha_refs = [(_name(rs, r, f"MHA ({si(rate(r).median)} tokens/s)"), rate(r).median) for r in train
                if r.attention == "mha" and rate(r) is not None]
    mfu_note = "MFU with causal attention FLOPs (Megatron's convention); the training table has the full-attention MFU too."
    mem = [(by_width(r), r.intermediate_size, r.result.peak_memory_bytes) for r in train]
    mem += [(by_width(r) + " (analytic)", r.intermediate_size, train_analytic_memory(r)) for r in train
            if r.result.peak_memory_bytes is not None]
    return [
        line_plot("tokens_per_s_vs_compression", "Training tokens/s vs compression ratio", "KV compression ratio vs "
                  "same-dims MHA", "tokens/s", [(by_ratio(r), r.compression_ratio, rate(r)) for r in train], autolog=True,
                  hlines=mha_refs, contended=ringed(lambda r: r.compression_ratio, rate),
                  caption=BARS + " " + RATIO_X + (" Dashed: MHA's tokens/s." if mha_refs else "")),
        line_plot("tokens_per_s_vs_ffn", "Training tokens/s vs FFN width", "intermediate_size", "tokens/s",
                  [(by_width(r), r.intermediate_size, rate(r)) for r in train], autolog=True, caption=BARS,
                  contended=ringed(lambda r: r.intermediate_size, rate)),
        line_plot("mfu_vs_compression", "Training MFU vs compression ratio", "KV compression ratio vs same-dims MHA",
                  "MFU (causal)", [(by_ratio(r), r.compression_ratio, mfu(r)) for r in train], percent=True,
                  caption=mfu_note, contended=ringed(lambda r: r.compression_ratio, mfu)),
        line_plot("mfu_vs_ffn", "Training MFU vs FFN width", "intermediate_size", "MFU (causal)",
                  [(by_width(r), r.intermediate_size, mfu(r)) for r in train], percent=True, caption=mfu_note,
                  contended=ringed(lambda r: r.intermediate_size, mfu)),
        line_plot("memory_vs_ffn", "Peak training memory vs FFN width", "intermediate_size", "peak memory", mem,
                  autolog=True, nbytes=True,
                  caption="Measured allocator peak and, marked analytic, the estimate it is compared with."),
    ]


def decode_plots(rs: ResultsSet) -> list[Plot | None]:
    dec = rs.ok("decode")
    if not dec:
        return []
    pts = [(r, m) for r in dec for m in decode_points(r)]
    # One line per run, unless a run measured several batches at one context; with `--batch max`
    # each context has its own (largest) batch, which the table lists.
    per_context: dict[tuple, set] = {}
    for r, m in pts:
        per_context.setdefault((id(r), m.point.context), set()).add(m.point.batch)
    batches = any(len(b) > 1 for b in per_context.values())
    width = _varies(dec, lambda r: r.intermediate_size)

    def name(r: Row) -> str:
        return _name(rs, r, r.series_key, f"kv_lora_rank={r.kv_lora_rank}" if r.kv_lora_rank else None,
                     f"ffn={r.intermediate_size}" if width else None)
    names = {}
    for r in dec:
        names.setdefault(name(r), set()).add(r.record.point_id)
    # the point's own label where the short name would merge two points into one line
    series = {id(r): name(r) if len(names[name(r)]) == 1 else _name(rs, r, r.label) for r in dec}
    return [line_plot("decode_vs_context", "Decode tokens/s vs context length", "context (tokens)", "decode tokens/s",
                      [(series[id(r)] + (f" · batch={m.point.batch}" if batches else ""), m.point.context, m.decode)
                       for r, m in pts], logx=True, autolog=True, caption=BARS,
                      contended=[(m.point.context, m.decode) for r, m in pts if is_contended(r)])]


def all_plots(rs: ResultsSet) -> list[Plot]:
    plots = analytic_plots(rs) + train_plots(rs) + decode_plots(rs)
    return [p for p in plots if p is not None]
