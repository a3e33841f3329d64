"""The loop's view of an engine, the factory that builds one, and the launch-time recipe checks."""
from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from pathlib import Path

import torch
import torch.nn as nn

from scaletool.analytic import expert_parallel as ep_analytic
from scaletool.config import Recipe, RecipeError
from scaletool.engines.dist import DistEnv
from scaletool.kinds.engines import EngineKind, launch_problems
from scaletool.kinds.engines import engine_kind as _registered
from scaletool.kinds.pipeline import pipeline_world_problems


def check_recipe(recipe: Recipe, world_size: int, local_world_size: int | None) -> None:
    """Problems of a recipe that train refuses before building anything, one RecipeError line each: the
    engine rules ``recipe check`` runs too (:meth:`Recipe.engine_problems`), with the world size now known,
    and those of the launch itself."""
    p = recipe.parallel
    given = p.model_fields_set
    problems = launch_problems(recipe, world_size)
    if local_world_size is not None and "nproc_per_node" in given and p.nproc_per_node != local_world_size:
        problems.append(f"parallel.nproc_per_node: the recipe says {p.nproc_per_node}, but this job has "
                        f"{local_world_size} processes per node; make them agree (or drop the key)")
    problems += recipe.engine_problems(world_size)
    if p.expert_parallel and recipe.model.ffn == "moe" and world_size % (p.tensor_parallel * p.pipeline_parallel) == 0:
        dp = world_size // (p.tensor_parallel * p.pipeline_parallel)  # a stage's data-parallel ranks under pipelining
        problems += ep_analytic.problems(recipe.model.n_routed_experts, dp,
                                         ep_analytic.degree(True, p.expert_parallel_degree, dp))
    problems += pipeline_world_problems(recipe, world_size)  # parallel.pipeline_parallel (kinds.pipeline)
    if problems:
        raise RecipeError(problems)


class Engine(ABC):
    """The loop's view of an engine. Subclasses set ``name`` and ``model`` (the callable module)."""

    name: str
    model: nn.Module

    @abstractmethod
    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over ``batches`` (the micro-batches of this rank, on its device).

        Returns this rank's mean micro-batch loss and the global gradient norm before clipping
        (None where not computed), both as device tensors: nothing here synchronises the host.
        """

    @abstractmethod
    def save(self, path: Path) -> None:
        """Write model and optimizer state to the directory ``path`` (collective)."""

    @abstractmethod
    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (collective), reading no code from it; a checkpoint of
        another model shape is a RecipeError naming the tensor and both shapes."""


def engine_kind(name: str) -> EngineKind:
    """The registered engine ``name`` with its torch parts provided: an engine's module is found by the engine's
    name, ``scaletool/engines/<name>.py``, and imported the first time its parts are asked for (that import
    runs its ``provide(constructor=...)``), so a new engine needs no line in this package's ``__init__``; an
    engine registered with its parts from elsewhere (a test, a plugin) is used as it is."""
    kind = _registered(name)
    module = f"{__package__}.{name}"
    if not kind.has("constructor") and name.isidentifier() and importlib.util.find_spec(module) is not None:
        importlib.import_module(module)
    return kind


def startup_notes(recipe: Recipe, env: DistEnv) -> list[str]:
    """Lines worth saying before the engine is built: slow one-time work it is about to do."""
    kind = engine_kind(recipe.parallel.engine)
    return kind.part("startup_notes")(recipe, env.device.type) if kind.has("startup_notes") else []


def make_engine(recipe: Recipe, env: DistEnv) -> Engine:
    """Build the recipe's model on this rank's device (same seed on every rank) and wrap it."""
    from scaletool.engines.float8 import check_runtime
    from scaletool.model import build_model
    check_runtime(recipe, env.device)  # no FP8 on this device, or no torchao: one line each, before building
    t = recipe.train
    model = build_model(recipe.model, env.device, seed=t.seed, sdpa_backend=t.sdpa_backend)
    # provided by the engine's module (engine_kind above imports it by the engine's name); pipeline stages by
    # scaletool.engines.pipeline for the engines they compose with (kinds.pipeline)
    part = "pipeline_constructor" if recipe.parallel.pipeline_parallel > 1 else "constructor"
    return engine_kind(recipe.parallel.engine).part(part)(model, recipe, env)
