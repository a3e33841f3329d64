"""The pieces of the training-memory model every engine shares: inputs, components, phases, the
per-layer activation units and the backward timeline they are evaluated along."""
from __future__ import annotations

from dataclasses import dataclass

from scaletool.analytic.flops import routed_experts_computed
from scaletool.analytic.params import attention_params, ffn_params, moe_params, param_counts
from scaletool.config import ModelConfig
from scaletool.kinds.attention import attention_kind, position_kind

# ---------------------------------------------------------------------------------------------
# Training memory
#
# Peak bytes per GPU of one training step, modelled in two phases, each the largest sum of tensors
# alive at one moment (every phase is a dict of the components below, summing to its total):
#
# - ``backward``: the forward and backward pass. The forward never exceeds the start of the
#   backward (everything it saves is still alive then, plus the loss gradient), so the phase is
#   evaluated at the moments the backward passes through: the loss, the head, every block (top
#   to bottom) and the embedding. Activations shrink and gradients grow along the way; which
#   moment is largest depends on the engine, the micro-batch and checkpointing.
# - ``optimizer_step``: after the backward; activations are gone, the optimizer's own
#   temporaries appear (DeepSpeed's fp32 copy of the gradient partition, foreach AdamW's sqrt).
#
# Components (the same six keys for every engine and phase):
#   weights      parameters the engine keeps (fp32 for single/DDP/FSDP, 16-bit under DeepSpeed)
#   gradients    gradient storage alive at that moment (engine-specific, see the engine functions)
#   optimizer    AdamW m and v (and DeepSpeed's fp32 master copy)
#   activations  what autograd keeps for the backward (under autocast also the 16-bit weight copies
#                the matmuls saved), and the checkpointed block being recomputed
#   buffers      the engine's communication and gathering buffers
#   temporaries  short-lived tensors of the moment: the loss gradient, the 16-bit weight gradient on
#                its way to the engine, the optimizer's flat and fp32 gradient copies


@dataclass(frozen=True)
class MemoryInputs:
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: str = "none"  # none | full | selective
    selective_every: int = 2
    compiled: bool = False  # torch.compile: Inductor recomputes element-wise results in the backward
    #: with ``compiled``: ``model`` (one graph, the head and the loss in it), ``module`` (the whole model
    #: compiled, but broken into a graph per module by the engine's module hooks: DeepSpeed ZeRO-3) or
    #: ``block`` (each block compiled, the head and the loss eager)
    compile_scope: str = "model"


