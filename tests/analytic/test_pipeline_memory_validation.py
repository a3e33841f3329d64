"""Stage memory against every committed pipeline run (benchmarks/results/pipeline/): each rank's peak beside its
stage's estimate (summaries), the largest stage's beside the run's peak (study records); docs/prediction.md's band."""
from __future__ import annotations

import ast
import json
import lzma
import statistics
from pathlib import Path

import pytest

from scaletool.analytic.pipeline import stage_memory
from scaletool.config import load_recipe, recipe_from_dict

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "pipeline"


def _records():
    for f in sorted(RESULTS.glob("*/records.jsonl.xz")):
        world = int(f.parent.name.split("x", 1)[0])  # 2xh200-..., 4xh200-...
        with lzma.open(f, "rt") as fh:
            yield from ((f.parent.name, world, json.loads(line)) for line in fh)


def _errors() -> list[tuple[str, float]]:
    out = []
    for folder, world, rec in _records():
        if rec["path"].endswith("summary.json"):
            s = json.loads(rec["text"])
            if s.get("status") != "completed" or s["recipe"]["parallel"]["pipeline_parallel"] < 2:
                continue
            ws = s["environment"]["world_size"]
            stages = stage_memory(recipe_from_dict(s["recipe"]), ws)
            per_stage = ws // s["recipe"]["parallel"]["pipeline_parallel"]
            for row in s["memory"]["per_rank"]:
                est = stages[row["rank"] // per_stage]["total_bytes"]
                out.append((f"{folder}/{rec['path']} rank {row['rank']}", est / row["peak_allocated_bytes"] - 1))
        elif rec["path"].endswith(".jsonl") and "run-summaries" not in rec["path"]:
            for line in rec["text"].splitlines():
                d = json.loads(line)
                sets = d.get("sets")
                sets = ast.literal_eval(sets) if isinstance(sets, str) else sets
                if not sets or not any(x.startswith("parallel.pipeline_parallel=") for x in sets):
                    continue
                measured = d["measured"] if isinstance(d["measured"], dict) else ast.literal_eval(d["measured"])
                if str(d["returncode"]) != "0" or not measured.get("peak_memory_bytes"):
                    continue
                recipe = load_recipe(ROOT / "recipes" / f"{d['model']}.yaml", [*sets, f"parallel.world_size={world}"])
                est = max(x["total_bytes"] for x in stage_memory(recipe, world))
                out.append((f"{folder}/{d['name']}", est / measured["peak_memory_bytes"] - 1))
    return out


def test_every_committed_pipeline_stage_is_estimated_within_the_stated_band():
    errors = _errors()
    assert len(errors) >= 160, len(errors)  # 108 ranks of 27 runs' summaries, 57 study records
    worst = [(name, round(e, 3)) for name, e in errors if not -0.10 <= e <= 0.12]
    assert not worst, worst
    assert statistics.median(abs(e) for _, e in errors) < 0.04
    # compiled 16-block stages of Llama-3-8B keep a compiled block's count: +10.1 ... +13.2% on the eager one
    assert all(abs(e) < 0.07 for name, e in errors if name.startswith("2xh200-2026-11-29/pp2-"))
    # interleaved's last rank holds three micro-batches of its first chunk at its peak (torch's issue order), not
    # 1.5 stages' worth of an average chunk: mla-1b PP 2 x 2 at 8 micro-batches was -10.4% (-11.7% kept gathered)
    raf = [e for name, e in errors if "-raf/run-summaries/" in name and "interleaved" in name and "rank 2" in name]
    assert len(raf) == 4 and all(abs(e) < 0.05 for e in raf), raf
    # beyond +10% only the 1-sequence PP 4 interleaved run at 4 micro-batches (the largest rank's peak; +11.8%)
    assert all("4xh200-2026-11-27/mla-1b-pp4-interleaved-m4" in name for name, e in errors if e > 0.10)


def test_interleaved_peak_follows_torchs_issue_order():
    """interleaved_peak against the order torch's own ScheduleInterleaved1F1B computes for each rank (its
    _calculate_single_rank_operations, no process group): the largest sum of in-flight chunk micro-batches."""
    import random

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from scaletool.analytic.pipeline import interleaved_peak

    rng = random.Random(0)
    for p, v, m in ((2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 12), (2, 4, 6), (8, 2, 16)):
        sched = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
        sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
        sched.number_of_rounds = max(1, m // p)
        sched.microbatches_per_round = m // sched.number_of_rounds
        for rank in range(p):
            sizes = [rng.uniform(1, 5) for _ in range(v)]
            held, best = 0.0, 0.0
            for act in sched._calculate_single_rank_operations(rank):
                if act is None:
                    continue
                local = act.stage_index // p
                if act.computation_type == _ComputationType.FORWARD:
                    held += sizes[local]
                    best = max(best, held)
                else:
                    best = max(best, held)
                    held -= sizes[local]
            assert interleaved_peak(p, v, m, rank, sizes)[0] == pytest.approx(best), (p, v, m, rank)
