"""What a decode run needs in memory, from the analytic model: the largest batch per context that fits
a budget, and the refusal of a run that cannot fit before anything is allocated.

Everything here is closed-form (``scaletool.analytic``): weights from the exact parameter count,
the KV cache from its bytes per token (DeepSeek-V2, Table 1), at the decode dtype.
"""
from __future__ import annotations

from scaletool.analytic.kv import cache_bytes_per_token
from scaletool.analytic.params import matmul_params, param_counts
from scaletool.config import ModelConfig
from scaletool.errors import RecipeError
from scaletool.fmt import gib
from scaletool.kinds.attention import attention_kind

# Held back from a memory budget for what the analytic fit does not count: prefill activations of
# one chunk, attention workspaces, logits, allocator fragmentation.
RESERVE_FRACTION = 0.05


def cache_label(cfg: ModelConfig, mla_mode: str | None) -> str:
    """The attention type as reported: mha/gqa/mqa/mla, with a mode other than the default named
    (mla-naive, mla-expand; mla-per_head, mla-per_head-naive)."""
    return attention_kind(cfg).decode_label(cfg, mla_mode)


def weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of all parameters at the decode dtype: what must stay resident."""
    return param_counts(cfg)["total"] * cfg.dtype_bytes


def weight_bytes_per_step(cfg: ModelConfig) -> int:
    """Weight bytes a decode step reads: every matmul weight once (the LM head included); the
    embedding lookup gathers B rows, norms are negligible."""
    return matmul_params(cfg) * cfg.dtype_bytes


def cache_positions(context: int, warmup_steps: int, new_tokens: int) -> int:
    """Positions a point's caches (and RoPE table) hold: the prompt, then every decode step, the
    warm-up steps included (they run at their own positions before the timed ones)."""
    return context + warmup_steps + new_tokens


def memory_fit(cfg: ModelConfig, budget_bytes: int, contexts: tuple[int, ...], extra_positions: int) -> dict:
    """Largest batch per context that fits ``budget_bytes``: analytic weights + KV cache, per attention type.

    Purely analytic (no allocation): batch = (budget − reserve − weights) / (cache bytes per token ×
    (context + extra_positions)), with ``RESERVE_FRACTION`` of the budget held back for activations
    and workspaces. An MLA recipe gets a row per decode mode (its latent cache, the naive per-head one).
    """
    reserve = int(RESERVE_FRACTION * budget_bytes)
    weights = weight_bytes(cfg)
    rows = []
    for mode in attention_kind(cfg).decode_modes(cfg) or (None,):
        per_token = cache_bytes_per_token(cfg, mode)
        for n in contexts:
            free = budget_bytes - reserve - weights
            max_batch = max(free // (per_token * (n + extra_positions)), 0)
            rows.append({"attention": cache_label(cfg, mode), "context": n, "kv_cache_bytes_per_token": per_token,
                         "weights_bytes": weights, "max_batch": int(max_batch),
                         "max_batch_x_context": int(max_batch * n),
                         "kv_cache_bytes_at_max_batch": int(max_batch * per_token * (n + extra_positions))})
    return {"budget_bytes": budget_bytes, "reserve_bytes": reserve,
            "basis": f"analytic: weights + KV cache at {cfg.dtype}, {RESERVE_FRACTION:.0%} of the budget reserved "
                     "for activations and workspaces", "rows": rows}


def check_memory(cfg: ModelConfig, largest_cache_bytes: int, device, *, init_fp32: bool = True) -> None:
    """Refuse, naming the figures, a run whose weights and largest KV cache exceed the memory available.

    Weights are built in fp32 and then cast (``init_fp32``), so for a moment both copies are
    resident; they are gone before the first cache is allocated, and points run one at a time: the
    peak is the weights plus the larger of the fp32 copy and the largest point's cache.
    """
    fp32 = param_counts(cfg)["total"] * 4 if init_fp32 and cfg.dtype_bytes != 4 else 0
    weights = weight_bytes(cfg)
    need = weights + max(fp32, largest_cache_bytes)
    from scaletool.measure.available import available_memory  # imports torch: not at import time

    have, source = available_memory(device)
    if have is None or need <= have:
        return
    parts = [f"weights {gib(weights)} at {cfg.dtype}"]
    parts += [f"{gib(fp32)} more while they are initialised in fp32"] if fp32 else []
    parts += [f"KV cache {gib(largest_cache_bytes)} at the largest point"]
    raise RecipeError(f"decode needs about {gib(need)} ({', '.join(parts)}), more than the {gib(have)} available "
                      f"on {device} ({source}); lower the batch, the context or the model size")
