"""FP8 training (``train.float8``) as data: its recipe rules, which linear layers it swaps, torch-free.

torchao's float8 training replaces ``nn.Linear`` modules by ``Float8Linear``, whose forward and
backward GEMMs run in FP8 (``torch._scaled_mm``) with scales computed from each tensor's amax on the
fly: one scale per tensor (``tensorwise``) or per row (``rowwise``). The swap happens in
:mod:`scaletool.engines.float8`; the rules here are what ``recipe check`` and every command apply,
and :func:`swapped` is the one filter both the torch swap and the analytic estimate use.
"""
from __future__ import annotations

from typing import Any

RECIPES = ("tensorwise", "rowwise")
#: CUDA compute capability with FP8 tensor cores (Ada 8.9, Hopper 9.0, Blackwell 10.0)
MIN_CAPABILITY = (8, 9)
#: torch._scaled_mm needs both GEMM dimensions of the weight divisible by 16
DIM_MULTIPLE = 16
#: linear layers left in bf16 whatever their shape: the LM head (the logits' precision, as torchtitan
#: keeps ``output``), the regression head and feature embeddings, and the MoE router (routing decisions
#: are sensitive to precision)
KEPT_NAMES = ("output", "head", "proj", "gate")
#: torchao's release line for torch 2.11+ (0.17 is built against torch 2.11; float8 training is Python
#: over torch._scaled_mm, so later releases import with later torch too)
TORCHAO_REQUIREMENT = "torchao>=0.17"
INSTALL_HINT = f"pip install 'scaletool[float8]' (or pip install '{TORCHAO_REQUIREMENT}')"


def swapped(fqn: str, in_features: int, out_features: int) -> bool:
    """Whether the linear layer at ``fqn`` (``layers.0.attention.wq``) runs in FP8: not a kept name,
    both dimensions divisible by :data:`DIM_MULTIPLE` (torchtitan's filter, plus the router)."""
    name = fqn.rsplit(".", 1)[-1]
    parts = fqn.split(".")
    if name in KEPT_NAMES or "proj" in parts:
        return False
    return in_features % DIM_MULTIPLE == 0 and out_features % DIM_MULTIPLE == 0


def float8_problems(recipe: Any) -> list[str]:
    """The rules of ``train.float8`` on a recipe (duck-typed config.Recipe): engines whose wrapping
    torchao's Float8Linear composes with, no tensor parallelism (torchao's Float8 TP plans are not
    applied here), bf16 compute."""
    from scaletool.kinds.engines import ENGINES, engine_kind

    t, p, m = recipe.train, recipe.parallel, recipe.model
    if t.float8 == "none":
        return []
    with_f8 = [e.name for e in ENGINES.values() if e.float8]
    if not engine_kind(p.engine).float8:
        return [f"train.float8: {t.float8} is not supported with parallel.engine={p.engine} (its ZeRO optimizer "
                f"owns and casts the parameters itself); use engine={' / '.join(with_f8)} or train.float8=none"]
    if p.tensor_parallel > 1:
        return [f"train.float8: {t.float8} is not supported with parallel.tensor_parallel={p.tensor_parallel} "
                "(tensor parallelism would need torchao's Float8 column/row-wise plans, not implemented); "
                "use tensor_parallel=1 or train.float8=none"]
    if m.dtype != "bf16":
        return [f"train.float8: {t.float8} needs model.dtype=bf16 (the FP8 GEMMs take and return bf16 "
                f"activations; got {m.dtype})"]
    return []


def float8_warnings(recipe: Any) -> list[str]:
    """What a float8 run should hear before it starts: without torch.compile the scaling and casting
    are separate eager kernels, which can make the step slower than bf16."""
    t = recipe.train
    if t.float8 == "none" or t.compile:
        return []
    return [f"train.float8={t.float8} without train.compile: the amax, scale and cast kernels run unfused "
            "(eager), usually slower than bf16; set train.compile=true for FP8's speed"]
