"""Tune the fused MLA decode kernel's launch configuration per (context, batch) and write the table it reads.

Usage (GPU machine, repo root; about 3-5 minutes on one H100, bounded by --budget-s):
    python benchmarks/scripts/decode_tune.py --out decode_tune.json --write-table tuned.json
    python benchmarks/scripts/decode_tune.py --from decode_tune.json --write-table tuned.json   # no GPU
    python benchmarks/scripts/decode_tune.py --dry-run                                # the grid, no GPU

One layer of mla-1b's attention (16 heads, kv_lora_rank 512, rope 64, bf16), with the device-side
length the CUDA-graph decode step passes, at contexts 1K-32K and batches 1-512 plus 'fit' (the largest
batch ``scaletool decode --batch max`` runs mla-1b's 16 layers at on this card; one layer's cache
is allocated, at most --cache-gb). Per point, in two stages to stay within the budget: every split
count with the default tile, then every tile (block_s, num_warps, num_stages) at the two best split
counts, and the single-split direct store (no fp32 partials, no merge launch) where one split won.
Last, the best split count and store with registers capped (``max_registers``: three or four 4-warp
programs per SM instead of two, some registers spilled). Each candidate is checked against the default's
output and timed with ``triton.testing.do_bench``
over CUDA-graph replays of one call (L2 cleared before each run; median, p10, p90, n). Bytes per call:
the cache, the queries, the output and the split partials (written and read back by the merge).
The HBM fraction is against a device-to-device copy measured in the same run. ``--write-table PATH``
merges the best configuration per point into the table at PATH (a new file holds the sweep's points
alone); a sweep of some points replaces those points' entries and keeps the others. Nothing writes into
the package unless PATH names the shipped
table: ``choose_config`` reads that one (nearest context, then nearest batch, for this card's name), and a
new table there is a change to commit deliberately. At up to ``MERGE_UP_MAX_ROWS`` sequences each call takes
mla-1b's W_UV, as the decode step's does, so the split merge's up-projection is timed with it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scaletool.kernels import mla_tuning  # noqa: E402  (no torch: --dry-run and --from run anywhere)

H, C, R, V, LAYERS = 16, 512, 64, 128, 16  # mla-1b
SCALE = 1 / (128 + 64) ** 0.5
CONTEXTS = (1024, 4096, 8192, 16384, 32768)
BATCHES = ("1", "8", "32", "128", "512", "fit")
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
TILES = [(bs, w, st) for bs in (32, 64) for w in (4, 8) for st in (1, 2, 3)]
CAPPED_TILES = [(16, 4, 168), (32, 4, 168), (16, 4, 128), (32, 4, 128)]  # block_s, warps, registers per thread


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cache_bytes(B: int, S: int) -> int:
    return B * S * (C + R) * 2


def call_bytes(B: int, S: int, n_splits: int, direct: bool) -> int:
    """Bytes one call moves: the cache, the queries, the output, and the fp32 partials and their
    log-sum-exps (written by the kernel, read by the merge) unless one split writes the output itself."""
    partials = 0 if direct and n_splits == 1 else 2 * B * n_splits * H * (C + 1) * 4
    return cache_bytes(B, S) + B * H * (C + R) * 2 + B * H * C * 2 + partials


def fit_batch(S: int, budget_bytes: int, cap_bytes: int) -> int:
    """The batch ``scaletool decode --batch max`` runs mla-1b at for context S in ``budget_bytes``
    (its analytic memory fit, 16 layers), limited so one layer's cache stays within ``cap_bytes``."""
    from scaletool.api import resolve
    from scaletool.decode.sizing import memory_fit

    cfg = resolve("mla-1b", ["model.dtype=bf16"]).model
    rows = memory_fit(cfg, budget_bytes, (S,), 3 + 32)["rows"]
    fit = next(r["max_batch"] for r in rows if r["attention"] == "mla")
    return max(1, min(fit, cap_bytes // cache_bytes(1, S)))


def split_candidates(B: int, S: int, sms: int, heuristic: int) -> list[int]:
    """Split counts worth timing: at least 64 positions a split, at most 16 programs per SM (2 splits
    always: halving each program's share evens the last wave of a large batch), and the heuristic's."""
    keep = {n for n in SPLITS if S // n >= 64 and (B * n <= 16 * sms or n <= 2)}
    return sorted(keep | {1, heuristic})


def config(n_splits: int, block_s: int = 64, num_warps: int = 4, num_stages: int = 2, direct: bool = False) -> dict:
    return {"n_splits": n_splits, "block_s": block_s, "num_warps": num_warps, "num_stages": num_stages,
            "direct": direct}


def plan(contexts, batches, sms: int, budget_bytes: int, cap_bytes: int) -> list[dict]:
    """The points (context, batch, stage-1 split counts) of the sweep, fit batches resolved."""
    from scaletool.kernels.mla_decode import KernelConfig

    out = []
    for S in contexts:
        for b in dict.fromkeys(batches):
            B = fit_batch(S, budget_bytes, cap_bytes) if b == "fit" else min(int(b), cap_bytes // cache_bytes(1, S))
            heuristic = KernelConfig().splits(B, H, S, sms)[0]
            out.append({"context": S, "batch": B, "batch_label": b, "heuristic_splits": heuristic,
                        "splits": split_candidates(B, S, sms, heuristic)})
    return out


# -- GPU ------------------------------------------------------------------------------------------------

def gpu_card():
    import torch
    import triton

    from scaletool.decode.bounds import copy_bandwidth
    from scaletool.measure.hardware import profile_for

    name = torch.cuda.get_device_name()
    prof = profile_for("cuda", name)
    return {"name": name, "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
            "peak_bandwidth_bytes_per_s": prof.peak_bandwidth_bytes_per_s if prof else None,
            "copy_bandwidth_bytes_per_s": copy_bandwidth(torch.device("cuda")),
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}}


def time_call(fn, est_s: float | None = None) -> dict:
    """do_bench over CUDA-graph replays of ``fn``: every run's time (s), median p10 p90 n."""
    import torch
    from triton.testing import do_bench

    from scaletool.stats import spread

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    rep_ms = max(25.0, 1e3 * 10 * (est_s or 0))  # at least ~10 runs of the largest calls
    s = spread([t / 1e3 for t in do_bench(g.replay, warmup=5, rep=rep_ms, return_mode="all")])
    return {"median": s.median, "p10": s.p10, "p90": s.p90, "n": s.n}


def run_point(p: dict, card: dict, deadline: float) -> dict:
    import torch

    from scaletool.kernels import mla_decode as K

    B, S = p["batch"], p["context"]
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, qp, ckv, kpe = mk(B, H, C), mk(B, H, R), mk(B, S, C), mk(B, S, R)
    length = torch.tensor([S], device="cuda")
    # at a few sequences the decode step's call takes W_UV (its merge applies it): timed as it runs there
    w_uv = mk(H, V, C) * 0.05 if B <= K.MERGE_UP_MAX_ROWS else None
    call = lambda cfg: K.latent_attention_triton(q, qp, ckv, kpe, SCALE, length, config=cfg, w_uv=w_uv)  # noqa: E731
    want = call(K.KernelConfig())
    k = min(B, 4)
    ref = K.up_project(K.latent_attention_reference(q[:k], qp[:k], ckv[:k], kpe[:k], SCALE), w_uv)
    default_err = ((want[:k].float() - ref.float()).norm() / ref.float().norm()).item()
    bw = card["copy_bandwidth_bytes_per_s"]
    rows = []

    def timed(cfgd: dict, stage: int) -> dict | None:
        cfg = K.KernelConfig(**cfgd)
        n = cfg.splits(B, H, S, card["sms"])[0]
        row = {"config": cfgd, "stage": stage, "splits_run": n}
        try:
            got = call(cfg)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            if not err < 2e-2:
                row["error"] = f"output differs from the default's by {err:.3g}"
                rows.append(row)
                return None
            nbytes = call_bytes(B, S, n, cfg.direct) + (0 if w_uv is None else H * V * C * 2)
            row["time_s"] = t = time_call(lambda: call(cfg), nbytes / bw)
            row.update(bytes=nbytes, bandwidth_bytes_per_s=nbytes / t["median"],
                       hbm_fraction_of_copy=nbytes / t["median"] / bw)
        except Exception as e:  # a tile that does not fit shared memory or registers: recorded, skipped
            torch.cuda.synchronize()
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        return row if "time_s" in row else None

    default = timed({**config(p["heuristic_splits"]), "n_splits": None}, 0)
    stage1 = [r for r in (timed(config(n), 1) for n in p["splits"]) if r]
    best_n = [r["config"]["n_splits"] for r in sorted(stage1, key=lambda r: r["time_s"]["median"])[:2]]
    for n in best_n:
        for bs, w, st in TILES:
            if time.time() > deadline:
                break
            if (bs, w, st) != (64, 4, 2):
                timed(config(n, bs, w, st), 2)
    if 1 in best_n[:1]:
        ok = [r for r in rows if "time_s" in r and r["config"].get("n_splits") == 1]
        top = min(ok, key=lambda r: r["time_s"]["median"])["config"]
        timed({**top, "direct": True}, 3)
    done = [r for r in rows if "time_s" in r]
    if done:  # the best split count and store with registers capped: more programs per SM, some spills
        top = min(done, key=lambda r: r["time_s"]["median"])["config"]
        for bs, w, regs in CAPPED_TILES:
            if time.time() > deadline:
                break
            timed({**config(top["n_splits"], bs, w, 2, top["direct"]), "max_registers": regs}, 4)
    done = [r for r in rows if "time_s" in r]
    best = min(done, key=lambda r: r["time_s"]["median"]) if done else None
    return {**p, "default_rel_err_vs_reference": default_err, "candidates": rows,
            "default": default, "best": best,
            "speedup_over_default": None if not (best and default) else
            default["time_s"]["median"] / best["time_s"]["median"]}


def write_table(sweep: dict, path: Path) -> dict:
    """Merge the sweep's best configurations into the table at ``path`` (a new file: the sweep's alone)."""
    old = json.loads(path.read_text()) if path.exists() else None
    table = mla_tuning.merge_tables(old, mla_tuning.table_from_sweep(sweep))
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table


def summary(points: list[dict]) -> str:
    lines = [f"{'context':>8} {'batch':>6} {'default':>9} {'best':>9} {'of copy':>8}  best config"]
    for p in points:
        d, b = p.get("default"), p.get("best")
        ms = lambda r: "-" if not r else f"{1e3 * r['time_s']['median']:.3f}"  # noqa: E731
        frac = "-" if not b else f"{100 * b['hbm_fraction_of_copy']:.0f}%"
        lines.append(f"{p['context']:>8} {p['batch']:>6} {ms(d):>9} {ms(b):>9} {frac:>8}  {b and b['config']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="decode_tune.json", help="the sweep's JSON")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--batches", default=",".join(BATCHES), help="integers and 'fit'")
    ap.add_argument("--cache-gb", type=float, default=60.0, help="the most one point's cache may take")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="after this many seconds each remaining point times its split counts only")
    ap.add_argument("--write-table", dest="table", metavar="PATH", default=None,
                    help="merge the best configs into the table at PATH (the shipped one: scaletool/kernels/...)")
    ap.add_argument("--from", dest="source", default=None, help="a sweep JSON to write the table from (no GPU)")
    ap.add_argument("--dry-run", action="store_true", help="print the grid for an H100 (132 SMs, 85 GB); no GPU")
    a = ap.parse_args(argv)
    try:
        contexts = tuple(int(x) for x in a.contexts.split(","))
        batches = tuple(x.strip() for x in a.batches.split(","))
        if any(n < 64 for n in contexts) or any(b != "fit" and (not b.isdigit() or int(b) < 1) for b in batches):
            raise ValueError
    except ValueError:
        print("error: --contexts takes integers >= 64 and --batches integers >= 1 or 'fit'", file=sys.stderr)
        return 2
    if a.table is not None and (not a.table.endswith(".json") or not Path(a.table).parent.is_dir()
                                or Path(a.table).is_symlink() or Path(a.table).is_dir()):
        print(f"error: --write-table {a.table!r}: a .json file in an existing folder (not a link)", file=sys.stderr)
        return 2
    if a.source:
        try:
            sweep = json.loads(Path(a.source).read_text())
            table = write_table(sweep, Path(a.table)) if a.table else mla_tuning.table_from_sweep(sweep)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: {a.source}: not a decode_tune.py result ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        print(json.dumps(table, indent=1) if not a.table else f"wrote {a.table}")
        return 0
    cap = int(a.cache_gb * 1e9)
    if a.dry_run:
        pts = plan(contexts, batches, 132, 85 * 10**9, cap)
        for p in pts:
            print(f"context {p['context']:>6} batch {p['batch']:>6} ({p['batch_label']}): splits {p['splits']}, "
                  f"then {len(TILES) - 1} tiles × 2, cache {cache_bytes(p['batch'], p['context']) / 1e9:.2f} GB")
        print(f"{len(pts)} points")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: the sweep needs a CUDA GPU (--dry-run prints the grid, --from writes a table)", file=sys.stderr)
        return 2
    t0 = time.time()
    card = gpu_card()
    log(f"{card['name']}: {card['sms']} SMs, copy {card['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    pts = plan(contexts, batches, card["sms"], card["total_memory_bytes"], cap)
    points = []
    for i, p in enumerate(pts):
        left = a.budget_s - (time.time() - t0)
        log(f"[{time.time() - t0:5.0f}s] {i + 1}/{len(pts)} context {p['context']} batch {p['batch']}")
        # the points left share what remains of the budget; past it, each point times its split counts only
        deadline = time.time() + max(left, 0) / (len(pts) - i)
        try:
            points.append(run_point(p, card, deadline))
        except torch.cuda.OutOfMemoryError:
            points.append({**p, "error": "out of memory"})
        torch.cuda.empty_cache()  # the point's cache is gone with run_point's frame
    doc = {"card": card, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([sys.executable, *sys.argv]), "shape": {"heads": H, "kv_lora_rank": C, "rope": R,
                                                                       "dtype": "bfloat16", "layers_for_fit": LAYERS},
           "timing": "triton.testing.do_bench over CUDA-graph replays of one call, L2 cleared before each run; "
                     "median p10 p90 n of the runs (do_bench's warm-up excluded)",
           "bytes": "cache + queries + output + fp32 split partials and log-sum-exps, written and read back "
                    "(+ W_UV at batches up to MERGE_UP_MAX_ROWS)",
           "points": points, "wall_s": time.time() - t0}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(summary(points))
    if a.table:
        write_table(doc, Path(a.table))
        log(f"wrote {a.table}")
    log(f"wrote {a.out} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
