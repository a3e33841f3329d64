"""Pipeline stages (``parallel.pipeline_parallel`` > 1): ``torch.distributed.pipelining`` over FSDP2, with tensor
parallelism inside each stage (``parallel.tensor_parallel``), as torchtitan composes them.

The ranks form a ``("pp", "dp")`` mesh, pipeline outermost (a stage's data-parallel ranks consecutive, one node's
where they fit), or ``("pp", "dp", "tp")`` with tensor-parallel groups of consecutive ranks. The model is built whole
(same seed as every other engine, so the weights equal a one-rank run's) and cut into the p·v chunks
:func:`scaletool.analytic.pipeline.stage_split` chooses; this rank keeps its chunks (:class:`StageModule`: the first
holds the embedding, the last the final norm and output layer). Each chunk gets, in order, tensor parallelism
(:func:`~scaletool.engines.tp.apply_tensor_parallel`: inside, a sequence-sharded DTensor residual stream; across
the boundary each rank's plain sequence shard; the last chunk's logits vocabulary-sharded, the loss under
``loss_parallel`` around the schedule's step), expert parallelism (each chunk's routed experts over groups of the
stage's ``dp`` ranks, left out of FSDP2), activation checkpointing, per-block compile and ``fully_shard`` (every
block, then the chunk), and becomes a ``PipelineStage``; the schedule runs the ``parallel.pipeline_microbatches``
micro-batches of each accumulation step, the mean cross-entropy (scaled so gradients equal the one-rank run's) on
the last stage. Chunks keep the whole model's parameter names (blocks in a ``ModuleDict`` keyed by index), so
checkpoints name tensors as every other engine does; optimizer states are saved flattened by name, one AdamW per
chunk. A MoE layer's balance loss joins the backward where the layer runs (DeepSeek-V2's ``AddAuxiliaryLoss``),
scaled as the cross-entropy, and is reported into the step's loss.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from scaletool.analytic.pipeline import stage_split
from scaletool.config import Recipe, RecipeError
from scaletool.engines.apply import compile_kwargs
from scaletool.engines.base import Engine
from scaletool.engines.dist import DistEnv
from scaletool.engines.expert_parallel import apply_expert_parallel, sync_replicated_expert_grads
from scaletool.engines.optim import make_adamw
from scaletool.engines.serialization import dcp_load, dcp_shapes, shape_problem, single_process_intended
from scaletool.engines.single import _by_mesh, _total_norm
from scaletool.engines.tp import apply_tensor_parallel
from scaletool.kinds.engines import FSDP
from scaletool.kinds.pipeline import chunk_ranks, pipeline_microbatches, schedule_kind
from scaletool.model.layers import TORCH_DTYPES
from scaletool.model.moe import aux_loss
from scaletool.model.transformer import Transformer

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def schedule_class(name: str) -> type:
    """The installed torch's class for ``parallel.pipeline_schedule``; a RecipeError naming what this torch has."""
    import torch.distributed.pipelining.schedules as schedules

    cls = getattr(schedules, schedule_kind(name).torch_class, None)
    if cls is None:
        raise RecipeError(f"parallel.pipeline_schedule: {name} needs torch.distributed.pipelining."
                          f"{schedule_kind(name).torch_class}, which torch {torch.__version__} does not have")
    return cls


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``h``; its backward also gives ``aux`` (a scalar) the gradient 1, so a stage's balance losses
    join the backward without passing through the later stages (DeepSeek-V2's ``AddAuxiliaryLoss``)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype, ctx.needs = aux.dtype, aux.requires_grad
        return h

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, (torch.ones((), dtype=ctx.aux_dtype, device=grad.device) if ctx.needs else None)


class StageModule(nn.Module):
    """Blocks ``[start, end)`` of a :class:`~scaletool.model.transformer.Transformer`, with its embedding
    (``first``) and its final norm and output layer (``last``); the same modules, not copies, under the
    same names. Forward: tokens (first) or hidden states in, hidden states or logits (last) out."""

    # the whole model's own code for the parts a chunk holds (they read only the attributes set below)
    _embed, embed, positions, lm_head = Transformer._embed, Transformer.embed, Transformer.positions, Transformer.lm_head

    def __init__(self, model: Transformer, start: int, end: int, first: bool, last: bool, tp_mesh=None):
        super().__init__()
        self.cfg, self.causal, self.embed_scale = model.cfg, model.causal, model.embed_scale
        # tensor parallelism within the stage: the residual stream is a sequence-sharded DTensor inside, and this
        # rank's sequence shard (a plain tensor) across the stage boundary; the logits leave vocabulary-sharded
        self.tp_mesh = tp_mesh
        self.tok_embeddings = model.tok_embeddings if first else None
        self.pos_embeddings = model.pos_embeddings if first else None
        self.pos_table = model.pos_table if first else None
        self.drop = model.drop
        # position buffers (no parameters, never saved): each chunk its own, so no module has two FSDP roots
        self.rope = copy.deepcopy(model.rope)
        self.alibi = copy.deepcopy(model.alibi)
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.aux_scale = 1.0  # the engine's loss scale: the balance loss is scaled as the cross-entropy
        self.aux_losses: list[torch.Tensor] = []  # this step's scaled balance losses (detached), for the report

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.embed(x)
        elif self.tp_mesh is not None:  # the previous stage's sequence shard
            h = DTensor.from_local(x, self.tp_mesh, (Shard(1),), run_check=False)
        else:
            h = x
        positions = self.positions(0, h.shape[1], h.shape[1], h.dtype)
        for layer in self.layers.values():
            h = layer(h, positions, self.causal)
        h = self.lm_head(self.norm(h)) if self.norm is not None else h
        if isinstance(h, DTensor):  # this rank's shard: the sequence's, or the logits' vocabulary slice
            h = h.to_local()
        aux = aux_loss(self) if self.training and torch.is_grad_enabled() else None
        if aux is not None:  # the balance losses of this chunk's MoE layers, for this pipeline micro-batch
            aux = aux * self.aux_scale
            self.aux_losses.append(aux.detach().float())
            h = _AddAuxLoss.apply(h, aux)
        return h


class PipelineEngine(Engine):
    """FSDP2 per stage under a ``torch.distributed.pipelining`` schedule (module docstring)."""

    name = "fsdp"

    def __init__(self, model: Transformer, recipe: Recipe, env: DistEnv):
        self.recipe, self.env = recipe, env
        p, t = recipe.parallel, recipe.train
        cls = schedule_class(p.pipeline_schedule)
        P, v, tp = p.pipeline_parallel, p.pipeline_virtual_stages, p.tensor_parallel
        S, dp = P * v, env.world_size // (P * tp)
        # pipeline outermost, tensor-parallel groups innermost (consecutive ranks, one node's), as torchtitan lays
        # out its ("pp", "dp_shard", "tp") mesh
        self.mesh = (init_device_mesh(env.device.type, (P, dp, tp), mesh_dim_names=("pp", "dp", "tp")) if tp > 1
                     else init_device_mesh(env.device.type, (P, dp), mesh_dim_names=("pp", "dp")))
        self.tp_mesh = self.mesh["tp"] if tp > 1 else None
        if tp > 1:
            # the gradient norm reduces over both of a stage's dimensions: with the flattened group DTensor does it
            # in one all-reduce instead of one per dimension (engines.dist.device_mesh flattens the same way)
            self.mesh["dp", "tp"]._flatten()
            # a chunk's output is its DTensor's local shard, a view: FSDP2 warns that an in-place op on it would skip
            # its pre-backward hook; the schedule only sends it (detached) and runs the backward from it
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor",
                                    category=UserWarning)
        self.pp_group = self.mesh["pp"].get_group()
        pp_rank = self.mesh["pp"].get_local_rank()
        self.split = stage_split(recipe, env.world_size)
        owners = chunk_ranks(p.pipeline_schedule, P, v)
        mine = [c for c in range(S) if owners[c] == pp_rank]
        parts = [StageModule(model, *self.split[c], first=c == 0, last=c == S - 1, tp_mesh=self.tp_mesh)
                 for c in mine]
        self.first, self.last = 0 in mine, S - 1 in mine
        self.m = pipeline_microbatches(recipe)
        self.scale = 1.0 / (self.m * t.grad_accum_steps)
        dtype = recipe.model.dtype
        mp = (MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[dtype], reduce_dtype=torch.float32)
              if dtype != "fp32" else MixedPrecisionPolicy())
        for part in parts:
            self._prepare(part, mp)
        self.parts = parts
        self.model = nn.ModuleList(parts)  # what callbacks walk (MoE layers, monitors); names come from each part
        from torch.distributed.pipelining import PipelineStage

        stages = [PipelineStage(part, c, S, env.device, group=self.pp_group) for part, c in zip(parts, mine)]
        self.schedule = cls(stages if schedule_kind(p.pipeline_schedule).looped else stages[0],
                            n_microbatches=self.m, loss_fn=self._loss, scale_grads=False)
        self.optimizers = [make_adamw(part, t, env.device) for part in parts]
        self.grad_clip = t.grad_clip

    def _prepare(self, part: StageModule, mp: MixedPrecisionPolicy) -> None:
        """Tensor parallelism, expert parallelism, checkpointing, per-block compile and FSDP2 on one chunk, in
        engines.apply's order."""
        t, p = self.recipe.train, self.recipe.parallel
        part.aux_scale = self.scale
        if self.tp_mesh is not None:
            apply_tensor_parallel(part, self.tp_mesh, self.recipe.model, p.tp_local_ops)
        # the chunk's routed experts over groups of the stage's data-parallel ranks (a chunk may hold no MoE layer)
        ignored = (apply_expert_parallel(part, self.mesh["dp"], p.expert_parallel_degree, require_moe=False)
                   if p.expert_parallel else None)
        if t.activation_checkpointing != "none":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            for key, block in part.layers.items():
                if t.activation_checkpointing == "full" or (int(key) + 1) % t.selective_every == 0:
                    part.layers[key] = checkpoint_wrapper(block)
        if t.compile:
            for key, block in part.layers.items():
                part.layers[key] = torch.compile(block, **compile_kwargs(t))
        kw = dict(mesh=self.mesh["dp"], mp_policy=mp, ignored_params=ignored or None)
        for block in part.layers.values():
            fully_shard(block, reshard_after_forward=p.reshard_after_forward, **kw)
        fully_shard(part, reshard_after_forward=False, **kw)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One pipeline micro-batch's cross-entropy, scaled so the step's gradients are the mean's. Under tensor
        parallelism the logits are this rank's vocabulary slice: the loss is parallel over it (``loss_parallel``,
        entered around the schedule's step, forward and backward)."""
        if self.tp_mesh is not None:
            logits = DTensor.from_local(logits, self.tp_mesh, (Shard(-1),), run_check=False)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1)) * self.scale
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def train_step(self, batches, lr):
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lr
        total = torch.zeros((), device=self.env.device)
        steps = 0
        for inputs, targets in batches:
            steps += 1
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.first else ()
            with loss_parallel() if self.tp_mesh is not None else contextlib.nullcontext():
                self.schedule.step(*args, target=targets if self.last else None, losses=losses, return_outputs=False)
            if self.last:
                total = total + torch.stack([x.detach().float() for x in losses]).sum()
        for part in self.parts:  # each chunk's balance losses (already scaled), wherever its MoE layers run
            # the last m per schedule step: the first step's metadata inference runs one forward more
            if part.aux_losses:
                total = total + torch.stack(part.aux_losses[-self.m * steps:]).sum()
                part.aux_losses.clear()
        # the loss lives on the last stage: every pipeline rank reports it (the trainer averages over all ranks)
        dist.all_reduce(total, group=self.pp_group)
        if self.recipe.parallel.expert_parallel:  # expert shards' gradients summed over their replicas
            for part in self.parts:
                sync_replicated_expert_grads(part)
        norm = self._clip() if self.grad_clip > 0 else None
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return total, norm

    def _clip(self) -> torch.Tensor:
        """The gradient norm over every stage (each rank's squared norm summed over the pipeline group), and
        clipping by it, as torchtitan's clip_grad_norm_ with a pipeline mesh."""
        params = [q for part in self.parts for q in part.parameters() if q.grad is not None]
        groups = _by_mesh(params)  # expert parallelism over groups smaller than the stage: a mesh of their own
        norm = _total_norm(groups)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        sq = norm.float() ** 2
        dist.all_reduce(sq, group=self.pp_group)
        norm = sq.sqrt()
        for group in groups:
            nn.utils.clip_grads_with_norm_(group, self.grad_clip, norm, foreach=True)
        return norm

    def _states(self) -> list[tuple[dict, dict]]:
        return [get_state_dict(part, opt, options=_FLAT) for part, opt in zip(self.parts, self.optimizers)]

    def _state(self) -> dict:
        model, optim = {}, {}
        for m_sd, o_sd in self._states():
            model.update(m_sd)
            optim.update(o_sd)
        return {"model": model, "optim": optim}

    def save(self, path: Path) -> None:
        with single_process_intended():
            dcp.save(self._state(), checkpoint_id=str(path))

    def load(self, path: Path) -> None:
        per_part = self._states()
        state = self._state()
        shapes = {k: tuple(v.shape) for k, v in state["model"].items()}
        mismatch = shape_problem(path, dcp_shapes(path), shapes)
        if mismatch:
            raise RecipeError(mismatch)
        dcp_load(state, path)
        for part, opt, (m_sd, o_sd) in zip(self.parts, self.optimizers, per_part):
            set_state_dict(part, opt, model_state_dict={k: state["model"][k] for k in m_sd},
                           optim_state_dict={k: state["optim"][k] for k in o_sd}, options=_FLAT)


FSDP.provide(pipeline_constructor=PipelineEngine)  # stages compose with FSDP2 (kinds.pipeline)
