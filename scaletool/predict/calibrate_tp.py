"""The host's issue time per tensor-parallel block and micro-batch: the floor under a pipeline stage's micro-batch.

Under tensor parallelism every op of a block runs through DTensor's dispatcher on the CPU (placements,
redistributes), several times a plain op's cost; where a micro-batch's device work is short (a pipeline stage of a
1B model, a few sequences) the stage waits on that issue time. The step model's TP dispatch figures
(``tp_{eager,compiled}_block[_mla]_s``) were fitted on whole steps divided by their blocks, so they also hold the
head, the vocabulary-parallel loss and the optimizer's DTensor work, which a pipeline would charge again on every
micro-batch. This probe measures the block alone, as :mod:`scaletool.predict.calibrate_host` does for eager blocks:
the recipe's engine (FSDP2 over a one-rank data mesh × TP over ``tp`` ranks, as the pipeline's stages and the fitted
figures run it), one sequence of at most 128 tokens, forward + loss + backward in a loop that waits on the device
only at its end, at 1 and 3 blocks; the difference per block is the issue time (embedding, head and loss cancel).

Keys: ``tp_<mode>_microbatch_block[_mla]_s`` (pipeline stages), and from :func:`probe_step` (the engine's
``train_step``, TP over all ranks, 1 and 3 blocks × 1 and 2 micro-batches: t(L, g) = g·(L·b + h) + L·u + c)
``tp_<mode>_step_<block|head|update_block|update>[_mla]_s``, read in place of the fitted whole-step figures, written
only where every part's lower decile is above zero (:func:`unresolved`).
"""
from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaletool.analytic.host import TP_STEP_PARTS, tp_overhead_key, tp_step_key
from scaletool.predict.calibrate_host import BLOCKS, MAX_TOKENS, timed_loop
from scaletool.stats import spread

#: iterations per timed sample (fewer than the eager probe's: a DTensor block issues in milliseconds)
INNER = 4


def probe_recipe(recipe, n_layers: int, tp: int, compiled: bool):
    """The recipe as the probe builds it: FSDP2 over a one-rank data mesh × TP ``tp``, ``n_layers`` blocks, one sequence."""
    t = recipe.train.model_copy(update={"compile": compiled, "micro_batch_size": 1, "grad_accum_steps": 1,
                                        "activation_checkpointing": "none", "float8": "none"})
    # every other parallel key at its default: a DeepSpeed recipe's ZeRO keys are not FSDP2's
    p = type(recipe.parallel)(engine="fsdp", tensor_parallel=tp, fsdp_on_one_rank=True, world_size=tp)
    model = recipe.model.model_copy(update={"n_layers": n_layers, "first_k_dense_replace": 0, "dropout": 0.0})
    return recipe.model_copy(update={"model": model, "train": t, "parallel": p})


def step_probe_recipe(recipe, n_layers: int, tp: int, compiled: bool):
    """The recipe as :func:`probe_step` builds it: tensor parallelism over all ``tp`` ranks without FSDP2, ``n_layers``
    blocks, one sequence a micro-batch, the recipe's optimizer and clipping."""
    r = probe_recipe(recipe, n_layers, tp, compiled)
    return r.model_copy(update={"parallel": r.parallel.model_copy(update={"fsdp_on_one_rank": False})})


def _timed(engine, tokens: torch.Tensor, device: torch.device) -> list[float]:
    """Seconds per forward + backward, REPS samples of INNER iterations (WARMUP first, compile included), the
    ranks starting each sample together."""
    def once():
        with engine.grad_sync(True):  # loss_parallel: the loss over vocabulary-sharded logits, and its backward
            with engine.autocast():
                loss = engine.model(tokens, tokens)
            loss.backward()

    return timed_loop(once, device, INNER, dist.barrier)


def _solve(a1: float, b1: float, a2: float, b2: float) -> dict[str, float]:
    """b, h, u, c of t(L, g) = g·(L·b + h) + L·u + c from t at (1, 1), (3, 1), (1, 2), (3, 2) blocks and micro-batches."""
    lo, hi = BLOCKS
    d1, d2 = (b1 - a1) / (hi - lo), (b2 - a2) / (hi - lo)  # g·b + u at g = 1 and 2
    b = d2 - d1
    u, h = d1 - b, (a2 - a1) - lo * b
    return {"block": b, "head": h, "update_block": u, "update": a1 - lo * (b + u) - h}


def step_parts(t: dict) -> dict[str, dict]:
    """Each part of the step (:func:`_solve`) from samples ``t[(L, g)]`` at L = 1, 3 and g = 1, 2: ``value`` from the
    four cells' medians; p10, p90 and n of the part solved sample by sample (samples paired in order)."""
    lo, hi = BLOCKS
    cells = [t[(lo, 1)], t[(hi, 1)], t[(lo, 2)], t[(hi, 2)]]
    value = _solve(*(spread(c).median for c in cells))
    paired = [_solve(*x) for x in zip(*cells)]
    out = {}
    for part in TP_STEP_PARTS:
        s = spread([x[part] for x in paired])
        out[part] = {"value": value[part], "p10": s.p10, "p90": s.p90, "n": s.n}
    return out


