"""MoE at dense speed? Capacity vs dropless dispatch, eager and compiled, on one GPU.

Usage (repository root, on the GPU machine; about 3 minutes on an H100)::

    python benchmarks/scripts/moe_dispatch.py OUT_DIR [--steps 12] [--compile-scope block] [--set KEY=VALUE ...]

The model is mla-1b with its FFN replaced by DeepSeekMoE: 16 routed experts of width 1024, top-2, one
shared expert, the first layer dense (the configuration of ``results/moe-h100-mla-1b-e16k2.json``),
micro-batch 8 × 2048, bf16. Each of the four points (dispatch ``capacity`` | ``dropless`` ×
``eager`` | ``compiled``) is one real ``scaletool train ... --json`` run, so its figures are what a
user gets: tokens/s from the median step (warm-up and compilation excluded), MFU on *active* FLOPs
(k routed experts per token, ``analytic.flops_per_token(...)["train"]``), peak memory and the
fraction of tokens dropped. The capacity path also computes its padding: its MFU on the FLOPs it
computes (``train_causal_computed``) is printed beside. The goal: dropless compiled >= 35% MFU.

Prints a table and writes each run's summary to ``OUT_DIR/<dispatch>-<mode>.json`` (plus ``table.md``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MOE = ["model.ffn=moe", "model.n_routed_experts=16", "model.num_experts_per_tok=2", "model.n_shared_experts=1",
       "model.moe_intermediate_size=1024", "model.first_k_dense_replace=1", "model.aux_loss_alpha=0.001"]
POINTS = [("capacity", False), ("dropless", False), ("capacity", True), ("dropless", True)]


def run_point(args, dispatch: str, compiled: bool) -> dict:
    """One ``scaletool train`` run; its summary (status != completed is reported, not raised)."""
    sets = [*MOE, f"model.moe_dispatch={dispatch}", f"train.steps={args.steps}", "train.log_every=100",
            f"train.measure_warmup_steps={args.warmup}", f"train.compile={str(compiled).lower()}",
            f"train.compile_scope={args.compile_scope}", *args.overrides]
    name = f"{dispatch}-{'compiled' if compiled else 'eager'}"
    cmd = [sys.executable, "-m", "scaletool", "train", args.recipe, "--json", "--out", str(args.out / "runs" / name)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    try:
        summary = json.loads(p.stdout)
    except json.JSONDecodeError:
        summary = {"status": "failed", "message": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    summary["benchmark"] = {"point": name, "wall_s": wall, "command": cmd, "returncode": p.returncode}
    (args.out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def row(name: str, s: dict, base: dict | None) -> list[str]:
    if s.get("status") != "completed":
        return [name, "failed: " + str(s.get("message"))[:60]] + [""] * 7
    m, f = s["metrics"], s["flops_per_token"]
    computed_mfu = s["mfu"] * f["train_causal_computed"] / f["train"] if s["mfu"] is not None else None
    speedup = f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}×" if base and base.get("status") == "completed" else ""
    return [name, s.get("moe", {}).get("expert_gemm", "?"), f"{s['tokens_per_s']:,.0f}",
            f"{1e3 * m['time/step_s_median']:.1f}", f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "n/a",
            f"{100 * computed_mfu:.1f}%" if computed_mfu is not None else "n/a",
            f"{100 * m.get('moe/dropped_fraction', 0):.2f}%",
            f"{s['peak_memory_bytes'] / 2**30:.1f}" if s["peak_memory_bytes"] else "n/a", speedup]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory for the run summaries and table.md")
    p.add_argument("--recipe", default="recipes/mla-1b.yaml")
    p.add_argument("--steps", type=int, default=12, help="steps per point (default 12)")
    p.add_argument("--warmup", type=int, default=4, help="steps always excluded (compilation lands here)")
    p.add_argument("--compile-scope", choices=["model", "block"], default="block",
                   help="block (default): the MoE blocks share one compilation, so the compiled points fit the "
                        "3-minute budget; model compiles the whole graph (slower to build)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if args.steps <= args.warmup + 2:
        p.error(f"--steps {args.steps} leaves fewer than 3 measured steps after --warmup {args.warmup}")
    args.out.mkdir(parents=True, exist_ok=True)
    header = ["point", "expert GEMM", "tokens/s", "step ms", "MFU (active)", "MFU (computed)", "dropped",
              "peak GiB", "vs capacity eager"]
    summaries = []
    for dispatch, compiled in POINTS:
        summaries.append(run_point(args, dispatch, compiled))
        b = summaries[-1]["benchmark"]
        print(f"{b['point']}: {summaries[-1].get('status')} in {b['wall_s']:.0f} s", file=sys.stderr)
    cards = {name for s in summaries for name in s.get("environment", {}).get("gpu_names", [])}
    lines = [f"MoE dispatch on {', '.join(sorted(cards)) or 'an unknown card'} ({args.recipe} + 16 experts top-2, "
             f"{args.steps} steps, compile scope {args.compile_scope})", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row(s["benchmark"]["point"], s, summaries[0])) + " |" for s in summaries]
    text = "\n".join(lines) + "\n"
    (args.out / "table.md").write_text(text)
    print(text)
    return 0 if all(s.get("status") == "completed" for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
