"""DeepSpeed: ``deepspeed.initialize`` with ZeRO stage 0-3, configured from the recipe.

The DeepSpeed config is built from the recipe (micro-batch, accumulation, clipping, precision,
ZeRO stage, offload) on top of defaults of our own (ZeRO-3's sized by the model's blocks:
:mod:`scaletool.analytic.zero3`); ``parallel.deepspeed`` is then merged in unchanged, and the result
is recorded in the run's result (``environment.deepspeed_config``). A passthrough key that contradicts
a recipe field is reported, one line per key, instead of silently winning. The learning rate follows
:mod:`scaletool.train.schedule` for every engine, so a DeepSpeed ``scheduler`` section is a conflict too. These rules live in
:mod:`scaletool.kinds.engines` (``deepspeed_settings``, ``deepspeed_problems``) so that validating a recipe
runs them; only ``train_batch_size`` waits for the world size.

The optimizer is torch's AdamW (fused on CUDA), handed to DeepSpeed as a client optimizer; with
``offload_optimizer`` DeepSpeed's own CPU Adam (declared in the config) runs the step on the CPU.

Checkpoints are DeepSpeed's own; they are read back through DeepSpeed's checkpoint engine with its
``load`` swapped for :func:`~scaletool.engines.serialization.load_pt` (plain data only; DeepSpeed's
own reader unpickles without restriction).
"""
from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import torch

from scaletool.analytic.timeline import ZERO_REDUCE_BUCKET
from scaletool.analytic.zero3 import zero3_defaults
from scaletool.config import Recipe, RecipeError
from scaletool.engines.apply import apply_activation_checkpointing, compile_kwargs
from scaletool.engines.base import Engine
from scaletool.engines.dist import DistEnv
from scaletool.engines.optim import make_adamw, param_groups
from scaletool.engines.serialization import load_model_states, load_pt, shape_problem
from scaletool.kinds.engines import DEEPSPEED, deepspeed_problems, deepspeed_settings
from scaletool.model.layers import TORCH_DTYPES as DTYPES
from scaletool.yaml_input import flatten_dotted

# Ours, not derived from a recipe field: the passthrough may override them freely.
DEFAULTS = {
    "steps_per_print": 2**31 - 1,  # the loop logs; DeepSpeed's own step log would interleave
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer under ZeRO
    "zero_optimization": {"overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": ZERO_REDUCE_BUCKET, "allgather_bucket_size": 5e8},
}


