"""HBM bandwidth of MLA's fused latent-attention decode kernel across launch shapes, beside MHA's SDPA decode.

Usage (GPU machine, repo root; about 2 minutes on one H100):
    python benchmarks/scripts/decode_bandwidth.py [--out FILE.json] [--quick]

One layer of mla-1b's attention (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, bf16) at 4K and
32K context and batches 1-128: for each launch shape of ``scaletool.kernels.mla_decode`` (split
target programs per SM, ``block_s``, ``num_warps``, ``num_stages``) the kernel time with its spread
(``triton.testing.do_bench``: CUDA events, L2 flushed between runs, all samples kept; median with
p10/p90), the cache bytes it must read over that time (B × S × (512 + 64) × 2 bytes: the latent
cache once), and that as a fraction of the card's datasheet HBM peak and of a device-to-device
copy measured here. Beside it: the per-shape default (``choose_config``), the torch reference
(two bmm), and MHA's decode step at mha-1b's shapes (16 heads × 128, K and V per head) through SDPA
with scaletool's backend priority (cuDNN first), over the cache prefix and over a static cache with
a length mask (the CUDA-graph path). Every kernel is checked against the fp32 reference first.
Prints progress, a table last, and writes the JSON (card, date, versions, command, rows).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from scaletool.kernels import mla_decode as K
from scaletool.measure.hardware import profile_for
from scaletool.model.attention import decode_backends
from scaletool.stats import Spread, spread

H, C, R, HD = 16, 512, 64, 128  # mla-1b / mha-1b attention shapes
SCALE = 1 / (128 + 64) ** 0.5
DEV = "cuda"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def card() -> dict:
    """The card, its datasheet peak (scaletool's profiles) and a measured device-to-device copy."""
    name = torch.cuda.get_device_name()
    prof = profile_for("cuda", name)
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    copy = time_fn(lambda: dst.copy_(src), graph=False)
    import triton

    return {"name": name, "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "peak_bandwidth_bytes_per_s": prof.peak_bandwidth_bytes_per_s if prof else None,
            "peak_source": prof.source if prof else "no profile matches this card",
            "copy_bandwidth_bytes_per_s": 2 * 2**30 / copy.median,  # bytes read + written
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}}


def time_fn(fn, warmup_ms: int = 10, rep_ms: int = 60, graph: bool = True) -> Spread:
    """Seconds per call: do_bench's per-run CUDA-event times (L2 cleared before each run).

    With ``graph`` the call is captured in a CUDA graph and each run is one replay, as the decode
    step runs: the host's launch work (tens of µs for a Triton launch from Python) stays out of the
    timed region, where at small shapes it would otherwise be most of it.
    """
    from triton.testing import do_bench

    if graph:
        fn()  # compile and select kernels outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return spread([t / 1e3 for t in do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")])


def timed(fn) -> tuple[Spread, str]:
    """``time_fn`` over graph replays; eager where the call cannot be captured (said in the second item)."""
    try:
        return time_fn(fn), "cuda graph replay"
    except Exception as e:  # a kernel that is not capture-safe: still timed, and the row says how
        torch.cuda.synchronize()
        return time_fn(fn, graph=False), f"eager (capture failed: {type(e).__name__}: {str(e)[:120]})"


