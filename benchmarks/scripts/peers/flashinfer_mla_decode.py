"""MLA decode beside FlashInfer: the same latent cache, the same card, three kernels.

Usage (GPU machine, repo root; a few minutes on one H100, most of it FlashInfer's first-use JIT build):
    pip install --no-deps .whl-fi/*.whl     # built by peers/flashinfer_trim.py; see peers/README.md
    python benchmarks/scripts/peers/flashinfer_mla_decode.py [--out FILE.json] [--page-size 1|64]
        [--backends fa3,fa2] [--contexts 4096,32768] [--batches 1,8,32,128]

Without flashinfer the FlashInfer rows say why. Its JIT cache goes under $FLASHINFER_WORKSPACE_BASE
(set here to a temporary directory when unset); the JSON records flashinfer's version and, per
backend, the seconds of its first plan and call (the nvcc build of the MLA module when not cached).

For mla-1b's attention (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, bf16), contexts 4K and 32K,
batches 1-128, one latent cache laid out as scaletool's ``LatentCache`` holds it (c_kv (B, S, 512)
and k_pe (B, S, 64), contiguous) is read by:

- scaletool's fused Triton kernel (``scaletool.kernels.mla_decode``, the per-shape default launch);
- FlashInfer's ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` over *the same tensors*, viewed as
  pages (page size 1: ``c_kv.view(B·S, 1, 512)``; 64: ``c_kv.view(B·S/64, 64, 512)``) with page
  table b·S/page + t: no copy, so both read identical bytes; ``plan`` is outside the timing;
- the naive form of the same attention through SDPA (keys and values up-projected per head from
  the latent, as ``--mla-mode naive`` decodes), for the numerical check, and MHA's SDPA decode
  step at mha-1b's shapes (16 × 128 K and V per head) for the bandwidth baseline.

All three MLA results are compared with the fp32 torch reference (max absolute and relative error
of the attention output per head, on the first sequences); times are ``triton.testing.do_bench``
samples over CUDA-graph replays where the call can be captured (else eager, and the row says so;
median, p10, p90); GB/s count the cache bytes each must read. Writes JSON with card,
date, versions and command after every point; prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks: the shared helpers
from decode_bandwidth import DEV, SCALE, C, H, R, card, latent_inputs, log, mha_rows, row, timed  # noqa: E402

from scaletool.kernels import mla_decode as K  # noqa: E402

NOPE = V = 128  # mla-1b's qk_nope_head_dim and v_head_dim: the up-projection for the naive check
CHECK = 2  # sequences compared against the fp32 reference (the reference materialises fp32 copies)

# flashinfer's JIT writes generated sources and built modules under $FLASHINFER_WORKSPACE_BASE/.cache
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.join(tempfile.gettempdir(), "flashinfer-ws"))
FIRST_CALL_S: dict[str, float] = {}  # backend -> seconds of its first plan + call (the JIT build, if any)

try:
    import flashinfer
    FLASHINFER = None
except ImportError as e:  # an optional peer: everything else still runs
    flashinfer = None
    FLASHINFER = (f"flashinfer is not installed ({e}); `pip install flashinfer-python flashinfer-cubin` on a CUDA "
                  "machine adds its rows")


def up_projections(seed: int = 2):
    """W_UK (H, nope, C) and W_UV (H, v, C), scaled so the up-projected keys stay O(1)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(H, n, C, generator=g, device=DEV, dtype=torch.bfloat16) / C**0.5 for n in (NOPE, V)]


def flashinfer_run(q, qp, ckv, kpe, page: int, backend: str):
    """A planned FlashInfer MLA decode over our cache viewed as pages; returns the run closure."""
    B, S = ckv.shape[:2]
    if S % page:
        raise ValueError(f"context {S} is not a multiple of page size {page}")
    per_seq = S // page
    i32 = dict(dtype=torch.int32, device=DEV)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 * 2**20, dtype=torch.int8, device=DEV),
                                                           backend=backend)
    wrapper.plan(torch.arange(B + 1, **i32), torch.arange(B + 1, **i32) * per_seq, torch.arange(B * per_seq, **i32),
                 torch.full((B,), S, **i32), H, C, R, page, False, SCALE, q.dtype, ckv.dtype)
    ckv_pages, kpe_pages = ckv.view(B * per_seq, page, C), kpe.view(B * per_seq, page, R)
    return lambda: wrapper.run(q, qp, ckv_pages, kpe_pages)


def errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = (got.float() - want).abs()
    return {"max_abs_error": d.max().item(), "rel_error": (d.norm() / want.norm()).item()}


