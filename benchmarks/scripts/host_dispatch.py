"""The host's issue time per eager block (forward + backward) for several models, on one GPU and on every GPU of
the host at once: the figure that bounds an eager step whose device work is small (:mod:`scaletool.analytic.host`).

    python benchmarks/scripts/host_dispatch.py OUT [--recipes mla-1b,mha-1b,...] [--processes 1,4]

Each recipe's own block at one sequence of at most 128 tokens, at 1 and 3 blocks, forward + loss + backward in a
loop that waits on the device only at its end, 3 warm-up iterations then 9 samples of 8 iterations; the per-block
figure is the difference over two blocks, under autocast over fp32 weights (single, DDP) and on bf16 weights
(FSDP2's and DeepSpeed's way); :func:`scaletool.predict.calibrate_host.measure_block_dispatch`, the measurement
``scaletool calibrate --recipe R`` makes. OUT/host-dispatch.jsonl gets one record per recipe and process count
(median, p10, p90 and n per process), OUT/overheads.yaml the calibration entries of the all-GPU run.
Expected wall time on a 4-GPU host: about 2 minutes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RECIPES = {"mla-1b": "recipes/mla-1b.yaml", "mha-1b": "recipes/mha-1b.yaml", "llama3-8b": "recipes/llama3-8b.yaml",
           "deepseek-v2-lite": "recipes/deepseek-v2-lite.yaml", "qwen2.5-1.5b": "tests/hf_configs/qwen2.5-1.5b.json"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--processes", default="1,4", help="process counts, comma-separated (default 1,4)")
    a = ap.parse_args()
    names = [n for n in a.recipes.split(",") if n]
    bad = [n for n in names if n not in RECIPES]
    if bad:
        print(f"error: unknown recipe {bad[0]!r}; one of {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    try:
        counts = [int(x) for x in a.processes.split(",") if x]
    except ValueError:
        print(f"error: --processes {a.processes!r}: comma-separated whole numbers", file=sys.stderr)
        return 2
    import torch

    from scaletool import api
    from scaletool.predict.calibrate_host import measure_block_dispatch, overheads_from

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    counts = [min(c, torch.cuda.device_count()) if gpu else 1 for c in counts]
    a.out.mkdir(parents=True, exist_ok=True)
    overheads = {}
    with (a.out / "host-dispatch.jsonl").open("a") as f:
        for name in names:
            recipe = api.resolve(RECIPES[name], [])
            for n in dict.fromkeys(counts):
                t0 = time.perf_counter()
                m = measure_block_dispatch(recipe, device, processes=n)
                rec = {"recipe": name, "processes": n, "card": torch.cuda.get_device_name(0) if gpu else "cpu",
                       "torch": torch.__version__, "wall_s": time.perf_counter() - t0, **m}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                if n == max(counts):
                    overheads.update(overheads_from(m))
                if "skipped" in m:
                    print(name, n, m["skipped"], flush=True)
                else:
                    print(name, n, {k: round(m[k]["block_s"] * 1e3, 3) for k in ("autocast", "bf16")}, "ms/block",
                          flush=True)
    (a.out / "overheads.yaml").write_text("".join(f"{k}: {v}\n" for k, v in sorted(overheads.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
