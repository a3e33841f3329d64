"""Measure the rates the step-time model reads on this machine's card(s): GEMMs at the recipe's shapes and
a few square sizes, fused causal attention forward + backward at its head dims (on a GPU at several sequence
lengths, the rate climbing with T), HBM copy bandwidth, and
the collectives' bus bandwidth (``scaletool.predict.calibrate_comm``). Each figure is a median with
p10/p90 and n over timed repetitions, warm-up excluded. The result is a calibration YAML that
``scaletool.analytic.load_calibration`` reads.
"""
from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.nn.functional as F

from scaletool.analytic.calibration import (
    ALIBI_KEY,
    COLLECTIVE_OPS,
    Calibration,
    calibration_for,
    curve_rate,
    shipped_calibration,
)
from scaletool.analytic.flops import gemm_shapes
from scaletool.kinds.attention import position_kind
from scaletool.predict.calibrate_host import measure_block_dispatch, overheads_from
from scaletool.predict.calibrate_tp import overheads_from as tp_overheads_from
from scaletool.stats import spread

WARMUP, REPS = 3, 10
#: a timed GPU sample lasts at least this long (the call repeated), so launch overhead does not count
MIN_SAMPLE_S = 0.005
#: Sequence lengths fused attention is timed at on a GPU (besides the recipe's), at ATTENTION_TOKENS tokens a call
#: (more when the recipe's micro-batch has more)
ATTENTION_SEQS = (1024, 2048, 4096, 8192, 16384)
ATTENTION_TOKENS = 32768
#: a GEMM that takes less than this is left out of the rate curve's fit: it times the launch and one partial
#: wave of tiles, not the rate of a training GEMM (tokens × d at thousands of tokens take hundreds of µs)
MIN_FIT_GEMM_S = 50e-6


def time_fn(fn, device: torch.device, warmup: int = WARMUP, reps: int = REPS, min_sample_s: float = 0.0) -> list[float]:
    """Seconds per call of ``fn``: ``reps`` samples after ``warmup`` untimed calls (CUDA events on a GPU).

    A sample repeats ``fn`` enough times to last ``min_sample_s`` (judged from the warm-up), so that a
    small GEMM is timed by the kernel and not by the launch and event overhead."""
    for _ in range(warmup):
        fn()
    inner = 1
    if min_sample_s > 0:
        once = _sample(fn, device, 1)
        inner = max(1, min(1000, int(min_sample_s / max(once, 1e-7))))
    return [_sample(fn, device, inner) for _ in range(reps)]


def _sample(fn, device: torch.device, inner: int) -> float:
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def spin_up(device: torch.device, seconds: float = 1.0) -> None:
    """Run large GEMMs for about ``seconds`` so that the GPU's clocks have left idle before anything is
    timed (the first shapes measured otherwise run at a fraction of the sustained rate)."""
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)


def _rate(flops: float, seconds: list[float]) -> dict:
    """A rate's median with p10/p90 and n (the fastest calls give p90)."""
    return spread([flops / s / 1e12 for s in seconds if s > 0]).model_dump()


