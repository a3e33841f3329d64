"""``scaletool estimate``'s result (kind "estimate"): the analytic model of a recipe, nothing built.

The parts shared with ``scaletool count`` (:class:`ModelSummary`, :class:`Params`) are defined here once,
so that the same figure has the same key in both documents (``params.total``, ``params.non_embedding``...).

Schema versions: 1 (written before results were typed: no ``kind``) had memory rows without phases;
2 adds ``phases`` (backward and optimizer_step, six components each), ``phase`` and ``backward_peak_at``
to every memory row. A version-1 document loads with those fields null.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from scaletool.results.base import Result, register


class Part(BaseModel):
    """A nested part of a result: typed fields, unknown keys kept (a newer writer's additions survive)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())


class ModelSummary(Part):
    attention: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    task: str


class Params(Part):
    """Exact parameter counts by component (``scaletool.analytic.param_counts``)."""

    total: int
    active: int
    non_embedding: int
    embedding: int
    head: int
    final_norm: int
    attention: int
    ffn: int
    norms: int
    per_layer: dict[str, Any]
    matmul: int
    rule_of_thumb_12d2L: int
    rule_of_thumb_rel_error: float
    moe: dict[str, Any] | None = None


class Flops(Part):
    per_token: dict[str, Any]  # scaletool.analytic.flops_per_token: forward/train in both conventions
    train_tokens: int
    train_total_6NT: float
    train_total: float


class KVCache(Part):
    elements_per_token_per_layer: int
    bytes_per_token_per_layer: int
    bytes_per_token: int
    mha_equivalent_bytes_per_token: int
    compression_ratio: float
    dtype: str
    bytes_per_sequence_at_seq_len: int
    naive_bytes_per_token: int | None = None


class AttentionScores(Part):
    elements_per_layer: int
    bytes_per_layer: int


class MemoryPhase(Part):
    """Bytes alive at a phase's largest moment, by component (``scaletool.analytic.COMPONENTS``)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers + self.temporaries


class MemoryPhases(Part):
    backward: MemoryPhase
    optimizer_step: MemoryPhase


class MemoryRow(Part):
    """One engine's training memory per GPU (``scaletool.analytic.training_memory``)."""

    engine: str
    world_size: int
    zero_stage: int | None = None
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    activations_per_token_per_layer_bytes: int
    transient_bytes: int
    total_bytes: int
    phases: MemoryPhases | None = None  # null in version-1 documents
    phase: Literal["backward", "optimizer_step"] | None = None
    backward_peak_at: str | None = None
    label: str | None = None  # memory.engines rows: single, ddp, fsdp, zero1..3
    activation_checkpointing: str | None = None
    #: train.float8's components (scaletool.analytic.float8): FP8 linear parameters, bytes added and saved
    float8: dict[str, int] | None = None


class Memory(Part):
    world_size: int
    recipe: MemoryRow  # the engine and settings the recipe selects
    engines: list[MemoryRow]  # every engine, with and without activation checkpointing


@register
class EstimateResult(Result):
    """Parameters, FLOPs, KV cache and training memory of a recipe, in closed form."""

    SCHEMA_VERSION: ClassVar[int] = 2
    kind: Literal["estimate"] = "estimate"
    schema_version: int = 2
    model: ModelSummary
    seq_len: int
    params: Params
    flops: Flops
    kv_cache: KVCache
    attention_scores: AttentionScores
    memory: Memory
    #: the step-time model per engine on one card (scaletool.predict.prediction.engine_predictions):
    #: hardware, calibration, world_size and rows of label, activation_checkpointing (the lightest that fits the
    #: card; null, with null figures and bound "does not fit", where none does), step_s, tokens_per_s(_per_gpu),
    #: mfu, hfu, bound
    prediction: Part | None = None
    #: pipeline stages (parallel.pipeline_parallel > 1; scaletool.analytic.pipeline_time.pipeline_estimate): the split,
    #: per-stage blocks, memory and in-flight micro-batches, the bubble, the stages that bound memory and the step
    pipeline: Part | None = None

    @classmethod
    def migrate(cls, data: Any) -> Any:
        """Version 1 had the same keys, minus the phase fields of memory rows (they load as null)."""
        return data
