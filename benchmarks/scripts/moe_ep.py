"""Expert parallelism for the dropless MoE beside EP with capacity dispatch and FSDP2 alone, each beside its prediction.

    python benchmarks/scripts/moe_ep.py OUT [--nproc 4] [--steps 12] [--warmup 4] [--tiny]

mla-1b with 16 routed experts top-2 (width 1,024), one shared expert, the first block dense, balance loss
α = 0.001 (the moe-speed study's MoE), bf16, eager, micro-batch 4 × 2,048 per GPU, one job per point under
``scaletool train --nproc-per-node N``:

- ``dropless-ep``: dropless dispatch, experts split over the N GPUs (uneven all-to-all);
- ``capacity-ep``: capacity dispatch (factor 1.25), experts split over the N GPUs (equal all-to-all);
- ``dropless-fsdp``: dropless dispatch, every expert sharded by FSDP2 (no expert parallelism).

OUT gets each run's directory, ``records.json`` (per point: tokens/s per GPU as median, p10, p90 and n over
the measured steps, warm-up excluded; the largest peak of the ranks; the estimate and the prediction;
the measured expert imbalance and the busiest rank's share) and ``table.md``. ``--tiny``: the tiny recipe's
MoE on the CPU (gloo), to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOE = ["model.ffn=moe", "model.n_routed_experts=16", "model.num_experts_per_tok=2", "model.n_shared_experts=1",
       "model.moe_intermediate_size=1024", "model.first_k_dense_replace=1", "model.aux_loss_alpha=0.001"]
TINY_MOE = ["model.ffn=moe", "model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.n_shared_experts=1",
            "model.moe_intermediate_size=32", "model.first_k_dense_replace=1"]
POINTS = {
    "dropless-ep": ["model.moe_dispatch=dropless", "parallel.expert_parallel=true"],
    "capacity-ep": ["model.moe_dispatch=capacity", "parallel.expert_parallel=true"],
    "dropless-fsdp": ["model.moe_dispatch=dropless"],
}


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = q * (len(s) - 1)
    lo = int(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


def spread(xs: list[float]) -> dict | None:
    return {"median": statistics.median(xs), "p10": _quantile(xs, 0.1), "p90": _quantile(xs, 0.9), "n": len(xs)} if xs else None


def run_point(out: Path, name: str, args) -> dict:
    recipe = str(ROOT / "recipes" / ("tiny.yaml" if args.tiny else "mla-1b.yaml"))
    sets = (TINY_MOE if args.tiny else MOE) + POINTS[name] + [
        "parallel.engine=fsdp", f"train.steps={args.steps}", f"train.measure_warmup_steps={args.warmup}",
        f"train.log_every={args.steps}", "train.compile=false"] + ([] if args.tiny else ["train.micro_batch_size=4"])
    cmd = [sys.executable, "-m", "scaletool", "train", recipe, "--out", str(out / "runs" / name), "--json",
           "--nproc-per-node", str(args.nproc)]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return {"point": name, "status": "failed", "message": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return figures(name, json.loads(p.stdout))


def figures(name: str, s: dict) -> dict:
    """One point's record from its train summary."""
    world = s["environment"]["world_size"]
    steps = s["history"]["step_time_s"][s["measure_warmup_steps"]:]
    per_gpu = [s["tokens_per_step"] / t / world for t in steps if t > 0]
    mem = s.get("memory") or {}
    peaks = [r.get("peak_allocated_bytes") for r in mem.get("per_rank") or [] if r.get("peak_allocated_bytes")]
    pred = s.get("prediction") or {}
    moe = s.get("moe") or {}
    loads = moe.get("tokens_per_expert_last_step") or {}
    per_rank = moe.get("experts_per_rank") or 0
    busiest = []  # each MoE layer: the busiest rank's routed rows over the mean (what the estimate takes as 1.35)
    for row in loads.values():
        if per_rank and len(row) > per_rank:
            ranks = [sum(row[i:i + per_rank]) for i in range(0, len(row), per_rank)]
            busiest.append(max(ranks) / (sum(ranks) / len(ranks)))
    return {
        "point": name, "status": s.get("status"), "world_size": world, "dispatch": moe.get("dispatch"),
        "experts_per_rank": per_rank, "tokens_per_s_per_gpu": spread(per_gpu),
        "predicted_tokens_per_s_per_gpu": pred.get("tokens_per_s_per_gpu"),
        "predicted_terms": pred.get("terms"), "contended": (s.get("contention") or {}).get("contended"),
        "peak_allocated_bytes_max_rank": max(peaks) if peaks else None,
        "estimated_bytes": (mem.get("analytic") or {}).get("total_bytes"),
        "expert_imbalance_mean": (s.get("metrics") or {}).get("moe/imbalance_ratio_mean"),
        "busiest_rank_over_mean": max(busiest) if busiest else None,
        "dropped_fraction": (s.get("metrics") or {}).get("moe/dropped_fraction"),
    }


def table(records: list[dict]) -> str:
    lines = ["| point | tokens/s per GPU (p10-p90, n) | predicted | error | peak GiB (max rank) | estimate GiB | error "
             "| busiest rank / mean | dropped |", "|---|---|---|---|---|---|---|---|---|"]
    gib = 2 ** 30
    for r in records:
        if r["status"] != "completed":
            lines.append(f"| {r['point']} | failed: {str(r.get('message'))[:80]} | | | | | | | |")
            continue
        t, pred = r["tokens_per_s_per_gpu"], r["predicted_tokens_per_s_per_gpu"]
        peak, est = r["peak_allocated_bytes_max_rank"], r["estimated_bytes"]
        cells = [r["point"], f"{t['median']:,.0f} ({t['p10']:,.0f}-{t['p90']:,.0f}, n={t['n']})" if t else "-",
                 f"{pred:,.0f}" if pred else "-", f"{(pred - t['median']) / t['median']:+.1%}" if pred and t else "-",
                 f"{peak / gib:.2f}" if peak else "-", f"{est / gib:.2f}" if est else "-",
                 f"{(est - peak) / peak:+.1%}" if peak and est else "-",
                 f"{r['busiest_rank_over_mean']:.2f}" if r["busiest_rank_over_mean"] else "-",
                 f"{r['dropped_fraction']:.2%}" if r["dropped_fraction"] is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--points", default=",".join(POINTS), help="comma-separated: " + ", ".join(POINTS))
    p.add_argument("--tiny", action="store_true", help="the tiny recipe's MoE (CPU check of the script)")
    args = p.parse_args(argv)
    names = [n for n in args.points.split(",") if n]
    bad = [n for n in names if n not in POINTS]
    if bad or not names:
        p.exit(2, f"error: --points: unknown point {bad[0] if bad else '(none)'}; choose from {', '.join(POINTS)}\n")
    if args.nproc < 1 or args.steps <= args.warmup or args.warmup < 0:
        p.exit(2, "error: --nproc >= 1 and --steps > --warmup >= 0\n")
    args.out.mkdir(parents=True, exist_ok=True)
    records = [run_point(args.out, n, args) for n in names]
    (args.out / "records.json").write_text(json.dumps(records, indent=1))
    (args.out / "table.md").write_text(table(records))
    print(table(records), end="")
    return 0 if all(r["status"] == "completed" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
