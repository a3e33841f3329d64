"""Sweep points: the base recipe with one combination of values applied, validated, and (optionally)
resized to an equal parameter budget. A point that does not validate is kept, with its reason, so the
sweep can record it as skipped instead of failing."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from scaletool.analytic.params import param_counts
from scaletool.config import Recipe, RecipeError, apply_overrides, recipe_from_dict
from scaletool.sweep.spec import MatchParams, Sweep, slug


@dataclass
class Point:
    index: int
    values: dict[str, Any]          # the dotted keys this point varies, as written in the sweep file
    label: str                      # short human name: "attention=mla kv_lora_rank=128"
    recipe: Recipe | None           # None when the point did not validate
    raw: dict                       # the recipe as written: base + set + values (+ the solved key)
    reason: str | None = None       # why it is skipped
    match_params: dict | None = None  # the equal-budget solution, when asked for

    @property
    def skipped(self) -> bool:
        return self.recipe is None

    @property
    def point_id(self) -> str:
        """Hash of the resolved recipe (of the raw mapping for an invalid point)."""
        if self.recipe is not None:
            return self.recipe.digest()
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def key(self, mode: str, args: list[str], repeat: int = 0) -> str:
        """Result key: resolved recipe + mode + the mode's extra arguments (Recipe.digest) + the repeat.

        Repeat 0 hashes exactly as before repeats existed, so results directories written then resume.
        """
        extra = f"\0{mode}\0{json.dumps(args)}" + (f"\0repeat={repeat}" if repeat else "")
        if self.recipe is not None:
            return self.recipe.digest(extra)
        blob = json.dumps(self.raw, sort_keys=True, default=str) + extra
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def dirname(self) -> str:
        """The point's directory under ``points/``: a safe slug of the label plus the point's hash."""
        return f"{slug(self.label, 60, '_') or 'base'}-{self.point_id[:8]}"


def short_names(keys: list[str]) -> dict[str, str]:
    """``model.kv_lora_rank`` -> ``kv_lora_rank`` unless two varied keys share their last part."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def label_of(values: dict[str, Any], names: dict[str, str]) -> str:
    if not values:
        return "base"
    return " ".join(f"{names[k]}={_fmt(v)}" for k, v in values.items())


def _fmt(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def expand(sweep: Sweep) -> list[Point]:
    """Every point of the sweep, in order: zip points outermost, then the grid's product."""
    all_values = sweep.point_values()
    keys: list[str] = []
    for v in all_values:
        keys += [k for k in v if k not in keys]
    names = short_names(keys)
    mp = sweep.spec.match_params
    points = []
    for i, values in enumerate(all_values):
        label = label_of(values, names)
        raw = apply_overrides(sweep.base_raw, list(values.items()))
        try:
            recipe = recipe_from_dict(raw, f"point {i} ({label})")
        except RecipeError as e:
            points.append(Point(i, values, label, None, raw, reason="; ".join(_strip(p) for p in e.problems)))
            continue
        solution = None
        if mp is not None:
            try:
                recipe, solution = solve_params(recipe, mp, sweep.target_params)
            except RecipeError as e:
                points.append(Point(i, values, label, None, raw, reason="; ".join(e.problems)))
                continue
            solution["target_source"] = sweep.target_source
            raw = apply_overrides(raw, [(mp.key, solution["value"])])
        points.append(Point(i, values, label, recipe, raw, match_params=solution))
    _refuse_duplicates(points)
    return points


def _refuse_duplicates(points: list[Point]) -> None:
    """Two points that resolve to the same recipe would share results and one report row.

    Where they differ only in keys the recipe leaves inactive (``kv_lora_rank`` of an MHA point, a MoE key
    of a dense FFN), the later point is kept as skipped, its reason naming the point it repeats and the
    inactive keys, so the sweep and the report say so. Any other collision (``128`` and ``128.0``, a value
    equal to the default it replaces, a solved key) is an error naming both points.
    """
    first: dict[str, Point] = {}
    problems = []
    for i, p in enumerate(points):
        other = first.setdefault(p.point_id, p)
        if other is p:
            continue
        differ = {k for k in {**other.values, **p.values} if other.values.get(k) != p.values.get(k)}
        inactive = set(p.recipe.inactive) | set(other.recipe.inactive)
        if differ and differ <= inactive:
            why = ", ".join(sorted(differ))
            points[i] = Point(p.index, p.values, p.label, None, p.raw, match_params=p.match_params,
                              reason=f"same recipe as point {other.index} ({_short(other.label)}): {why} inactive "
                                     f"for attention={p.recipe.model.attention}, ffn={p.recipe.model.ffn}")
            continue
        problems.append(f"points {other.index} ({_short(other.label)}) and {p.index} ({_short(p.label)}) resolve "
                        "to the same recipe; drop one of the values")
    if problems:
        raise RecipeError(problems)


def _short(label: str, limit: int = 100) -> str:
    """A label for an error line: one line, at most ``limit`` characters."""
    label = " ".join(label.split())
    return label if len(label) <= limit else label[:limit - 3] + "..."


def _strip(problem: str) -> str:
    """Drop the 'point i (label): ' prefix validation adds; the record carries the label already."""
    return problem.split(": ", 1)[1] if problem.startswith("point ") else problem


def solve_params(recipe: Recipe, mp: MatchParams, target: int) -> tuple[Recipe, dict]:
    """Set ``mp.key`` to the multiple of ``multiple_of`` whose parameter count is nearest ``target``.

    The count is linear and increasing in both matchable keys (intermediate_size scales the FFN
    matrices, n_layers repeats whole blocks), so a bisection over the multiples finds the crossing;
    the nearer of its two neighbours wins.
    """
    field_name = mp.key.split(".", 1)[1]
    unit = mp.multiple_of or (64 if field_name == "intermediate_size" else 1)
    cfg = recipe.model

    def params_at(k: int) -> int:
        return param_counts(cfg.model_copy(update={field_name: k * unit}))[mp.params]

    if params_at(1) > target:
        raise RecipeError(f"match_params: even {mp.key}={unit} gives {params_at(1):,} {mp.params} "
                          f"parameters, above the target {target:,}")
    lo, hi = 1, 2
    while params_at(hi) < target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: params_at(lo) < target <= params_at(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if params_at(mid) < target else (lo, mid)
    k = min((lo, hi), key=lambda j: abs(params_at(j) - target))
    value = k * unit
    solved = recipe_from_dict(apply_overrides(recipe.to_dict(), [(mp.key, value)]), "match_params")
    achieved = param_counts(solved.model)[mp.params]
    return solved, {"key": mp.key, "value": value, "base_value": getattr(cfg, field_name), "target": target,
                    "achieved": achieved, "rel_error": (achieved - target) / target, "params": mp.params,
                    "multiple_of": unit}
