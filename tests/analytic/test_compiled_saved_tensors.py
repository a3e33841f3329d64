"""What a compiled whole model keeps for the backward, read off the compiled graph, against the count.

``recipe_memory`` counts a whole-model ``torch.compile`` run's activations tensor by tensor
(:func:`scaletool.analytic.timeline._activation_bytes_per_token_per_layer`, ``_units``): each norm keeps
its input and its 16-bit output, SwiGLU gate, up and their product, the head the 16-bit logits and two fp32
row statistics (not log_softmax's fp32 output). Here a real model (GQA 8/2, SwiGLU, tied embeddings, a
32K vocabulary, bf16 autocast) is compiled on the CPU by the installed torch, one forward is run, and every
tensor the backward graph holds is walked from the loss: the bytes per token (the difference of two
micro-batches, so the per-model weight copies drop out) must equal the count to 1%, and differ from the
eager count by far more than that. The partitioner's choices are the same code on every device.
"""
from __future__ import annotations

import pytest
import torch

from scaletool.analytic.timeline import MemoryInputs, _units
from scaletool.config import load_recipe
from scaletool.model import build_model

pytestmark = pytest.mark.slow

SETS = ["model.attention=gqa", "model.d_model=512", "model.n_heads=8", "model.n_kv_heads=2", "model.intermediate_size=2816",
        "model.vocab_size=32768", "model.tie_embeddings=true", "model.dtype=bf16", "model.n_layers=2",
        "model.max_seq_len=64", "train.seq_len=64"]


def _saved_bytes(model, batch: int, T: int, V: int) -> int:
    """Bytes of every tensor the autograd graph of one loss holds (parameters themselves excluded)."""
    x = torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, held, stack = set(), {}, [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if not (name.startswith("_saved_") or name == "saved_tensors"):
                continue
            try:
                value = getattr(fn, name)
            except RuntimeError:  # a saved tensor already freed or not materialised
                continue
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor):
                    held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack += [g for g, _ in fn.next_functions]
    return sum(n for ptr, n in held.items() if ptr not in params)


def _counted(recipe, batch: int, compiled: bool) -> float:
    units, _ = _units(recipe.model, MemoryInputs(batch, recipe.seq_len, compiled=compiled), autocast=True,
                      expert_parallel=False)
    return sum(u.saved for u in units)


def test_a_compiled_model_keeps_what_the_count_says():
    torch.manual_seed(0)
    recipe = load_recipe("tiny", SETS)
    model = build_model(recipe.model)
    model.compile()
    T, V = recipe.seq_len, recipe.model.vocab_size
    one, two = (_saved_bytes(model, b, T, V) for b in (1, 2))
    measured = (two - one) / T  # bytes per token
    counted = (_counted(recipe, 2, True) - _counted(recipe, 1, True)) / T
    eager = (_counted(recipe, 2, False) - _counted(recipe, 1, False)) / T
    assert measured == pytest.approx(counted, rel=0.01), (measured, counted)
    assert eager > 1.3 * measured  # the eager count (fp32 log_softmax, silu kept) is far off
