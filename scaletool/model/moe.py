"""DeepSeek-style mixture-of-experts FFN: shared experts, routed experts, a top-k router.

y = shared(x) + Σ_{j ≤ k} g_j · expert_{e_j}(x)   (DeepSeek-V2 §2.2, V3 §2.1.2)

Routing (:meth:`MoE.route`): softmax (V2) or sigmoid with an aux-loss-free bias (V3) scores, optional
group-limited selection, weights renormalised and scaled. Dispatch (:meth:`MoE.dispatch`,
``moe_dispatch``): ``dropless`` sorts assignments by expert (:func:`sort_by_expert`, moved by a gather
both ways) and runs gate/up as one grouped GEMM, the down projection as another (:func:`segment_matmul`):
nothing dropped, no host sync; ``capacity`` fills an [E, C, d] buffer (static shapes,
assignments past capacity dropped and counted). Expert parallelism (``scaletool.engines.expert_parallel``)
moves either: the capacity buffer as it is, the dropless sorted tokens in variable-sized pieces.
:meth:`MoE.reference` is the plain per-expert loop the tests check both against. After each forward
the module keeps ``aux_loss`` (sequence-wise balance loss) and the load statistics
(``tokens_per_expert``, ``dropped``, ``assignments``) for :func:`expert_load_metrics`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletool.config import ModelConfig, expert_capacity
from scaletool.model.layers import FeedForward


def swiglu_experts(buf: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU on its slots at once: buf (E, C, d), w1/w3 (E, d, i), w2 (E, i, d).

    Weights are cast to the activations' dtype: under FSDP2's mixed precision (no autocast) the
    activations are 16-bit while expert-parallel weights, which FSDP leaves alone, stay fp32.
    """
    gate, up = torch.bmm(buf, torch.cat([w1.to(buf.dtype), w3.to(buf.dtype)], -1)).chunk(2, -1)  # one bmm: (E, C, i) each
    return torch.bmm(F.silu(gate) * up, w2.to(buf.dtype))  # (E, C, d)


@torch.compiler.assume_constant_result
def _sm90_or_newer(device_index: int) -> bool:
    """Hopper or newer. A constant to torch.compile (no graph break on the hot path)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def grouped_mm_supported(x: torch.Tensor, width: int) -> bool:
    """Whether ``torch._grouped_mm`` runs the SwiGLU projections of x (M, d) with experts of ``width``:
    CUDA on Hopper or newer, bf16 activations, d and width multiples of 8 (its CUTLASS kernels
    need 16-byte aligned rows)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and x.shape[-1] % 8 == 0 and width % 8 == 0 and _sm90_or_newer(x.device.index or 0))


class _GatherRows(torch.autograd.Function):
    """``x[index]`` whose backward is a gather too: ``inverse`` lists, for each of x's rows repeated
    ``k`` times, the output row that took it (``index`` is a permutation of ``arange(len(x)·k) // k``).
    Autograd's own backward of ``x[index]`` is a scatter-add (sort or atomics); this one is one
    ``index_select`` and a sum over the k copies: deterministic, no atomics, fusable under compile."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.rows = k, x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)
        return (g.view(ctx.rows, ctx.k, -1).sum(1) if ctx.k > 1 else g), None, None, None


def sort_by_expert(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choices idx (N, k) -> ``order`` (N·k,): assignments grouped by expert (token order within one),
    its inverse permutation, and the rows per expert (E,). Device-side only: no host sync."""
    expert = idx.reshape(-1)  # assignment a = token a // k, choice a % k
    order = expert.argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order, inverse, expert_counts(expert, n_experts)


