"""The recipe's run sections: ``train``, ``parallel``, ``data`` and ``profile`` (with its monitors).

Each field's default and description is its documentation (``scaletool schema``, ``recipe show``); the
rules that join sections (an engine's keys, pipeline and FP8 constraints) are checked on the whole
:class:`~scaletool.config.Recipe`. Re-exported by :mod:`scaletool.config`.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator

from scaletool.config.base import MAX_HEADS, MAX_LAYERS, _Section
from scaletool.errors import echo
from scaletool.kinds.engines import DEFAULT_ENGINE, engine_names
from scaletool.kinds.pipeline import SCHEDULE_NAMES
from scaletool.yaml_input import key_text as _key_text


class TrainConfig(_Section):
    steps: int = Field(20, gt=0, description="optimizer steps")
    micro_batch_size: int = Field(4, gt=0, description="sequences per rank per micro-step")
    grad_accum_steps: int = Field(1, gt=0)
    seq_len: int | None = Field(None, gt=0, description="default model.max_seq_len")
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(2, ge=0, description="linear learning-rate warm-up steps")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = off")
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    selective_every: int = Field(2, gt=0, description="selective checkpointing: every n-th block")
    compile: bool = False
    compile_scope: Literal["auto", "model", "block"] = Field(
        "auto", description="torch.compile the whole model or each block; auto: model on engine=single, "
        "block on sharded engines (communication hooks stay between compiled regions)")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode, with train.compile: reduce-overhead wraps each compiled "
        "region in CUDA graphs (no per-kernel launch cost); max-autotune-no-cudagraphs autotunes matmuls")
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto", description="auto: cuDNN first when q/k and v head dims differ (MLA), else flash")
    float8: Literal["none", "tensorwise", "rowwise"] = Field(
        "none", description="FP8 GEMMs for the blocks' linear layers (torchao's float8 training; engines single, "
        "ddp, fsdp; model.dtype=bf16; CUDA capability >= 8.9): tensorwise (one scale per tensor; FSDP2 all-gathers "
        "fp8 weights) or rowwise (a scale per row, closer to bf16); wants train.compile for its speed")
    weight_cast: Literal["micro-batch", "step"] = Field(
        "micro-batch", description="when the linear layers' 16-bit weight copies are made under autocast: "
        "micro-batch (autocast casts at every forward) or step (engine=single: once per optimizer step, each "
        "micro-batch's 16-bit weight gradient added into the fp32 one in one kernel; the same numbers, fewer "
        "casts with train.grad_accum_steps > 1)")
    seed: int = 1234
    measure_warmup_steps: int = Field(2, ge=0, description="steps excluded from throughput and MFU")
    log_every: int = Field(1, gt=0)
    checkpoint_every: int = Field(0, ge=0, description="save every n steps; 0 = never")
    fused_optimizer: bool | None = Field(None, description="default: fused AdamW on CUDA")


def _engine_enum(schema: dict) -> None:
    schema["enum"] = list(engine_names())  # the registry as it is when the schema is written


def _quoted_or(names: tuple[str, ...]) -> str:
    quoted = [f"'{n}'" for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class ParallelConfig(_Section):
    engine: str = Field(DEFAULT_ENGINE, json_schema_extra=_engine_enum,
                        description="the training engine (scaletool.kinds.engines)")
    zero_stage: int = Field(1, ge=0, le=3, description="deepspeed ZeRO stage")
    reshard_after_forward: bool = True
    cpu_offload: bool = Field(False, description="fsdp: CPUOffloadPolicy for params, grads and optimizer")
    reduce_scatter_every: Literal["step", "micro-batch"] = Field(
        "step", description="fsdp with train.grad_accum_steps > 1: reduce-scatter the gradients once per optimizer "
        "step (gradient sync off until the last micro-batch; FSDP2 holds every gradient unsharded in fp32 between "
        "micro-batches) or after every micro-batch (sharded gradients only; that many times the traffic)")
    offload_optimizer: bool = Field(False, description="deepspeed: optimizer state on the CPU")
    offload_params: bool = Field(False, description="deepspeed ZeRO-3: parameters on the CPU")
    world_size: int = Field(1, gt=0, description="ranks assumed by `estimate` (train uses the real one)")
    nnodes: int = Field(1, gt=0)
    nproc_per_node: int = Field(1, gt=0)
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="passed through as DeepSpeed config")
    collective_timeout_s: int = Field(600, gt=0, description="process-group init and every collective: a rank "
                                      "that waits longer for its peers fails with an error naming it")
    expert_parallel: bool = Field(False, description="fsdp, ffn=moe: split the routed experts over the data-parallel "
                                  "ranks (each keeps n_routed_experts / expert_parallel_degree of them); tokens move "
                                  "by all-to-all, a variable number per expert with moe_dispatch=dropless")
    expert_parallel_degree: int = Field(0, ge=0, description="expert_parallel: ranks in each expert-parallel group "
                                        "(consecutive ranks; it divides the data-parallel ranks and n_routed_experts), "
                                        "experts replicated across the groups; 0 = every data-parallel rank")
    tensor_parallel: int = Field(1, gt=0, le=MAX_HEADS, description="fsdp: ranks that split every layer's heads and FFN "
                                 "width (Megatron-style, with sequence parallelism); FSDP2 shards over the "
                                 "world_size / tensor_parallel data-parallel ranks")
    async_tp: bool = Field(False, description="tensor_parallel > 1 with train.compile on CUDA: inductor fuses each "
                           "all-gather with the matmul it feeds and each matmul with its reduce-scatter, overlapping "
                           "them chunk by chunk over symmetric memory")
    tp_local_ops: bool = Field(False, description="tensor_parallel > 1: the same split with every op inside a block "
                               "on local tensors (parameters stay DTensors), saving DTensor's per-op host dispatch")
    data_parallel_replicate: int = Field(1, gt=0, description="fsdp: HSDP, FSDP2 on a 2-D (replicate, shard) mesh: "
                                         "states sharded over world_size / data_parallel_replicate ranks (a node), "
                                         "replicated across this many groups (nodes); gradient shards all-reduced "
                                         "across them")
    fsdp_on_one_rank: bool = Field(False, description="fsdp with tensor_parallel = world size (pure tensor parallelism): "
                                   "wrap FSDP2 anyway, over its one-rank data mesh, where it shards nothing and costs "
                                   "host time per block; off, the split model trains directly under autocast")
    pipeline_parallel: int = Field(1, gt=0, le=MAX_LAYERS, description="fsdp: pipeline ranks (torch.distributed."
                                   "pipelining); FSDP2 shards each stage over world_size / pipeline_parallel ranks")
    pipeline_schedule: Literal[SCHEDULE_NAMES] = Field(
        "1f1b", description="pipeline_parallel > 1: gpipe, 1f1b, interleaved-1f1b (pipeline_virtual_stages >= 2), "
        "interleaved-zb or zbv (zero bubble; where the installed torch has them)")
    pipeline_virtual_stages: int = Field(1, gt=0, le=MAX_LAYERS, description="model chunks per pipeline rank "
                                         "(interleaved schedules: >= 2; zbv: 2)")
    pipeline_microbatches: int | None = Field(None, gt=0, description="pipeline micro-batches that "
                                              "train.micro_batch_size splits into; default one sequence each")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        """One of the registered engines (a registry, not a Literal: an engine registered later is accepted)."""
        names = engine_names()
        if value not in names:
            raise ValueError(f"Input should be {_quoted_or(names)}")
        return value

    @field_validator("deepspeed")
    @classmethod
    def _plain_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        """The passthrough becomes DeepSpeed's JSON config: string keys, finite numbers, no YAML dates or sets."""
        stack: list[tuple[str, Any]] = [("", value)]
        while stack:
            where, v = stack.pop()
            if isinstance(v, dict):
                for k, sub in v.items():
                    if not isinstance(k, str):
                        raise ValueError(f"{where + ': ' if where else ''}key {echo(k)} is not a string")
                    stack.append((f"{where}.{_key_text(k)}" if where else _key_text(k), sub))
            elif isinstance(v, list):
                stack.extend((f"{where}[{i}]", sub) for i, sub in enumerate(v))
            elif isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{where}: {v} is not a finite number")
            elif not isinstance(v, (str, int, float, bool, type(None))):
                raise ValueError(f"{where}: a {type(v).__name__} is not a JSON value")
        return value

    def pure_tensor_parallel(self, world_size: int, tensor_parallel: int | None = None) -> bool:
        """Tensor parallelism (``tensor_parallel``, default this section's) over all ``world_size`` ranks, one
        data-parallel rank: engines.fsdp trains it without FSDP2 unless ``fsdp_on_one_rank``, and the
        estimates follow the same rule."""
        tp = self.tensor_parallel if tensor_parallel is None else tensor_parallel
        return 1 < tp == world_size and not self.fsdp_on_one_rank


