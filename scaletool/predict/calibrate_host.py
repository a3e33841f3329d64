"""The host's dispatch time per transformer block in eager mode: the floor under a step whose device work is small.

In eager mode every op of a block's forward and backward is issued from Python, one kernel launch after another;
the device runs ahead only while its queue holds work. Where a micro-batch is small (a pipeline stage of a few
blocks over one sequence, a small data-parallel micro-batch), the device waits on the host and the step is the
host's issue time, not the device's work. This module measures that issue time as a mechanism, not as a fit to
step times: the recipe's own block at a token count where the device is idle (one sequence of at most 128 tokens),
forward + loss + backward in a loop that never synchronises until its end, at two block counts; the difference per
block is the host seconds one block costs (embedding, head, loss and the autograd engine's fixed cost cancel).

Two ways an engine runs a block: under ``torch.autocast`` over fp32 weights (single, DDP, DeepSpeed: a cast per
weight per use) or on 16-bit weights without autocast (FSDP2's mixed-precision policy gathers bf16 weights); both
are measured (``mode``). With ``processes`` > 1 the probe runs on that many GPUs at once, one process each, so the
host's contention of a multi-GPU job (its cores, its memory bandwidth, the driver) is in the figure.

The calibration keys (:func:`overhead_key`) are read by :mod:`scaletool.analytic.step` and
:mod:`scaletool.analytic.pipeline` (``eager_dispatch_s``).
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from scaletool.analytic.host import overhead_key
from scaletool.stats import spread

BLOCKS = (1, 3)           # the two block counts whose difference is measured
WARMUP, REPS, INNER = 3, 9, 8
MAX_TOKENS = 128
MODES = ("autocast", "bf16")


def _model(cfg, n_layers: int, device: torch.device, mode: str):
    from scaletool.model.transformer import build_model

    # the probed blocks are of the recipe's own FFN kind: an MoE recipe's leading dense layers left out
    model = build_model(cfg.model_copy(update={"n_layers": n_layers, "first_k_dense_replace": 0}), device)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    return model


def timed_loop(once, device: torch.device, inner: int = INNER, before_sample=None) -> list[float]:
    """Seconds per call of ``once``: WARMUP calls, then REPS samples of ``inner`` calls that wait on the device
    only at each sample's end (``before_sample``: run before each, a barrier where ranks time together)."""
    for _ in range(WARMUP):
        once()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for _ in range(REPS):
        sync()
        if before_sample is not None:
            before_sample()
        t0 = time.perf_counter()
        for _ in range(inner):
            once()
        sync()
        out.append((time.perf_counter() - t0) / inner)
    return out


def _iteration_seconds(model, tokens: torch.Tensor, device: torch.device, mode: str) -> list[float]:
    """Seconds per forward + backward, REPS samples of INNER iterations each (WARMUP iterations first)."""
    use_autocast = mode == "autocast" and device.type == "cuda"

    def once():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            loss = model(tokens, tokens)
        loss.backward()

    return timed_loop(once, device)


def probe(cfg, seq_len: int, device: torch.device, modes: tuple[str, ...] = MODES) -> dict:
    """Per mode: host seconds per block (forward + backward) as median, p10, p90 and n, and the per-iteration
    times at each block count; one process, one device."""
    T = min(seq_len, MAX_TOKENS)
    gen = torch.Generator().manual_seed(0)
    if cfg.task != "lm":
        raise ValueError("the host-dispatch probe runs language models (model.task=lm)")
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=gen).to(device)
    result = {}
    for mode in modes:
        times = {}
        for L in BLOCKS:
            model = _model(cfg, L, device, mode)
            times[L] = _iteration_seconds(model, tokens, device, mode)
            del model
        lo, hi = BLOCKS
        per_block = [(b - a) / (hi - lo) for a, b in zip(times[lo], times[hi])]
        s = spread(per_block)
        result[mode] = {"block_s": {"median": s.median, "p10": s.p10, "p90": s.p90, "n": s.n},
                        "iteration_s": {str(L): sorted(v) for L, v in times.items()}}
    return {"tokens": T, "blocks": list(BLOCKS), "device": str(device), **result}


