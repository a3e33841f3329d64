"""Predicted against measured: every GPU training result re-predicted with its card's calibration.

Reads ``train`` result files (``result.json``) and sweep record files (``*.results.jsonl``), loose or in a run
folder's bundle of records (``records.jsonl.xz``, read through :mod:`scaletool.records`); a run counts
when it completed on a GPU and recorded ``throughput/tokens_per_s_per_gpu``. The card comes from the
result's environment (its GPU name matched to a hardware profile, then to the shipped calibration of
that profile), the world size from the environment, the layout from the recorded recipe. A run given twice
counts once; a run recorded with an option this version no longer has is skipped, and the reason given.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from scaletool.analytic.calibration import Calibration, calibration_for, load_calibration
from scaletool.analytic.zero3 import deepspeed_as_ran
from scaletool.config import recipe_from_dict
from scaletool.errors import RecipeError, echo, shorten
from scaletool.fmt import printable
from scaletool.kinds.engines import ENGINE_KEYS, engine_kind
from scaletool.measure.hardware import load_profiles, profile_for
from scaletool.predict.claims import layout_fields, outside
from scaletool.predict.prediction import predict
from scaletool.records import BUNDLE, read_bundle, read_record, walk_records
from scaletool.resources import data_dir, read_bounded

#: the committed GPU training results, relative to the repository root: train results and sweep record files,
#: loose or in their run folder's bundle (:mod:`scaletool.records`)
COMMITTED = "benchmarks/results"


def _committed_kind(path: Path) -> bool:
    return path.suffix == ".json" or path.name.endswith(".results.jsonl")


def committed_paths() -> list[Path]:
    """The committed results, each by the path it has unpacked (most are in a run folder's bundle): not the
    ``runs/`` folders a study's runs leave beside them (git ignores them; the study's own copy of each result
    is what is committed)."""
    root = data_dir("recipes").resolve().parent  # the checkout: recipes/ beside benchmarks/
    return [r.path for r in walk_records(root / COMMITTED)
            if _committed_kind(r.path) and "runs" not in r.path.relative_to(root).parts[:-1]]


def _given(paths: list[Path]) -> list[tuple[Path, str | None]]:
    """(path, text) of each file named: a bundle (``records.jsonl.xz``) stands for the result files it holds,
    read from it (text given); any other file is read when its runs are (text None)."""
    out: list[tuple[Path, str | None]] = []
    for path in map(Path, paths):
        if path.name == BUNDLE:
            entries = read_bundle(path)
            out += [(path.parent / rel, entries[rel]) for rel in entries if _committed_kind(Path(rel))]
        else:
            out.append((path, None))
    return out


#: a result file is a few KiB, a sweep's record file a few MiB; larger is the wrong file
MAX_RESULT_BYTES = 64 << 20
#: ranges a recorded figure must lie in to be re-predicted: far past any real run, so a real result always
#: passes and a corrupt one (Infinity, 1e-320 s, a 400-digit count) is skipped with the reason
MAX_WORLD = 1 << 20
MAX_TOKENS_PER_STEP = 1e13
MAX_RATE = 1e9  # tokens/s per GPU
STEP_S_RANGE = (1e-6, 1e6)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _runs_in(path: Path, text: str | None = None) -> list[tuple[str, dict]]:
    """(label, train result) of every completed GPU training run the file holds (``text``: its text, read from a
    bundle). The file is read only if it is a regular file of at most :data:`MAX_RESULT_BYTES` (a FIFO or
    /dev/zero is refused, never waited on or read without end); NaN and Infinity, which are not JSON, make a
    record unreadable."""
    if text is None:
        text = read_bounded(path, MAX_RESULT_BYTES, "a training result").decode("utf-8")
    elif len(text) > MAX_RESULT_BYTES:
        raise RecipeError(f"{shorten(str(path))}: larger than {MAX_RESULT_BYTES >> 20} MiB; a training result is a few KiB")
    if path.suffix == ".jsonl":
        out = []
        for line in text.splitlines():
            rec = json.loads(line, parse_constant=_reject_constant) if line.strip() else {}
            if not isinstance(rec, dict):
                continue
            res = rec.get("result")
            if rec.get("mode") == "train" and rec.get("status") == "ok" and isinstance(res, dict):
                out.append((f"{path.name}: {printable(rec.get('label', '?'))}", res))
        return [(label, r) for label, r in out if _usable(r)]
    data = json.loads(text, parse_constant=_reject_constant)
    # committed results by their path under results/, any other file as given
    under = [i for i, part in enumerate(path.parts[:-1]) if part == "results"]
    label = "/".join(path.parts[under[-1] + 1:]) if under else str(path)
    return [(printable(label), data)] if isinstance(data, dict) and _usable(data) else []


def _usable(r: dict) -> bool:
    env, m = r.get("environment"), r.get("metrics")
    if not (isinstance(env, dict) and isinstance(m, dict) and isinstance(r.get("recipe"), dict)):
        return False
    names, rate = env.get("gpu_names"), m.get("throughput/tokens_per_s_per_gpu")
    return (env.get("device_type") == "cuda" and isinstance(names, list) and bool(names) and isinstance(names[0], str)
            and isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0
            and r.get("status", "completed") == "completed")  # its range: figures_problem, with the reason


def _number_kind(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _real(x) -> bool:
    """A number of JSON's kind (not a bool), finite; an integer too large for a float is not one."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return abs(x) < 1e300 and math.isfinite(x)