def _set(d: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


def deepspeed_config(recipe: Recipe, world_size: int) -> tuple[dict, list[str]]:
    """(config, problems): the DeepSpeed config for ``recipe`` and one line per passthrough conflict
    (:func:`scaletool.kinds.engines.deepspeed_problems`; a validated recipe can only still conflict on
    ``train_batch_size``, which needs the world size)."""
    derived = deepspeed_settings(recipe, world_size)
    config = copy.deepcopy(DEFAULTS)
    if recipe.parallel.zero_stage == 3:  # sized by the model's blocks (scaletool.analytic.zero3)
        config["zero_optimization"].update(zero3_defaults(recipe.model))
    for key, (value, _) in derived.items():
        _set(config, key, value)
    for key, value in flatten_dotted(recipe.parallel.deepspeed).items():
        if key not in derived or derived[key][0] == value:
            _set(config, key, value)
    return config, deepspeed_problems(recipe, world_size)


def config_record(recipe: Recipe, world_size: int) -> dict:
    """What a training result records of the engine: the DeepSpeed config it was given."""
    return {"deepspeed_config": deepspeed_config(recipe, world_size)[0]}


def build_notes(recipe: Recipe, device_type: str) -> list[str]:
    """What DeepSpeed will compile before training starts (its JIT-built ops), said before it happens:
    its CPU Adam with ``offload_optimizer`` (a built op is reused from torch's extension directory).
    ``device_type`` is where training runs; the CPU Adam is built whatever it is."""
    from torch.utils.cpp_extension import _get_build_directory  # where torch.utils.cpp_extension.load builds

    ops = ["cpu_adam"] if recipe.parallel.offload_optimizer else []
    missing = [op for op in ops if not (Path(_get_build_directory(op, verbose=False)) / f"{op}.so").is_file()]
    return [f"deepspeed: compiling its {op} op (first run only; about a minute or more)" for op in missing]


# ZeRO-2/3 call torch's deprecated all_gather_into_tensor / reduce_scatter_tensor every step; each call
# prints a FutureWarning pair into the step log that only DeepSpeed's authors can act on.
_DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def _skip_inference_shm_op() -> None:
    """Keep DeepSpeed's CPU backend from JIT-building its shared-memory all-reduce (``deepspeed_shm_comm``).

    ``TorchBackend.__init__`` (deepspeed/comm/torch.py) builds it on every CPU run on a machine without a
    cached build (about 75 s on two cores), yet only ``inference_all_reduce`` (DeepSpeed-Inference's tensor
    parallelism) uses it; training reduces through torch.distributed (gloo here). ``build_shm_op`` returning
    None is DeepSpeed's own path for a machine where the op is not compatible.
    """
    import importlib

    # by module name: the attribute deepspeed.comm.torch is the torch package that deepspeed.comm imports
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def register_tied_head(model: torch.nn.Module) -> bool:
    """ZeRO-3: gather a tied LM head's weight for the whole forward of the root module.

    The tied head multiplies by the embedding's weight outside the embedding's forward
    (:meth:`scaletool.model.transformer.Transformer.lm_head`). ZeRO-3 gathers a partitioned parameter
    only in the pre-forward hooks of the modules that own or registered it; eager, its parameter
    dictionary notices the stray access and gathers on the spot, but a compiled forward reads the
    parameter as a graph input and meets its empty partition (size (0,)). Registered as an external
    parameter of the root (DeepSpeed's ``register_external_parameter``, deepspeed/runtime/zero/
    partition_parameters.py), it is gathered by the root's pre-forward hook and kept until the root's
    forward ends, as FSDP2 keeps its root's parameters. Returns whether a weight was registered."""
    weight = getattr(getattr(model, "tok_embeddings", None), "weight", None)
    if getattr(model, "output", True) is not None or weight is None:
        return False  # untied: the head is called as a module and its own hooks gather its weight
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    register_external_parameter(model, weight)
    return True


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, recipe: Recipe, env: DistEnv):
        os.environ.setdefault("DS_ACCELERATOR", env.device.type)
        os.environ.setdefault("LOCAL_RANK", str(env.local_rank))  # DeepSpeed insists, even for one process
        from scaletool.engines.deepspeed_import import quiet_deepspeed

        with quiet_deepspeed():
            import deepspeed

        self.env = env
        t = recipe.train
        config, _ = deepspeed_config(recipe, env.world_size)  # problems were reported at launch
        apply_activation_checkpointing(model, t)
        warnings.filterwarnings("ignore", message=_DEPRECATED_COLLECTIVES, category=FutureWarning)
        if env.device.type == "cpu":
            _skip_inference_shm_op()
        deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
        if recipe.parallel.zero_stage == 3:
            register_tied_head(model)
        if recipe.parallel.offload_optimizer:
            kw = {"model_parameters": param_groups(model, t.weight_decay)}
        else:
            kw = {"optimizer": make_adamw(model, t, env.device)}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, config=config, **kw)
        if t.compile:
            self.engine.compile(compile_kwargs=compile_kwargs(t))
        self.model = self.engine
        self.dtype = DTYPES[recipe.model.dtype]
        # DeepSpeed reads every checkpoint file through its checkpoint engine's load(path, map_location)
        self.engine.checkpoint_engine.load = lambda path, map_location=None: load_pt(
            path, map_location=map_location, deepspeed=True)

    def train_step(self, batches, lr):
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        total = None
        for inputs, targets in batches:
            if inputs.is_floating_point():  # regression features meet 16-bit weights: no autocast here
                inputs = inputs.to(self.dtype)
            loss = self.engine(inputs, targets)
            self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
            self.engine.step()  # applies the update only at the accumulation boundary
            total = loss.detach().float() if total is None else total + loss.detach().float()
        norm = self.engine.get_global_grad_norm()
        if norm is not None and not torch.is_tensor(norm):
            norm = torch.tensor(float(norm), device=total.device)
        return total / len(batches), norm

    def save(self, path: Path) -> None:
        # no "latest" file: the directory is renamed once complete, and the loop finds checkpoints itself
        self.engine.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        # ZeRO-3 leaves empty local tensors in place of partitioned parameters; ds_shape is the full one
        return {k: tuple(getattr(p, "ds_shape", p.shape)) for k, p in self.engine.module.named_parameters()}

    def load(self, path: Path) -> None:
        states = sorted(path.glob("*mp_rank_00_model_states.pt"))
        if states:
            saved = load_model_states(states[0])
            groups = saved.get("param_shapes")  # ZeRO: one {name: shape} per parameter group
            found = ({k: tuple(v) for group in groups for k, v in group.items()} if groups else
                     {k: tuple(v.shape) for k, v in saved["module"].items()})
            mismatch = shape_problem(path, found, self._shapes())
            if mismatch:
                raise RecipeError(mismatch)
        try:
            loaded, _ = self.engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                                    load_lr_scheduler_states=False)
        except RecipeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, AssertionError, EOFError) as e:
            # files that verified (readable, plain data) but hold what DeepSpeed does not expect
            raise RecipeError(f"{path}: DeepSpeed cannot load it ({type(e).__name__}: "
                              f"{(str(e).strip().splitlines() or [''])[0][:150]})") from None
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")


DEEPSPEED.provide(constructor=DeepSpeedEngine, startup_notes=build_notes, config_record=config_record)
