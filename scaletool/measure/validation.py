"""Predicted against measured: every GPU training result re-predicted with its card's calibration.

Reads ``train`` result files (``result.json``) and sweep record files (``*.results.jsonl``); a run counts
when it completed on a GPU and recorded ``throughput/tokens_per_s_per_gpu``. The card comes from the
result's environment (its GPU name matched to a hardware profile, then to the shipped calibration of
that profile), the world size from the environment, the layout from the recorded recipe.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from scaletool.analytic.calibration import Calibration, calibration_for, load_calibration
from scaletool.analytic.step import predict_step
from scaletool.analytic.zero3 import deepspeed_as_ran
from scaletool.config import recipe_from_dict
from scaletool.errors import RecipeError
from scaletool.measure.hardware import load_profiles, profile_for
from scaletool.resources import data_dir

#: the committed GPU training results, relative to the repository root
COMMITTED = ("recipes/benchmarks/results/*.json", "recipes/benchmarks/results/*/*.json",
             "recipes/benchmarks/sweep-results/*.results.jsonl")


def committed_paths() -> list[Path]:
    root = data_dir("recipes").parent
    return sorted(p for pat in COMMITTED for p in root.glob(pat))


def _runs_in(path: Path) -> list[tuple[str, dict]]:
    """(label, train result) of every completed GPU training run the file holds."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        out = []
        for line in text.splitlines():
            rec = json.loads(line) if line.strip() else {}
            res = rec.get("result")
            if rec.get("mode") == "train" and rec.get("status") == "ok" and isinstance(res, dict):
                out.append((f"{path.name}: {rec.get('label', '?')}", res))
        return [(label, r) for label, r in out if _usable(r)]
    data = json.loads(text)
    label = path.name if path.parent.name == "results" else f"{path.parent.name}/{path.name}"
    return [(label, data)] if isinstance(data, dict) and _usable(data) else []


def _usable(r: dict) -> bool:
    env, m = r.get("environment") or {}, r.get("metrics") or {}
    return (env.get("device_type") == "cuda" and bool(env.get("gpu_names")) and "recipe" in r
            and bool(m.get("throughput/tokens_per_s_per_gpu")) and r.get("status", "completed") == "completed")


def calibration_of(gpu_name: str, profiles=None, cache: dict | None = None) -> Calibration | None:
    """The shipped calibration of the hardware profile this GPU name matches (None: none)."""
    cache = {} if cache is None else cache
    if gpu_name not in cache:
        prof = profile_for("cuda", gpu_name, profiles)
        cache[gpu_name] = calibration_for(prof.name) if prof else None
    return cache[gpu_name]


def validate(paths: list[Path] | None = None, calibration: str | None = None) -> dict:
    """Every run's predicted and measured tokens/s per GPU, the relative error, and its distribution
    overall and by engine (median and worst |error|, n)."""
    paths = committed_paths() if paths is None else paths
    profiles, cache, rows, skipped = load_profiles(), {}, [], []
    forced = load_calibration(calibration) if calibration else None
    for path in paths:
        try:
            runs = _runs_in(Path(path))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RecipeError(f"{path}: cannot read a result: {e}") from None
        for label, r in runs:
            env = r["environment"]
            card = env["gpu_names"][0]
            cal = forced or calibration_of(card, profiles, cache)
            if cal is None:
                skipped.append(f"{label}: no calibration for {card!r}")
                continue
            recipe = recipe_from_dict(_as_ran(r), label)
            pred = predict_step(recipe, cal, world_size=int(env.get("world_size") or 1))
            measured = measured_tokens_per_s_per_gpu(r)
            rows.append({"run": label, "moe": bool(recipe.model.n_moe_layers), "async_tp": recipe.parallel.async_tp,
                         "tp_local_ops": recipe.parallel.tp_local_ops,
                         "float8": recipe.train.float8,
                         "card": card,
                         "calibration": cal.name, "engine": _engine(recipe),
                         "world_size": pred["world_size"], "compiled": pred["compiled"],
                         "attention": recipe.model.attention, "measured_tokens_per_s_per_gpu": measured,
                         "predicted_tokens_per_s_per_gpu": pred["tokens_per_s_per_gpu"],
                         "rel_error": pred["tokens_per_s_per_gpu"] / measured - 1, "bound": pred["bound"],
                         "predicted_step_s": pred["step_s"]})
    return {"runs": rows, "skipped": skipped, "summary": summarize(rows)}


def _as_ran(r: dict) -> dict:
    """The recorded recipe with the settings the run had: the ZeRO settings (:func:`deepspeed_as_ran` for a
    run recorded before scaletool derived them); FSDP2 under pure tensor parallelism for a run recorded before
    the engine dropped it there (its recipe has no ``parallel.fsdp_on_one_rank``)."""
    recipe = r["recipe"]
    par = recipe.get("parallel") or {}
    if (par.get("tensor_parallel") or 1) > 1 and "fsdp_on_one_rank" not in par:
        return {**recipe, "parallel": {**par, "fsdp_on_one_rank": True}}
    if par.get("engine") != "deepspeed" or "deepspeed_config" in r["environment"]:
        return recipe
    return {**recipe, "parallel": {**par, "deepspeed": deepspeed_as_ran(par.get("deepspeed"), par.get("zero_stage"))}}


def measured_tokens_per_s_per_gpu(r: dict) -> float:
    """Tokens/s per GPU at the median step time (warm-up excluded) where the result records it: ZeRO-3's
    host-bound steps have long tails that the mean carries; else the result's own throughput."""
    m, median = r["metrics"], r["metrics"].get("time/step_s_median")
    world = int(r["environment"].get("world_size") or 1)
    if median and r.get("tokens_per_step"):
        return r["tokens_per_step"] / world / median
    return float(m["throughput/tokens_per_s_per_gpu"])


def _engine(recipe) -> str:
    p = recipe.parallel
    name = f"deepspeed ZeRO-{p.zero_stage}" if p.engine == "deepspeed" else p.engine
    return name + (f" TP{p.tensor_parallel}" if p.tensor_parallel > 1 else "")


def summarize(rows: list[dict]) -> dict:
    """Median and worst |relative error| with n, overall and by engine (compiled runs apart)."""
    def stats(rs):
        errs = [abs(r["rel_error"]) for r in rs]
        return {"n": len(errs), "median_abs_error": statistics.median(errs) if errs else None,
                "worst_abs_error": max(errs) if errs else None}
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["engine"] + (" compiled" if r["compiled"] else ""), []).append(r)
    return {"all": stats(rows), "by_engine": {k: stats(v) for k, v in sorted(groups.items())}}