def figures_problem(r: dict) -> str | None:
    """Why the recorded figures a re-prediction reads (world size, tokens per step, median step time,
    throughput) are not a run's, or None: each must be a finite number of its type within a range far
    past any real run."""
    env, m = r["environment"], r["metrics"]
    world = env.get("world_size", 1)
    if world is None:
        world = 1
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        return f"its environment's world_size is not an integer in 1..{MAX_WORLD:,} ({echo(world)})"
    rate = m["throughput/tokens_per_s_per_gpu"]
    if not rate <= MAX_RATE:
        return f"its throughput/tokens_per_s_per_gpu {echo(rate)} is past {MAX_RATE:g} tokens/s per GPU"
    # not numbers at all (null, text): not used, the run's own throughput is (measured_tokens_per_s_per_gpu)
    tokens, median = r.get("tokens_per_step"), m.get("time/step_s_median")
    tokens = tokens if _number_kind(tokens) else None
    median = median if _number_kind(median) else None
    if tokens is not None and not (_real(tokens) and 0 < tokens <= MAX_TOKENS_PER_STEP):
        return f"its tokens_per_step {echo(tokens)} is not a positive number up to {MAX_TOKENS_PER_STEP:g}"
    if median is not None and not (_real(median) and STEP_S_RANGE[0] <= median <= STEP_S_RANGE[1]):
        return f"its time/step_s_median {echo(median)} is not a step time in {STEP_S_RANGE[0]:g}..{STEP_S_RANGE[1]:g} s"
    if tokens is not None and median is not None and tokens / world / median > MAX_RATE:
        return f"its tokens per step over its median step time is past {MAX_RATE:g} tokens/s per GPU"
    return None


def calibration_of(gpu_name: str, profiles=None, cache: dict | None = None) -> Calibration | None:
    """The shipped calibration of the hardware profile this GPU name matches (None: none)."""
    cache = {} if cache is None else cache
    if gpu_name not in cache:
        prof = profile_for("cuda", gpu_name, profiles)
        cache[gpu_name] = calibration_for(prof.name) if prof else None
    return cache[gpu_name]


def validate(paths: list[Path] | None = None, calibration: str | Calibration | None = None) -> dict:
    """Every run's predicted and measured tokens/s per GPU, the relative error, and its distribution
    overall and by engine (median and worst |error|, n). ``calibration`` (a shipped name, a YAML's path or a
    :class:`Calibration`) predicts every run; by default each run's card's."""
    named = paths is not None
    profiles, cache, rows, skipped, seen, duplicates = load_profiles(), {}, [], [], {}, []
    forced = calibration if isinstance(calibration, Calibration) else (load_calibration(calibration) if calibration
                                                                       else None)
    for path, text in (_given(paths) if named else [(p, None) for p in committed_paths()]):
        try:
            runs = _runs_in(Path(path), text if named else read_record(path))
        except RecipeError as e:  # not a regular file, too large
            if named:
                raise
            skipped.extend(printable(p) for p in e.problems)
            continue
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # nesting past the parser's depth
            raise RecipeError(f"{shorten(str(path))}: cannot read a result: {printable(str(e)[:200])}") from None
        for label, r in runs:
            key = json.dumps([r["metrics"], r["environment"]], sort_keys=True, default=str)
            if key in seen:
                duplicates.append(f"{label}: the run of {seen[key]}")
                continue
            seen[key] = label
            env = r["environment"]
            card = env["gpu_names"][0]
            cal = forced or calibration_of(card, profiles, cache)
            if cal is None:
                skipped.append(f"{label}: no calibration for {printable(echo(card))}")
                continue
            problem = figures_problem(r)
            if problem:
                skipped.append(f"{label}: {printable(problem)}")
                continue
            try:
                recipe = recipe_from_dict(_as_ran(r), label)
            except RecipeError as e:  # an option since removed, or a recipe no version wrote: cannot say what ran
                why = printable(str(e).removeprefix(f"{label}: "))
                skipped.append(f"{label}: recorded with an option this version does not have ({why})")
                continue
            world = 1 if env.get("world_size") is None else env["world_size"]  # absent: one process
            try:
                pred = predict(recipe, cal, world)  # a pipeline run by its stages (analytic.pipeline)
            except (RecipeError, ValueError, ArithmeticError) as e:  # a layout the model refuses at this size
                skipped.append(f"{label}: cannot be predicted ({printable(shorten(str(e), 200))})")
                continue
            measured = measured_tokens_per_s_per_gpu(r, world)
            if not (_real(pred["tokens_per_s_per_gpu"]) and pred["tokens_per_s_per_gpu"] > 0):
                skipped.append(f"{label}: its prediction is not a positive rate ({echo(pred['tokens_per_s_per_gpu'])})")
                continue
            rows.append({"run": label, "outside": None, "moe": bool(recipe.model.n_moe_layers), **layout_fields(recipe),
                         "card": card,
                         "calibration": cal.name, "engine": _engine(recipe),
                         "world_size": pred["world_size"], "compiled": recipe.train.compile,  # what ran
                         "attention": recipe.model.attention, "measured_tokens_per_s_per_gpu": measured,
                         "predicted_tokens_per_s_per_gpu": pred["tokens_per_s_per_gpu"],
                         "rel_error": pred["tokens_per_s_per_gpu"] / measured - 1, "bound": pred["bound"],
                         "predicted_step_s": pred["step_s"],
                         "alloc_retries": (r.get("memory") or {}).get("alloc_retries") or 0})
            rows[-1]["outside"] = outside(rows[-1])
    return {"runs": rows, "skipped": skipped, "duplicates": duplicates, "summary": summarize(rows)}


