"""The bubble of torch's own pipeline action order, with ideal communication: is a measured bubble in the order of
the computations or in how the sends and receives run?

    python benchmarks/scripts/pipeline_order.py [--ranks 4] [--chunks 2] [--microbatches 4,8] [--json]

Builds each rank's compute actions exactly as ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` does (its
``_get_warmup_ops`` and ``_get_1f1b_rank_ops``; the installed torch's), then runs them as a list schedule: each rank
takes its actions in order, a forward of chunk s waits for chunk s − 1's forward of the same micro-batch, a backward
for its own forward and chunk s + 1's backward; a chunk's forward takes 1/v, its backward 2/v of a rank's
micro-batch. The bubble is the makespan's share beyond m micro-batches' work, beside Megatron-LM's (p − 1)/v
(Narayanan et al. 2021) and plain 1F1B's (p − 1). Communication is free here: a measured bubble above these is
in the sends and receives (their order on the communication stream), not in the computations' order.
"""
from __future__ import annotations

import argparse
import json
import sys


def rank_orders(P: int, v: int, m: int) -> dict[int, list]:
    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops, _get_warmup_ops

    rounds = max(1, m // P)
    per_round = m // rounds
    out = {}
    for r in range(P):
        warmup = _get_warmup_ops(r, v, per_round, P, m, multiply_factor=2)
        steady = v * m - warmup

        def fwd(step, r=r):
            return ((step // per_round) % v) * P + r

        def bwd(step, r=r, warmup=warmup):
            return (v - 1 - ((step - warmup) // per_round) % v) * P + r

        ops = _get_1f1b_rank_ops(v, P, warmup, steady, v * m - steady, r, fwd, bwd)
        out[r] = [a for a in ops if a is not None]
    return out


def makespan(P: int, v: int, m: int) -> float:
    """Time to run every rank's actions, a rank's micro-batch (all its chunks, forward + backward) taking 3 units."""
    from torch.distributed.pipelining.schedules import _ComputationType

    S, orders = P * v, rank_orders(P, v, m)
    done: dict[tuple, float] = {}
    clock, nxt = [0.0] * P, [0] * P
    while any(nxt[r] < len(orders[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while nxt[r] < len(orders[r]):
                a = orders[r][nxt[r]]
                s, i = a.stage_index, a.microbatch_index
                if a.computation_type == _ComputationType.FORWARD:
                    key, deps, dur = ("F", s, i), [("F", s - 1, i)] if s else [], 1.0 / v
                else:
                    key, deps, dur = ("B", s, i), [("F", s, i)] + ([("B", s + 1, i)] if s < S - 1 else []), 2.0 / v
                if not all(d in done for d in deps):
                    break
                done[key] = max([clock[r]] + [done[d] for d in deps]) + dur
                clock[r] = done[key]
                nxt[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the action order deadlocks")
    return max(clock)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, choices=range(2, 65), metavar="P")
    ap.add_argument("--chunks", type=int, default=2, choices=range(2, 17), metavar="V")
    ap.add_argument("--microbatches", default="4,8", help="comma-separated micro-batch counts (default 4,8)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        counts = [int(x) for x in a.microbatches.split(",") if x]
    except ValueError:
        print(f"error: --microbatches {a.microbatches!r}: comma-separated whole numbers", file=sys.stderr)
        return 2
    import torch

    rows = []
    for m in counts:
        work = 3.0 * m
        mk = makespan(a.ranks, a.chunks, m)
        rows.append({"ranks": a.ranks, "chunks": a.chunks, "microbatches": m, "bubble": (mk - work) / mk,
                     "megatron_bubble": (a.ranks - 1) / a.chunks * 3 / (work + (a.ranks - 1) / a.chunks * 3),
                     "one_f_one_b_bubble": (a.ranks - 1) * 3 / (work + (a.ranks - 1) * 3), "torch": torch.__version__})
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"P={r['ranks']} v={r['chunks']} m={r['microbatches']}: torch's order {r['bubble']:.1%}, "
                  f"Megatron-LM {r['megatron_bubble']:.1%}, plain 1F1B {r['one_f_one_b_bubble']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
