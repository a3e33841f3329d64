"""A decode run's set-up, checked before anything is allocated: the device, the settings, the memory budget
and the model.

:func:`prepare` turns :func:`scaletool.api.decode`'s arguments into a :class:`DecodeSetup` (device,
:class:`~scaletool.decode.bench.DecodeSettings`, budget) or refuses them with one
:class:`~scaletool.errors.RecipeError` line: a device this machine lacks, a path the device or combination
cannot run (:func:`check_decode_paths`), a context past a learned position table, a cache that would not fit.
:func:`decode_model` then builds the model at the recipe's dtype, with weights from a seed or from a loader
the caller hands in (a training checkpoint: decoding knows nothing of how training stores them).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from scaletool.config import ModelConfig, Recipe
from scaletool.decode.bench import DecodeSettings, plan_points
from scaletool.decode.generate import require_lm
from scaletool.decode.sizing import cache_bytes_per_token, check_memory, memory_fit, weight_bytes
from scaletool.errors import RecipeError, positive_finite, positive_int
from scaletool.kinds.attention import attention_kind, position_kind
from scaletool.model.attention import DecodeMode
from scaletool.model.layers import TORCH_DTYPES


@dataclass(frozen=True)
class DecodeSetup:
    """Where and how a decode run goes: the device, its settings, and the memory budget in bytes (None: no
    budget, on a CPU without ``memory_budget_gib``)."""

    device: torch.device
    settings: DecodeSettings
    budget_bytes: int | None


def decode_device(device: str | None) -> torch.device:
    """``cuda`` or ``cpu`` (None: cuda when available); a device this machine lacks is refused."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise RecipeError(f"device: decode runs on cuda or cpu, got {str(device)[:40]!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device cuda: no CUDA device is available here (use cpu)")
    return torch.device(device)


def batches(batch) -> tuple[int | None, ...]:
    """``batch`` as a tuple of positive ints and None ('max'): an int, 'max', or a sequence of them."""
    items = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    out = []
    for b in items:
        if b is None or b == "max":
            out.append(None)
        elif isinstance(b, int) and not isinstance(b, bool) and b > 0:
            out.append(b)
        else:
            raise RecipeError(f"batch: {str(b)[:40]!r} is neither a positive integer nor 'max'")
    if not out:
        raise RecipeError("batch: give at least one batch size")
    return tuple(out)


def check_decode_paths(cfg: ModelConfig, mode: DecodeMode, dev: torch.device, *, cuda_graph: bool | None,
                       compile: bool, split_batch: int) -> None:
    """Refuse (RecipeError) the decode paths this device or combination cannot run: CUDA graphs off CUDA, a
    split batch under compile, the Triton MLA kernel where it cannot run."""
    from scaletool.kernels.mla_decode import triton_supports

    if cuda_graph and dev.type != "cuda":
        raise RecipeError("cuda_graph: CUDA graphs need a CUDA device")
    if compile and split_batch != 1:
        raise RecipeError(f"split_batch {split_batch}: the batch's parts run on separate CUDA streams, which the "
                          "compiled step does not take; drop compile or use split_batch 1")
    if mode.kernel == "triton" and attention_kind(cfg).decode_path(cfg, mode.mla) == "absorbed":
        why = triton_supports(dev, TORCH_DTYPES[cfg.dtype], cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        if why:
            raise RecipeError(f"mla_kernel triton: the fused kernel cannot run here: {why}")


def launch_defaults(dev: torch.device, pdl: bool | None, gemv: bool | None, compile: bool) -> tuple[bool, bool]:
    """``decode``'s PDL (None: where the GPU has it) and GEMV (None: with PDL under ``compile``, where
    Inductor's kernels around it let it load its weights early)."""
    if pdl is None:
        from scaletool.kernels.pdl import supported

        pdl = supported(dev)
    return bool(pdl), bool(pdl and compile) if gemv is None else bool(gemv)


def _check_positions(cfg: ModelConfig, s: DecodeSettings) -> None:
    longest = max(s.contexts) + s.extra_positions
    if not position_kind(cfg).extrapolates and longest > cfg.max_seq_len:
        raise RecipeError(f"context: position_encoding=learned has a table of model.max_seq_len={cfg.max_seq_len} "
                          f"positions, and the longest point needs {longest} (context {max(s.contexts)} + "
                          f"{s.warmup_steps} warm-up + {s.new_tokens} new tokens); a learned table cannot grow")


def _budget(dev: torch.device, memory_budget_gib: float | None) -> int | None:
    """The memory budget in bytes: ``memory_budget_gib``, else the GPU's memory (none on a CPU)."""
    gib = positive_finite("memory_budget_gib", memory_budget_gib)
    if gib:
        return int(gib * 2**30)
    return torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None


def prepare(cfg: ModelConfig, *, contexts: Sequence[int] | None, batch, new_tokens: int, device: str | None,
            mla_mode: str | None, mla_kernel: str, cuda_graph: bool | None, memory_budget_gib: float | None,
            seed: int, prefill_chunk: int, warmup_steps: int, prefill_repeats: int, compile: bool,
            compile_tuning: bool, gemv: bool | None, split_batch: int, join_projections: bool,
            pdl: bool | None) -> DecodeSetup:
    """:func:`scaletool.api.decode`'s arguments checked and resolved (see its docstring for each); a run whose
    weights and largest cache exceed the memory available is refused here, before anything is allocated."""
    require_lm(cfg)
    try:
        mode = DecodeMode(attention_kind(cfg).resolve_mode(cfg, mla_mode), mla_kernel)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    dev = decode_device(device)
    check_decode_paths(cfg, mode, dev, cuda_graph=cuda_graph, compile=compile, split_batch=split_batch)
    contexts = tuple(positive_int("context", n) for n in (contexts or (cfg.max_seq_len,)))
    pdl, gemv = launch_defaults(dev, pdl, gemv, compile)
    s = DecodeSettings(batches=batches(batch), contexts=contexts, new_tokens=positive_int("new_tokens", new_tokens),
                       mode=mode, cuda_graph=dev.type == "cuda" if cuda_graph is None else cuda_graph,
                       compile=bool(compile), compile_tuning=bool(compile_tuning), gemv=bool(gemv),
                       join=bool(join_projections), pdl=bool(pdl),
                       split=positive_int("split_batch", split_batch),
                       prefill_chunk=positive_int("prefill_chunk", prefill_chunk),
                       warmup_steps=positive_int("warmup_steps", warmup_steps),
                       prefill_repeats=positive_int("prefill_repeats", prefill_repeats), seed=seed)
    _check_positions(cfg, s)
    budget = _budget(dev, memory_budget_gib)
    fit = None if budget is None else memory_fit(cfg, budget, s.contexts, s.extra_positions)
    largest = max(b * (n + s.extra_positions) for n, b in plan_points(cfg, s, fit))
    check_memory(cfg, largest * cache_bytes_per_token(cfg, mode.mla), dev)
    return DecodeSetup(device=dev, settings=s, budget_bytes=budget)


def announce_build(progress, cfg: ModelConfig, dev: torch.device, from_checkpoint: bool) -> None:
    """Tell ``progress`` that the model is being built, and that random CPU weights take a while."""
    from scaletool.analytic.params import param_counts
    from scaletool.fmt import gib

    slow = dev.type == "cpu" and not from_checkpoint and weight_bytes(cfg) > 2**29
    progress(0, None, f"decode: building the model on {dev.type} ({param_counts(cfg)['total']:,} "
                      f"parameters, {gib(weight_bytes(cfg))} at {cfg.dtype})"
                      + ("; drawing random weights on a CPU takes a while" if slow else ""))


def decode_model(r: Recipe, dev: torch.device, seed: int, load_weights: Callable[[torch.nn.Module], object] | None = None):
    """The recipe's model on ``dev`` at its dtype, in eval mode: random weights from ``seed``, or what
    ``load_weights(model)`` puts in (a checkpoint's)."""
    from scaletool.model import build_model

    model = build_model(r.model, dev, seed=seed, sdpa_backend=r.train.sdpa_backend)
    if load_weights is not None:
        load_weights(model)
    model = model.to(TORCH_DTYPES[r.model.dtype]).eval()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return model