def _as_ran(r: dict) -> dict:
    """The recorded recipe with the settings the run had: the ZeRO settings (:func:`deepspeed_as_ran` for a
    run recorded before scaletool derived them); FSDP2 under pure tensor parallelism for a run recorded before
    the engine dropped it there (its recipe has no ``parallel.fsdp_on_one_rank``); the capacity dispatch for a
    MoE run recorded before ``model.moe_dispatch`` existed (capacity was the only dispatch then)."""
    recipe = r["recipe"]
    model = recipe.get("model") if isinstance(recipe.get("model"), dict) else {}
    if (model.get("ffn") == "moe" or model.get("n_routed_experts")) and "moe_dispatch" not in model:
        recipe = {**recipe, "model": {**model, "moe_dispatch": "capacity"}}
    par = recipe.get("parallel") if isinstance(recipe.get("parallel"), dict) else {}
    tp = par.get("tensor_parallel")
    # a value of another type ("2", [2]) is left for the recipe's validation to name
    if _real(tp) and tp > 1 and "fsdp_on_one_rank" not in par:
        return {**recipe, "parallel": {**par, "fsdp_on_one_rank": True}}
    # runs of the engine with the DeepSpeed passthrough that did not record the config they were given
    if ENGINE_KEYS.get("deepspeed") != par.get("engine") or "deepspeed_config" in r["environment"]:
        return recipe
    ds = par.get("deepspeed")
    if ds is not None and not (isinstance(ds, dict) and isinstance(ds.get("zero_optimization") or {}, dict)):
        return recipe  # not a passthrough DeepSpeed could have run: the recipe's validation names it
    return {**recipe, "parallel": {**par, "deepspeed": deepspeed_as_ran(ds, par.get("zero_stage"))}}


def measured_tokens_per_s_per_gpu(r: dict, world: int) -> float:
    """Tokens/s per GPU at the median step time (warm-up excluded) where the result records it: ZeRO-3's
    host-bound steps have long tails that the mean carries; else the result's own throughput."""
    m, median = r["metrics"], r["metrics"].get("time/step_s_median")
    tokens = r.get("tokens_per_step")
    if isinstance(median, (int, float)) and median > 0 and isinstance(tokens, (int, float)) and tokens > 0:
        return tokens / world / median
    return float(m["throughput/tokens_per_s_per_gpu"])


def _engine(recipe) -> str:
    p = recipe.parallel
    kind = engine_kind(p.engine)
    name = f"{p.engine} {kind.title(p.zero_stage)}" if kind.zero_stages else p.engine
    pp = f" PP{p.pipeline_parallel} {p.pipeline_schedule}" if p.pipeline_parallel > 1 else ""
    return name + (f" TP{p.tensor_parallel}" if p.tensor_parallel > 1 else "") + pp


def summarize(rows: list[dict]) -> dict:
    """Median and worst |relative error| with n: over every run (``all``), over those the model claims
    (``modelled``: no :func:`outside` reason) and by engine among them (compiled runs apart), and per reason
    for the others (``outside``)."""
    def stats(rs):
        errs = [abs(r["rel_error"]) for r in rs]
        return {"n": len(errs), "median_abs_error": statistics.median(errs) if errs else None,
                "worst_abs_error": max(errs) if errs else None}
    modelled = [r for r in rows if not r.get("outside")]
    groups: dict[str, list[dict]] = {}
    for r in modelled:
        groups.setdefault(r["engine"] + (" compiled" if r["compiled"] else ""), []).append(r)
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("outside"):
            out.setdefault(r["outside"], []).append(r)
    return {"all": stats(rows), "modelled": stats(modelled),
            "by_engine": {k: stats(v) for k, v in sorted(groups.items())},
            "outside": {k: stats(v) for k, v in out.items()}}
