"""What ``train.float8`` changes in the estimates: which GEMMs run in FP8, and the memory it adds and saves.

torchao's ``Float8Linear`` (torchao/float8/float8_linear.py, ``matmul_with_hp_or_float8_args``) saves its
input and weight for the backward in high precision, as ``nn.Linear`` does, and casts both to FP8
inside the forward and again inside the backward (with the output gradient): the FP8 copies are
transient, one GEMM's worth at a time. So, per layout (eager):

- saved activations: unchanged, except that under autocast (single, DDP) the 16-bit weight copy autocast
  caches for each matmul is gone for the swapped layers (Float8Linear skips autocast and saves the fp32
  master by reference): minus 2 bytes per swapped parameter;
- temporaries: the largest swapped GEMM's FP8 input, weight and output gradient (1 byte each element;
  rowwise also casts the transposed input and gradient for the weight gradient: twice that);
- FSDP2 with tensorwise scaling: the swapped weights are all-gathered in FP8, 1 byte instead of 2 for
  them in the gathered-parameter buffers (and on the wire).

Torch-free; the GEMM names are :func:`scaletool.analytic.flops.gemm_shapes`'.
"""
from __future__ import annotations

from scaletool.analytic.flops import gemm_shapes
from scaletool.config import Recipe
from scaletool.kinds.engines import engine_kind
from scaletool.kinds.float8 import swapped

#: bytes of FP8 cast traffic per element of a swapped GEMM's operand: amax read (2 B), cast read (2 B)
#: and FP8 write (1 B) of a bf16 tensor
CAST_BYTES_PER_ELEMENT = 5


def fp8_gemm(name: str, n: int, k: int) -> bool:
    """Whether :func:`~scaletool.analytic.flops.gemm_shapes`' GEMM ``name`` (output width n, inner k) runs in
    FP8: the blocks' nn.Linear layers (attention projections, dense and shared-expert FFNs) with both
    dimensions divisible by 16; not the heads, the router or the routed experts (grouped weights, no Linear)."""
    if name in ("lm_head", "head", "moe.router", "moe.experts"):
        return False
    fqn = f"layers.0.{name.replace('moe.shared', 'ffn.shared')}"
    return swapped(fqn, k, n)


def swapped_shapes(shapes: list[tuple[str, int, int, int, int]]) -> list[tuple[str, int, int, int, int]]:
    """The FP8 ones among ``gemm_shapes`` rows (name, m, n, k, count)."""
    return [s for s in shapes if fp8_gemm(s[0], s[2], s[3])]


def cast_bytes(shapes: list[tuple[str, int, int, int, int]], rowwise: bool) -> float:
    """HBM bytes of the FP8 casts of one micro-batch's forward and backward: each swapped GEMM casts its
    input and weight (forward, again in the backward) and its output gradient; rowwise adds the transposed
    input and output gradient for the weight gradient."""
    total = 0.0
    for _, m, n, k, c in swapped_shapes(shapes):
        per = 2 * (m * k + n * k) + m * n + ((m * k + m * n) if rowwise else 0)
        total += CAST_BYTES_PER_ELEMENT * per * c
    return total


def float8_memory(recipe: Recipe, row: dict) -> dict:
    """``row`` (a :func:`~scaletool.analytic.memory.recipe_memory` result) with FP8's components: the
    backward phase's activations, temporaries and buffers adjusted as the module docstring says, the peak
    phase chosen again, and ``float8`` = the components in bytes."""
    t, cfg = recipe.train, recipe.model
    if t.float8 == "none":
        return row
    tokens = t.micro_batch_size * recipe.seq_len
    fp8 = swapped_shapes(gemm_shapes(cfg, tokens))
    params = sum(n * k * c for _, _, n, k, c in fp8)
    per_layer = params / cfg.n_layers
    kind = engine_kind(recipe.parallel.engine)
    rowwise = t.float8 == "rowwise"
    largest = max(((m * k + n * k + m * n) * (2 if rowwise else 1) for _, m, n, k, _ in fp8), default=0)
    autocast_copies = 2 * params if kind.autocast else 0
    # FSDP2 holds two blocks gathered around the backward (this one and the prefetched next)
    gathered = (cfg.dtype_bytes - 1) * per_layer * 2 if kind.float8_all_gather and t.float8 == "tensorwise" else 0
    comp = {"fp8_params": int(params), "fp8_cast_temporaries_bytes": int(largest),
            "autocast_weight_copies_saved_bytes": int(autocast_copies),
            "fp8_all_gather_saved_bytes": int(gathered)}
    phases = {name: dict(c) for name, c in row["phases"].items()}
    back = phases["backward"]
    back["activations"] = max(0, back["activations"] - autocast_copies)
    back["temporaries"] += largest
    back["buffers"] = max(0, back["buffers"] - gathered)
    totals = {name: sum(c.values()) for name, c in phases.items()}
    phase = max(totals, key=totals.get)
    return {**row, "phases": phases, "phase": phase, "total_bytes": totals[phase],
            "activations_bytes": max(0, row["activations_bytes"] - autocast_copies),
            "transient_bytes": phases[phase]["buffers"] + phases[phase]["temporaries"], "float8": comp}
