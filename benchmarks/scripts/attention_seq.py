"""Fused causal attention's rate against sequence length: SDPA forward + backward at the head dims of the committed
models, T from 512 to 16,384 at a fixed token count per call, through the kernel priority training uses.

    python benchmarks/scripts/attention_seq.py OUT [--dims 128/128,192/128] [--heads 32,16] [--kv-heads 8,16]
        [--seqs 512,...,16384] [--alibi]

Each point is :func:`scaletool.predict.calibrate.measure_attention` (the measurement ``scaletool calibrate`` makes at
the recipe's T): FLOPs in the causal convention, 3 warm-up calls then timed samples, median with p10/p90 and n.
OUT/attention-seq.jsonl gets one record per (dims, heads, T); the card, torch and date come first. It answers
whether one rate per head-dim pair (measured at T = 2,048) holds at T = 8,192, where Llama-3's published and
committed runs train, and (``--kv-heads``, GQA and MQA as training attends them, ``enable_gqa``) whether fewer key/value
heads change it, and (``--alibi``) what ALiBi's dense score bias costs against T (no kernel can skip the masked
half of a bias it is handed). Expected wall time on one H100/H200: under a minute per dims pair.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise SystemExit(f"error: {what} {text!r}: comma-separated positive whole numbers")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dims", default="128/128,192/128", help="q·k/v head dims, comma-separated")
    ap.add_argument("--heads", default="32,16", help="heads per dims pair, comma-separated (one per --dims)")
    ap.add_argument("--kv-heads", default=None, help="key/value heads per dims pair (default: as many as --heads)")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=32768, help="batch × T per call (default 32,768)")
    ap.add_argument("--alibi", action="store_true", help="also each point with ALiBi's additive bias (the causal mask "
                    "folded in, as training passes it): the rate of the bias path beside the causal one")
    a = ap.parse_args()
    dims = [tuple(_ints(d.replace("/", ","), "--dims")) for d in a.dims.split(",") if d]
    heads, seqs = _ints(a.heads, "--heads"), _ints(a.seqs, "--seqs")
    kv = heads if a.kv_heads is None else _ints(a.kv_heads, "--kv-heads")
    if len(heads) != len(dims) or len(kv) != len(dims) or any(len(d) != 2 for d in dims):
        print("error: --heads and --kv-heads need one count per --dims pair (QK/V)", file=sys.stderr)
        return 2
    if any(h % g for h, g in zip(heads, kv)):
        print("error: --kv-heads: each must divide its --heads count", file=sys.stderr)
        return 2
    import torch

    from scaletool.predict.calibrate import measure_attention, spin_up
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "attention-seq.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"card": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                            "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}) + "\n")
        spin_up(dev, 2.0)
        for (qk, v), h, g in zip(dims, heads, kv):
            for T in seqs:
                for alibi in (False, True) if a.alibi else (False,):
                    r = measure_attention(h, qk, v, T, max(1, a.tokens // T), dev, torch.bfloat16, kv_heads=g,
                                          alibi=alibi)
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    t = r["tflops"]
                    print(f"{qk}/{v} H={h} KV={g} T={T:>6} B={r['batch']:>3}{' alibi' if alibi else ''}: "
                          f"{t['median']:.1f} TFLOP/s (p10 {t['p10']:.1f}, p90 {t['p90']:.1f}, n={t['n']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
