"""Weights prefetched into L2 while a batch-1 decode step's latency-bound kernels run: what it would save.

Usage (GPU machine, repo root; under a minute on one H100):
    python benchmarks/scripts/l2_prefetch.py --out l2_prefetch.json

At batch 1, MLA's step spends about a third of each layer in kernels that move little data (the absorbed
products, the latent attention over a 4.7 MB cache with its merge, norms): HBM idles while they run. If the
next projections' weights were read into L2 then, those projections would stream from L2. mla-1b's
weights (bf16): the output projection 8.4 MB, the joined q/latent projection 14.9 MB, down 23.1 MB,
gate/up 46.1 MB. For each, matrix-vector products (cuBLAS, one row, as the decode step runs them):

1. ``gemv``: cold (L2 flushed by reading 192 MB first) and after a prefetch of the whole weight or of
   its first part, each as the difference of two CUDA graphs (8 repeats of flush [+ prefetch] + product
   against 8 of flush [+ prefetch]), median of ``--reps`` replays, p10/p90 of the differences.
2. ``prefetch``: the prefetch kernels alone: loads that keep lines in L2 (``evict_last``) and, on Hopper,
   ``cp.async.bulk.prefetch.L2`` (no registers), on a few grid sizes: bytes/s.
3. ``overlap``: MLA's middle of a layer at batch 1 and 4K context (absorbed query product, latent attention
   and merge, absorbed output product) followed by the output projection and gate/up, with the weights
   prefetched on a side stream during the middle part or not, in one CUDA graph each, 16 times over
   (16 layers' worth, each layer's weights distinct): the step time it would save.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from probe_args import checked, positive_int  # noqa: E402  (beside this script)

D, FFN, H, C, R, NOPE, V = 2048, 5632, 16, 512, 64, 128, 128
WEIGHTS = {"o": (D, H * V), "qkv": (H * (NOPE + R) + C + R, D), "down": (D, FFN), "gate_up": (2 * FFN, D)}
MB = 1e6


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(xs: list[float]) -> dict:
    from scaletool.stats import spread as _spread

    return _spread(xs).model_dump()


def kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_load(x, n, sink, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(sink + tl.program_id(0), tl.sum(acc, 0))

    @triton.jit
    def _prefetch_bulk(x, n_chunks, sink, CHUNK: tl.constexpr, LANES: tl.constexpr):  # CHUNK: 8192 bf16 = 16 KB
        done = tl.zeros([LANES], tl.int32)
        for start in range(tl.program_id(0) * LANES, n_chunks, tl.num_programs(0) * LANES):
            idx = start + tl.arange(0, LANES)
            ptrs = x + tl.where(idx < n_chunks, idx, 0).to(tl.int64) * CHUNK
            done += tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], 16384;\n mov.u32 $0, 0;", "=r,l", [ptrs],
                dtype=tl.int32, is_pure=False, pack=1)
        tl.store(sink + tl.program_id(0), tl.sum(done, 0).to(tl.float32))

    return _prefetch_load, _prefetch_bulk


class Prefetcher:
    def __init__(self, kind: str, programs: int):
        import torch

        self.kind, self.programs = kind, programs
        self.load, self.bulk = kernels()
        self.sink = torch.zeros(4096, device="cuda")

    def __call__(self, w, nbytes: int | None = None):
        n = w.numel() if nbytes is None else min(w.numel(), nbytes // w.element_size())
        if self.kind == "load":
            self.load[(self.programs,)](w, n, self.sink, BLOCK=4096, num_warps=8)
        else:
            chunk = 8192  # elements: 16 KB a prefetch instruction
            self.bulk[(self.programs,)](w, n // chunk, self.sink, CHUNK=chunk, LANES=128, num_warps=4)


def graph_of(fn, reps: int = 1):
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def diff(with_fn, without_fn, reps: int, per: int) -> dict:
    """Seconds that ``with_fn`` adds over ``without_fn``, each repeated ``per`` times in one graph."""
    from scaletool.measure.timing import graph_replay_seconds

    a = graph_replay_seconds(graph_of(with_fn, per), reps)
    b = graph_replay_seconds(graph_of(without_fn, per), reps)
    mb = statistics.median(b)
    return spread([(x - mb) / per for x in a])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=positive_int, default=30)
    ap.add_argument("--context", type=positive_int, default=4096)
    a = checked(ap, argv)

    import torch
    import torch.nn.functional as F
    import triton

    from scaletool.kernels.mla_decode import latent_attention_triton
    from scaletool.measure.timing import graph_replay_seconds

    props = torch.cuda.get_device_properties(0)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/scripts/l2_prefetch.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "card": {"name": props.name, "sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
                    "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}},
           "gemv": [], "prefetch": [], "overlap": [], "errors": []}

    def save():
        a.out.write_text(json.dumps(out, indent=1))

    g = torch.Generator(device="cuda").manual_seed(0)
    w = {k: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for k, s in WEIGHTS.items()}
    x = {k: torch.randn(1, s[1], device="cuda", dtype=torch.bfloat16, generator=g) for k, s in WEIGHTS.items()}
    flush_src = torch.empty(96 * 2**20, device="cuda", dtype=torch.bfloat16)  # 192 MB, past any L2
    flush_dst = torch.empty((), device="cuda", dtype=torch.float32)

    def flush():
        torch.sum(flush_src, 0, dtype=torch.float32, out=flush_dst)

    kinds = ["load", "bulk"]
    pre = {}
    for kind in kinds:
        for programs in (16, 32, 66, 132):
            p = Prefetcher(kind, programs)
            try:
                t = diff(lambda p=p: (flush(), p(w["gate_up"])), flush, a.reps, 8)
            except Exception as e:  # noqa: BLE001  (reported; the other kind may serve)
                out["errors"].append(f"prefetch {kind} on {programs} programs: {type(e).__name__}: {str(e)[:300]}")
                break
            nbytes = w["gate_up"].numel() * 2
            out["prefetch"].append({"kind": kind, "programs": programs, "bytes": nbytes, "time_s": t,
                                    "bytes_per_s": nbytes / t["median"]})
            log(f"prefetch {kind} x{programs}: {t['median'] * 1e6:.1f} us, {nbytes / t['median'] / 1e12:.2f} TB/s")
            pre.setdefault(kind, p) if programs == 32 else None
    save()
    prefetch = pre.get("bulk") or pre.get("load")
    if prefetch is None:
        save()
        return 1

    for name, wt in w.items():
        nbytes = wt.numel() * 2
        parts = [None] + [m * 2**20 for m in (8, 16, 24, 32) if m * 2**20 < nbytes]
        xv = x[name]
        cold = diff(lambda xv=xv, wt=wt: (flush(), F.linear(xv, wt)), flush, a.reps, 8)
        out["gemv"].append({"weight": name, "bytes": nbytes, "prefetched_bytes": 0, "time_s": cold,
                            "bytes_per_s": nbytes / cold["median"]})
        log(f"gemv {name} cold: {cold['median'] * 1e6:.1f} us")
        for part in parts:
            t = diff(lambda part=part, xv=xv, wt=wt: (flush(), prefetch(wt, part), F.linear(xv, wt)),
                     lambda part=part, wt=wt: (flush(), prefetch(wt, part)), a.reps, 8)
            out["gemv"].append({"weight": name, "bytes": nbytes, "prefetched_bytes": part or nbytes, "time_s": t,
                                "bytes_per_s": nbytes / t["median"], "prefetch": prefetch.kind})
            log(f"gemv {name} after {(part or nbytes) / MB:.1f} MB prefetched: {t['median'] * 1e6:.1f} us")
        save()

    # the middle of an MLA layer at batch 1 (latency-bound), then the output projection and gate/up
    S = a.context
    c_kv = torch.randn(1, S, C, device="cuda", dtype=torch.bfloat16, generator=g)
    k_pe = torch.randn(1, S, R, device="cuda", dtype=torch.bfloat16, generator=g)
    uk = torch.randn(H, NOPE, C, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    uv = torch.randn(H, C, V, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    q_nope = torch.randn(H, 1, NOPE, device="cuda", dtype=torch.bfloat16, generator=g)
    q_pe = torch.randn(1, H, R, device="cuda", dtype=torch.bfloat16, generator=g)
    lengths = torch.full((1,), S, device="cuda", dtype=torch.int32)
    layers = [{k: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
               for k, s in WEIGHTS.items() if k in ("o", "gate_up")} for _ in range(16)]
    side = torch.cuda.Stream()

    def middle():
        q_lat = torch.bmm(q_nope, uk).transpose(0, 1)  # (1, H, C)
        o_lat = latent_attention_triton(q_lat, q_pe, c_kv, k_pe, 0.07, lengths)
        return torch.bmm(o_lat.transpose(0, 1), uv).transpose(0, 1).reshape(1, H * V)

    def layer_stack(ahead_bytes: int | None, join_before: bool = True):
        for lw in layers:
            if ahead_bytes is not None:  # fork: the side stream reads the weights into L2 while the middle runs
                here = torch.cuda.current_stream()
                side.wait_stream(here)
                with torch.cuda.stream(side):
                    prefetch(lw["o"])
                    prefetch(lw["gate_up"], ahead_bytes)
            o = middle()
            if ahead_bytes is not None and join_before:  # the projections wait for the prefetch
                torch.cuda.current_stream().wait_stream(side)
            F.linear(F.linear(o, lw["o"]), lw["gate_up"])
            if ahead_bytes is not None and not join_before:  # or run beside its tail
                torch.cuda.current_stream().wait_stream(side)

    runs = [(None, True)] + [(m * 2**20, j) for m in (8, 16, 24, 32, 46) for j in (True, False)]
    for ahead, join in runs:
        try:
            t = spread(graph_replay_seconds(graph_of(lambda ahead=ahead, join=join: (flush(), layer_stack(ahead, join))),
                                    a.reps))
            base = spread(graph_replay_seconds(graph_of(flush), a.reps))
        except Exception as e:  # noqa: BLE001
            out["errors"].append(f"overlap {ahead} {join}: {type(e).__name__}: {str(e)[:300]}")
            continue
        per_layer = (t["median"] - base["median"]) / 16
        out["overlap"].append({"gate_up_prefetched_bytes": ahead, "join_before_projections": join, "time_s": t,
                               "flush_s": base, "per_layer_s": per_layer,
                               "prefetch": None if ahead is None else prefetch.kind})
        log(f"16 layers, gate/up prefetched {ahead} (join before: {join}): {per_layer * 1e6:.1f} us a layer")
        save()
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