def mla_rows(S: int, B: int, page: int, w_uk, w_uv, c: dict, backends=("fa3", "fa2")) -> list[dict]:
    _, qp, ckv, kpe = latent_inputs(B, S)
    # the absorbed query from a per-head q_nope, so the naive path below computes the very same scores
    q_nope = torch.randn(B, H, NOPE, generator=torch.Generator(device=DEV).manual_seed(3), device=DEV,
                         dtype=torch.bfloat16)
    q = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    nbytes = B * S * (C + R) * 2
    ref_lat = K.latent_attention_reference(q[:CHECK].float(), qp[:CHECK].float(), ckv[:CHECK].float(),
                                           kpe[:CHECK].float(), SCALE)  # (CHECK, H, C)
    ref = torch.einsum("bhc,hvc->bhv", ref_lat, w_uv.float())  # per-head attention output
    rows = []
    ours = lambda: K.latent_attention_triton(q, qp, ckv, kpe, SCALE)  # noqa: E731
    t, how = timed(ours)
    rows.append(row("scaletool-triton", S, B, nbytes, t, c, timing=how,
                    **errors(torch.einsum("bhc,hvc->bhv", ours()[:CHECK].float(), w_uv.float()), ref)))
    for backend in backends:
        name = f"flashinfer-{backend}-page{page}"
        if FLASHINFER:
            rows.append(row(name, S, B, nbytes, None, c, error=FLASHINFER))
            continue
        try:
            t0 = time.time()
            fi = flashinfer_run(q, qp, ckv, kpe, page, backend)
            out = fi()
            torch.cuda.synchronize()
            first = {}
            if backend not in FIRST_CALL_S:  # the first plan + call builds (or loads) the JIT module
                FIRST_CALL_S[backend] = first["first_call_s"] = time.time() - t0
                log(f"flashinfer {backend}: first plan + call {FIRST_CALL_S[backend]:.1f}s")
            err = errors(torch.einsum("bhc,hvc->bhv", out[:CHECK].float(), w_uv.float()), ref)
            t, how = timed(fi)
            rows.append(row(name, S, B, nbytes, t, c, timing=how, **err, **first))
        except Exception as e:  # a backend this card or build lacks: recorded, not fatal
            rows.append(row(name, S, B, nbytes, None, c, error=f"{type(e).__name__}: {e}"[:300]))
    # the same attention, naive: per-head keys [c_kv·W_UKᵀ, k_pe] (192) and values c_kv·W_UVᵀ (128), via SDPA
    k = torch.cat([torch.einsum("bsc,hnc->bhsn", ckv[:CHECK], w_uk),
                   kpe[:CHECK, None].expand(-1, H, -1, -1)], -1)
    v = torch.einsum("bsc,hvc->bhsv", ckv[:CHECK], w_uv)
    q_naive = torch.cat([q_nope[:CHECK], qp[:CHECK]], -1)[:, :, None]  # (CHECK, H, 1, 192)
    naive = torch.nn.functional.scaled_dot_product_attention(q_naive, k, v, scale=SCALE)[:, :, 0]
    rows.append(row("sdpa-mla-naive", S, B, CHECK * S * H * (NOPE + R + V) * 2, None, c, **errors(naive, ref),
                    note="numerical check only, on the first sequences"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="flashinfer_mla_decode.json")
    ap.add_argument("--page-size", type=int, default=1, choices=(1, 64))
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--backends", default="fa3,fa2", help="FlashInfer backends (each JIT-builds once)")
    a = ap.parse_args()
    backends = tuple(b for b in a.backends.split(",") if b)
    if not set(backends) <= {"fa2", "fa3"}:
        ap.error(f"--backends: fa2 and/or fa3, not {a.backends!r}")
    if FLASHINFER:
        log(f"note: {FLASHINFER}")
    t0 = time.time()
    c = card()
    c["versions"]["flashinfer"] = getattr(flashinfer, "__version__", None)
    w_uk, w_uv = up_projections()
    rows = []
    points = list(itertools.product(map(int, a.contexts.split(",")), map(int, a.batches.split(","))))

    def save(done: int) -> None:  # after every point, so a run cut short keeps what it measured
        doc = {"card": c, "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
               "flashinfer": FLASHINFER or "installed", "flashinfer_first_call_s": FIRST_CALL_S,
               "flashinfer_workspace_base": os.environ["FLASHINFER_WORKSPACE_BASE"], "page_size": a.page_size,
               "points_done": done, "points": len(points), "rows": rows, "wall_s": time.time() - t0}
        Path(a.out).write_text(json.dumps(doc, indent=1))

    for i, (S, B) in enumerate(points):
        log(f"[{time.time() - t0:5.0f}s] context {S} batch {B}")
        rows += mla_rows(S, B, a.page_size, w_uk, w_uv, c, backends)
        rows += [r for r in mha_rows(S, B, c) if r["kernel"] == "mha-sdpa"]
        torch.cuda.empty_cache()
        save(i + 1)
    peak = c["peak_bandwidth_bytes_per_s"] or float("nan")
    print(f"{c['name']} (datasheet {peak / 1e12:.2f} TB/s); TB/s of the cache bytes each kernel must read")
    for r in rows:
        bw = r.get("bandwidth_bytes_per_s")
        speed = f"{bw['median'] / 1e12:6.2f} TB/s {100 * bw['median'] / peak:4.0f}%" if bw else f"{'-':>17}"
        err = f"max|Δ| {r['max_abs_error']:.1e}" if "max_abs_error" in r else r.get("error", "")[:60]
        print(f"{r['context']:>6} {r['batch']:>4} {r['kernel']:<24} {speed}  {err}")
    log(f"wrote {a.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
