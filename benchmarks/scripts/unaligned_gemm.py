"""A language-model head whose vocabulary is not a multiple of 8 (GPT-2's 50,257) against padded and aligned ones:
bf16 forward x·Wᵀ and both backward GEMMs, eager (cuBLAS) and under torch.compile (Inductor pads), on one GPU.
The eager and compiled shares of the aligned rate are ``gemm_unaligned`` (scaletool.analytic.calibration).

    python benchmarks/scripts/unaligned_gemm.py OUT.json [--tokens 32768] [--d-model 1600]
"""
from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F

from scaletool.predict.calibrate import time_fn
from scaletool.stats import spread

VOCABS = (50257, 50304, 32064, 151936)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--d-model", type=int, default=1600)
    a = ap.parse_args()
    M, K, res = a.tokens, a.d_model, {}
    for V in VOCABS:
        x, w = (torch.randn(r, K, device="cuda", dtype=torch.bfloat16) for r in (M, V))
        g = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
        for mode in ("eager", "compiled"):
            wrap = torch.compile if mode == "compiled" else (lambda f: f)
            gemms = {"fwd": (wrap(F.linear), x, w), "dgrad": (wrap(torch.mm), g, w), "wgrad": (wrap(torch.mm), g.t(), x)}
            for name, (fn, p, q) in gemms.items():
                s = spread(time_fn(partial(fn, p, q), torch.device("cuda"), warmup=5, reps=20))
                tflops = 2 * M * K * V / s.median / 1e12
                res[f"V{V}-{mode}-{name}"] = {"median_s": s.median, "p10": s.p10, "p90": s.p90, "n": s.n, "tflops": tflops}
                print(f"V={V:6d} {mode:8s} {name:5s} {tflops:7.1f} TFLOP/s (median {s.median * 1e3:.2f} ms, "
                      f"p10 {s.p10 * 1e3:.2f}, p90 {s.p90 * 1e3:.2f}, n {s.n})", flush=True)
        del x, w, g
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
