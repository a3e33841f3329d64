"""The training-dynamics findings: each claim about the runs' stability judged against the study's points.

Each claim (:data:`~scaletool.report.dynamics.CLAIM_NORM`, ``CLAIM_REMEDY``, ``CLAIM_COLLAPSE``) is judged per
group of points that differ only in what it is about (:mod:`scaletool.report.dynamics` builds the points and
defines divergence, loss spikes and collapse): supported, contradicted, mixed, or cannot tell.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from scaletool.report.data import ResultsSet
from scaletool.report.dynamics import (
    CLAIM_COLLAPSE,
    CLAIM_NORM,
    CLAIM_REMEDY,
    ENTROPY,
    RANK,
    Knobs,
    Point,
    Run,
    study,
)
from scaletool.report.tables import fmt
from scaletool.stats import Spread, compare

SUPPORTS, CONTRADICTS, UNKNOWN = "supports", "contradicts", "cannot tell"


@dataclass
class Evidence:
    verdict: str  # SUPPORTS, CONTRADICTS or UNKNOWN
    text: str


def _pairs(points: list[Point], knob: str, a: Callable[[Knobs], bool], b: Callable[[Knobs], bool],
           keep: Callable[[Knobs], bool] = lambda k: True) -> list[tuple[Point, Point]]:
    """(a point, b point) pairs that differ only in ``knob`` (several b points may pair with one a)."""
    groups: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        if keep(p.knobs):
            groups[p.knobs.without(knob)].append(p)
    return [(x, y) for g in groups.values() for x in g if a(x.knobs) for y in g if b(y.knobs)]


def _verdict(claim: str, evidence: list[Evidence], none: str) -> str:
    """One finding: the claim, the verdict over the judged groups, and each group's evidence."""
    judged = [e for e in evidence if e.verdict != UNKNOWN]
    if not judged:
        why = none if not evidence else none + "; " + "; ".join(e.text for e in evidence)
        return f"Claim “{claim}”: cannot tell — {why}."
    if all(e.verdict == SUPPORTS for e in judged):
        head = "supported by the data"
    elif all(e.verdict == CONTRADICTS for e in judged):
        head = "contradicted by the data"
    else:
        n = sum(e.verdict == SUPPORTS for e in judged)
        head = f"mixed: supported in {n} of {len(judged)} comparisons, contradicted in {len(judged) - n}"
    return f"Claim “{claim}”: {head} — " + "; ".join(f"{e.text} ({e.verdict})" for e in evidence) + "."


def _event(r: Run) -> str:
    if r.diverged_at is not None:
        return f"diverged at step {r.diverged_at}"
    return f"loss spike at step {r.spike_at} (+{r.spike_rise:.0%})"


def _loss(s: Spread) -> str:
    return f"{fmt(s.median, 'float')} (p10–p90 {fmt(s.p10, 'float')}–{fmt(s.p90, 'float')}, n={s.n})"


def norm_claim(points: list[Point]) -> str:
    """Post-LN against Pre-LN, both without warm-up, at each other setting (clipping, lr, ...)."""
    pairs = _pairs(points, "norm", lambda k: k.norm == "pre", lambda k: k.norm == "post", keep=lambda k: k.warmup == 0)
    evidence = []
    for pre, post in pairs:
        where = post.knobs.describe("clip", "lr")
        if not (pre.trained and post.trained):
            evidence.append(Evidence(UNKNOWN, f"{where}: a run without a result"))
        elif pre.diverged:
            also = f", Post-LN {_event(post.diverged[0])}" if post.diverged else ", Post-LN did not"
            evidence.append(Evidence(CONTRADICTS, f"{where}: Pre-LN {_event(pre.diverged[0])}{also}"))
        elif post.diverged:
            evidence.append(Evidence(SUPPORTS, f"{where}: Post-LN {_event(post.diverged[0])}, Pre-LN did not diverge"))
        elif post.final is None or pre.final is None:
            evidence.append(Evidence(UNKNOWN, f"{where}: no final loss to compare"))
        else:
            c = compare(post.final, pre.final)
            losses = f"final loss Post-LN {_loss(post.final)} vs Pre-LN {_loss(pre.final)}"
            if c.reason:
                evidence.append(Evidence(UNKNOWN, f"{where}: {losses}, {c.describe()}"))
            elif c.significant and c.rel_diff > 0:
                evidence.append(Evidence(SUPPORTS, f"{where}: neither diverged; Post-LN trained worse: {losses}, "
                                                   f"{c.describe()}"))
            else:
                evidence.append(Evidence(CONTRADICTS, f"{where}: neither diverged; {losses}, "
                                                      f"{c.describe('Post-LN worse', 'Post-LN better')}"))
    none = ("no pair could be judged" if pairs else
            "the data have no Pre-LN and Post-LN points without warm-up that differ in nothing else")
    return _verdict(CLAIM_NORM, evidence, none)


