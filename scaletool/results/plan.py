"""``scaletool plan``'s result (kind "plan"): the layouts that fit, predicted and ranked, each with its command."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from scaletool.results.base import Result, register


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class Prediction(_Part):
    """The step-time model's figures for one layout (scaletool.analytic.step)."""

    step_s: float
    tokens_per_s: float = Field(description="global, all GPUs")
    tokens_per_s_per_gpu: float
    mfu: float | None = None
    hfu: float | None = None
    bound: str = Field(description="the term that bounds the step: compute, memory bandwidth or exposed communication")
    terms: dict[str, float] = Field({}, description="seconds per step of each term of the model")
    calibration: str | None = None


class PlannedLayout(_Part):
    rank: int
    label: str = Field(description="single, ddp, fsdp, zero1, zero2, zero3")
    engine: str
    zero_stage: int
    tensor_parallel: int
    data_parallel: int
    expert_parallel: bool = False
    attention: str
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_tokens: int
    activation_checkpointing: str
    compiled: bool
    weight_cast: str = Field("micro-batch", description="train.weight_cast: step for a single layout that accumulates")
    reduce_scatter_every: str = Field("step", description="parallel.reduce_scatter_every: micro-batch for an FSDP "
                                      "layout that accumulates and fits only so")
    expert_parallel_degree: int = Field(0, description="parallel.expert_parallel_degree (0: every data-parallel rank)")
    pipeline_parallel: int = Field(1, description="parallel.pipeline_parallel: pipeline ranks (stages)")
    pipeline_schedule: str = "1f1b"
    pipeline_virtual_stages: int = 1
    pipeline_microbatches: int = Field(0, description="pipeline micro-batches per accumulation step (0: no pipeline)")
    pipeline: dict | None = Field(None, description="a pipeline layout's bubble (fraction and seconds), exposed "
                                  "point-to-point seconds, bounding stage and peak bytes of every stage")
    exposed_all_to_all_s: float = Field(0.0, description="expert parallelism's all-to-all seconds per step, exposed")
    outside: str | None = Field(None, description="why the step model does not stand behind this prediction (a key of "
                                "scaletool.predict.claims.OUTSIDE, the plan's notes say it in words), or null")
    memory_bytes: int = Field(description="estimated peak per GPU (phase-resolved; a pipeline's largest stage)")
    margin_bytes: int = Field(description="usable memory left at that peak (the allocator's share kept free)")
    memory_phase: str
    prediction: Prediction
    cost_per_million_tokens: float | None = Field(None, description="at --price-per-gpu-hour, for all GPUs")
    command: str | None = Field(None, description="the scaletool launch command, shlex-quoted")
    argv: list[str] | None = None
    command_problems: list[str] = Field([], description="what launch would refuse in this layout: empty, since such "
                                        "a layout is not offered (the plan's left_out says why)")


class Verified(_Part):
    """One layout run on this machine: predicted beside measured (median of the measured steps)."""

    rank: int
    layout: str
    world_size: int
    predicted_tokens_per_s: float
    measured_tokens_per_s: dict | None = Field(description="median, p10, p90, n of the measured steps")
    rel_error_tokens_per_s: float | None
    predicted_memory_bytes: int
    measured_peak_memory_bytes: int | None = Field(description="the allocator's peak (CUDA); null on the CPU")
    rel_error_memory: float | None
    status: str
    message: str | None = None
    command: str


@register
class PlanResult(Result):
    kind: Literal["plan"] = "plan"
    recipe: str
    gpus: int
    gpus_per_node: int
    nodes: int
    hardware: str
    card_bytes: int
    seq_len: int
    global_batch_tokens: int | None = Field(description="fixed by --global-batch-tokens; null: accumulation 1")
    price_per_gpu_hour: float | None = None
    calibration: str | None = None
    layouts: list[PlannedLayout] = Field(description="the top layouts, best first")
    fitting_layouts: int = Field(description="layouts predicted (those that fit), of which the top are listed")
    considered: dict = Field(description="families searched, memory estimates made, layouts predicted")
    pipeline_comparison: dict | None = Field(None, description="the best layout with pipeline stages beside the best "
                                             "without (ranks, tokens/s per GPU, MFU, speedup); null unless both fit")
    assumptions: list[str]
    notes: list[str] = []
    within_error: list[int] = Field([], description="ranks of the listed layouts predicted within the model's median "
                                    "|error| of the best (the best included): the prediction does not settle their order")
    left_out: list[dict] = Field([], description="layouts not offered because launch would refuse them or the installed "
                                 "versions cannot run them: layout (engine, tensor parallelism, checkpointing, mode, or a "
                                 "listed micro-batch), label, and the reason (one line)")
    elapsed_s: float = Field(description="seconds the search took")
    verify: list[Verified] | None = None
    verify_notes: list[str] = []