def expert_counts(expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of ``expert``'s entries (..., n) name each expert -> (..., E), long. A comparison summed
    over n: one reduction under compile. (``index_add_``/``scatter_add_`` into E bins serialise on the
    duplicates: on an H100 the compiled ``index_add_`` sorted and ran ~0.26 ms a layer for 32,768 entries.)"""
    return (expert.unsqueeze(-1) == torch.arange(n_experts, device=expert.device)).sum(-2)


def segment_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, impl: str) -> torch.Tensor:
    """Rows of x (M, K), in contiguous per-expert segments of ``counts`` (E,) rows, times their
    expert's w[e] (K, N) -> (M, N). ``impl``: ``grouped_mm`` (one kernel, no host sync) or ``loop``
    (one matmul per segment after reading the counts on the host: the reference path).

    On the meta device there are no counts to read; one matmul of all M rows against w[0] stands in,
    with the output shape and FLOPs of every split (what counting on meta needs)."""
    if impl == "grouped_mm":
        return torch._grouped_mm(x, w, offs=counts.cumsum(0, dtype=torch.int32))
    if x.device.type == "meta":
        return x @ w[0]
    segments = x.split(counts.tolist())
    return torch.cat([seg @ w[e] for e, seg in enumerate(segments)])


def sorted_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, impl: str) -> torch.Tensor:
    """SwiGLU experts on tokens x (M, d) sorted by expert in segments of ``counts`` (E,) rows: gate and up
    as one grouped GEMM on w13 = w1|w3 (E, d, 2i), the down projection on w2 (E, i, d), both already in
    x's dtype -> (M, d). Shared by the local experts and expert parallelism's shard of them."""
    gate, up = segment_matmul(x, w13, counts, impl).chunk(2, -1)
    return segment_matmul(F.silu(gate) * up, w2, counts, impl)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: w1, w3 (E, d, i) and w2 (E, i, d).

    ``forward`` takes the capacity dispatch buffer (E, C, d) and runs every expert with one bmm per
    projection; :meth:`sorted_forward` takes dropless tokens sorted by expert. Expert parallelism
    (``scaletool.engines.expert_parallel``) keeps a slice of the experts per rank and wraps this
    module; the model never knows.
    """

    #: ``train.weight_cast=step``: persistent 16-bit (w1|w3 (E, d, 2i), w2) that
    #: :mod:`scaletool.engines.weight_cast` refreshes once per optimizer step; None casts at each forward
    weights16: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, n_experts: int, d_model: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, intermediate_size))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, intermediate_size))
        self.w2 = nn.Parameter(torch.empty(n_experts, intermediate_size, d_model))

    def fused_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1|w3 (E, d, 2i), w2 (E, i, d)) in ``dtype``: the persistent copies where they are of that
        dtype, else cast now (the same rounded numbers either way)."""
        if self.weights16 is not None and self.weights16[0].dtype == dtype:
            return self.weights16
        return torch.cat([self.w1.to(dtype), self.w3.to(dtype)], -1), self.w2.to(dtype)

    def forward(self, buf: torch.Tensor) -> torch.Tensor:  # buf (E, C, d)
        return swiglu_experts(buf, self.w1, self.w2, self.w3)

    def sorted_forward(self, x: torch.Tensor, counts: torch.Tensor, impl: str | None = None,
                       fuse_gate_up: bool = True) -> torch.Tensor:
        """Tokens x (M, d) sorted by expert, ``counts`` (E,) rows per expert -> (M, d).

        ``impl`` None picks ``grouped_mm`` where :func:`grouped_mm_supported`, else ``loop``.
        ``fuse_gate_up``: w1 and w3 as one (E, d, 2i) grouped GEMM, else two; the weights are cast to
        the activations' dtype (see :func:`swiglu_experts`), under compile in one kernel with the concat."""
        impl = impl or self.impl_for(x)
        if fuse_gate_up:
            w13, w2 = self.fused_weights(x.dtype)
            return sorted_swiglu(x, w13, w2, counts, impl)
        gate, up = (segment_matmul(x, w.to(x.dtype), counts, impl) for w in (self.w1, self.w3))
        return segment_matmul(F.silu(gate) * up, self.w2.to(x.dtype), counts, impl)  # (M, d)

    def impl_for(self, x: torch.Tensor) -> str:
        """The segment-matmul implementation :meth:`sorted_forward` uses for activations like ``x``."""
        return "grouped_mm" if grouped_mm_supported(x, self.w1.shape[-1]) else "loop"

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` alone on tokens (n, d): the reference path."""
        return (F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None) -> None:
        for w, s in ((self.w1, std), (self.w3, std), (self.w2, out_std)):
            nn.init.normal_(w, 0.0, s, generator=generator)


class MoE(nn.Module):
    """Shared experts + routed experts behind a top-k router (DeepSeekMoE)."""

    #: the dropless path's expert GEMM (None: :meth:`GroupedExperts.impl_for` picks) and its
    #: permutation: ``gather`` (index_select both ways, gate/up fused) or ``indexed`` (advanced
    #: indexing, scatter-add backward, three GEMMs: the earlier path, kept to compare against).
    #: Class defaults, so a benchmark can switch every layer; an instance may override them.
    expert_impl: str | None = None
    permute: str = "gather"

    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        E, d = cfg.n_routed_experts, cfg.d_model
        self.n_experts, self.top_k = E, cfg.num_experts_per_tok
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = GroupedExperts(E, d, cfg.moe_intermediate_size)
        self.shared = (FeedForward(cfg, cfg.n_shared_experts * cfg.moe_intermediate_size)
                       if cfg.n_shared_experts else None)
        # V3's selection bias: checkpointed state, moved by a sign rule, never by a gradient
        self.register_buffer("router_bias", torch.zeros(E) if cfg.scoring_func == "sigmoid" else None)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        self.assignments = 0

    # -- routing ---------------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens (N, d) -> expert ids (N, k), gate weights (N, k) fp32, scores (N, E) fp32."""
        cfg, E, k = self.cfg, self.n_experts, self.top_k
        logits = self.gate(x).float()  # (N, E)
        scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
        choice = scores.detach() if self.router_bias is None else scores.detach() + self.router_bias
        if cfg.n_group > 1:
            groups = choice.view(-1, cfg.n_group, E // cfg.n_group)  # (N, G, E/G)
            group_score = groups.amax(-1) if cfg.scoring_func == "softmax" else groups.topk(2, -1).values.sum(-1)
            best = group_score.topk(cfg.topk_group, -1).indices  # (N, topk_group)
            keep = torch.zeros_like(group_score).scatter(1, best, torch.ones_like(group_score)) > 0  # (N, G)
            choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, E)
        idx = choice.topk(k, -1).indices  # (N, k)
        weights = scores.gather(1, idx)  # (N, k): scores without the bias
        if cfg.norm_topk_prob and k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.routed_scaling_factor, scores

    def balance_loss(self, idx: torch.Tensor, scores: torch.Tensor, batch: int) -> torch.Tensor:
        """α·mean over sequences of Σ_i f_i·P_i (see the module docstring); idx (N, k), scores (N, E)."""
        E, k = self.n_experts, self.top_k
        T = idx.shape[0] // batch
        probs = scores / scores.sum(-1, keepdim=True)  # softmax: unchanged; sigmoid: V3's s'
        counts = expert_counts(idx.view(batch, T * k), E)  # (B, E)
        f = counts.float() * (E / (k * T))
        P = probs.view(batch, T, E).mean(1)  # (B, E)
        return self.cfg.aux_loss_alpha * (f * P).sum(-1).mean()

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, d)
        B, T, d = x.shape
        flat = x.reshape(-1, d)  # (N, d)
        idx, weights, scores = self.route(flat)
        routed = self.dispatch(flat, idx, weights)
        self.aux_loss = (self.balance_loss(idx, scores, B)
                         if self.training and self.cfg.aux_loss_alpha > 0 else None)
        out = routed if self.shared is None else routed + self.shared(flat)
        return out.view(B, T, d)

    def dispatch(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed experts on tokens (N, d) with choices ``idx`` and gate ``weights`` (N, k) -> (N, d)."""
        if self.cfg.moe_dispatch == "capacity":
            return self.dispatch_capacity(flat, idx, weights)
        return self.dispatch_dropless(flat, idx, weights)

    def dispatch_dropless(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                          impl: str | None = None) -> torch.Tensor:
        """Tokens sorted by expert, one grouped GEMM per projection, nothing dropped (module docstring)."""
        N, d = flat.shape
        k = self.top_k
        impl = impl or self.expert_impl
        order, inverse, counts = sort_by_expert(idx, self.n_experts)
        if self.permute == "indexed":
            y = self.experts.sorted_forward(flat[order // k], counts, impl, fuse_gate_up=False)  # (N·k, d)
            out = torch.empty_like(y)
            out[order] = y  # back to assignment order (a permutation: no two writes collide)
        else:
            y = self.experts.sorted_forward(_GatherRows.apply(flat, order // k, inverse, k), counts, impl)
            out = _GatherRows.apply(y, inverse, order, 1)  # (N·k, d) in assignment order
        routed = (out.view(N, k, d) * weights.unsqueeze(-1).to(out.dtype)).sum(1)  # (N, d)
        self.tokens_per_expert = counts.detach()
        self.dropped = torch.zeros((), dtype=torch.long, device=flat.device)
        self.assignments = k * N
        return routed.to(flat.dtype)

    def dispatch_capacity(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Capacity-based batched expert computation (module docstring); drops past capacity."""
        N, d = flat.shape
        E, k = self.n_experts, self.top_k
        C = expert_capacity(self.cfg, N)
        expert = idx.t().reshape(-1)  # (k·N,) choice-major: every first choice before any second
        one_hot = F.one_hot(expert, E)  # (k·N, E)
        pos = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # place of each assignment in its expert's queue
        kept = pos < C
        slot = torch.where(kept, expert * C + pos, E * C)  # (k·N,); E·C: the bin of dropped assignments
        token = torch.arange(N, device=flat.device).repeat(k)  # (k·N,)
        # slot -> token map; empty slots point at row N, a zero row appended to the tokens
        slot_token = torch.full((E * C + 1,), N, device=flat.device, dtype=torch.long)
        slot_token = slot_token.scatter(0, slot, token)[:E * C]
        padded = torch.cat([flat, flat.new_zeros(1, d)])  # (N+1, d)
        buf = padded[slot_token].view(E, C, d)
        out = self.experts(buf)  # (E, C, d)
        out = torch.cat([out.reshape(E * C, d), out.new_zeros(1, d)])  # (E·C+1, d): dropped read zeros
        picked = out[slot].view(k, N, d)
        routed = (picked * weights.t().unsqueeze(-1).to(picked.dtype)).sum(0)  # (N, d)
        tokens_per_expert = one_hot.sum(0)
        self.tokens_per_expert = tokens_per_expert.detach()
        self.dropped = (~kept).sum().detach()
        self.assignments = k * N
        return routed.to(flat.dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same layer as a plain loop over experts with boolean masks, never dropping a token."""
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        idx, weights, _ = self.route(flat)
        routed = torch.zeros_like(flat)
        for e in range(self.n_experts):
            hit = idx == e  # (N, k)
            rows = hit.any(-1)
            if rows.any():
                w = (weights * hit).sum(-1)[rows].unsqueeze(-1)  # (n, 1)
                routed[rows] += (w * self.experts.expert(e, flat[rows])).to(flat.dtype)
        out = routed if self.shared is None else routed + self.shared(flat)
        return out.view(B, T, d)

    def expert_gemm(self, dtype: torch.dtype) -> str:
        """What runs the routed experts for activations of ``dtype`` on the experts' device: ``bmm``
        (capacity), ``grouped_mm`` or ``loop`` (dropless)."""
        if self.cfg.moe_dispatch == "capacity":
            return "bmm"
        w = self.experts.w1
        return self.expert_impl or self.experts.impl_for(torch.empty(0, w.shape[1], device=w.device, dtype=dtype))

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, speed: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3 §2.1.2): b_i += speed·sign(mean load − load_i)."""
        load = tokens_per_expert.float()
        self.router_bias += speed * torch.sign(load.mean() - load)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None) -> None:
        """Experts only: the gate and the shared SwiGLU are Linears that Transformer.init_weights covers."""
        self.experts.init_weights(std, out_std, generator)
        if self.router_bias is not None:
            self.router_bias.zero_()


def make_ffn(cfg: ModelConfig, layer_id: int) -> nn.Module:
    """The FFN of block ``layer_id``: MoE past ``first_k_dense_replace`` when ffn=moe, else dense."""
    if cfg.ffn == "moe" and layer_id >= cfg.first_k_dense_replace:
        return MoE(cfg, layer_id)
    return FeedForward(cfg)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the MoE layers' balance losses from the last forward (None when there are none)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def expert_load_metrics(model: nn.Module, reduce=None) -> dict[str, float]:
    """Expert load of the last forward as metrics, one host sync for all of them.

    Per MoE layer i: ``moe/layer{i}/imbalance_ratio`` (busiest expert's assignments over the mean,
    1 = perfectly balanced) and ``moe/layer{i}/dropped_fraction`` (assignments past capacity);
    over layers: ``moe/imbalance_ratio_mean``, ``moe/imbalance_ratio_max``, ``moe/dropped_fraction``.
    ``reduce`` (e.g. an all-reduce sum over data-parallel ranks) is applied to the stacked counts
    first, so every rank reports the global load.
    """
    layers = [m for m in moe_layers(model) if m.tokens_per_expert is not None]
    if not layers:
        return {}
    load = torch.stack([m.tokens_per_expert.float() for m in layers])  # (L, E)
    dropped = torch.stack([m.dropped.float() for m in layers])  # (L,)
    assigned = torch.tensor([float(m.assignments) for m in layers], device=load.device)
    stacked = torch.cat([load, dropped[:, None], assigned[:, None]], dim=1)
    if reduce is not None:
        reduce(stacked)
    load, dropped, assigned = stacked[:, :-2], stacked[:, -2], stacked[:, -1]
    imbalance = load.amax(-1) / load.mean(-1).clamp_min(1e-9)
    frac = dropped / assigned.clamp_min(1)
    summary = torch.stack([imbalance.mean(), imbalance.amax(), dropped.sum() / assigned.sum().clamp_min(1)])
    imb, fr, s = imbalance.tolist(), frac.tolist(), summary.tolist()
    out = {"moe/imbalance_ratio_mean": s[0], "moe/imbalance_ratio_max": s[1], "moe/dropped_fraction": s[2]}
    for m, a, b in zip(layers, imb, fr):
        out[f"moe/layer{m.layer_id}/imbalance_ratio"] = a
        out[f"moe/layer{m.layer_id}/dropped_fraction"] = b
    return out
