"""MLA's latent attention on a share of the SMs (CUDA green contexts), alone and beside a decode layer's GEMMs.

Usage (GPU machine, repo root; about 2-4 minutes on one H100):
    python benchmarks/scripts/sm_partition.py --out sm_partition.json
    python benchmarks/scripts/sm_partition.py --sms 132,116,100 --batch 1036 --context 4096 --out x.json

The question it answers: can a decode step at a large batch hide its projections (compute-bound) behind the
latent cache read (memory-bound)? Only if the attention kernel still reads the cache at full speed on part of
the SMs while the GEMMs take the rest. mla-1b's shapes (16 heads, kv_lora_rank 512, rope 64, d_model 2048,
FFN 5632, bf16), the batch as two parts of half the batch each:

1. ``partition``: a green context of n SMs is made and a kernel that records each program's SM id runs on
   its stream; the distinct SMs it used are reported (the check that the partition holds).
2. ``attention``: the latent kernel (scaletool's, with the tuned configuration and a few others) on one part,
   on the green stream of each n and on an ordinary stream (all SMs): median, p10, p90, n, bytes/s.
3. ``gemms``: one part's layer of GEMMs and element-wise work (norm, the joined q/latent projection, the two
   absorbed products, output projection, norm, gate/up, SiLU·up, down) on an ordinary stream.
4. ``pipeline``: 16 layers of both parts, one part's attention on the green stream while the other part's
   GEMMs run on an ordinary stream, events ordering each part's layers; against the same schedule with both
   on ordinary streams and against everything on one stream. What the step would take without the head.

Timing: CUDA events, warm-up runs excluded (the first ``--warmup`` of each), median with p10/p90 over
``--reps``. Results are only comparable within one run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from probe_args import checked, count, positive_int, positive_ints  # noqa: E402  (beside this script)

H, C, R, D, FFN, NOPE, V = 16, 512, 64, 2048, 5632, 128, 128  # mla-1b
SCALE = 1 / (NOPE + R) ** 0.5
LAYERS = 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(xs: list[float]) -> dict:
    from scaletool.stats import spread as _spread

    return _spread(xs).model_dump()


def green_stream(n_sms: int):
    """(context, stream, how) for a green context of ``n_sms`` SMs; the context must outlive the stream."""
    import torch
    from torch.cuda import green_contexts as gc

    G = gc.GreenContext
    ctx = G.create(num_sms=n_sms, device_id=torch.cuda.current_device()) if hasattr(G, "create") else G(num_sms=n_sms)
    if hasattr(ctx, "Stream"):
        return ctx, ctx.Stream(), "GreenContext.Stream()"
    ctx.set_context()
    try:
        stream = torch.cuda.Stream()
    finally:
        ctx.pop_context()
    return ctx, stream, "set_context + torch.cuda.Stream()"


def sm_ids_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _smid(out, SPIN: tl.constexpr):
        pid = tl.program_id(0)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
        acc = pid.to(tl.float32)
        for _ in range(SPIN):  # hold the SM a while, so the programs spread over the SMs the grid may use
            acc = acc * 1.0000001 + 1.0
        tl.store(out + pid, tl.where(acc > -1.0, sm, -1))
    return _smid


def used_sms(stream, programs: int = 2048) -> int:
    import torch

    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    k = sm_ids_kernel()
    with torch.cuda.stream(stream):
        k[(programs,)](out, SPIN=20000)
    torch.cuda.synchronize()
    return len(set(out.tolist()) - {-1})


def timed(fn, stream, reps: int, warmup: int) -> dict:
    """``fn()`` enqueued on ``stream``; each run between two events on that stream."""
    import torch

    times = []
    for i in range(warmup + reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            fn()
            b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b) / 1e3)
    return spread(times)


class Part:
    """One part of the batch: its latent cache (one layer's, reused by every layer: 2.4 GB at 518 × 4K, far
    past L2), its activations and one layer's weights (shared by the parts, as in the model)."""

    def __init__(self, B: int, S: int, w: dict, dev):
        import torch

        g = torch.Generator(device=dev).manual_seed(B)
        self.c_kv = torch.randn(B, S, C, device=dev, dtype=torch.bfloat16, generator=g)
        self.k_pe = torch.randn(B, S, R, device=dev, dtype=torch.bfloat16, generator=g)
        self.lengths = torch.full((B,), S, device=dev, dtype=torch.int32)
        self.x = torch.randn(B, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
        self.q_lat = torch.randn(B, H, C, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
        self.q_pe = torch.randn(B, H, R, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
        self.o_lat = torch.zeros(B, H, C, device=dev, dtype=torch.bfloat16)
        self.w = w

    cfg = None  # the kernel's configuration in the pipeline (None: the tuned table's)

    def attention(self, cfg=None):
        from scaletool.kernels.mla_decode import latent_attention_triton

        self.o_lat = latent_attention_triton(self.q_lat, self.q_pe, self.c_kv, self.k_pe, SCALE, self.lengths,
                                             config=cfg or self.cfg)

    def gemms(self):
        """This part's layer after its attention and the next layer's work before it (the absorbed decode
        step's projections and element-wise work, eager)."""
        import torch
        import torch.nn.functional as F

        w, B = self.w, self.x.shape[0]
        o = torch.bmm(self.o_lat.transpose(0, 1), w["uv"]).transpose(0, 1).reshape(B, H * V)
        h = self.x + o @ w["o"].t()
        gu = F.rms_norm(h, (D,), w["n2"]) @ w["gu"].t()
        g, u = gu.split(FFN, -1)
        self.x = h + (F.silu(g) * u) @ w["down"].t()
        q = F.rms_norm(self.x, (D,), w["n1"]) @ w["qkv"].t()  # the next layer's joined q / latent projection
        q_nope = q[:, :H * NOPE].view(B, H, NOPE)
        self.q_lat = torch.bmm(q_nope.transpose(0, 1), w["uk"]).transpose(0, 1)
        self.q_pe = q[:, H * NOPE:H * (NOPE + R)].reshape(B, H, R)


def weights(dev) -> dict:
    import torch

    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g) * 0.02  # noqa: E731
    return {"qkv": r(H * (NOPE + R) + C + R, D), "uk": r(H, NOPE, C), "uv": r(H, C, V), "o": r(D, H * V),
            "gu": r(2 * FFN, D), "down": r(D, FFN), "n1": torch.ones(D, device=dev, dtype=torch.bfloat16),
            "n2": torch.ones(D, device=dev, dtype=torch.bfloat16)}


def pipeline(parts, attn_stream, gemm_stream, layers: int):
    """Both parts' layers, part p's attention on ``attn_stream`` while the other's GEMMs run on ``gemm_stream``;
    events order each part's own work (attention after its GEMMs, GEMMs after its attention)."""
    import torch

    ready = [torch.cuda.Event() for _ in parts]  # q of part p is ready (its GEMMs ran)
    done = [torch.cuda.Event() for _ in parts]  # part p's attention ran
    start = torch.cuda.current_stream()
    for s in {attn_stream, gemm_stream}:
        s.wait_stream(start)
    for i in range(layers):
        for p, part in enumerate(parts):
            with torch.cuda.stream(attn_stream):
                if i:
                    attn_stream.wait_event(ready[p])
                part.attention()
                done[p].record(attn_stream)
            with torch.cuda.stream(gemm_stream):
                gemm_stream.wait_event(done[p])
                part.gemms()
                ready[p].record(gemm_stream)
    for s in {attn_stream, gemm_stream}:
        start.wait_stream(s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=positive_int, default=1036, help="the whole batch; two parts of half each")
    ap.add_argument("--context", type=positive_int, default=4096)
    ap.add_argument("--sms", type=positive_ints, default=[124, 116, 108, 100, 92], help="green-context SM counts to try")
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--warmup", type=count, default=3)
    ap.add_argument("--layers", type=positive_int, default=LAYERS)
    a = checked(ap, argv)

    import torch
    import triton

    from scaletool.decode.bounds import copy_bandwidth
    from scaletool.kernels.mla_decode import KernelConfig, choose_config

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/scripts/sm_partition.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "card": {"name": props.name, "sms": props.multi_processor_count,
                    "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
                    "copy_bandwidth_bytes_per_s": copy_bandwidth(dev)},
           "shape": {"batch": a.batch, "part": a.batch // 2, "context": a.context, "heads": H, "kv_lora_rank": C,
                     "rope": R, "layers": a.layers}, "partition": [], "attention": [], "gemms": None,
           "pipeline": [], "errors": []}

    def save():
        a.out.write_text(json.dumps(out, indent=1))

    half = a.batch // 2
    w = weights(dev)
    parts = [Part(half, a.context, w, dev), Part(a.batch - half, a.context, w, dev)]
    cache_bytes = half * a.context * (C + R) * 2
    tuned = choose_config(half, H, a.context, dev)
    configs = {"tuned": tuned, "bs32-w4-s3": KernelConfig(block_s=32, num_stages=3, n_splits=1, direct=True),
               "bs64-w8-s2": KernelConfig(block_s=64, num_warps=8, n_splits=1, direct=True),
               "bs32-w8-s4": KernelConfig(block_s=32, num_warps=8, num_stages=4, n_splits=1, direct=True),
               "tuned-2-splits": KernelConfig(block_s=64, num_stages=2, n_splits=2)}
    ordinary = torch.cuda.Stream()
    greens = {}
    for n in a.sms:
        try:
            ctx, s, how = green_stream(n)
            greens[n] = (ctx, s)
            out["partition"].append({"requested": n, "sms_used": used_sms(s), "how": how})
        except Exception as e:  # noqa: BLE001  (reported, the run goes on with what works)
            out["errors"].append(f"green context of {n} SMs: {type(e).__name__}: {str(e)[:300]}")
        log(f"partition {n}: {out['partition'][-1] if out['partition'] else out['errors'][-1]}")
    out["partition"].append({"requested": "ordinary stream", "sms_used": used_sms(ordinary)})
    save()

    for name, cfg in configs.items():
        for n, stream in [(props.multi_processor_count, ordinary)] + [(n, s) for n, (_, s) in greens.items()]:
            try:
                t = timed(lambda cfg=cfg: parts[0].attention(cfg), stream, a.reps, a.warmup)
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"attention {name} on {n} SMs: {type(e).__name__}: {str(e)[:300]}")
                continue
            out["attention"].append({"config": name, "sms": n, "green": stream is not ordinary, "time_s": t,
                                     "bytes_per_s": cache_bytes / t["median"]})
            log(f"attention {name} on {n} SMs: {t['median'] * 1e3:.3f} ms, {cache_bytes / t['median'] / 1e12:.2f} TB/s")
        save()

    out["gemms"] = {"time_s": timed(parts[0].gemms, ordinary, a.reps, a.warmup)}
    try:  # the same work replayed from a CUDA graph: the GPU's time without the host's launches
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            parts[0].gemms()
        out["gemms"]["graph_time_s"] = timed(g.replay, ordinary, a.reps, a.warmup)
        log(f"gemms, graphed: {out['gemms']['graph_time_s']['median'] * 1e3:.3f} ms")
    except Exception as e:  # noqa: BLE001
        out["errors"].append(f"gemms graph: {type(e).__name__}: {str(e)[:300]}")
    log(f"gemms: {out['gemms']['time_s']['median'] * 1e3:.3f} ms")
    save()

    def run(label: str, attn_stream, gemm_stream, n):
        try:
            t = timed(lambda: pipeline(parts, attn_stream, gemm_stream, a.layers), ordinary, max(5, a.reps // 2),
                      a.warmup)
        except Exception as e:  # noqa: BLE001
            out["errors"].append(f"pipeline {label}: {type(e).__name__}: {str(e)[:300]}")
            return
        nbytes = 2 * a.layers * cache_bytes
        out["pipeline"].append({"schedule": label, "attention_sms": n, "time_s": t, "cache_bytes_per_s": nbytes / t["median"]})
        log(f"pipeline {label}: {t['median'] * 1e3:.2f} ms ({nbytes / t['median'] / 1e12:.2f} TB/s of cache)")
        save()

    run("one stream", ordinary, ordinary, props.multi_processor_count)
    run("two ordinary streams", torch.cuda.Stream(), torch.cuda.Stream(), props.multi_processor_count)
    hi = torch.cuda.Stream(priority=-1)
    run("two ordinary streams, attention high priority", hi, torch.cuda.Stream(), props.multi_processor_count)
    run("two ordinary streams, GEMMs high priority", torch.cuda.Stream(), hi, props.multi_processor_count)
    for n, (_, s) in greens.items():
        run(f"attention on a green context of {n} SMs", s, torch.cuda.Stream(), n)
        run(f"attention on a green context of {n} SMs, GEMMs high priority", s, hi, n)
    for p in parts:
        p.cfg = configs["tuned-2-splits"]
    run("two ordinary streams, GEMMs high priority, 2 splits", torch.cuda.Stream(), hi, props.multi_processor_count)
    for n, (_, s) in greens.items():
        run(f"attention on a green context of {n} SMs, GEMMs high priority, 2 splits", s, hi, n)
    for p in parts:
        p.cfg = None
    if greens:  # the schedule captured in one CUDA graph, as a decode step would replay it
        n, (_, s) = min(greens.items())
        try:
            graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with torch.cuda.graph(graph):
                pipeline(parts, s, side, a.layers)
            t = timed(graph.replay, ordinary, max(5, a.reps // 2), a.warmup)
            out["pipeline"].append({"schedule": f"green context of {n} SMs, one CUDA graph", "attention_sms": n,
                                    "time_s": t, "cache_bytes_per_s": 2 * a.layers * cache_bytes / t["median"]})
            log(f"graph: {t['median'] * 1e3:.2f} ms")
        except Exception as e:  # noqa: BLE001
            out["errors"].append(f"capture with a green stream: {type(e).__name__}: {str(e)[:300]}")
    save()
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
