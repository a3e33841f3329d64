"""The library under the CLI: one function per command, each taking a recipe and options and
returning that command's result.

``scaletool.cli`` parses arguments and calls these; a notebook or another tool calls them directly::

    from scaletool import api
    est = api.estimate("recipes/mla-1b.yaml", overrides=["model.kv_lora_rank=256"])

A recipe argument is a path, or an already validated :class:`~scaletool.config.Recipe`. Library
functions raise :class:`~scaletool.errors.RecipeError` for input they cannot use (one line per
problem) and never name CLI flags in their messages. Heavy modules (torch) are imported inside the
functions that need them, so importing this module stays cheap.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from scaletool.config import Recipe, RecipeError, apply_overrides, load_recipe, recipe_from_dict

RecipeLike = str | Path | Recipe


def resolve(recipe: RecipeLike, overrides: Sequence[str] = ()) -> Recipe:
    """A validated recipe from a path or a :class:`Recipe`, with ``key=value`` overrides applied."""
    if isinstance(recipe, Recipe):
        if not overrides:
            return recipe
        from scaletool.config import parse_override

        raw = apply_overrides(recipe.model_dump(mode="json", exclude_unset=True),
                              [parse_override(o) for o in overrides])
        return recipe_from_dict(raw, "recipe")
    if not isinstance(recipe, (str, Path)):
        raise RecipeError(f"recipe: expected a path or a Recipe, got {type(recipe).__name__}")
    return load_recipe(recipe, list(overrides))


def estimate(recipe: RecipeLike, *, overrides: Sequence[str] = (), tokens: int | None = None,
             world_size: int | None = None) -> dict:
    """The analytic model of ``recipe``: parameters, FLOPs, KV cache and training memory (no model built)."""
    from scaletool import analytic

    return analytic.estimate(resolve(recipe, overrides), tokens=tokens, world_size=world_size)


def _batches(batch) -> tuple[int | None, ...]:
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


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{name}: expected a positive integer, got {str(value)[:40]!r}")
    return value


def decode(recipe: RecipeLike, *, overrides: Sequence[str] = (), contexts: Sequence[int] | None = None,
           batch: int | str | Sequence[int | str] = 1, new_tokens: int = 32, device: str | None = None,
           dtype: str | None = None, mla_mode: str = "absorbed", mla_kernel: str = "auto",
           cuda_graph: bool | None = None, memory_budget_gib: float | None = None, checkpoint: str | Path | None = None,
           trust_checkpoint: bool = False, seed: int = 0, prefill_chunk: int = 4096, warmup_steps: int = 3,
           prefill_repeats: int = 3, progress=None):
    """Prefill and decode ``recipe``'s model at each (context, batch); a :class:`~scaletool.results.decode.DecodeResult`.

    ``batch``: an int, 'max' (the largest batch whose weights + KV cache fit the memory budget, by
    the analytic fit) or a sequence of them (``[1, "max"]``). ``device``: 'cuda' or 'cpu' (default:
    cuda when available). ``cuda_graph``: replay each decode step from a CUDA graph (default: on for
    CUDA). ``memory_budget_gib``: for 'max' and the fit table (default: the GPU's memory; none on
    CPU). ``checkpoint``: a ``scaletool train`` checkpoint directory (default: random weights from
    ``seed``). ``progress(done, total, description)`` hears of each point. A run whose weights and
    largest cache exceed the memory available is refused before anything is allocated.
    """
    import torch

    from scaletool.decode.bench import DecodeSettings, plan_points, run_decode
    from scaletool.decode.generate import require_lm
    from scaletool.decode.sizing import cache_bytes_per_token, check_memory, memory_fit
    from scaletool.kernels.mla_decode import triton_supports
    from scaletool.model.attention import MLA_MODES, DecodeMode
    from scaletool.model.layers import TORCH_DTYPES

    r = resolve(recipe, [*overrides, *([f"model.dtype={dtype}"] if dtype else [])])
    cfg = r.model
    require_lm(cfg)
    if mla_mode not in MLA_MODES:
        raise RecipeError(f"mla_mode: expected one of {', '.join(MLA_MODES)}, got {str(mla_mode)[:40]!r}")
    if mla_mode == "naive" and cfg.attention != "mla":
        raise RecipeError(f"mla_mode naive is for attention=mla recipes; this one is {cfg.attention}")
    try:
        mode = DecodeMode(mla_mode, mla_kernel)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    dev = _decode_device(device)
    if cuda_graph and dev.type != "cuda":
        raise RecipeError("cuda_graph: CUDA graphs need a CUDA device")
    if mla_kernel == "triton" and cfg.attention == "mla" and mla_mode == "absorbed":
        why = triton_supports(dev, TORCH_DTYPES[cfg.dtype], cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        if why:
            raise RecipeError(f"mla_kernel triton: the fused kernel cannot run here: {why}")
    contexts = tuple(_positive("context", n) for n in (contexts or (cfg.max_seq_len,)))
    s = DecodeSettings(batches=_batches(batch), contexts=contexts, new_tokens=_positive("new_tokens", new_tokens),
                       mode=mode, cuda_graph=dev.type == "cuda" if cuda_graph is None else cuda_graph,
                       prefill_chunk=_positive("prefill_chunk", prefill_chunk),
                       warmup_steps=_positive("warmup_steps", warmup_steps),
                       prefill_repeats=_positive("prefill_repeats", prefill_repeats), seed=seed)
    budget = int(memory_budget_gib * 2**30) if memory_budget_gib else (
        torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None)
    fit = None if budget is None else memory_fit(cfg, budget, s.contexts, s.extra_positions)
    largest = max(b * (n + s.extra_positions) for n, b in plan_points(cfg, s, fit))
    check_memory(cfg, largest * cache_bytes_per_token(cfg, mla_mode), dev)
    threads = None
    if dev.type == "cpu":
        from scaletool.threads import pin_threads

        threads = pin_threads()
    model = _decode_model(r, dev, seed, checkpoint, trust_checkpoint)
    res = run_decode(cfg, model, s, budget_bytes=budget, progress=progress)
    return res.model_copy(update={"recipe": str(recipe) if isinstance(recipe, (str, Path)) else None,
                                  "checkpoint": None if checkpoint is None else str(checkpoint), "threads": threads})


def _decode_device(device: str | None):
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise RecipeError(f"device: decode runs on cuda or cpu, got {str(device)[:40]!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device cuda: no CUDA device is available here (use cpu)")
    return torch.device(device)


def _decode_model(r: Recipe, dev, seed: int, checkpoint, trust_checkpoint: bool):
    """The recipe's model on ``dev`` at its dtype, in eval mode: random weights from ``seed``, or a checkpoint's."""
    import inspect

    import torch

    from scaletool.model import build_model
    from scaletool.model.layers import TORCH_DTYPES

    model = build_model(r.model, dev, seed=seed, sdpa_backend=r.train.sdpa_backend)
    if checkpoint is not None:
        from scaletool.train.checkpoint import load_model_weights

        # trust_checkpoint arrives with the train branch's safe loading; pass it once the loader has it
        takes_trust = "trust_checkpoint" in inspect.signature(load_model_weights).parameters
        load_model_weights(checkpoint, model, **({"trust_checkpoint": trust_checkpoint} if takes_trust else {}))
    model = model.to(TORCH_DTYPES[r.model.dtype]).eval()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return model