def _worker(rank: int, cfg, seq_len: int, out_dir: str, modes: tuple[str, ...]) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    res = probe(cfg, seq_len, device, modes)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(res))


#: bytes per parameter the probe holds at its larger block count: fp32 weight and gradient, the 16-bit copy
PROBE_BYTES_PER_PARAM = 10
#: the share of the device's memory the probe may take (on the CPU: of CPU_PROBE_BYTES)
PROBE_MEMORY_SHARE = 0.3
CPU_PROBE_BYTES = 2 << 30


def probe_bytes(cfg) -> int:
    """What the probe's larger model (its most blocks, the embedding and the head) holds, in bytes."""
    from scaletool.analytic.params import param_counts

    largest = cfg.model_copy(update={"n_layers": max(BLOCKS), "first_k_dense_replace": 0})
    return PROBE_BYTES_PER_PARAM * param_counts(largest)["total"]


def not_probed(cfg, device: torch.device) -> str | None:
    """Why the probe does not run on ``device`` for this model, or None: it runs language models only (a
    regression head's input is features, not tokens), and only where its blocks fit the share of memory it may
    take (DeepSeek-V3's three MoE blocks hold 36 B parameters: more than a card)."""
    if cfg.task != "lm":
        return "not measured: the probe runs language models (model.task=lm); the base calibration's figures stand"
    if device.type == "cuda":
        budget = PROBE_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory
    else:
        budget = PROBE_MEMORY_SHARE * CPU_PROBE_BYTES
    need = probe_bytes(cfg)
    if need <= budget:
        return None
    return (f"not measured: {max(BLOCKS)} blocks of this model hold {need / 2**30:.1f} GiB, over the "
            f"{budget / 2**30:.1f} GiB the probe may take on {device.type}; the base calibration's figures stand")


def measure_block_dispatch(recipe, device: torch.device, processes: int = 1, modes: tuple[str, ...] = MODES) -> dict:
    """The recipe's eager block host time per ``mode``; on ``processes`` GPUs at once (their medians' median,
    every process's figure kept), or one process on ``device``. A model whose blocks do not fit the probe's
    share of memory is not probed: the result says so (``skipped``) and gives no figures."""
    cfg, T = recipe.model, recipe.seq_len
    reason = not_probed(cfg, device)
    if reason:
        return {"skipped": reason, "attention": cfg.attention, "moe": cfg.ffn == "moe"}
    if processes <= 1 or device.type != "cuda":
        per = [probe(cfg, T, device, modes)]
    else:
        with tempfile.TemporaryDirectory(prefix="scaletool-host-") as d:
            mp.start_processes(_worker, args=(cfg, T, d, modes), nprocs=processes, join=True, start_method="spawn")
            per = [json.loads(Path(d, f"{r}.json").read_text()) for r in range(processes)]
    out = {"tokens": per[0]["tokens"], "blocks": per[0]["blocks"], "processes": len(per),
           "attention": cfg.attention, "moe": cfg.ffn == "moe", "per_process": per}
    for mode in modes:
        meds = sorted(p[mode]["block_s"]["median"] for p in per)
        out[mode] = {"block_s": meds[len(meds) // 2], "per_process_block_s": meds,
                     "key": overhead_key(mode, cfg.attention, cfg.ffn == "moe")}
    return out


def overheads_from(measured: dict) -> dict:
    """The calibration's overhead entries a :func:`measure_block_dispatch` result gives (none when skipped)."""
    # a difference of two timings: noise on a busy host can take it below zero, which means none measurable
    return {measured[m]["key"]: max(0.0, round(measured[m]["block_s"], 6)) for m in MODES if m in measured}

