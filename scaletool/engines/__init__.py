"""Training engines: one module per engine, one small interface.

An :class:`Engine` owns the wrapped model and its optimizer and does one optimizer step over a
list of micro-batches (``train_step``), with gradient accumulation, clipping and mixed precision as
its backend does them; ``save``/``load`` write and read its native checkpoint format. The training
trainer (:mod:`scaletool.train.trainer`) sees only this interface.

- ``single`` (:mod:`.single`): one device, autocast mixed precision; also the base of DDP and FSDP.
- ``ddp`` (:mod:`.ddp`): ``DistributedDataParallel``, ``no_sync`` while accumulating.
- ``fsdp`` (:mod:`.fsdp`): FSDP2 ``fully_shard`` per block then the root; with
  ``parallel.tensor_parallel`` over a data × tensor mesh (:mod:`.tp`, Megatron-style tensor parallelism).
- ``deepspeed`` (:mod:`.deepspeed`): ``deepspeed.initialize`` with ZeRO stage 0-3.

Modules: :mod:`.dist` (rank layout and process group), :mod:`.apply` (activation checkpointing,
compile), :mod:`.optim` (AdamW), :mod:`.base` (the interface, the factory, launch-time checks),
:mod:`.serialization` (checkpoint reads that run no code from the file, shape checks), :mod:`.float8`
(``train.float8``: torchao's Float8Linear swap). Each engine module provides its class to its kind
(:mod:`scaletool.kinds.engines`); this package imports them. Model code stays single-device; what makes
it distributed, checkpointed or compiled is applied here, as torchtitan's ``parallelize`` does.
"""
from __future__ import annotations

from scaletool.engines.base import Engine, check_recipe, make_engine, startup_notes
from scaletool.engines.dist import DistEnv, agree, data_parallel, init_distributed, launcher_env

# each engine's module provides its kind's constructor (scaletool.kinds.engines) when imported; the shipped ones
# here, any other by its name when first built (scaletool.engines.base.engine_kind); DeepSpeed's module imports
# DeepSpeed itself only when an engine is built
from scaletool.engines import ddp, deepspeed, fsdp, pipeline, single  # noqa: E402, F401  isort: skip

__all__ = ["DistEnv", "Engine", "agree", "check_recipe", "data_parallel", "init_distributed", "launcher_env",
           "make_engine", "startup_notes"]
