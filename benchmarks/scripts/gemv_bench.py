"""The decode GEMV against cuBLAS at the projections of mla-1b and mha-1b (one GPU, seconds).

    python benchmarks/scripts/gemv_bench.py OUT.json [--rows 1,4,8] [--iters 50]

Per weight shape (N, K) of the recipes' bias-free linear layers and per row count M: F.linear (cuBLAS)
and scaletool's Triton GEMV (scaletool.kernels.gemv). Each kernel's calls are captured in a CUDA graph
(``--calls`` calls, each reading a different copy of the weight, enough copies to exceed 256 MiB, so no
call finds its weight in the L2 cache: a decode step reads each weight once); a replay of the graph is
timed with CUDA events, ``--iters`` replays after two warm-up replays, and a call's time is the replay's
over ``--calls``: the kernels back to back as in a captured decode step, no host launch inside the
interval. Bandwidth is the weight's bytes over the median call; the copy rate of the card is measured
beside it. Writes JSON with the card, date, torch and Triton versions and the command.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: (N, K) of the bias-free linear layers of mla-1b and mha-1b (d 2048, 16 heads, FFN 5632, vocab 32000)
SHAPES = {"mla-1b wq (2048 -> 16 x 192)": (3072, 2048), "mla-1b wkv_a (2048 -> 512 + 64)": (576, 2048),
          "wo (2048 -> 2048)": (2048, 2048), "mha-1b wqkv (2048 -> 3 x 2048)": (6144, 2048),
          "w1 / w3 (2048 -> 5632)": (5632, 2048), "w2 (5632 -> 2048)": (2048, 5632),
          "output (2048 -> 32000)": (32000, 2048)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--rows", default="1,4,8", help="row counts M, comma-separated (default 1,4,8)")
    p.add_argument("--iters", type=int, default=20, help="timed graph replays per kernel and shape (default 20)")
    p.add_argument("--calls", type=int, default=32, help="calls captured per graph (default 32)")
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows {args.rows!r}: expected integers such as 1,4,8")
    if args.iters < 3 or args.calls < 1 or not rows or min(rows) < 1:
        p.error("--iters must be >= 3, --calls >= 1 and --rows positive")
    import torch
    import torch.nn.functional as F

    from scaletool.decode.bounds import copy_bandwidth
    from scaletool.kernels import gemv
    from scaletool.measure.timing import graph_replay_seconds
    from scaletool.stats import spread

    if not torch.cuda.is_available() or gemv.triton is None:
        sys.exit("error: gemv_bench needs a CUDA GPU and Triton")
    dev = torch.device("cuda")
    results = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, -(-2**28 // nbytes)))]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            err = (gemv.gemv_triton(x, copies[0]).float() - F.linear(x.float(), copies[0].float())).abs().max().item()
            row = {"shape": name, "n": n, "k": k, "rows": m, "weight_bytes": nbytes, "max_abs_error_vs_fp32": err}
            for kernel, fn in (("cublas", F.linear), ("gemv", gemv.gemv_triton)):
                fn(x, copies[0])  # the GEMV's autotuning, cuBLAS's workspace: before the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(args.calls):
                        fn(x, copies[i % len(copies)])
                times = graph_replay_seconds(graph, args.iters, warmup=2, per=args.calls)
                del graph
                s = spread(times)
                row[kernel] = {"us": {"median": 1e6 * s.median, "p10": 1e6 * s.p10, "p90": 1e6 * s.p90, "n": s.n},
                               "bytes_per_s": nbytes / s.median}
            row["speedup"] = row["cublas"]["us"]["median"] / row["gemv"]["us"]["median"]
            results.append(row)
            print(f"{name:36s} M={m}: cuBLAS {row['cublas']['us']['median']:7.1f} us "
                  f"({row['cublas']['bytes_per_s'] / 1e12:.2f} TB/s), GEMV {row['gemv']['us']['median']:7.1f} us "
                  f"({row['gemv']['bytes_per_s'] / 1e12:.2f} TB/s): {row['speedup']:.2f}x", file=sys.stderr)
        del copies
    import triton
    out = {"benchmark": "decode-gemv", "card": torch.cuda.get_device_name(dev),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
           "python": platform.python_version(), "command": [Path(sys.executable).name, *sys.argv],
           "copy_bandwidth_bytes_per_s": copy_bandwidth(dev), "iters": args.iters, "calls_per_graph": args.calls,
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