def measure_gemm(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> dict:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    secs = time_fn(lambda: a @ b, device, min_sample_s=MIN_SAMPLE_S if device.type == "cuda" else 0.0)
    return {"m": m, "n": n, "k": k, "tflops": _rate(2 * m * n * k, secs)}


def fit_gemm_curve(points: list[dict]) -> dict:
    """Fit rate = R·s/(s+h), s the smallest dimension, to median rates: 1/rate = 1/R + (h/R)/s is linear
    in 1/s, fitted by least squares on the relative error (each point weighted by its rate squared, so
    that the fast large shapes count as much as the slow small ones); a degenerate fit keeps the fastest
    rate and h = 1. Points faster than ``MIN_FIT_GEMM_S`` are left out while two others remain."""
    timed = [p for p in points if 2 * p["m"] * p["n"] * p["k"] / (p["tflops"]["median"] * 1e12) >= MIN_FIT_GEMM_S]
    points = timed if len(timed) >= 2 else points
    xs = [1 / min(p["m"], p["n"], p["k"]) for p in points]
    rates = [p["tflops"]["median"] for p in points]
    ys = [1 / r for r in rates]
    ws = [r * r for r in rates]
    sw = sum(ws)
    mx, my = sum(w * x for w, x in zip(ws, xs)) / sw, sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    if a <= 0 or b < 0:
        return {"max_tflops": max(rates), "half_dim": 1.0}
    return {"max_tflops": 1 / a, "half_dim": max(b / a, 1.0)}


def measure_attention(heads: int, qk: int, v: int, seq: int, batch: int, device: torch.device,
                      dtype: torch.dtype, kv_heads: int | None = None, alibi: bool = False) -> dict:
    """Causal SDPA forward + backward, FLOPs in the causal convention (3 × 2·B·H·T²·(qk+v)/2), through the
    kernel priority training uses (``sdpa_backend: auto``: cuDNN first where q/k and v dims differ).
    ``kv_heads``: fewer key/value heads than query heads (GQA, MQA), attended as training does
    (``enable_gqa``); the FLOPs are the query heads' either way. ``alibi``: ALiBi's additive score bias
    (1, H, T, T) with the causal mask folded in, passed as training passes it (``attn_mask``, no causal flag, so no
    kernel skips the masked half): its rate in the same causal convention, comparable with the causal one."""
    from contextlib import nullcontext

    from torch.nn.attention import sdpa_kernel

    from scaletool.model.attention import sdpa_backends

    kv = heads if kv_heads is None else kv_heads
    if kv < 1 or heads % kv:
        raise ValueError(f"{kv} key/value heads do not divide {heads} query heads")
    q = torch.randn(batch, heads, seq, qk, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv, seq, qk, device=device, dtype=dtype, requires_grad=True)
    val = torch.randn(batch, kv, seq, v, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(batch, heads, seq, v, device=device, dtype=dtype)
    backends = sdpa_backends("auto", qk, v) if device.type == "cuda" else None
    bias = None
    if alibi:
        from scaletool.model.positions import alibi_bias, alibi_slopes
        bias = alibi_bias(alibi_slopes(heads), torch.arange(seq, device=device), seq, causal=True).to(dtype)

    def step():
        with sdpa_kernel(backends, set_priority=True) if backends else nullcontext():
            F.scaled_dot_product_attention(q, k, val, attn_mask=bias, is_causal=bias is None,
                                           enable_gqa=kv != heads).backward(grad)
    flops = 3 * 2 * batch * heads * seq * seq * (qk + v) / 2
    secs = time_fn(step, device, min_sample_s=MIN_SAMPLE_S if device.type == "cuda" else 0.0)
    out = {"heads": heads, "kv_heads": kv, "qk": qk, "v": v, "seq": seq, "batch": batch, "tflops": _rate(flops, secs)}
    return out | ({"alibi": True} if alibi else {})


def kv_heads_of(cfg, heads: int) -> int:
    """The key/value heads the recipe's attention runs with ``heads`` query heads (fewer on the CPU path):
    GQA's and MQA's group size kept where it fits; MHA and MLA (its keys expanded per head) attend with all."""
    if cfg is None or cfg.attention not in ("gqa", "mqa") or not cfg.n_kv_heads:
        return heads
    group = max(1, cfg.n_heads // cfg.n_kv_heads)
    kv = max(1, heads // group)
    return kv if heads % kv == 0 else 1


def measure_hbm(nbytes: int, device: torch.device) -> dict:
    """Copy bandwidth, GB/s: a copy reads and writes ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    secs = time_fn(lambda: dst.copy_(src), device)
    return {"bytes": nbytes, "gb_s": spread([2 * nbytes / s / 1e9 for s in secs if s > 0]).model_dump()}


def card_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"CPU {platform.processor() or platform.machine()}"


def calibrate(device: torch.device, *, recipe=None, gpus: int = 1, command: str = "", comm: dict | None = None) -> dict:
    """Every measurement on ``device``, as a calibration mapping (the YAML's content)."""
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    sizes = [1024, 2048, 4096, 8192] if gpu else [64, 128, 256]
    shapes = {(s, s, s) for s in sizes}
    if recipe is not None:
        tokens = recipe.train.micro_batch_size * recipe.seq_len if gpu else min(128, recipe.seq_len)
        shapes |= {(m, n, k) for _, m, n, k, _ in gemm_shapes(recipe.model, tokens)}
    if not gpu:  # keep the CPU path small: CI runs it
        shapes = {(min(m, 256), min(n, 256), min(k, 256)) for m, n, k in shapes}
    # a shape off 16-byte alignment (a 50,257-token head) leaves cuBLAS's fast kernels: timed apart from the curve,
    # its share of the curve is the calibration's eager gemm_unaligned (analytic.calibration.UNALIGNED_GEMM)
    odd = {x for x in shapes if any(d % 8 for d in x)} if gpu else set()
    spin_up(device)
    gemms = [measure_gemm(m, n, k, device, dtype) for m, n, k in sorted(shapes - odd)]
    curve = fit_gemm_curve(gemms)
    unaligned = [measure_gemm(m, n, k, device, dtype) for m, n, k in sorted(odd)]
    for g in unaligned:
        g["share_of_curve"] = g["tflops"]["median"] * 1e12 / curve_rate(curve, g["m"], g["n"], g["k"])
    cfg = recipe.model if recipe is not None else None
    heads, qk, v = (cfg.n_heads, cfg.qk_head_dim, cfg.v_dim) if cfg else (16, 128, 128)
    seq = (recipe.seq_len if recipe else 2048) if gpu else min(128, recipe.seq_len if recipe else 128)
    batch = max(recipe.train.micro_batch_size if recipe else 8, 1) if gpu else 1
    # on a GPU at several T (the rate climbs with T: benchmarks/results/attention-seq), the same tokens per call
    seqs, tokens = (sorted({*ATTENTION_SEQS, seq}), max(seq * batch, ATTENTION_TOKENS)) if gpu else ([seq], seq)
    heads = heads if gpu else min(heads, 4)
    attention = [measure_attention(heads, qk, v, T, max(1, tokens // T), device, dtype, kv_heads=kv_heads_of(cfg, heads))
                 for T in seqs]
    def entry(points: list[dict]):  # one rate, or {T: rate} measured at several T
        return points[0]["tflops"]["median"] if len(points) == 1 else {a["seq"]: a["tflops"]["median"] for a in points}

    rates = entry(attention)
    table = {f"{qk}/{v}": rates, "default": rates}
    if recipe is not None and position_kind(cfg).bias:  # ALiBi: its dense score bias path too (analytic.step)
        biased = [measure_attention(heads, qk, v, T, max(1, tokens // T), device, dtype,
                                    kv_heads=kv_heads_of(cfg, heads), alibi=True) for T in seqs]
        attention += biased
        table[ALIBI_KEY] = entry(biased)
    hbm = measure_hbm((1 << 30) if gpu else (1 << 24), device)
    # the host's issue time of the recipe's eager block, on every GPU at once (analytic.host)
    host = measure_block_dispatch(recipe, device, processes=gpus if gpu else 1) if recipe is not None else None
    # with two or more processes: the recipe's tensor-parallel block issue time per micro-batch (pipeline stages)
    tp_host = _tp_dispatch(recipe, device) if recipe is not None and gpus >= 2 else None
    card = card_name(device)
    base = _base_calibration(card, gpu)
    comm = comm or {}
    collectives = _collectives(comm, base)
    version = str(torch.__version__)
    date = datetime.date.today().isoformat()
    peak = base.peak_tflops if gpu else max(curve["max_tflops"], 1e-3)
    return {
        "name": f"{card} (measured {date})", "hardware": base.hardware if gpu else "CPU",
        "source": f"measured {date} {card} torch {version}" + ("" if comm.get("ops") else "; collectives not measured"),
        "peak_tflops": peak, "memory_gib": (torch.cuda.get_device_properties(device).total_memory / 2**30) if gpu else None,
        "gemm_tflops": {**curve, "points": [{"m": g["m"], "n": g["n"], "k": g["k"], "tflops": g["tflops"]["median"]}
                                            for g in gemms]},
        "attention_tflops": table,
        "hbm_gb_s": hbm["gb_s"]["median"],
        "elementwise": dict(base.elementwise),
        "gemm_unaligned": dict(base.gemm_unaligned) | ({"eager": min(1.0, statistics.median(
            g["share_of_curve"] for g in unaligned))} if unaligned else {}),
        "overheads": (dict(base.overheads) | (overheads_from(host) if host else {})
                      | (tp_overheads_from(tp_host) if tp_host and "skipped" not in tp_host else {})),
        "collectives": collectives,
        "measured": {"command": command, "date": date, "card": card, "torch": version, "device": str(device),
                     "dtype": str(dtype).removeprefix("torch."), "warmup": WARMUP, "reps": REPS, "gemm": gemms,
                     "attention": attention, "hbm": hbm, "collectives": comm.get("ops", {}),
                     **({"gemm_unaligned": unaligned} if unaligned else {}),
                     **({"collectives_failed_attempts": comm["failed_attempts"]} if comm.get("failed_attempts") else {}),
                     **({"host_dispatch": host} if host else {}),
                     **({"tp_dispatch": tp_host} if tp_host else {}),
                     **({"collectives_inter_node": comm["inter_node"], "collectives_world": comm.get("world", {}),
                         "nodes": comm.get("nodes"), "per_node": comm.get("per_node")} if comm.get("inter_node") else {}),
                     "fitted_elsewhere": "elementwise factors and overheads (but the eager and tensor-parallel block "
                                         "issue times measured here): copied from " + base.source},
    }


def _tp_dispatch(recipe, device: torch.device) -> dict:
    """:func:`measure_tp_dispatch` over 2 processes, or why not (``skipped``): a model TP 2 cannot split, blocks too
    large for the probe's share of memory (:func:`scaletool.predict.calibrate_host.not_probed`), or a probe that
    failed SPAWN_ATTEMPTS times (the rest of the calibration stands; each failure's last line is kept)."""
    from torch.multiprocessing.spawn import ProcessException

    from scaletool.kinds.engines import layout_problems
    from scaletool.predict.calibrate_comm import SPAWN_ATTEMPTS, start_again
    from scaletool.predict.calibrate_host import not_probed
    from scaletool.predict.calibrate_tp import measure_tp_dispatch, probe_recipe

    reason = not_probed(recipe.model, device)
    if reason:
        return {"skipped": reason}
    probe = probe_recipe(recipe, recipe.model.n_layers, 2, False)
    problems = layout_problems(probe, probe.seq_len) + probe.engine_problems(2)
    if problems:
        return {"skipped": "not measured: " + "; ".join(problems)}
    try:
        out, failures = start_again(lambda: measure_tp_dispatch(recipe, 2))
    except ProcessException as e:
        return {"skipped": f"not measured: the probe failed {SPAWN_ATTEMPTS} times (last: {e.failed_attempts[-1]})",
                "failed_attempts": e.failed_attempts}
    return {**out, "failed_attempts": failures} if failures else out


def _base_calibration(card: str, gpu: bool) -> Calibration:
    """The shipped calibration the unmeasured parts (element-wise factors, overheads, datasheet
    collectives) come from: the card's own when there is one, else the H100 SXM's."""
    if gpu:
        from scaletool.measure.hardware import profile_for
        prof = profile_for("cuda", card)
        cal = calibration_for(prof.name) if prof else None
        if cal is not None:
            return cal
    return shipped_calibration("h100-sxm")


def _collectives(comm: dict, base: Calibration) -> dict:
    """Bus GB/s per op and group size inside a node: the measured medians, else the base calibration's figures;
    across nodes (a job over several nodes, :func:`scaletool.predict.calibrate_comm.measure_in_job`): the
    all-reduce's over one rank per node (the rails), else the base calibration's figure."""
    measured = comm.get("ops", {})
    table = {}
    for op in COLLECTIVE_OPS:  # an op the backend lacks takes the measured all-reduce's figures
        sizes = {int(r): v["bus_gb_s"]["median"] for r, v in (measured.get(op) or measured.get("all_reduce") or {}).items()}
        intra = base.collectives["intra_node_gb_s"]
        table[op] = sizes or dict(intra.get(op) or intra["all_reduce"])
    if not measured:
        src = base.collectives.get("source", "not measured")
    elif comm.get("nodes", 1) > 1:
        src = f"measured {comm.get('backend')} inside each of {comm['nodes']} nodes of {comm.get('per_node')} ranks"
    else:
        src = f"measured {comm.get('backend')} over {comm.get('world_size')} local processes"
    out = {"source": src, "intra_node_gb_s": table, "inter_node_gb_s": base.collectives["inter_node_gb_s"]}
    across = comm.get("inter_node", {})
    rail = across.get("all_reduce") or next(iter(across.values()), None)
    if rail:
        op = "all_reduce" if "all_reduce" in across else next(iter(across))
        nodes = max(rail, key=int)
        out["inter_node_gb_s"] = rail[nodes]["bus_gb_s"]["median"]
        out["inter_node_source"] = (f"measured {comm.get('backend')}: {op} over {nodes} nodes, one rank per node, "
                                    f"{max(comm.get('messages') or [0]) / 2**20:g} MiB")
    else:
        out["inter_node_source"] = base.collectives.get("inter_node_source", "assumed, not measured")
    return out
