"""Predicted against measured throughput: a table and a scatter plot over every train point with a prediction.

A run records the step-time model's prediction for its layout and device (``predict/tokens_per_s``);
a GPU run written before that is re-predicted from its recipe, its world size and the calibration of
its card's hardware profile. The error is (predicted − measured) / measured, the measured figure the
median of the point's measured steps (or of its runs' medians). A CPU run's calibration is a
placeholder: its row is shown, marked, and left out of the plot.
"""
from __future__ import annotations

import io
import statistics

from scaletool.report.data import ResultsSet, Row
from scaletool.report.plots import BARS, CONTENDED_CAPTION, Plot, _mpl_text, _tick, ring_contended
from scaletool.report.tables import Column, _table, is_contended, spread_cells, spread_columns
from scaletool.stats import rel_error

#: the error band drawn around the y = x line of the plot
BAND = 0.2
CPU_CALIBRATION = "CPU (placeholder)"


def _repredict(r: Row, cache: dict) -> tuple[float, str, str] | None:
    """(tokens/s, calibration, bound) of the step model for a GPU run that recorded no prediction."""
    from scaletool.analytic.step import predict_step
    from scaletool.errors import RecipeError
    from scaletool.measure.hardware import profile_named
    from scaletool.predict.prediction import calibration_for_device

    res = r.result
    name = res.hardware_profile
    if res.device_type != "cuda" or not name or r.recipe is None:
        return None
    try:
        if name not in cache:
            cache[name] = calibration_for_device("cuda", profile_named(name))
        pred = predict_step(r.recipe, cache[name], world_size=res.world_size or 1)
    except (RecipeError, ValueError, KeyError, ZeroDivisionError):
        return None
    return pred["tokens_per_s"], f"{cache[name].name} (re-predicted)", pred["bound"]


def predicted(r: Row, cache: dict) -> tuple[float, str, str] | None:
    """(tokens/s predicted, calibration, bound) of a train point: as recorded (median over its runs), or
    re-predicted for a GPU run that predates the record; None when there is neither."""
    got = [(run.metrics.get("predict/tokens_per_s"), run.prediction or {}) for run in r.runs]
    got = [(x, p) for x, p in got if x]
    if got:
        p = got[-1][1]
        return statistics.median(x for x, _ in got), p.get("calibration") or "recorded", p.get("bound") or "-"
    return _repredict(r, cache)


def points(rs: ResultsSet) -> list[tuple[Row, tuple[float, str, str]]]:
    cache: dict = {}
    out = []
    for r in rs.ok("train"):
        if r.across(lambda t: t.rate) is not None and (p := predicted(r, cache)) is not None:
            out.append((r, p))
    return out


def prediction_table(rs: ResultsSet):
    found = {id(r): p for r, p in points(rs)}
    if not found:
        return None

    def cells(r: Row):
        rate, calib, bound = found[id(r)]
        measured = r.across(lambda t: t.rate)
        return [[r.setup, r.world_size, calib, rate, *spread_cells(measured), rel_error(rate, measured.median), bound]]
    cols = [Column("setup"), Column("GPUs", "int"), Column("calibration"), Column("predicted", "rate", "tokens/s"),
            *spread_columns("measured tokens/s"), Column("predicted vs measured", "pct"), Column("bound")]
    rows = [r for r in rs.ok("train") if id(r) in found]
    return _table(rs, "prediction", "Predicted vs measured throughput", cols, rows, cells,
                  timed=("measured tokens/s", "predicted vs measured"), note=
                  "Predicted: the step-time model for the point's layout, with the calibration of its card, as the run "
                  "recorded it or re-predicted from its recipe for runs written before; error = (predicted − measured) "
                  f"/ measured, against the median measured step. {CPU_CALIBRATION}: not meaningful (the CPU's "
                  "calibration is not measured).")


