"""Time the MLA split merge that applies W_UV (``merge_up_triton``) per launch shape, beside the merge and einsum.

Usage (GPU machine, repo root; under a minute on one H100):
    python benchmarks/scripts/merge_up_tune.py --out merge_up.json

mla-1b's heads (16, kv_lora_rank 512, 128 values per head) at batch 1 with the split counts its decode step's
static caches get from the tuned latent kernel (33 at 4K, 57 at 32K) and 64. Each candidate (latent channels
per program, warps) runs 16 times in one CUDA graph (a step's 16 layers, each with its own W_UV so none is
served from L2 by the one before); the reference is ``merge_splits_triton`` followed by the einsum, the two launches it replaces.
Median, p10, p90 over ``--reps`` replays (3 warm-up replays excluded), microseconds per layer.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from probe_args import checked, positive_int  # noqa: E402  (beside this script)

H, C, V, NOPE, LAYERS = 16, 512, 128, 128, 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=positive_int, default=30)
    a = checked(ap, argv)

    import torch
    import triton

    from scaletool.kernels import mla_decode as k
    from scaletool.measure.timing import graph_replay_seconds
    from scaletool.stats import spread

    g = torch.Generator(device="cuda").manual_seed(0)
    w_uvs = [torch.randn(H * (NOPE + V), C, device="cuda", dtype=torch.bfloat16, generator=g).view(H, NOPE + V, C)[:, NOPE:]
             for _ in range(LAYERS)]

    def timed(fn) -> dict:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return spread(graph_replay_seconds(graph, a.reps, per=LAYERS)).model_dump()

    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/scripts/merge_up_tune.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "card": torch.cuda.get_device_name(),
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
           "shape": {"batch": 1, "heads": H, "kv_lora_rank": C, "v_head_dim": V, "layers": LAYERS}, "points": []}
    for splits in (33, 57, 64):  # mla-1b's static caches at 4K and 32K split into 33 and 57
        o_part = torch.randn(1, splits, H, C, device="cuda", generator=g)
        lse = torch.randn(1, splits, H, device="cuda", generator=g)
        ref = timed(lambda o=o_part, s=lse: [k.up_project(k.merge_splits_triton(o, s, torch.bfloat16), w) for w in w_uvs])
        out["points"].append({"splits": splits, "kernel": "merge + einsum", "time_s": ref})
        print(f"{splits:3d} splits  merge + einsum       {ref['median'] * 1e6:6.2f} us", flush=True)
        counters = [torch.zeros(H, device="cuda", dtype=torch.int32) for _ in w_uvs]  # each call leaves them at 0
        for block_c in (32, 64, 128):
            for warps in (4, 8):
                t = timed(lambda o=o_part, s=lse, cs=counters, bc=block_c, nw=warps: [
                    k.merge_up_triton(o, s, w, torch.bfloat16, counters=c, block_c=bc, num_warps=nw)
                    for w, c in zip(w_uvs, cs)])
                out["points"].append({"splits": splits, "kernel": "merge_up", "block_c": block_c, "num_warps": warps,
                                      "time_s": t})
                print(f"{splits:3d} splits  block_c {block_c:3d} warps {warps}  {t['median'] * 1e6:6.2f} us "
                      f"({t['p10'] * 1e6:.2f}-{t['p90'] * 1e6:.2f})", flush=True)
    a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