def remedy_claim(points: list[Point], knob: str) -> str:
    """Runs without the remedy (``clip`` or ``warmup`` 0) against the same runs with it: unstable without
    it and stable with it supports the claim; unstable with it contradicts it; stable either way says nothing."""
    name = {"clip": "gradient clipping", "warmup": "warm-up"}[knob]
    pairs = _pairs(points, knob, lambda k: getattr(k, knob) == 0, lambda k: getattr(k, knob) > 0)
    evidence = []
    for off, on in pairs:
        where = on.knobs.describe(*(n for n in ("norm", "warmup", "clip", "lr") if n != knob))
        where += f" ({on.knobs.describe(knob, rest=False)} against none)"
        if not (off.trained and on.trained):
            evidence.append(Evidence(UNKNOWN, f"{where}: a run without a result"))
        elif off.unstable and not on.unstable:
            evidence.append(Evidence(SUPPORTS, f"{where}: without it {_event(off.unstable[0])}, with it stable"))
        elif on.unstable:
            without = f"without it {_event(off.unstable[0])}" if off.unstable else "stable without it"
            evidence.append(Evidence(CONTRADICTS, f"{where}: with it {_event(on.unstable[0])}, {without}"))
    none = (f"no run without {name} was unstable (no divergence, no loss spike), so there was nothing to prevent"
            if pairs else f"the data have no points with and without {name} that differ in nothing else")
    return _verdict(f"{CLAIM_REMEDY} ({name})", evidence, none)


def collapse_claim(points: list[Point]) -> str:
    """Did entropy and rank collapse come before each divergence (and how often without one)?"""
    diverged = [r for p in points for r in p.diverged if r.monitored]
    stable = [r for p in points for r in p.runs if r.monitored and r.diverged_at is None and r.status == "completed"]
    evidence = []
    for r in diverged:
        head = f"a run diverging at step {r.diverged_at}"
        if not (r.before(ENTROPY) or r.before(RANK)):
            evidence.append(Evidence(UNKNOWN, f"{head}: no monitored step before it"))
            continue
        ent, rank = r.collapse_at(ENTROPY), r.collapse_at(RANK)
        text = (f"{head}: " + (f"entropy collapse at step {ent}" if ent is not None else "no entropy collapse") + ", "
                + (f"rank collapse at step {rank}" if rank is not None else "no rank collapse") + " before it")
        both = ent is not None and rank is not None
        if not both and (ent is not None or rank is not None):
            text += " (only one of the two)"  # the claim names both
        evidence.append(Evidence(SUPPORTS if both else CONTRADICTS, text))
    none = "no monitored step came before any divergence" if diverged else "no monitored run diverged"
    text = _verdict(CLAIM_COLLAPSE, evidence, none)
    if not diverged:
        text += _against_spikes([r for p in points for r in p.monitored if r.spike_at is not None])
    false_alarms = [r for r in stable if r.collapse_at(ENTROPY) is not None or r.collapse_at(RANK) is not None]
    if stable:
        text += (f" Of the {len(stable)} monitored run(s) that did not diverge, {len(false_alarms)} collapsed "
                 "(entropy or rank below its threshold) all the same.")
    return text


def _against_spikes(spiking: list[Run]) -> str:
    """With no divergence to test the claim on, what the monitors show around the loss spikes (not the claim's
    verdict: a spike is not a divergence)."""
    if not spiking:
        return ""
    measured = [r for r in spiking if r.before(ENTROPY, r.spike_at) or r.before(RANK, r.spike_at)]
    text = " Against the loss spikes instead, the nearest instability in these runs: "
    if measured:
        ent = sum(r.collapse_at(ENTROPY, r.spike_at) is not None for r in measured)
        rank = sum(r.collapse_at(RANK, r.spike_at) is not None for r in measured)
        first = [r for r in measured if r.collapse_at(ENTROPY, r.spike_at) is not None
                 or r.collapse_at(RANK, r.spike_at) is not None]
        later = sum(r.collapse_at(ENTROPY) is not None or r.collapse_at(RANK) is not None for r in measured
                    if r not in first)
        text += (f"of the {len(measured)} spiking run(s) with a monitored step before the spike, entropy collapse came "
                 f"first in {ent} and rank collapse in {rank}; {later} collapsed only after the spike, "
                 f"{len(measured) - len(first) - later} not at all")
    unseen = len(spiking) - len(measured)
    if unseen:
        text += ("; " if measured else "") + f"{unseen} spiked before their first monitored step"
    return text + "."


def dynamics_findings(rs: ResultsSet) -> list[str]:
    points = study(rs)
    if not points:
        return []
    return [norm_claim(points), remedy_claim(points, "clip"), remedy_claim(points, "warmup"), collapse_claim(points)]