def unresolved(parts: dict[str, dict]) -> str | None:
    """Why the measured step parts (:func:`step_parts`) are not figures to predict with, or None: a host's issue
    time is not negative, so a part whose lower decile falls below zero is not told apart from the noise (on 2
    H200s every mode of mla-1b and mha-1b had one, and the parts then predicted pure TP=2 runs −38.7% … +12.0%
    against −14.3% … +12.0% with the fitted figures: benchmarks/results/host-dispatch)."""
    below = [f"{part} {v['value'] * 1e3:.3g} ms (p10 {v['p10'] * 1e3:.3g})" for part, v in parts.items()
             if v["p10"] < 0]
    return f"not resolved from the noise: {', '.join(below)}" if below else None


def probe_step(recipe, env, tp: int, mode: str, tokens: torch.Tensor) -> dict:
    """Host seconds of a whole tensor-parallel step's parts (:func:`step_parts`: value, p10, p90, n each) on this
    rank, timed through the engine's ``train_step``; every rank of the ``tp``-rank group calls it together."""
    from scaletool.engines import make_engine

    samples = {}
    for L in BLOCKS:
        engine = make_engine(step_probe_recipe(recipe, L, tp, mode == "compiled"), env)
        for g in (1, 2):
            samples[(L, g)] = timed_loop(partial(engine.train_step, [(tokens, tokens)] * g, recipe.train.lr),
                                         env.device, INNER, dist.barrier)
        del engine
        torch._dynamo.reset()
    parts = step_parts(samples)
    why = unresolved(parts)
    return {part: v | {"key": tp_step_key(part, mode, recipe.model.attention)} for part, v in parts.items()} \
        | {"step_s": {f"{L} blocks x {g}": sorted(v) for (L, g), v in samples.items()}} \
        | ({"unresolved": why} if why else {})


def probe(recipe, env, tp: int, modes: tuple[str, ...]) -> dict:
    """Per mode: host seconds per TP block and micro-batch (median, p10, p90, n) on this rank; every rank of the
    ``tp``-rank group calls it together."""
    from scaletool.engines import make_engine

    T = min(recipe.seq_len, MAX_TOKENS)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, recipe.model.vocab_size, (1, T), generator=gen).to(env.device)
    result = {}
    for mode in modes:
        times = {}
        for L in BLOCKS:
            engine = make_engine(probe_recipe(recipe, L, tp, mode == "compiled"), env)
            times[L] = _timed(engine, tokens, env.device)
            del engine
            torch._dynamo.reset()
        lo, hi = BLOCKS
        per_block = [(b - a) / (hi - lo) for a, b in zip(times[lo], times[hi])]
        result[mode] = {"block_s": spread(per_block).model_dump(), "iteration_s": {str(L): sorted(v) for L, v in times.items()},
                        "key": tp_overhead_key(mode, recipe.model.attention),
                        "step": probe_step(recipe, env, tp, mode, tokens)}
    return {"tokens": T, "blocks": list(BLOCKS), "tensor_parallel": tp, **result}


def _worker(rank: int, tp: int, recipe, store: str, result: str, modes: tuple[str, ...]) -> None:
    from scaletool.engines.dist import DistEnv

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=tp,
                            timeout=timedelta(seconds=600))
    try:
        out = probe(recipe, DistEnv(rank, tp, rank, tp, device, backend, False), tp, modes)
        if rank == 0:
            Path(result).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def measure_tp_dispatch(recipe, tp: int = 2, modes: tuple[str, ...] | None = None) -> dict:
    """The recipe's TP block issue time per micro-batch over ``tp`` local processes (GPUs, else gloo on the CPU),
    eager and compiled on GPUs, eager on the CPU (no compiler assumed there)."""
    modes = modes or (("eager", "compiled") if torch.cuda.is_available() else ("eager",))
    with tempfile.TemporaryDirectory(prefix="scaletool-tp-") as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(tp, recipe, store, result, modes), nprocs=tp, join=True,
                           start_method="spawn")
        return json.loads(Path(result).read_text())


def overheads_from(measured: dict) -> dict:
    """The calibration's overhead entries a :func:`measure_tp_dispatch` result gives."""
    out = {}
    for m in measured.values():
        if isinstance(m, dict) and "key" in m:
            out[m["key"]] = max(0.0, round(m["block_s"]["median"], 6))
            # the step's parts, where every one was told apart from the noise (else the fitted figures stand)
            step = m.get("step", {})
            if "unresolved" not in step:
                out |= {p["key"]: max(0.0, round(p["value"], 6)) for p in step.values() if "key" in p}
    return out
