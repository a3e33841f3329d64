"""Training-dynamics monitors: entropy collapse and rank collapse, gradient norms, update sizes.

Every ``profile.monitors.every`` steps, on a fixed probe micro-batch (``batch_size`` sequences of
the step after the last, so never trained on), :class:`DynamicsMonitor` measures per layer

- the attention entropy, mean over heads and query positions, and the lowest head's mean, from the
  attention modules' plain ``probs()`` (entropy collapse: attention concentrating on few tokens);
- the effective rank of each block's output hidden states (rank collapse: token representations
  becoming alike), and that rank over its maximum ``min(seq_len, d_model)``;
- the gradient norm of each block's parameters for the probe batch;
- the update-to-weight ratio ‖W_t − W_{t−1}‖ / ‖W_{t−1}‖ of each block (one optimizer step).

They run between steps, inside the trainer's ``unmeasured()`` (synchronised, timed, left out of
throughput and step times) and inside a ``scaletool::unmeasured`` profiler range (left out of the
operator breakdown), on a plain replica that shares the trained weights: gradients are taken with
``torch.autograd.grad``, so the training gradients, DDP hooks and optimizer state are untouched.
Sharded engines (FSDP2, ZeRO-3) gather the full weights (a collective on every rank); rank 0 measures.
Values go through the trainer's metrics writer (TensorBoard, ``metrics.jsonl``) and into ``summary.json``
under ``dynamics``; a layer whose entropy or rank ratio falls below its threshold is logged as a warning.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from scaletool.config import MonitorConfig
from scaletool.profile.breakdown import UNMEASURED
from scaletool.results.train import TrainResult
from scaletool.train.callbacks import Callback, StepState, TrainInfo

_TINY = 1e-30


def attention_entropy(probs: torch.Tensor) -> tuple[float, float]:
    """(mean, lowest head) entropy in nats of attention weights ``probs`` (B, H, T, S).

    Entropy per query row −Σ p·ln p (0·ln 0 = 0), averaged over batch and positions per head; the
    first returned value averages the heads too. A uniform row over S keys has ln S.
    """
    p = probs.float()
    row = -(p * p.clamp_min(_TINY).log()).sum(-1)  # (B, H, T)
    per_head = row.mean(dim=(0, 2))  # (H,)
    return per_head.mean().item(), per_head.min().item()


def effective_rank(x: torch.Tensor) -> float:
    """Effective rank (Roy & Vetterli, 2007) of x (..., N, d), averaged over leading dims.

    exp(H(p)) with p = σ / Σσ the normalised singular values: d for a matrix whose singular values
    are all equal, 1 for rank one, and in between a smooth count of the directions in use.
    """
    s = torch.linalg.svdvals(x.float())  # (..., min(N, d))
    p = s / s.sum(-1, keepdim=True).clamp_min(_TINY)
    h = -(p * p.clamp_min(_TINY).log()).sum(-1)
    return h.exp().mean().item()


def update_ratio(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    """‖after − before‖ / ‖before‖ over a group of tensors (Frobenius norms of the concatenation)."""
    num = sum((a.float() - b.float()).pow(2).sum() for a, b in zip(after, before))
    den = sum(b.float().pow(2).sum() for b in before)
    return math.sqrt(float(num) / float(den)) if float(den) > 0 else float("nan")


def grad_norm(grads: list[torch.Tensor | None]) -> float:
    return math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads if g is not None))


def full_weights(engine, rank: int) -> dict[str, torch.Tensor] | None:
    """The model's full state dict under canonical names (wrapper prefixes stripped) on rank 0.

    Unsharded engines return the live tensors (no copy). FSDP2 all-gathers to rank 0's CPU;
    ZeRO-3 gathers its partitions and rank 0 keeps a copy. Collective: call on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank0 = rank == 0
    module = getattr(engine.model, "module", engine.model)  # DeepSpeed's and DDP's wrapped module
    if any(hasattr(p, "ds_id") for p in module.parameters()):  # ZeRO-3: parameters are partitioned
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            sd = get_model_state_dict(module)
            return {k: v.detach().clone() for k, v in sd.items()} if rank0 else None
    sharded = any(isinstance(p, DTensor) for p in module.parameters())
    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=sharded))
    return sd if rank0 else None


def block_prefix(i: int) -> str:
    return f"layers.{i}."