def latent_inputs(B: int, S: int, seed: int = 0):
    """An absorbed query and a latent cache of B sequences × S positions, random bf16."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    return mk(B, H, C), mk(B, H, R), mk(B, S, C), mk(B, S, R)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def row(kernel: str, S: int, B: int, bytes_read: int, t: Spread | None, c: dict, **extra) -> dict:
    out = {"kernel": kernel, "context": S, "batch": B, "bytes_read": bytes_read, **extra}
    if t is None:
        return out
    bw = t.inverse(bytes_read)  # bytes / seconds: the percentiles swap
    peak = c["peak_bandwidth_bytes_per_s"]
    return {**out, "time_s": t.model_dump(), "bandwidth_bytes_per_s": bw.model_dump(),
            "fraction_of_peak": bw.median / peak if peak else None,
            "fraction_of_copy": bw.median / c["copy_bandwidth_bytes_per_s"]}


def configs(quick: bool) -> list[K.KernelConfig]:
    """The launch shapes swept around the default: split counts, tile, warps, pipeline depth."""
    shapes = [K.KernelConfig(block_s=32), K.KernelConfig(num_warps=8), K.KernelConfig(num_stages=3)]
    if quick:
        return shapes
    splits = [K.KernelConfig(n_splits=n) for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)]
    return shapes + splits + [K.KernelConfig(n_splits=n, num_stages=3) for n in (2, 4, 8, 16)]


def mla_rows(S: int, B: int, cfgs: list[K.KernelConfig], c: dict) -> list[dict]:
    q, qp, ckv, kpe = latent_inputs(B, S)
    nbytes = B * S * (C + R) * 2
    want = K.latent_attention_reference(q[:4].float(), qp[:4].float(), ckv[:4].float(), kpe[:4].float(), SCALE)
    rows = []
    chosen = K.choose_config(B, H, S, torch.device(DEV))
    for cfg in [chosen] + [x for x in cfgs if x != chosen]:
        shape = {**dataclasses.asdict(cfg), "splits": cfg.splits(B, H, S, c["sms"])[0], "default": cfg == chosen}
        try:
            got = K.latent_attention_triton(q, qp, ckv, kpe, SCALE, config=cfg)
            err = rel_err(got[:4], want)
            if not err < 2e-2:
                raise AssertionError(f"wrong result: relative error {err:.2e}")
            t, how = timed(lambda cfg=cfg: K.latent_attention_triton(q, qp, ckv, kpe, SCALE, config=cfg))
            rows.append(row("mla-triton", S, B, nbytes, t, c, config=shape, rel_error=err, timing=how))
        except Exception as e:  # out of shared memory for a shape, or a wrong result: recorded, not fatal
            rows.append(row("mla-triton", S, B, nbytes, None, c, config=shape, error=f"{type(e).__name__}: {e}"[:300]))
    t, how = timed(lambda: K.latent_attention_reference(q, qp, ckv, kpe, SCALE))
    rows.append(row("mla-torch-reference", S, B, nbytes, t, c, timing=how))
    return rows


def mha_rows(S: int, B: int, c: dict) -> list[dict]:
    """One decode step of MHA attention: q (B,16,1,128) over K, V (B,16,S,128), as scaletool runs it."""
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(B, H, n, HD, generator=g, device=DEV, dtype=torch.bfloat16) for n in (1, S, S))
    nbytes = 2 * B * H * S * HD * 2
    mask = (torch.arange(S, device=DEV) < S).view(1, 1, 1, S)  # the graph path's length mask, all valid here

    def sdpa(attn_mask=None):
        with sdpa_kernel(decode_backends("auto"), set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    q2, k2, v2 = (t[:2].float() for t in (q, k, v))
    want = torch.softmax((q2 @ k2.transpose(-1, -2)) / HD**0.5, -1) @ v2
    rows = []
    for kernel, fn in (("mha-sdpa", sdpa), ("mha-sdpa-length-mask", lambda: sdpa(mask))):
        err = rel_err(fn()[:2], want)
        t, how = timed(fn)
        rows.append(row(kernel, S, B, nbytes, t, c, rel_error=err, timing=how))
    return rows


def summary(rows: list[dict], c: dict) -> str:
    peak = c["peak_bandwidth_bytes_per_s"] or float("nan")
    lines = [f"{c['name']}: datasheet {peak / 1e12:.2f} TB/s, copy {c['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s",
             f"{'ctx':>6} {'batch':>5}  {'default TB/s':>13} {'%peak':>5}  {'best TB/s':>10} {'%peak':>5}  best shape"
             f"{'':14} {'torch':>6} {'MHA sdpa':>9}"]
    for (S, B), grp in itertools.groupby(rows, key=lambda r: (r["context"], r["batch"])):
        grp = [r for r in grp if "bandwidth_bytes_per_s" in r]
        tri = [r for r in grp if r["kernel"] == "mla-triton"]
        tb = lambda r: r["bandwidth_bytes_per_s"]["median"] / 1e12 if r else float("nan")  # noqa: E731
        default = next((r for r in tri if r["config"]["default"]), None)
        best = max(tri, key=lambda r: r["bandwidth_bytes_per_s"]["median"], default=None)
        ref = next((r for r in grp if r["kernel"] == "mla-torch-reference"), None)
        mha = next((r for r in grp if r["kernel"] == "mha-sdpa"), None)
        shape = "-" if best is None else "s{splits} b{block_s} w{num_warps} st{num_stages} m{min_split}".format(
            **best["config"])
        lines.append(f"{S:>6} {B:>5}  {tb(default):>13.2f} {100 * tb(default) * 1e12 / peak:>5.0f}  {tb(best):>10.2f} "
                     f"{100 * tb(best) * 1e12 / peak:>5.0f}  {shape:<24} {tb(ref):>6.2f} {tb(mha):>9.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="decode_bandwidth.json")
    ap.add_argument("--quick", action="store_true", help="three launch shapes beside the default instead of 18")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--batches", default="1,8,32,128")
    a = ap.parse_args()
    t0 = time.time()
    c = card()
    log(f"{c['name']}: {c['sms']} SMs, copy {c['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    cfgs = configs(a.quick)
    rows = []
    for S, B in itertools.product(map(int, a.contexts.split(",")), map(int, a.batches.split(","))):
        log(f"[{time.time() - t0:5.0f}s] context {S} batch {B}: {len(cfgs)} launch shapes, reference, MHA")
        rows += mla_rows(S, B, cfgs, c)
        try:
            rows += mha_rows(S, B, c)
        except torch.cuda.OutOfMemoryError:
            rows.append({"kernel": "mha-sdpa", "context": S, "batch": B, "error": "out of memory"})
        torch.cuda.empty_cache()
    doc = {"card": c, "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
           "shapes": {"n_heads": H, "kv_lora_rank": C, "qk_rope_head_dim": R, "mha_head_dim": HD, "dtype": "bf16"},
           "timing": "triton.testing.do_bench over CUDA-graph replays of one call (no host launch work in the "
                     "timed region), every run's CUDA-event time, L2 cleared before each; median p10 p90",
           "rows": rows, "wall_s": time.time() - t0}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(summary(rows, c))
    log(f"wrote {a.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
