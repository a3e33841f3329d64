"""How fast this card reads HBM, and how near MLA's latent decode kernel comes to it.

Usage (GPU machine, repo root; about a minute on one H100):
    python benchmarks/scripts/read_ceiling.py --out read_ceiling.json
    python benchmarks/scripts/read_ceiling.py --batch 130 --context 32768 --out x.json

The decode step's share of the datasheet bandwidth is bounded by what the latent kernel can read, and that by
what the card can read at all. Three measurements over one buffer the size of one layer of mla-1b's latent
cache at ``--batch`` × ``--context`` (16 heads, kv_lora_rank 512, rope 64, bf16; 4.9 GB at 1,036 × 4K):

1. ``copy``: a device-to-device copy of 1 GiB (bytes read + written) from the stream, the rate scaletool's
   reports divide by.
2. ``read``: pure reads, no writes: a Triton kernel that sums the buffer, each program a tile, or a grid of k
   programs per SM, interleaved (program p reads tiles p, p + programs, ...: together they sweep the buffer
   in order) or each over its own contiguous chunk (as the latent kernel's programs read one sequence
   each); tile sizes, warps, pipelining depth; and ``torch.sum``.
3. ``latent``: the latent kernel over that cache (every sequence ``--context`` long in a static cache of
   ``--context`` + 35 positions, as ``scaletool decode`` allocates), in the configuration the card's tuned table
   gives and with registers capped (``KernelConfig.max_registers``: three or four 4-warp programs per SM
   instead of two); each checked against the table's output first.

Timing: each call (but the copy) captured in a CUDA graph, CUDA events around each replay (no host time inside),
``--warmup`` replays excluded, median with p10/p90 over ``--reps``; the buffers are far larger than L2, so no
flush is needed. Rates are bytes over the median; fractions are of the
datasheet peak (scaletool's hardware profiles) and of the copy. Comparable only within one run.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from probe_args import checked, count, positive_int  # noqa: E402  (beside this script)

H, C, R = 16, 512, 64  # mla-1b's latent attention
SCALE = 1 / (128 + R) ** 0.5
STATIC_EXTRA = 35  # scaletool decode's cache: the context plus the new tokens and the warm-up steps


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _read_sum(x, out, n_tiles, per_program, BLOCK: tl.constexpr, CHUNKED: tl.constexpr):
        """Interleaved: program p sums tiles p, p + programs, ... (a grid of n_tiles programs reads one tile
        each); chunked: program p sums tiles p·per_program .. (p + 1)·per_program - 1."""
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], tl.float32)
        if CHUNKED:
            lo = pid * per_program
            for t in range(lo, tl.minimum(lo + per_program, n_tiles)):
                acc += tl.load(x + t.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
        else:
            for t in range(pid, n_tiles, tl.num_programs(0)):
                acc += tl.load(x + t.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
        tl.store(out + pid, tl.sum(acc, 0))
    return _read_sum


def timed(fn, reps: int, warmup: int, graph: bool = True) -> dict:
    """``fn`` (run once before) captured in a CUDA graph, each replay between two events; or, with
    ``graph=False``, each call of ``fn`` between two events."""
    import types

    import torch

    from scaletool.measure.timing import graph_replay_seconds
    from scaletool.stats import spread

    runner = types.SimpleNamespace(replay=fn)  # graph_replay_seconds times anything with a replay()
    if graph:
        runner = torch.cuda.CUDAGraph()
        with torch.cuda.graph(runner):
            fn()
    return spread(graph_replay_seconds(runner, reps, warmup)).model_dump()


def row(name: str, nbytes: int, t: dict, peak: float | None, copy: float | None, **extra) -> dict:
    rate = nbytes / t["median"]
    r = {"name": name, "bytes": nbytes, "time_s": t, "bytes_per_s": rate,
         "fraction_of_datasheet": rate / peak if peak else None, "fraction_of_copy": rate / copy if copy else None,
         **extra}
    log(f"  {name:<44} {rate / 1e12:6.3f} TB/s" + (f"  {rate / peak:6.1%} of datasheet" if peak else ""))
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=positive_int, default=1036)
    ap.add_argument("--context", type=positive_int, default=4096)
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--warmup", type=count, default=3)
    a = checked(ap, argv)

    import torch
    import triton

    from scaletool.kernels import mla_decode as K
    from scaletool.measure.hardware import profile_for

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    prof = profile_for("cuda", name)
    peak = prof.peak_bandwidth_bytes_per_s if prof else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B, S = a.batch, a.context + STATIC_EXTRA
    out = {"card": {"name": name, "sms": sms, "peak_bandwidth_bytes_per_s": peak,
                    "peak_source": prof.source if prof else "no profile matches this card"},
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/scripts/read_ceiling.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "shape": {"batch": B, "context": a.context, "static_cache": S, "heads": H, "kv_lora_rank": C, "rope": R},
           "timing": f"CUDA events per call, {a.warmup} warm-up calls excluded, median p10 p90 over {a.reps}",
           "rows": []}
    rows = out["rows"]

    log("copy")
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    # from the stream, as scaletool's reports measure it: captured in a graph the copy becomes a memcpy node,
    # which ran at 2.42 TB/s on an H100 against 2.94 from the stream
    t = timed(lambda: dst.copy_(src), a.reps, a.warmup, graph=False)
    copy = 2 * 2**30 / t["median"]
    rows.append(row("copy 1 GiB (read + written)", 2 * 2**30, t, peak, None, kind="copy"))
    out["card"]["copy_bandwidth_bytes_per_s"] = copy
    src = dst = None  # freed before the next buffer

    log("read")
    elems = B * S * (C + R)
    x = torch.ones(elems, dtype=torch.bfloat16, device=dev)
    k = read_kernel()
    grids = [(None, False)] + [(n, chunked) for n in (2, 4) for chunked in (False, True)]
    for block, warps, stages in ((4096, 4, 2), (8192, 8, 2), (16384, 8, 2), (32768, 8, 2)):
        tiles = elems // block
        for per_sm, chunked in grids:
            programs = tiles if per_sm is None else per_sm * sms
            per_program = -(-tiles // programs)
            res = torch.empty(programs, dtype=torch.float32, device=dev)
            fn = functools.partial(k[(programs,)], x, res, tiles, per_program, BLOCK=block, CHUNKED=chunked,
                                   num_warps=warps, num_stages=stages)
            fn()
            torch.cuda.synchronize()
            want = float(tiles * block)
            if abs(res.double().sum().item() - want) > 1e-3 * want:
                raise SystemExit(f"error: the read kernel summed {res.double().sum().item()}, not {want}")
            grid = "a tile per program" if per_sm is None else \
                f"{per_sm} programs per SM, {'a contiguous chunk each' if chunked else 'interleaved'}"
            rows.append(row(f"triton read {block * 2 // 1024} KB tiles, {warps} warps, {stages} stages, {grid}",
                            tiles * block * 2, timed(fn, a.reps, a.warmup), peak, copy, kind="read",
                            block=block, num_warps=warps, num_stages=stages, programs_per_sm=per_sm,
                            chunked=chunked))
    x.sum(dtype=torch.float32)
    rows.append(row("torch.sum (fp32 accumulation)", elems * 2,
                    timed(lambda: x.sum(dtype=torch.float32), a.reps, a.warmup), peak, copy, kind="read"))
    x = None

    log(f"latent kernel, batch {B}, context {a.context} (static cache {S})")
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16)  # noqa: E731
    q, qp, ckv, kpe = mk(B, H, C), mk(B, H, R), mk(B, S, C), mk(B, S, R)
    lengths = torch.full((B,), a.context, device=dev, dtype=torch.int32)
    nbytes = B * a.context * (C + R) * 2
    tuned = K.choose_config(B, H, S, dev, C, R, torch.bfloat16)
    want = K.latent_attention_triton(q, qp, ckv, kpe, SCALE, lengths, config=tuned)
    out["tuned_config"] = vars(tuned)
    candidates = [("tuned", tuned)]
    for bs, regs in ((16, 168), (32, 168), (64, 168), (16, 128), (32, 128)):
        candidates.append((f"tuned, {bs}-position tiles, registers capped at {regs}",
                           K.KernelConfig(**{**vars(tuned), "block_s": bs, "num_warps": 4, "max_registers": regs})))
    for label, cfg in candidates:
        fn = lambda cfg=cfg: K.latent_attention_triton(q, qp, ckv, kpe, SCALE, lengths, config=cfg)  # noqa: E731
        try:
            got = fn()
        except Exception as e:  # a tile that does not fit: recorded, the rest goes on
            rows.append({"name": f"latent {label}", "kind": "latent", "config": vars(cfg),
                         "error": f"{type(e).__name__}: {str(e)[:200]}"})
            log(f"  latent {label}: {type(e).__name__}")
            continue
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        if not err < 2e-2:
            rows.append({"name": f"latent {label}", "kind": "latent", "config": vars(cfg),
                         "error": f"output differs from the tuned configuration's by {err:.3g}"})
            continue
        rows.append(row(f"latent {label}", nbytes, timed(fn, a.reps, a.warmup), peak, copy, kind="latent",
                        config=vars(cfg), rel_err_vs_tuned=err))
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