class DynamicsMonitor(Callback):
    """Training callback (see :mod:`scaletool.train.callbacks`) for the monitors above."""

    def __init__(self, cfg: MonitorConfig):
        self.cfg = cfg
        self.history: list[dict] = []
        self.warnings: list[str] = []
        self._prev: tuple[int, dict[str, torch.Tensor]] | None = None
        self._replica: nn.Module | None = None

    def on_train_start(self, info: TrainInfo) -> None:
        from scaletool.train.data import make_source

        self.info = info
        r, env = info.recipe, info.env
        self.steps = r.train.steps
        inputs, targets = make_source(r, env.rank, env.world_size).batch(r.train.steps, 0)
        n = min(self.cfg.batch_size, inputs.shape[0])
        self.probe = inputs[:n].to(env.device), targets[:n].to(env.device)

    def _due(self, step: int) -> bool:
        return (step + 1) % self.cfg.every == 0 or step == self.steps - 1

    def on_step_end(self, step: int, state: StepState) -> dict[str, float] | None:
        now, before_next = self._due(step), step + 1 < self.steps and self._due(step + 1)
        if not (now or before_next):
            return None
        with self.info.unmeasured(), record_function(UNMEASURED):
            weights = full_weights(self.info.engine, self.info.env.rank)
            if weights is None:  # not rank 0: it only took part in gathering
                return None
            out = self.measure(step, weights) if now else None
            # the next step's update ratio needs these weights; unsharded engines gave live tensors
            self._prev = (step, {k: v.detach().clone() for k, v in weights.items()}) if before_next else None
        return out

    def on_train_end(self, result: TrainResult) -> None:
        if self.info.env.rank != 0:
            return
        result.dynamics = {
            "every": self.cfg.every, "batch_size": self.probe[0].shape[0],
            "entropy_threshold_nats": self.cfg.entropy_threshold, "rank_threshold": self.cfg.rank_threshold,
            "steps": [h["step"] for h in self.history], "history": self.history, "warnings": self.warnings,
        }

    # -- measurement -----------------------------------------------------------------------------

    def replica(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        """A plain, eager copy of the model holding ``weights`` (shared, not copied, when on the device)."""
        from scaletool.model import build_model

        r, device = self.info.recipe, self.info.env.device
        if self._replica is None:
            m = build_model(r.model, "meta", sdpa_backend=r.train.sdpa_backend)
            m.init_buffers(device)  # position tables and slopes: not in the weights
            self._replica = m.eval()
        self._replica.load_state_dict(weights, assign=True)
        return self._replica.to(device)

    def measure(self, step: int, weights: dict[str, torch.Tensor]) -> dict[str, float]:
        """All monitors at ``step`` (rank 0); returns the namespaced scalars and records warnings."""
        model = self.replica(weights)
        inputs, targets = self.probe
        if inputs.is_floating_point():  # regression features meet the weights' dtype (16-bit under DeepSpeed)
            inputs = inputs.to(next(model.parameters()).dtype)
        L, T, d = len(model.layers), inputs.shape[1], model.cfg.d_model
        values: dict[str, float] = {}
        with torch.no_grad():
            states = model.hidden_states(inputs)  # L block inputs, then the final normed output
            positions = model.positions(0, T, T, states[0].dtype)
            for i, layer in enumerate(model.layers):
                mean, low = attention_entropy(layer.attention_probs(states[i], positions, model.causal))
                values[f"dynamics/attention_entropy_nats/layer_{i:02d}"] = mean
                values[f"dynamics/attention_entropy_min_head_nats/layer_{i:02d}"] = low
                rank = effective_rank(states[i + 1])
                values[f"dynamics/effective_rank/layer_{i:02d}"] = rank
                values[f"dynamics/effective_rank_ratio/layer_{i:02d}"] = rank / min(T, d)
        blocks = [list(layer.parameters()) for layer in model.layers]
        with torch.enable_grad():
            loss = model(inputs, targets)
            grads = torch.autograd.grad(loss, [p for ps in blocks for p in ps], allow_unused=True)
        k = 0
        for i, ps in enumerate(blocks):
            values[f"dynamics/grad_norm/block_{i:02d}"] = grad_norm(list(grads[k:k + len(ps)]))
            k += len(ps)
        if self._prev is not None and self._prev[0] == step - 1:
            prev = self._prev[1]
            for i in range(L):
                names = [n for n in weights if n.startswith(block_prefix(i))]
                values[f"dynamics/update_to_weight_ratio/block_{i:02d}"] = update_ratio(
                    [prev[n] for n in names], [weights[n].to(prev[n].device) for n in names])
        self._warn(step, values, L)
        self.history.append({"step": step, **values})
        return values

    def _warn(self, step: int, v: dict[str, float], n_layers: int) -> None:
        c = self.cfg
        for i in range(n_layers):
            ent = v[f"dynamics/attention_entropy_nats/layer_{i:02d}"]
            if ent < c.entropy_threshold:
                low = v[f"dynamics/attention_entropy_min_head_nats/layer_{i:02d}"]
                self._emit(f"warning: entropy collapse at step {step}, layer {i}: mean attention entropy "
                           f"{ent:.3f} nats (lowest head {low:.3f}) < profile.monitors.entropy_threshold "
                           f"{c.entropy_threshold}; try a longer learning-rate warm-up or gradient clipping")
            ratio = v[f"dynamics/effective_rank_ratio/layer_{i:02d}"]
            if ratio < c.rank_threshold:
                self._emit(f"warning: rank collapse at step {step}, layer {i}: effective rank "
                           f"{v[f'dynamics/effective_rank/layer_{i:02d}']:.2f} is {ratio:.3f} of its maximum "
                           f"< profile.monitors.rank_threshold {c.rank_threshold}")

    def _emit(self, message: str) -> None:
        self.warnings.append(message)
        self.info.writer.log(message, style="yellow")
