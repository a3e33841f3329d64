"""Measure prefill and decoding: KV-cache bytes against the analytic model, speed, memory bandwidth.

Per context length N, a point:

1. allocates caches for ``batch × (N + new_tokens)`` positions and reads their size twice: from the
   cache tensors and from the CUDA allocator (``memory_allocated`` before and after), next to the
   analytic ``kv_cache(cfg)`` bytes per token (DeepSeek-V2 Table 1) times the positions;
2. prefills one random prompt of N tokens (timed after a short warm-up prefill) and copies its cache
   rows to the rest of the batch (identical prompts: the decode step reads exactly the bytes a full
   batch prefill would leave, without minutes of prefill compute at 32K × large batches);
3. decodes ``new_tokens`` greedy steps for the whole batch after warm-up steps, timed with CUDA
   events around the loop only; the loop never syncs with the host;
4. derives the bytes one step reads, weights (every matmul, the LM head included, at the decode
   dtype) plus the cache up to the current position, over the measured time per step: achieved
   bandwidth, against the card's peak HBM bandwidth.

Decode steps run eagerly. At the long contexts this command is for, a step reads gigabytes and
takes tens of milliseconds, against ~1-2 ms of kernel launches for a 16-layer model, so CUDA graphs
(or ``torch.compile(mode="reduce-overhead")``) would buy a few percent there while forcing the
attention to mask a full ``max_len`` cache each step; the loop is written so graphs could be added
(static caches, no host syncs) if short contexts become the interest.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from scaletool.analytic import kv_cache, matmul_params, param_counts
from scaletool.config import ModelConfig, RecipeError
from scaletool.decode.cache import cache_bytes, make_caches, replicate_first_row
from scaletool.decode.generate import decode, prefill, require_lm
from scaletool.kernels.mla_decode import triton_supports
from scaletool.measure.hardware import profile_for

# Held back from a memory budget for what the analytic fit does not count: prefill activations of
# one chunk, attention workspaces, logits, allocator fragmentation.
RESERVE_FRACTION = 0.05


@dataclass(frozen=True)
class DecodeSettings:
    batch: int | None  # None: the largest batch that fits the memory budget at each context
    contexts: tuple[int, ...]
    new_tokens: int
    mla_mode: str = "absorbed"
    kernel: str = "auto"
    prefill_chunk: int = 4096
    warmup_steps: int = 3
    seed: int = 0


def peak_bandwidth(device: torch.device) -> tuple[float | None, str]:
    """Peak HBM bytes/s of this device and where the figure comes from (None on CPU or unknown GPUs)."""
    if device.type != "cuda":
        return None, "no peak bandwidth is assumed for CPUs"
    name = torch.cuda.get_device_name(device)
    prof = profile_for("cuda", name)
    if prof is None or prof.peak_bandwidth_bytes_per_s is None:
        return None, f"unknown accelerator '{name}': no HBM peak known, bandwidth fraction is null"
    return prof.peak_bandwidth_bytes_per_s, f"datasheet peak for profile {prof.source}"


def cache_label(cfg: ModelConfig, mla_mode: str) -> str:
    """The attention type as reported: mha/gqa/mqa/mla, and mla-naive for the uncompressed cache."""
    return "mla-naive" if cfg.attention == "mla" and mla_mode == "naive" else cfg.attention


def cache_bytes_per_token(cfg: ModelConfig, mla_mode: str) -> int:
    """Analytic cache bytes per token, all layers, at cfg.dtype (``scaletool estimate``'s figure)."""
    kv = kv_cache(cfg)
    return kv["naive_bytes_per_token"] if cache_label(cfg, mla_mode) == "mla-naive" else kv["bytes_per_token"]


def weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of all parameters at the decode dtype: what must stay resident."""
    return param_counts(cfg)["total"] * cfg.dtype_bytes


def weight_bytes_per_step(cfg: ModelConfig) -> int:
    """Weight bytes a decode step reads: every matmul weight once (the LM head included); the
    embedding lookup gathers B rows, norms are negligible."""
    return matmul_params(cfg) * cfg.dtype_bytes


def memory_fit(cfg: ModelConfig, budget_bytes: int, contexts: tuple[int, ...], new_tokens: int) -> dict:
    """Largest batch per context that fits ``budget_bytes``: analytic weights + KV cache, per attention type.

    Purely analytic (no allocation): batch = (budget − reserve − weights) / (cache bytes per token ×
    (context + new_tokens)), with ``RESERVE_FRACTION`` of the budget held back for activations and
    workspaces. An MLA recipe gets rows for its latent cache and for the naive per-head cache.
    """
    reserve = int(RESERVE_FRACTION * budget_bytes)
    weights = weight_bytes(cfg)
    modes = ("absorbed", "naive") if cfg.attention == "mla" else ("absorbed",)
    rows = []
    for mode in modes:
        per_token = cache_bytes_per_token(cfg, mode)
        for n in contexts:
            free = budget_bytes - reserve - weights
            max_batch = max(free // (per_token * (n + new_tokens)), 0)
            rows.append({"attention": cache_label(cfg, mode), "context": n, "kv_cache_bytes_per_token": per_token,
                         "weights_bytes": weights, "max_batch": int(max_batch),
                         "max_batch_x_context": int(max_batch * n),
                         "kv_cache_bytes_at_max_batch": int(max_batch * per_token * (n + new_tokens))})
    return {"budget_bytes": budget_bytes, "reserve_bytes": reserve,
            "basis": f"analytic: weights + KV cache at {cfg.dtype}, {RESERVE_FRACTION:.0%} of the budget reserved "
                     "for activations and workspaces", "rows": rows}


def attention_kernel(cfg: ModelConfig, mla_mode: str, kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel a decode step's attention runs, in words (see README, scaletool decode)."""
    if cache_label(cfg, mla_mode) != "mla":
        return "sdpa over the cached K/V, cuDNN first (the fastest single-query kernel measured on H200)"
    why = triton_supports(device, dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    if kernel == "torch" or (kernel == "auto" and why is not None):
        return "torch reference: two bmm over the latent cache (reads it twice)" + (f"; {why}" if why else "")
    return "triton fused split-KV latent attention (reads the latent cache once)"


class _Timer:
    """CUDA events on GPU (device time, one sync at the end), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def measure_point(model, cfg: ModelConfig, s: DecodeSettings, batch: int, context: int,
                  peak_bytes_per_s: float | None) -> dict:
    """One context length at one batch size (see the module docstring for the procedure)."""
    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    max_len = context + s.new_tokens
    rope_before = model.rope.max_seq_len
    model.extend_rope(max_len)
    per_token = cache_bytes_per_token(cfg, s.mla_mode)
    point = {"attention": cache_label(cfg, s.mla_mode), "batch": batch, "context": context, "max_len": max_len,
             "new_tokens": s.new_tokens, "rope_extended_to": max_len if max_len > rope_before else None,
             "attention_kernel": attention_kernel(cfg, s.mla_mode, s.kernel, device, dtype),
             "kv_cache_bytes_per_token_analytic": per_token,
             "kv_cache_bytes_analytic": per_token * batch * max_len}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = _allocated(device)
    caches = make_caches(cfg, batch, max_len, dtype=dtype, device=device, mla_mode=s.mla_mode, kernel=s.kernel)
    after = _allocated(device)
    measured = cache_bytes(caches)
    point["kv_cache_bytes_measured"] = measured
    point["kv_cache_bytes_allocator"] = None if before is None else after - before
    point["kv_cache_rel_error"] = (measured - point["kv_cache_bytes_analytic"]) / point["kv_cache_bytes_analytic"]

    gen = torch.Generator(device=device).manual_seed(s.seed)
    prompt = torch.randint(cfg.vocab_size, (1, context), device=device, generator=gen)
    prefill(model, prompt[:, :min(context, s.prefill_chunk)], caches, chunk=s.prefill_chunk)  # warm-up
    with _Timer(device) as t:
        logits = prefill(model, prompt, caches, chunk=s.prefill_chunk)
    point["prefill_seconds"] = t.seconds
    point["prefill_tokens_per_s"] = context / t.seconds

    replicate_first_row(caches, context, batch)
    first = logits.argmax(-1).expand(batch).contiguous()  # (B,)
    decode(model, caches, first, context, s.warmup_steps)  # warm-up: kernel selection, autotuning; overwritten
    with _Timer(device) as t:
        decode(model, caches, first, context, s.new_tokens)
    step_s = t.seconds / s.new_tokens
    # Step i reads the cache up to position context + i: on average context + (new_tokens + 1) / 2.
    bytes_per_step = weight_bytes_per_step(cfg) + batch * per_token * (context + (s.new_tokens + 1) / 2)
    bw = bytes_per_step / step_s
    point.update({
        "decode_seconds": t.seconds,
        "decode_ms_per_token": 1e3 * step_s,
        "decode_tokens_per_s": batch / step_s,
        "decode_bytes_per_step": int(bytes_per_step),
        "decode_bandwidth_bytes_per_s": bw,
        "decode_bandwidth_fraction_of_peak": None if peak_bytes_per_s is None else bw / peak_bytes_per_s,
        "memory_peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    })
    return point


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_decode(cfg: ModelConfig, model, s: DecodeSettings, *, budget_bytes: int | None, progress=None) -> dict:
    """Measure every context of ``s``; ``progress`` (a rich Progress or None) gets one task over them."""
    require_lm(cfg)
    weight = next(model.parameters())
    device = weight.device
    peak, peak_source = peak_bandwidth(device)
    fit = None if budget_bytes is None else memory_fit(cfg, budget_bytes, s.contexts, s.new_tokens)
    if s.batch is None and fit is None:
        raise RecipeError("--batch max needs a memory budget: pass --memory-budget GiB (the default is the "
                          "GPU's memory, and there is none on CPU)")
    label = cache_label(cfg, s.mla_mode)
    fit_batch = {r["context"]: r["max_batch"] for r in (fit or {"rows": []})["rows"] if r["attention"] == label}
    points = []
    task = progress.add_task(f"decode {label}", total=len(s.contexts)) if progress is not None else None
    for n in s.contexts:
        batch = s.batch or fit_batch[n]
        if progress is not None:
            progress.update(task, description=f"decode {label}: batch {batch} × context {n}")
        if batch < 1:
            points.append({"attention": label, "batch": 0, "context": n, "error": "no batch fits the memory budget"})
        else:
            try:
                points.append(measure_point(model, cfg, s, batch, n, peak))
            except torch.cuda.OutOfMemoryError:
                points.append({"attention": label, "batch": batch, "context": n, "error": "out of memory"})
            _free(device)
        if progress is not None:
            progress.advance(task)
    return {
        "attention": label,
        "mla_mode": s.mla_mode if cfg.attention == "mla" else None,
        "device": {"type": device.type,
                   "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "peak_bandwidth_bytes_per_s": peak, "peak_bandwidth_source": peak_source},
        "dtype": cfg.dtype,
        "settings": {"new_tokens": s.new_tokens, "prefill_chunk": s.prefill_chunk,
                     "warmup_steps": s.warmup_steps, "seed": s.seed, "kernel": s.kernel,
                     "batch": "max" if s.batch is None else s.batch},
        "weights_bytes": weight_bytes(cfg),
        "weights_bytes_read_per_step": weight_bytes_per_step(cfg),
        "kv_cache": kv_cache(cfg),
        "points": points,
        "memory_fit": fit,
        "timing": "CUDA events around the timed loop, warm-up prefill and decode steps excluded" if device.type == "cuda"
                  else "perf_counter around the timed loop, warm-up excluded",
    }

