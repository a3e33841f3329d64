"""``train.float8``: swap the blocks' linear layers for torchao's ``Float8Linear``, and what FSDP2 adds.

Applied to the plain model before activation checkpointing, compile and wrapping, as torchtitan's float8
converter does. Under FSDP2 with tensorwise scaling, the swapped weights are all-gathered in FP8
(``enable_fsdp_float8_all_gather``: each rank casts its shard, halving the gathered bytes) and their
scales are computed for all of them in one all-reduce after each optimizer step
(``precompute_float8_dynamic_scale_for_fsdp``). Rowwise scaling gathers bf16 weights.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn as nn

from scaletool.config import Recipe, RecipeError
from scaletool.kinds.engines import engine_kind
from scaletool.kinds.float8 import INSTALL_HINT, MIN_CAPABILITY, swapped


def hardware_problem(device: torch.device | None = None) -> str | None:
    """Why this device cannot run FP8 GEMMs (None: it can). ``device`` None: the GPU this process would
    use (``LOCAL_RANK``), or the CPU where there is none."""
    if device is None:
        device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
                  if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda":
        return (f"train.float8: needs an NVIDIA GPU with FP8 tensor cores (compute capability >= "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada, Hopper, Blackwell); this run is on the {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"train.float8: {name} has compute capability {cap[0]}.{cap[1]}, without FP8 tensor cores "
                f"(needs >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada, Hopper, Blackwell); set train.float8=none")
    return None


def torchao_problem() -> str | None:
    """Why torchao's float8 training cannot be imported (None: it can)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except ImportError as e:
        return f"train.float8: needs torchao ({INSTALL_HINT}); importing it failed: {e}"
    return None


def runtime_problems(recipe: Recipe, device: torch.device | None = None) -> list[str]:
    """What this machine lacks for the recipe's ``train.float8`` (empty if off): the hardware first, and
    torchao only where the hardware could use it, so a refusal is one line."""
    if recipe.train.float8 == "none":
        return []
    problem = hardware_problem(device) or torchao_problem()
    return [problem] if problem else []


def check_runtime(recipe: Recipe, device: torch.device | None = None) -> None:
    problems = runtime_problems(recipe, device)
    if problems:
        raise RecipeError(problems)


def fsdp_float8_all_gather(recipe: Recipe) -> bool:
    """Whether FSDP2 gathers the swapped weights in FP8 (tensorwise scaling under an engine that does:
    the kind's ``float8_all_gather``)."""
    return recipe.train.float8 == "tensorwise" and engine_kind(recipe.parallel.engine).float8_all_gather


def convert(model: nn.Module, recipe: Recipe) -> dict[str, list[str]]:
    """Swap the linear layers that :func:`scaletool.kinds.float8.swapped` selects, in place; returns
    ``{"swapped": [fqn...], "kept": [fqn...]}`` (the linear layers left in bf16)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe_name = recipe.train.float8
    config = Float8LinearConfig.from_recipe_name(recipe_name)
    if fsdp_float8_all_gather(recipe):
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    report: dict[str, list[str]] = {"swapped": [], "kept": []}

    def keep_or_swap(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        ok = swapped(fqn, module.in_features, module.out_features)
        report["swapped" if ok else "kept"].append(fqn)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=keep_or_swap)
    if recipe_name == "rowwise" and recipe.train.compile:
        # inductor keeps the bf16 -> fp32 -> fp8 rounding of the eager casts (torchtitan sets this too)
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True
    return report


def after_optimizer_step(model: nn.Module, recipe: Recipe) -> None:
    """FSDP2 with FP8 all-gather: the next step's weight scales, all of them in one all-reduce."""
    if fsdp_float8_all_gather(recipe):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