class DataConfig(_Section):
    source: Literal["synthetic", "text", "tokens", "csv"] = Field(
        "synthetic", description="lm: synthetic | text | tokens; regression: synthetic | csv")
    path: str | None = None
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    num_samples: int = Field(4096, gt=0, description="synthetic regression series")


class MonitorConfig(_Section):
    enabled: bool = False
    every: int = Field(10, gt=0, description="measure after every n-th step (and after the last)")
    batch_size: int = Field(2, gt=0, description="sequences in the probe micro-batch (at most train.micro_batch_size)")
    entropy_threshold: float = Field(0.5, ge=0, description="warn when a layer's mean attention entropy (nats) falls below")
    rank_threshold: float = Field(0.1, ge=0, le=1, description="warn when a layer's effective rank / min(seq_len, "
                                  "d_model) falls below")


class ProfileConfig(_Section):
    enabled: bool = Field(False, description="run torch.profiler and write traces and the operator breakdown")
    wait: int = Field(1, ge=0, description="schedule: steps skipped first")
    warmup: int = Field(1, ge=0, description="schedule: steps traced but discarded")
    active: int = Field(2, gt=0, description="schedule: steps recorded per cycle")
    repeat: int = Field(1, ge=0, description="schedule: cycles (0 = until training ends)")
    ranks: list[int] | Literal["all"] = Field("all", description="ranks that profile")
    record_shapes: bool = False
    with_stack: bool = False
    with_flops: bool = False
    profile_memory: bool = Field(False, description="allocation events in the trace")
    memory_snapshot: bool = Field(False, description="CUDA: a memory snapshot for pytorch.org/memory_viz")
    monitors: MonitorConfig = Field(default_factory=MonitorConfig)