#: Engine defaults the estimate depends on, in elements: scaletool's reduce bucket
#: (``scaletool.engines.deepspeed.DEFAULTS``) and DeepSpeed's own ZeRO-3 defaults
#: (deepspeed/runtime/zero/config.py: stage3_max_reuse_distance, stage3_prefetch_bucket_size,
#: sub_group_size).
ZERO_REDUCE_BUCKET = 500_000_000
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000
ZERO3_PREFETCH_BUCKET = 50_000_000
ZERO3_SUB_GROUP_SIZE = 1_000_000_000

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "buffers", "temporaries")
PHASES = ("backward", "optimizer_step")


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings the memory model reads; the defaults are what scaletool configures."""
    zero_stage: int = 1
    reshard_after_forward: bool = True
    expert_parallel: bool = False
    expert_parallel_degree: int = 0  # ranks per expert-parallel group; 0: every data-parallel rank
    fused_optimizer: bool = True  # torch's fused AdamW (the CUDA default) or foreach
    reduce_bucket: float = ZERO_REDUCE_BUCKET
    overlap_comm: bool = True  # DeepSpeed ZeRO-1/2: two IPG buckets instead of one
    max_reuse_distance: float = ZERO3_MAX_REUSE_DISTANCE
    prefetch_bucket: float = ZERO3_PREFETCH_BUCKET
    persistence_threshold: float = 100_000  # ZeRO-3: parameters this small stay whole on every rank
    sub_group_size: float = ZERO3_SUB_GROUP_SIZE
    weight_cast_step: bool = False  # train.weight_cast=step: the linear layers' 16-bit copies persist
    grad_accum_steps: int = 1  # > 1: the later micro-batches' backward starts with every gradient held
    reduce_scatter_every_micro_batch: bool = False  # fsdp: sharded gradients only, even while accumulating


def _norm_readers(cfg: ModelConfig) -> tuple[int, int]:
    """How many matmuls read each block norm's output: the attention's (q, k, v apart; MLA's query and latent
    projections) and the FFN's (SwiGLU's gate and up; one up-projection otherwise, a MoE block's router).

    What it decides: CUDA autocast runs ``layer_norm`` in fp32, so an eager LayerNorm keeps an fp32 copy of its
    16-bit input (4d, not res·d) and every matmul reading its fp32 output makes its own 16-bit cast (autocast
    caches only leaf weights' casts): 2d a reader. Measured on an H200 (MPT-1B's shapes, single engine,
    benchmarks/results/published-shape/): +8.2d and +8.4d bytes a token and block over the plain count with
    GELU (MHA: 3 readers, then 1), +10.1d with SwiGLU (3, then 2); RMSNorm (not in autocast's fp32 list) and
    FSDP2's 16-bit parameters (no autocast) keep the plain count (within 0.1%). The CPU's autocast runs
    ``layer_norm`` in 16 bits: there the plain count holds and this one is over by the extra."""
    return (2 if cfg.attention == "mla" else 3), (2 if cfg.ffn == "swiglu" else 1)


def _activation_bytes_per_token_per_layer(cfg: ModelConfig, moe: bool = False, res: int = 4,
                                          compiled: bool = False, autocast_block: bool = False,
                                          layernorm_fp32: bool = False) -> float:
    """Bytes autograd keeps per token in one block, eager mode (or ``compiled``), mixed precision.

    Counted tensor by tensor (residual stream of ``res`` bytes, 16-bit matmul inputs): each norm
    keeps its input (res·d) and the 16-bit cast its matmul reads (2d); fused SDPA keeps q, k, v and the output
    (no T×T scores) plus an fp32 log-sum-exp per head (MLA's v is a view into ``wkv_b``'s output, which
    therefore stays whole: H·(qk_nope_head_dim + v_head_dim)); SwiGLU keeps gate, up, silu(gate) and their
    product (4 tensors of i), GELU/ReLU the pre-activation and activation (2 of i).
    A MoE block (``moe``) keeps the router's fp32 logits and scores (2·E), the dispatch buffer
    (d per computed slot: k per token dropless, E·C/N ≈ capacity_factor·k with capacity) and each slot's SwiGLU
    (4·i_moe), the k gathered expert outputs (k·d), and the shared experts' SwiGLU (4·n_shared·i_moe).

    ``compiled`` (a whole model under ``torch.compile``): what Inductor's min-cut partitioner saves, read off
    the compiled backward's saved tensors (``tests/analytic/test_compiled_memory.py`` measures them on the
    installed torch): each norm still keeps its input and its 16-bit output (the output is the next
    matmul's input); SwiGLU keeps gate, up and their product (3 of i: only silu(gate) is recomputed);
    attention saves what fused SDPA needs either way. GELU/ReLU keep the eager count (not measured compiled).
    ``autocast_block`` (a block compiled alone over fp32 weights under autocast, DDP): a dense SwiGLU keeps eager's
    four of i (2 DDP runs, benchmarks/results/plan-verify/README.md: 181–183 KB a token over three, 16 × 2·i =
    180 KB); a whole model compiled under autocast keeps three. ``layernorm_fp32``: :func:`_norm_readers`.
    """
    d, H, a = cfg.d_model, cfg.n_heads, 2 if cfg.dtype != "fp32" else 4
    norms = 2 * (res * d + a * d)
    if layernorm_fp32:
        norms += sum((4 - res) * d + (n - 1) * a * d for n in _norm_readers(cfg))
    attn = a * attention_kind(cfg).activation_elements(cfg) + 4 * H  # + the fp32 log-sum-exp
    if moe:
        slots, i = routed_experts_computed(cfg), cfg.moe_intermediate_size
        kept = 3 if compiled else 4  # of each SwiGLU's i-wide tensors
        ffn = (4 * 2 * cfg.n_routed_experts + a * slots * (d + kept * i) + a * cfg.num_experts_per_tok * d
               + a * kept * cfg.n_shared_experts * i)
    else:
        glu = cfg.ffn in ("swiglu", "moe")
        ffn = a * cfg.intermediate_size * ((3 if compiled and not autocast_block else 4) if glu else 2)
    return norms + attn + ffn


@dataclass(frozen=True)
class _Unit:
    """One stop of the backward (the head, a block, the embedding), in the order the backward visits them.

    Bytes are totals for the micro-batch; parameter counts are elements."""
    name: str
    params: int  # parameters whose gradients it produces
    largest: int  # its largest parameter
    gathered: int  # parameters FSDP / ZeRO-3 gather for it (expert-parallel experts stay local)
    saved: float  # activation bytes it keeps from the forward until its backward
    live: float  # activation bytes alive during its backward (recomputed when checkpointed)
    temp: float  # temporaries of its backward
    checkpointed: bool = False


def cast_once_params(cfg: ModelConfig) -> int:
    """Parameters ``train.weight_cast=step`` keeps a persistent 16-bit copy of: every block's attention
    projections and dense FFN, a MoE block's router and shared experts (``nn.Linear`` weights), its stacked
    routed experts where the dispatch is dropless (the capacity dispatch casts its own), an untied LM head."""
    attn = sum(v for k, v in attention_params(cfg).items() if not k.endswith(("norm", "bias")))
    dense = cfg.n_layers - cfg.n_moe_layers
    moe = moe_params(cfg) if cfg.n_moe_layers else {"gate": 0, "shared": 0, "routed": 0}
    routed = moe["routed"] if cfg.moe_dispatch == "dropless" else 0
    head = cfg.vocab_size * cfg.d_model if cfg.task == "lm" and not cfg.tie_embeddings else 0
    return (cfg.n_layers * attn + dense * ffn_params(cfg) + cfg.n_moe_layers * (moe["gate"] + moe["shared"] + routed)
            + head)


def _units(cfg: ModelConfig, inputs: MemoryInputs, *, autocast: bool, expert_parallel: bool,
           cast_once: bool = False) -> tuple[list[_Unit], float]:
    """The backward's stops (head, blocks L-1..0, embedding) and the loss gradient's bytes.

    Language model head: the final norm keeps its input (res·d) and output (the head matmul's input,
    a·d); of the cross-entropy over ``logits.float()`` autograd keeps only log_softmax's fp32 output
    (4·V per token: the 16-bit logits and their fp32 copy are freed when the forward returns). At the
    loss, NLL's gradient and log_softmax's gradient (fp32, 8·V per token) exist next to it
    (aten nll_loss_backward, _log_softmax_backward_data); at the head, the logits' gradient in the
    compute dtype (a·V) and the head weight's gradient before it reaches the engine (a·V·d).
    Under autocast (single, DDP: fp32 weights, 16-bit compute) every matmul saves the 16-bit copy of
    its weight that autocast made (torch autocast's weight cast cache), 2 bytes per matmul parameter,
    until its backward; FSDP2 and DeepSpeed compute with their own 16-bit parameters instead.
    ``cast_once`` (``train.weight_cast=step``): the copies of :func:`cast_once_params` are persistent
    (counted with the weights by the caller), not saved per unit; a capacity-dispatch MoE block's experts still are.
    """
    mixed = cfg.dtype != "fp32"
    res = a = cfg.dtype_bytes if mixed else 4  # 16-bit residual stream under mixed precision (see embed())
    tokens = inputs.micro_batch_size * inputs.seq_len
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    pc = param_counts(cfg)
    attn = attention_params(cfg)
    attn_total = sum(attn.values())
    attn_matmul = sum(v for k, v in attn.items() if not k.endswith("norm"))
    norms = pc["per_layer"]["norms"]
    moe = moe_params(cfg) if cfg.n_moe_layers else None
    copy = 2 if autocast and mixed else 0  # bytes of autocast's 16-bit weight copy per matmul parameter
    autocast_block = autocast and mixed and inputs.compiled and inputs.compile_scope == "block"
    layernorm_fp32 = autocast and mixed and not inputs.compiled and cfg.norm == "layernorm"
    ac = inputs.activation_checkpointing
    dense_layers = L - cfg.n_moe_layers
    blocks = []
    for i in reversed(range(L)):
        is_moe = i >= dense_layers
        ffn = moe["gate"] + moe["routed"] + moe["shared"] if is_moe else ffn_params(cfg)
        # the largest single tensor: a stacked expert weight (E·d·i_moe) or one FFN matrix
        largest = max(max(attn.values()), moe["routed"] // 3 if is_moe else ffn // (3 if cfg.ffn in ("swiglu", "moe") else 2))
        gathered = attn_total + norms + ffn - (moe["routed"] if is_moe and expert_parallel else 0)
        copied = (moe["routed"] if is_moe and cfg.moe_dispatch != "dropless" else 0) if cast_once else attn_matmul + ffn
        full = (tokens * _activation_bytes_per_token_per_layer(cfg, moe=is_moe, res=res, compiled=inputs.compiled,
                                                               autocast_block=autocast_block,
                                                               layernorm_fp32=layernorm_fp32) + copy * copied)
        ckpt = ac == "full" or (ac == "selective" and (i + 1) % inputs.selective_every == 0)
        blocks.append(_Unit(f"block {i}", attn_total + norms + ffn, largest, gathered,
                            saved=tokens * res * d if ckpt else full, live=full, temp=0.0, checkpointed=ckpt))
    final_norm = pc["final_norm"]
    if cfg.task == "lm":
        head_mm = V * d  # the LM head matmul (the embedding matrix when tied)
        head_params = head_mm + final_norm  # a tied matrix's gradient first appears here too
        norm_saved = tokens * ((4 if layernorm_fp32 else res) + a) * d  # its fp32 input copy under autocast
        head_copy = 0 if cast_once and not cfg.tie_embeddings else copy * head_mm
        # eager: log_softmax's fp32 output (4·V); compiled: the 16-bit logits and two fp32 row statistics
        # (max, log-sum-exp), log_softmax recomputed in the backward's one fused kernel
        whole = inputs.compiled and inputs.compile_scope in ("model", "module")
        # the logits made in the loss's own graph (not the output of an untied head's separate graph under
        # ZeRO-3's hooks) are an activation AOTAutograd can donate to the backward (below)
        donated = whole and (inputs.compile_scope == "model" or cfg.tie_embeddings)
        loss_saved = tokens * ((a * V + 8) if whole else 4 * V)
        head = _Unit("head", head_params, head_mm, head_params, saved=norm_saved + loss_saved + head_copy,
                     live=norm_saved + head_copy, temp=tokens * a * V + a * head_mm)
        emb_params = 0 if cfg.tie_embeddings else V * d
        # eager: NLL's and log_softmax's fp32 gradients (8·V); compiled: the logits' 16-bit gradient, made by
        # that fused kernel straight from the saved logits, into their own buffer where they are donated
        # (AOTAutograd donates saved activations to the compiled backward, torch._functorch.config.donated_buffer,
        # and Inductor reuses a donated buffer whose last reader writes a tensor of its size), else a new one
        loss_temp = (0 if donated else tokens * a * V) if whole else tokens * 8 * V
    else:  # regression: the head reads the last time step only
        head_params = pc["head"] + final_norm
        head = _Unit("head", head_params, pc["head"], head_params, saved=tokens * res * d * 3, live=0.0, temp=0.0)
        emb_params = pc["embedding"]
        loss_temp = 0.0
    # ALiBi: the (1, H, T, T) score bias in the compute dtype, built once a forward and saved by every block's
    # attention (one tensor): kept until the last block's backward
    bias = a * cfg.n_heads * inputs.seq_len ** 2 if position_kind(cfg).bias else 0.0
    embedding = _Unit("embedding", emb_params, emb_params, emb_params, saved=bias, live=0.0, temp=0.0)
    return [head, *blocks, embedding], loss_temp


def _timeline(units: list[_Unit], loss_temp: float, states: dict, grads_at, buffers_at,
              temp_at=None) -> tuple[dict, str]:
    """The backward's largest moment as components, and its name.

    ``grads_at(i, done)`` and ``buffers_at(i)`` give the engine's gradient and buffer bytes at stop
    ``i`` (-1: the loss) once ``done`` parameters have their gradients; ``temp_at(i, done)`` adds
    engine temporaries."""
    saved_from = [0.0] * (len(units) + 1)  # activations still kept at and below stop i
    for i in reversed(range(len(units))):
        saved_from[i] = saved_from[i + 1] + units[i].saved
    best, where, done = None, "", 0
    for i in range(-1, len(units)):
        if i < 0:
            act, temp = saved_from[0], loss_temp
        else:
            done += units[i].params
            act, temp = saved_from[i + 1] + units[i].live, units[i].temp
        extra = temp_at(i, done) if temp_at else 0.0
        comp = {**states, "gradients": grads_at(i, done), "activations": act, "buffers": buffers_at(i),
                "temporaries": temp + extra}
        if best is None or sum(comp.values()) > sum(best.values()):
            best, where = comp, ("loss" if i < 0 else units[i].name)
    return best, where


def _group_sizes(cfg: ModelConfig) -> tuple[int, int]:
    """Elements in scaletool's two AdamW groups (``engines.optim.param_groups``): decayed matrices and
    embeddings (dim >= 2), and the undecayed norms and biases."""
    pc = param_counts(cfg)
    small = pc["norms"]
    small += cfg.n_layers * sum(v for k, v in attention_params(cfg).items() if k.endswith(("norm", "bias")))
    if cfg.task == "regression":
        small += sum(cfg.group_widths) + 2 * cfg.d_model + cfg.horizon  # Linear biases, BatchNorm
    return pc["total"] - small, small
