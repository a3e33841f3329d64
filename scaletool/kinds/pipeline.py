"""Pipeline schedules as data: one object per ``parallel.pipeline_schedule``, torch-free.

Each schedule names its ``torch.distributed.pipelining`` class (looked up on the installed torch when
training starts), its chunks per rank and their placement (looped: r, r + p, ...; ``v``: r and 2p - 1 - r),
and its idle share of a slot for :mod:`scaletool.analytic.pipeline`.

Sources of the closed forms, with p pipeline ranks, v chunks per rank, m micro-batches:

- GPipe (Huang et al. 2019, §2.2): bubble (p - 1) micro-batch slots of forward + backward; every
  stage holds all m micro-batches' activations until the backward starts.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021 "Efficient Large-Scale Language Model Training on GPU
  Clusters", §2.2.1): the same bubble, (p - 1)/m of the ideal time; stage s holds min(p - s, m).
- Interleaved 1F1B (same paper, §2.2.2): bubble (p - 1)/(v·m); rank s warms up (p - s - 1)·2 + (v - 1)·p
  chunk micro-batches (Megatron-LM's schedule), one more in the steady state, each 1/v of the stage's layers
  (the first rank p·(1 + (p - 1)/(p·v)) micro-batches, Korthikanti et al. 2022 §5).
- Zero bubble (Qi et al. 2023 "Zero Bubble Pipeline Parallelism", §3): the backward splits into the input
  gradient B and the weight gradient W, and W fills the bubble: ZB-H1's idle time is (p - 1)(T_F + T_B - T_W)
  against 1F1B's (p - 1)(T_F + T_B + T_W), a third of it with T_F = T_B = T_W, at 1F1B's memory.
  torch's interleaved zero bubble is that schedule over v chunks per rank (bubble divided by v).
- ZB-V (Qi et al. 2024, §4): two chunks per rank in a V; (p - 1)(T_F + T_B - 2·T_W) idle; p micro-batches held.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaletool.kinds.engines import engine_kind

#: T_F : T_B : T_W of one micro-batch on one chunk, the zero-bubble paper's working assumption (§3.1): the
#: input gradient and the weight gradient each cost about a forward
F_B_W = (1.0, 1.0, 1.0)


@dataclass(frozen=True)
class ScheduleKind:
    """One value of ``parallel.pipeline_schedule``.

    ``torch_class``: the class in ``torch.distributed.pipelining.schedules``. ``looped``: several chunks
    per rank (PipelineScheduleMulti; ``virtual`` is then the chunks per rank it needs: ``None`` any >= 2,
    an int exactly that). ``placement``: ``loop`` or ``v`` (see the module docstring). ``bubble_work``: the
    idle share of one chunk-slot in units of F + B + W (1 for GPipe and 1F1B, 1/3 for ZB-H1, 0 for ZB-V).
    ``one_chunk_bubble_from``: the pipeline ranks from which torch's implementation was measured to idle as
    if each rank held one chunk (its sends and receives, not its order of computations), or None.
    ``issue_order``: a rank's memory peak is read off the order the torch class issues its chunks' forwards and
    backwards (:func:`scaletool.analytic.pipeline.interleaved_peak`), not a count of average chunks.
    """

    name: str
    torch_class: str
    looped: bool
    virtual: int | None
    placement: str
    bubble_work: float
    source: str
    one_chunk_bubble_from: int | None = None
    issue_order: bool = False

    def realised_chunks(self, p: int, v: int, designed: bool = False) -> int:
        """The chunks per rank the bubble divides by as torch runs the schedule on ``p`` ranks (``designed``:
        as the schedule's paper has it, for another project's implementation)."""
        if not designed and self.one_chunk_bubble_from is not None and p >= self.one_chunk_bubble_from:
            return 1
        return v

    def virtual_problem(self, v: int) -> str | None:
        if self.virtual is not None and v != self.virtual:
            need = "1 (one chunk per rank)" if self.virtual == 1 else f"{self.virtual} (its chunks form a V)"
            return (f"parallel.pipeline_virtual_stages: {v}, but pipeline_schedule={self.name} takes {need}"
                    + ("; use interleaved-1f1b for more" if self.virtual == 1 and v > 1 else ""))
        if self.virtual is None and v < 2:
            return (f"parallel.pipeline_virtual_stages: {v}, but pipeline_schedule={self.name} interleaves >= 2 "
                    "chunks per rank; use 1f1b or gpipe for one")
        return None


_F, _B, _W = F_B_W
SCHEDULES: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("gpipe", "ScheduleGPipe", False, 1, "loop", 1.0, "Huang et al. 2019"),
    ScheduleKind("1f1b", "Schedule1F1B", False, 1, "loop", 1.0, "Narayanan et al. 2021 §2.2.1"),
    # torch 2.11's ScheduleInterleaved1F1B on 4 ranks measured plain 1F1B's bubble (39.1% and 24.3% at 4 and 8
    # micro-batches against 1F1B's 42.9% and 27.3% and the design's 27.3% and 15.8%; mla-1b and mha-1b on
    # 4 H200s, benchmarks/results/pipeline/4xh200-2026-11-27-s4*), its design's on 2 (within 1.1 points);
    # pytorch/pytorch#188833. Larger counts are assumed alike, not measured.
    ScheduleKind("interleaved-1f1b", "ScheduleInterleaved1F1B", True, None, "loop", 1.0, "Narayanan et al. 2021 §2.2.2",
                 one_chunk_bubble_from=4, issue_order=True),
    ScheduleKind("interleaved-zb", "ScheduleInterleavedZeroBubble", True, None, "loop",
                 (_F + _B - _W) / (_F + _B + _W), "Qi et al. 2023 §3 (ZB-H1)"),
    ScheduleKind("zbv", "ScheduleZBVZeroBubble", True, 2, "v", max(0.0, _F + _B - 2 * _W) / (_F + _B + _W),
                 "Qi et al. 2024 §4 (ZB-V)"),
)}
SCHEDULE_NAMES = tuple(SCHEDULES)


def schedule_kind(name: str) -> ScheduleKind:
    return SCHEDULES[name]


def pipeline_microbatches(recipe: Any) -> int:
    """``parallel.pipeline_microbatches``, or its default: one sequence per pipeline micro-batch (the
    smallest bubble a micro-batch of ``train.micro_batch_size`` sequences allows)."""
    m = recipe.parallel.pipeline_microbatches
    return m if m else recipe.train.micro_batch_size


def chunk_ranks(schedule: str, p: int, v: int) -> list[int]:
    """The pipeline rank of each of the p·v chunks, in model order."""
    if schedule_kind(schedule).placement == "v":
        return [c if c < p else 2 * p - 1 - c for c in range(p * v)]
    return [c % p for c in range(p * v)]


def pipeline_problems(recipe: Any) -> list[str]:
    """What ``parallel.pipeline_parallel`` > 1 needs of the recipe, one line each (the torch side checks that
    the installed torch has the schedule)."""
    p, m, t = recipe.parallel, recipe.model, recipe.train
    P, v = p.pipeline_parallel, p.pipeline_virtual_stages
    if P == 1:
        given = p.model_fields_set & {"pipeline_schedule", "pipeline_virtual_stages", "pipeline_microbatches"}
        return [f"parallel.{k}: only used with parallel.pipeline_parallel > 1" for k in sorted(given)
                if getattr(p, k) != type(p).model_fields[k].default]
    problems = []
    if "pipeline_parallel" not in engine_kind(p.engine).layouts:
        problems.append(f"parallel.pipeline_parallel: {P} stages compose with parallel.engine=fsdp (FSDP2 shards "
                        f"each stage over its data-parallel ranks, as torchtitan does), not engine={p.engine}")
    if m.task != "lm":
        problems.append("parallel.pipeline_parallel: supported for task=lm (the regression model's batch norm "
                        "and last-step head are not split into stages)")
    if schedule_kind(p.pipeline_schedule).bubble_work < 1:
        problems.append(f"parallel.pipeline_schedule: {p.pipeline_schedule} splits each backward into input and "
                        "weight gradients, and torch.distributed.pipelining's split bypasses FSDP2's gathered "
                        "parameters: weight gradients go missing (a 2-stage gloo run's gradient norm 4% under the "
                        "one-rank run's); use 1f1b, interleaved-1f1b or gpipe")
    bad_v = schedule_kind(p.pipeline_schedule).virtual_problem(v)
    if bad_v:
        problems.append(bad_v)
    if m.n_layers < P * v:
        problems.append(f"parallel.pipeline_parallel: {P} ranks × {v} virtual stages = {P * v} stages, more than "
                        f"model.n_layers={m.n_layers} (every stage holds at least one block)")
    mb = pipeline_microbatches(recipe)
    if t.micro_batch_size % mb:
        problems.append(f"parallel.pipeline_microbatches: {mb} does not divide train.micro_batch_size="
                        f"{t.micro_batch_size} (each pipeline micro-batch is an equal slice of it)")
    if m.tie_embeddings:
        problems.append("model.tie_embeddings: the embedding sits on the first stage and the output layer on the "
                        "last; a tied weight would need its two gradients summed across stages, which "
                        "torch.distributed.pipelining does not do; untie it (tie_embeddings: false) to pipeline")
    if p.tensor_parallel > 1 and p.async_tp:
        problems.append("parallel.async_tp: not composed with pipeline stages (each stage's blocks compile alone); "
                        "set it to false to pipeline with tensor parallelism")
    if m.ffn == "moe" and m.bias_update_speed > 0:
        problems.append("model.bias_update_speed: the bias update reads each MoE layer's load of the whole step, and "
                        "a pipeline stage keeps only its last pipeline micro-batch's; set it to 0 to pipeline")
    if m.dtype == "fp16":
        problems.append("model.dtype: fp16 needs a loss scaler whose overflow check spans every stage; use bf16 or "
                        "fp32 with pipeline stages")
    if t.float8 != "none":
        problems.append(f"train.float8: {t.float8} is not composed with pipeline stages yet")
    return problems


def pipeline_world_problems(recipe: Any, world_size: int) -> list[str]:
    """The launch-time rule: pipeline ranks divide the world size."""
    P, tp = recipe.parallel.pipeline_parallel, recipe.parallel.tensor_parallel
    if P > 1 and world_size % (P * tp):
        what = f"{P} × parallel.tensor_parallel={tp}" if tp > 1 else f"{P}"
        return [f"parallel.pipeline_parallel: {what} does not divide the world size {world_size} (pipeline ranks × "
                + ("data-parallel ranks × tensor-parallel ranks)" if tp > 1 else "data-parallel ranks)")]
    return []
