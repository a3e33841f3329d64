"""The training-dynamics study: what the runs' losses and monitors show, and the claims about them.

The section appears when a train run carries the monitors' record (:mod:`scaletool.profile.monitors`).
It sets each run's loss and per-layer attention entropy and effective rank against four knobs:
``model.norm_placement``, ``train.warmup_steps``, ``train.grad_clip``, ``train.lr``. Definitions
(table, plots and findings alike): *diverged* (a non-finite loss), *loss spike* (the rolling median
of :data:`SMOOTH` steps rising :data:`SPIKE` above its low), *unstable* (either), *final loss* (the
last :data:`FINAL_STEPS` finite losses, compared by the noise rule), *entropy/rank collapse* (below
the run's own monitor threshold before any divergence). The claims about them are judged in
:mod:`scaletool.report.dynamics_findings`.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from scaletool.report.data import ResultsSet, Row
from scaletool.report.plots import Curve, Plot, curve_plot
from scaletool.report.tables import Column, Table
from scaletool.results.train import TrainResult
from scaletool.stats import Spread, spread

#: a loss spike: the rolling median rises more than this fraction above its lowest value so far
SPIKE = 0.10
#: steps of the rolling median a spike is judged on
SMOOTH = 3
#: steps at the end of a run whose losses make its final loss
FINAL_STEPS = 10
ENTROPY, RANK = "dynamics/attention_entropy_nats/layer_", "dynamics/effective_rank_ratio/layer_"
NORM, WARMUP, CLIP, LR = "model.norm_placement", "train.warmup_steps", "train.grad_clip", "train.lr"
KNOBS = (NORM, WARMUP, CLIP, LR)
GROUP = "Training dynamics"
CLAIM_NORM = "Post-LN without warm-up diverges or trains worse, Pre-LN does not"
CLAIM_REMEDY = "gradient clipping and warm-up prevent early instability"
CLAIM_COLLAPSE = "attention entropy collapse and rank collapse precede divergence"


def recorded(row: Row, key: str, default: Any) -> Any:
    """The point's value of dotted ``key`` as its record gives it: the sweep's values, else the recorded
    recipe, else ``default`` (a record written before the key existed had the default's behaviour)."""
    if key in row.record.values:
        return row.record.values[key]
    node: Any = row.record.recipe or {}
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


@dataclass(frozen=True)
class Knobs:
    """The four knobs of a point, its results dir (when the report has several) and the sweep's other varied keys."""

    norm: str
    warmup: int
    clip: float
    lr: float
    source: str = ""
    other: tuple = ()  # ((key, value), ...)

    def without(self, name: str) -> tuple:
        """Everything but knob ``name``: points with equal ``without(name)`` differ only in it."""
        return tuple(getattr(self, n) for n in ("norm", "warmup", "clip", "lr") if n != name) + (self.source, self.other)

    def describe(self, *names: str, rest: bool = True) -> str:
        """``Post-LN, warm-up 0, clipping off, lr 0.03`` for the knobs ``names``; with ``rest``, the results dir
        and the other varied keys too."""
        words = {"norm": f"{self.norm.capitalize()}-LN", "warmup": f"warm-up {self.warmup}",
                 "clip": f"clipping {self.clip:g}" if self.clip else "clipping off", "lr": f"lr {self.lr:g}"}
        extra = ([self.source] if self.source else []) + [f"{k.split('.')[-1]} {v}" for k, v in self.other] if rest else []
        return ", ".join(extra + [words[n] for n in names])


class Run:
    """One train run's curves and events, from its typed result."""

    def __init__(self, view: TrainResult):
        self.view = view
        h = view.history
        steps = list(zip(h.step, h.loss))  # a summary whose lists differ in length is read as far as both go
        self.steps = [s for s, _ in steps]
        self.loss = [x if x is not None and math.isfinite(x) else None for _, x in steps]
        d = view.dynamics or {}
        self.entropy_threshold = _finite(d.get("entropy_threshold_nats"))
        self.rank_threshold = _finite(d.get("rank_threshold"))
        # measurements in step order; one without a numeric step cannot be placed
        history = d.get("history") if isinstance(d.get("history"), list) else []
        self.monitor = sorted((m for m in history if isinstance(m, dict) and _finite(m.get("step")) is not None),
                              key=lambda m: m["step"])
        self.monitored = bool(self.monitor)

    @property
    def status(self) -> str:
        return self.view.status or "failed"

    @cached_property
    def diverged_at(self) -> int | None:
        """The first step with a non-finite loss of a run that stopped on it (its last step if none is kept)."""
        if self.status != "diverged":
            return None
        return next((s for s, x in zip(self.steps, self.loss) if x is None), self.steps[-1] if self.steps else 0)

    @cached_property
    def _spike(self) -> tuple[int | None, float]:
        """(the first step where the rolling median of the loss rose more than SPIKE above its lowest so far,
        the largest such rise over the run). The first loss starts the low: at initialisation every token's
        prediction is near uniform, so it is the one loss without batch noise to smooth."""
        finite = [(s, x) for s, x in zip(self.steps, self.loss) if x is not None]
        first, rise, low = None, 0.0, finite[0][1] if finite else math.inf
        for i in range(SMOOTH - 1, len(finite)):
            m = statistics.median(x for _, x in finite[i - SMOOTH + 1:i + 1])
            rise = max(rise, m / low - 1)
            if first is None and m > low * (1 + SPIKE):
                first = finite[i][0]
            low = min(low, m)
        return first, rise

    @property
    def spike_at(self) -> int | None:
        return self._spike[0]

    @property
    def spike_rise(self) -> float | None:
        """The largest rise of the smoothed loss above its lowest so far, of a run that spiked."""
        return self._spike[1] if self.spike_at is not None else None

    @property
    def unstable_at(self) -> int | None:
        """The first step of instability: a spike, or the divergence when no spike came first."""
        events = [s for s in (self.spike_at, self.diverged_at) if s is not None]
        return min(events) if events else None

    @property
    def final(self) -> list[float]:
        """The last FINAL_STEPS finite losses, of a run that neither diverged nor failed."""
        if self.status != "completed":
            return []
        return [x for x in self.loss if x is not None][-FINAL_STEPS:]

    def layers(self, prefix: str) -> dict[str, list[float | None]]:
        """Per layer (``layer_00``...): the monitored value at each monitored step (None where not finite)."""
        names = sorted({k for m in self.monitor for k in m if k.startswith(prefix)})
        return {k.removeprefix(prefix): [_finite(m.get(k)) for m in self.monitor] for k in names}

    @property
    def monitor_steps(self) -> list[int]:
        return [int(m["step"]) for m in self.monitor]

    def lowest(self, prefix: str) -> list[float | None]:
        """At each monitored step, the lowest layer's value (None where no layer has a finite one)."""
        per_layer = list(self.layers(prefix).values())
        return [min((v[i] for v in per_layer if v[i] is not None), default=None) for i in range(len(self.monitor))]

    def before(self, prefix: str, until: int | None = None) -> list[tuple[int, float]]:
        """(step, lowest layer's value) at the monitored steps before ``until`` (default: the divergence;
        every step of a run that did not diverge)."""
        end = self.diverged_at if until is None else until
        return [(s, v) for s, v in zip(self.monitor_steps, self.lowest(prefix))
                if v is not None and (end is None or s < end)]

    def collapse_at(self, prefix: str, until: int | None = None) -> int | None:
        """The first monitored step before ``until`` (default: the divergence) where the lowest layer fell
        below the run's threshold."""
        threshold = self.entropy_threshold if prefix == ENTROPY else self.rank_threshold
        if threshold is None:
            return None
        return next((s for s, v in self.before(prefix, until) if v < threshold), None)


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


@dataclass
class Point:
    """A point of the study: its knobs and every train run it has (ok repeats, and failed ones that kept a result)."""

    label: str
    source: str
    order: tuple
    knobs: Knobs
    runs: list[Run] = field(default_factory=list)
    failed: int = 0  # train runs that ended without a result to read, or failed before training could finish

    @property
    def trained(self) -> bool:
        return any(r.status in ("completed", "diverged") for r in self.runs)

    @property
    def diverged(self) -> list[Run]:
        return [r for r in self.runs if r.diverged_at is not None]

    @property
    def unstable(self) -> list[Run]:
        return [r for r in self.runs if r.unstable_at is not None]

    @property
    def final(self) -> Spread | None:
        return spread([x for r in self.runs for x in r.final])

    @property
    def monitored(self) -> list[Run]:
        return [r for r in self.runs if r.monitored]

    def events(self) -> str:
        """``diverged at step 17``, ``loss spike at step 9``, ``stable``, or per run when repeats differ."""
        def one(r: Run) -> str:
            if r.diverged_at is not None:
                early = r.spike_at is not None and r.spike_at < r.diverged_at
                return f"diverged at step {r.diverged_at}" + (f" (loss spike at step {r.spike_at})" if early else "")
            if r.spike_at is not None:
                return f"loss spike at step {r.spike_at} (+{r.spike_rise:.0%})"
            return "stable" if r.status == "completed" else r.status
        words = [one(r) for r in self.runs] + ["failed"] * self.failed
        return words[0] if len(set(words)) == 1 else "; ".join(f"run {i + 1}: {w}" for i, w in enumerate(words))


def study(rs: ResultsSet) -> list[Point]:
    """The study's points in results-dir and sweep order: every train point of each results dir where some
    run was monitored."""
    by: dict[tuple, Point] = {}
    rows = [r for r in rs.rows if r.mode == "train" and r.recipe is not None and r.status != "skipped"]
    for row in sorted(rows, key=rs.order):
        key = (row.source, row.record.sweep, row.label)  # a point's rows, as the report's data groups them
        if key not in by:
            by[key] = Point(row.label, row.source, rs.order(row), knobs_of(rs, row))
        runs = [Run(v) for v in row.runs]
        by[key].runs += [r for r in runs if r.status != "failed"]
        # a run that failed (a crash, a timeout: its partial result says "failed") or left no result
        by[key].failed += sum(r.status == "failed" for r in runs) + (not runs)
    monitored = {p.source for p in by.values() if p.monitored}
    return [p for p in by.values() if p.source in monitored]


def knobs_of(rs: ResultsSet, row: Row) -> Knobs:
    t = row.recipe.train
    other = tuple(sorted((k, v) for k, v in row.record.values.items() if k not in KNOBS))
    return Knobs(str(recorded(row, NORM, "pre")), t.warmup_steps, t.grad_clip, t.lr, row.source if rs.multi else "",
                 other)


# --- the table -------------------------------------------------------------------------------------


def dynamics_table(rs: ResultsSet) -> Table | None:
    points = study(rs)
    if not points:
        return None
    g_loss, g_ent, g_rank = "loss", "attention entropy, lowest layer (nats)", "effective rank / max, lowest layer"
    cols = [Column("point")] + ([Column("source")] if rs.multi else []) + [
        Column("norm_placement"), Column("warmup_steps", "int"), Column("grad_clip", "float"), Column("lr", "float"),
        Column("runs", "int"), Column("outcome"), Column("first", "float", g_loss),
        Column("final median", "float", g_loss), Column("final p10–p90", "range", g_loss), Column("final n", "int", g_loss),
        Column("max grad norm", "float"),
        Column("first", "float", g_ent), Column("lowest", "float", g_ent), Column("collapse at step", "int", g_ent),
        Column("first", "float", g_rank), Column("lowest", "float", g_rank), Column("collapse at step", "int", g_rank)]
    t = Table("dynamics", "Training dynamics", cols, note=(
        f"Outcome: diverged (a non-finite loss stopped the run) or a loss spike (the {SMOOTH}-step rolling median of "
        f"the loss {SPIKE:.0%} above its lowest so far), else stable. Final loss: the last {FINAL_STEPS} losses of "
        "the runs that did not diverge, median and p10–p90. Entropy and effective rank: the lowest layer's value at "
        "the first and the lowest monitored step before any divergence; collapse: the first monitored step below "
        "the run's profile.monitors threshold (entropy_threshold, rank_threshold). Max grad norm: the clipped "
        "steps' global norm before clipping (blank with clipping off). With repeats, the first run's curves."))
    for p in points:
        k, first = p.knobs, (p.runs[0] if p.runs else None)
        final = p.final
        t.rows.append([p.label] + ([p.source] if rs.multi else []) + [
            k.norm, k.warmup, k.clip, k.lr, len(p.runs) + p.failed, p.events(),
            _first_loss(first), *([final.median, final if final.n > 1 else None, final.n] if final else [None] * 3),
            _max_grad(p), *_monitor_cells(first, ENTROPY), *_monitor_cells(first, RANK)])
    return t


def _first_loss(r: Run | None) -> float | None:
    return next((x for x in r.loss if x is not None), None) if r else None


def _max_grad(p: Point) -> float | None:
    norms = [x for r in p.runs for x in r.view.history.grad_norm if x is not None and math.isfinite(x)]
    return max(norms) if norms else None


def _monitor_cells(r: Run | None, prefix: str) -> list[Any]:
    vals = r.before(prefix) if r else []
    if not vals:
        return [None, None, None]
    return [vals[0][1], min(v for _, v in vals), r.collapse_at(prefix)]


# --- the plots -------------------------------------------------------------------------------------


def _encoding(points: list[Point]) -> Callable[[Point], dict]:
    """A point's panel (norm placement), colour (lr, and the results dir and other varied keys) and line
    style (warm-up and clipping), each from the knobs that vary only, so the legend has one entry per value
    rather than one per run."""
    varies = {n: len({getattr(p.knobs, n) for p in points}) > 1 for n in ("norm", "warmup", "clip", "lr")}
    rest = len({(p.knobs.source, p.knobs.other) for p in points}) > 1

    def enc(p: Point) -> dict:
        k = p.knobs
        return {"panel": f"{k.norm.capitalize()}-LN" if varies["norm"] else "",
                "colour": k.describe(*(["lr"] if varies["lr"] else []), rest=rest),
                "style": k.describe(*(n for n in ("warmup", "clip") if varies[n]), rest=False)}
    return enc


def dynamics_plots(rs: ResultsSet) -> list[Plot]:
    points = [p for p in study(rs) if p.runs]
    if not points:
        return []
    enc = _encoding(points)
    firsts = [x for p in points for r in p.runs[:1] for x in r.loss[:1] if x is not None]
    ymax = 1.5 * max(firsts) if firsts else None
    diverged = "diverged (last finite value)"
    plots = [curve_plot("dynamics_loss", "Training loss per step", "step", "loss",
                        [Curve(r.steps, r.loss, end=r.diverged_at is not None, **enc(p)) for p in points for r in p.runs],
                        end_label=diverged, ymax=ymax, group=GROUP,
                        caption="One line per run. Panels: norm placement; colours and line styles as the legend says.")]
    for prefix, key, what, threshold in ((ENTROPY, "dynamics_entropy", "attention entropy (nats)", "entropy_threshold"),
                                         (RANK, "dynamics_rank", "effective rank / max", "rank_threshold")):
        runs = [(p, r) for p in points for r in p.monitored]
        lines = sorted({v for _, r in runs for v in [r.entropy_threshold if prefix == ENTROPY else r.rank_threshold]
                        if v is not None})
        plots.append(curve_plot(
            key, f"Lowest layer's {what} per monitored step", "step", what,
            [Curve(r.monitor_steps, r.lowest(prefix), end=r.diverged_at is not None, **enc(p)) for p, r in runs],
            end_label=diverged, hlines=[(f"profile.monitors.{threshold} {v:g}", v) for v in lines], group=GROUP,
            caption="At each monitored step, the layer with the lowest value."))
    plots += _chosen_plots(points)
    return [p for p in plots if p is not None]


def _chosen_plots(points: list[Point]) -> list[Plot | None]:
    """Per layer, for the monitored run that diverged first, else the one with the largest loss spike (none when
    every run was stable)."""
    runs = [(p, r) for p in points for r in p.monitored if r.unstable_at is not None and len(r.monitor) >= 2]
    if not runs:
        return []
    p, r = min(runs, key=lambda pr: (pr[1].diverged_at is None, pr[1].diverged_at or -(pr[1].spike_rise or 0),
                                     pr[0].order))
    marks = [(f"{what} (step {s})", s) for what, s in (("loss spike", r.spike_at), ("diverged", r.diverged_at))
             if s is not None]
    out = []
    for prefix, key, what in ((ENTROPY, "dynamics_entropy_layers", "attention entropy (nats)"),
                              (RANK, "dynamics_rank_layers", "effective rank / max")):
        curves = [Curve(r.monitor_steps, ys, colour=f"layer {int(layer)}")
                  for layer, ys in r.layers(prefix).items()]
        out.append(curve_plot(key, f"{what.capitalize()} per layer: {p.label}", "step", what, curves, vlines=marks,
                              group=GROUP, caption="The monitored run that diverged first, else the one with "
                                                   "the largest loss spike."))
    return out