def prediction_plots(rs: ResultsSet) -> list[Plot]:
    """Measured against predicted tokens/s, one marker per point, on log axes with y = x and ±20%."""
    pts = [(r, p) for r, p in points(rs) if not p[1].startswith(CPU_CALIBRATION)]
    if len(pts) < 2:
        return []
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(5.2, 4.4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    by_setup: dict[str, list] = {}
    for r, (rate, _, _) in pts:
        by_setup.setdefault(f"{r.setup} · {r.world_size} GPU", []).append((rate, r.across(lambda t: t.rate)))
    for i, (name, xs) in enumerate(sorted(by_setup.items())):
        ax.errorbar([x for x, _ in xs], [m.median for _, m in xs],
                    yerr=[[m.median - m.p10 for _, m in xs], [m.p90 - m.median for _, m in xs]], linestyle="none",
                    marker="os^D"[i // 10 % 4], markersize=4, capsize=2, label=_mpl_text(name))
    busy = [(x, r.across(lambda t: t.rate).median) for r, (x, _, _) in pts if is_contended(r)]
    ring_contended(ax, [x for x, _ in busy], [y for _, y in busy])
    values = [v for _, (x, _, _) in pts for v in (x,)] + [r.across(lambda t: t.rate).median for r, _ in pts]
    lo, hi = min(values) / 1.3, max(values) * 1.3
    ax.plot([lo, hi], [lo, hi], color="0.3", linewidth=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * (1 - BAND), hi * (1 - BAND)], [lo * (1 + BAND), hi * (1 + BAND)],
                    color="0.85", alpha=0.6, linewidth=0, label=f"±{BAND:.0%}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(_tick))
    ax.set_xlabel("predicted tokens/s")
    ax.set_ylabel("measured tokens/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=7, frameon=False, ncol=2)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    errors = sorted(abs(rel_error(x, r.across(lambda t: t.rate).median)) for r, (x, _, _) in pts)
    caption = (f"{len(pts)} points; |error| median {statistics.median(errors):.0%}, worst {errors[-1]:.0%}. Log axes; "
               f"the band is ±{BAND:.0%} around predicted = measured. {BARS}"
               + (f" {CONTENDED_CAPTION}" if busy else ""))
    return [Plot("predicted_vs_measured", "Measured vs predicted tokens/s", caption, buf.getvalue(), "prediction")]


def _why(r: Row, bound: str) -> str:
    """What the step model is known to miss for this point (docs/prediction.md), or its bound."""
    rec = r.recipe
    if rec is not None and rec.model.ffn == "moe":
        return "MoE routing and expert dispatch are not modelled"
    if rec is not None and rec.parallel.async_tp:
        return "async tensor parallelism is not modelled"
    if any(run.contended for run in r.runs):
        return "the run was contended"
    if bound.startswith("host"):
        return "host-bound: the dispatch cost is fitted on one machine's CPU"
    return f"bound: {bound}"


def prediction_findings(rs: ResultsSet) -> list[str]:
    """The prediction's error over the GPU points, and each point beyond ±20% with what the model misses."""
    pts = [(r, p) for r, p in points(rs) if not p[1].startswith(CPU_CALIBRATION)]
    if not pts:
        return []
    # a contended point measures the other process as much as the layout: out of the error, said so
    left_out = [r for r, _ in pts if is_contended(r)]
    pts = [(r, p) for r, p in pts if not is_contended(r)]
    skipped = (f" {len(left_out)} contended point(s) left out ({', '.join(r.label for r in left_out[:4])}"
               f"{', ...' if len(left_out) > 4 else ''}): another process held the CPU or GPU during their timed steps."
               if left_out else "")
    if not pts:
        return [f"Step-time model: no uncontended GPU point to judge it on.{skipped}"]
    errs = [(rel_error(rate, r.across(lambda t: t.rate).median), r, bound) for r, (rate, _, bound) in pts]
    errs.sort(key=lambda e: -abs(e[0]))
    worst = errs[0]
    out = [f"Step-time model against {len(errs)} GPU point(s): |error| median "
           f"{statistics.median(abs(e) for e, _, _ in errs):.1%}, worst {worst[0]:+.1%} ({worst[1].label}, "
           f"{worst[1].world_size} GPU).{skipped}"]
    beyond = [e for e in errs if abs(e[0]) > BAND]
    if beyond:
        shown = "; ".join(f"{r.label} ({r.world_size} GPU) {e:+.0%}: {_why(r, b)}" for e, r, b in beyond[:4])
        more = f"; and {len(beyond) - 4} more" if len(beyond) > 4 else ""
        out.append(f"Predicted beyond ±{BAND:.0%} of measured: {shown}{more}.")
    return out
