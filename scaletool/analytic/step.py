"""Step time: a recipe's layout at a calibration's rates, every term shown.

Per micro-batch on one rank: every GEMM at the calibrated rate for its shape (forward; backward is
twice the forward's FLOPs at the same shape class), causal fused attention at the kernel's rate,
recomputation under activation checkpointing, element-wise traffic (a calibrated factor times the
bytes eager autograd saves, plus the logits) at HBM bandwidth. Per step: the optimizer's bytes
(fused AdamW + clipping, 40 B per fp32 parameter on the rank), gradient accumulation's adds, each
collective of :func:`~scaletool.analytic.comm.communication` at the calibrated bus bandwidth with an
exposure model per engine, and the host overheads. Torch-free, IO-free (the calibration is passed in).
"""
from __future__ import annotations

from scaletool.analytic import expert_parallel as ep_analytic
from scaletool.analytic.calibration import FP8_OVER_BF16, Calibration
from scaletool.analytic.comm import collective_group, communication, tensor_parallel_config
from scaletool.analytic.engine_step import EngineStepTerms, StepContext
from scaletool.analytic.engines import kind_with_forms
from scaletool.analytic.float8 import CAST_BYTES_PER_ELEMENT, fp8_gemm, swapped_shapes
from scaletool.analytic.float8 import cast_bytes as fp8_cast_bytes
from scaletool.analytic.flops import attention_flops_per_token, flops_per_token, gemm_shapes
from scaletool.analytic.host import eager_dispatch_s, tp_overhead_key, tp_step_dispatch_s
from scaletool.analytic.memory import compile_scope
from scaletool.analytic.network import group_seconds, per_node_of
from scaletool.analytic.params import param_counts
from scaletool.analytic.timeline import _activation_bytes_per_token_per_layer, cast_once_params
from scaletool.config import ModelConfig, Recipe
from scaletool.kinds.attention import position_kind
from scaletool.kinds.engines import EngineKind, casts_once

OPTIMIZER_BYTES_PER_PARAM = 40  # fused AdamW on fp32 (read p, g, m, v; write p, m, v) + clipping (norm, scale)
ACCUMULATE_BYTES_PER_PARAM = 8  # an accumulated micro-batch: read and write the fp32 gradient
CAST_BYTES_PER_PARAM = 6  # fp32 weight read, 16-bit copy written, per micro-batch (autocast, FSDP2's cast)
#: the model's median |error| in tokens/s per GPU over the committed dense bf16 GPU runs (`scaletool calibrate
#: --validate`; README and docs/prediction.md state it, tests/cli/test_one_answer_80_columns.py keeps it in step):
#: predictions closer than this do not settle which layout is faster
MEDIAN_ABS_ERROR = 0.028


#: What the step model says of a compile scope (memory.compile_scope) beside its figures
SCOPE_NOTES = {
    "module": ["DeepSpeed ZeRO-3 under engine.compile predicted as eager: its parameter-gathering hooks run eagerly "
               "(mla-1b on 4 H200s ran 1.8% faster than eager, FSDP2 and DDP 12%)"],
    "block": ["each block compiled alone: the embedding, the output head and the loss run eager (their logits' "
              "element-wise traffic at the eager factor)"],
}


def _compute(local: ModelConfig, cfg: ModelConfig, kind: EngineKind, tokens: int, T: int, ac: str, every: int,
             compiled: bool, calib: Calibration, float8: str = "none", cast_once: int = 0,
             head_eager: bool = False) -> dict:
    """Seconds of one micro-batch on one rank: GEMMs (train.float8: the swapped ones at the FP8 rate, plus
    their casts' traffic), attention, element-wise traffic, recomputation. ``cast_once``: matmul parameters
    whose 16-bit copy is made once per step instead (train.weight_cast=step; the caller counts that cast).
    ``head_eager``: the blocks compiled but the head and the loss not (compile scope ``block``,
    :func:`scaletool.analytic.memory.compile_scope`): the logits' element-wise traffic at the eager factor."""
    L = local.n_layers
    shapes = gemm_shapes(local, tokens)
    heads = ("lm_head", "head")

    elem = 4 if local.dtype == "fp32" else 2

    def rate(name, m, n, k):
        if float8 != "none" and fp8_gemm(name, n, k):
            return calib.gemm_rate_fp8(m, n, k)
        # a dimension off 16 bytes (GPT-2's 50,257-token head): eager cuBLAS leaves its fast kernels, Inductor pads
        return calib.gemm_rate(m, n, k) * calib.unaligned_factor(m, n, k, compiled and not (head_eager and name in heads),
                                                                 elem)

    fwd_blocks = sum(2 * m * n * k * c / rate(name, m, n, k) for name, m, n, k, c in shapes if name not in heads)
    fwd_head = sum(2 * m * n * k * c / rate(name, m, n, k) for name, m, n, k, c in shapes if name in heads)
    att_flops = attention_flops_per_token(local, T, causal=cfg.task == "lm") * tokens
    # ALiBi: SDPA handed the dense score bias (the causal mask folded in) runs a bias kernel over the whole T x T,
    # its rate in the causal convention (twice that over a non-causal encoder's full scores)
    bias = position_kind(cfg).bias
    att_rate = calib.attention_rate(local.qk_head_dim, local.v_dim, T, bias=bias) * (2 if bias and cfg.task != "lm" else 1)
    frac = 1.0 if ac == "full" else ((L // every) / L if ac == "selective" else 0.0)
    dense, moe = L - local.n_moe_layers, local.n_moe_layers
    act = (dense * _activation_bytes_per_token_per_layer(local)
           + (moe * _activation_bytes_per_token_per_layer(local, moe=True) if moe else 0)) / L
    hbm = calib.hbm_gb_s * 1e9
    factor = calib.elementwise["compiled_bytes_factor" if compiled else "eager_bytes_factor"]
    head_factor = calib.elementwise["eager_bytes_factor"] if head_eager else factor
    V = local.vocab_size if cfg.task == "lm" else 0
    weights = sum(n * k * c for _, m, n, k, c in shapes)  # this rank's matmul weights (every routed expert)
    casts = CAST_BYTES_PER_PARAM * (weights - cast_once) if kind.casts_weights else 0.0
    if float8 != "none":
        casts += fp8_cast_bytes(shapes, rowwise=float8 == "rowwise")
    elementwise = (factor * tokens * L * act + head_factor * tokens * 4 * V + casts) / hbm
    fwd_share = 1 / 3  # the forward's share of element-wise work, recomputed with the forward
    recompute = frac * (fwd_blocks + att_flops / att_rate + fwd_share * factor * tokens * L * act / hbm)
    return {"gemm_forward": fwd_blocks + fwd_head, "gemm_backward": 2 * (fwd_blocks + fwd_head),
            "attention": 3 * att_flops / att_rate, "elementwise": elementwise, "recompute": recompute,
            "recompute_fraction": frac, "att_rate": att_rate, "factor": factor, "bias": bias}


def _communication(recipe: Recipe, local: ModelConfig, N: int, tp: int, G: int, c: dict, gas: int,
                   calib: Calibration) -> tuple[dict, float, EngineStepTerms, list[str]]:
    """Each collective's total seconds, the exposed TP seconds, the engine's own step terms (its exposed
    data-parallel seconds, host and device work: :mod:`scaletool.analytic.engine_step`) and the assumptions (each
    collective over its group's nodes: :mod:`scaletool.analytic.network`)."""
    dp = N // tp
    rows = communication(recipe, N, tp)["collectives"] if N > 1 else []
    times, totals, notes = [], {}, []
    for r in rows:
        ranks, stride = collective_group(r["group"], N, tp, recipe.parallel.data_parallel_replicate)
        ranks = r.get("ranks", ranks)  # expert parallelism: its group's ranks (consecutive data-parallel ranks)
        times.append(group_seconds(calib, r["op"], r["message_bytes"], ranks, per_node_of(ranks, stride, G),
                                   r["count"])["seconds"])
        key = f"comm/{r['group']}.{r['op']}_total_s"
        totals[key] = totals.get(key, 0.0) + times[-1]
    tp_exposed = sum(x for r, x in zip(rows, times) if r["group"] == "tp")
    if tp_exposed:
        notes.append("tensor parallelism: every collective on the critical path (no overlap)")
    dp_rows = [(r, x) for r, x in zip(rows, times) if r["group"] != "tp"]  # HSDP's dp_replicate rows too
    fwd = c["gemm_forward"] + c["attention"] / 3 + c["elementwise"] / 3
    bwd = c["gemm_backward"] + 2 * c["attention"] / 3 + c["recompute"]
    ctx = StepContext(recipe, local, dp, gas, [r for r, _ in dp_rows], [x for _, x in dp_rows], fwd, bwd, calib)
    own = kind_with_forms(recipe.parallel.engine).part("step")(ctx)
    notes += own.notes if dp_rows or own.host_s or own.device_s else []
    return totals, tp_exposed, own, notes


def _tp_dispatch(local: ModelConfig, tp: int, gas: int, compiled: bool, async_tp: bool, calib: Calibration,
                 pure: bool = False) -> float:
    """Host seconds per step to issue a tensor-parallel step: every op on a DTensor goes through its
    dispatcher (placements, redistributes) on the CPU, about ten times a plain tensor's cost. The CPU
    runs ahead of the GPU, so this bounds the step only when it exceeds the device's work (1B models at
    8 sequences per rank: yes; Llama-3-8B layers at T=8192: no). Per block, by attention family (MLA's
    latent path has more ops) and mode (per-block compile fuses the element-wise ones away). Calibrated with
    FSDP2 over the one-rank data mesh; ``pure`` (tensor parallelism over every rank, which now runs without
    FSDP2) takes those hooks' share per block off. Where the calibration holds its host's measured step parts
    (``scaletool calibrate --gpus 2 --recipe R``: TP over every rank, :func:`scaletool.analytic.host.tp_step_dispatch_s`)
    those stand instead, FSDP2's hooks added per block and micro-batch where data-parallel ranks shard."""
    if tp == 1:
        return 0.0
    ov = calib.overheads
    mode = "compiled" if compiled else "eager"
    measured = tp_step_dispatch_s(local.n_layers, gas, mode, local.attention, calib)
    if measured is not None:
        return measured + (0.0 if pure else gas * local.n_layers * ov.get("tp_fsdp1_hooks_block_s", 0.0))
    key = f"tp_{mode}_block{'_mla' if local.attention == 'mla' else ''}_s"
    per_block = ov.get(key, ov.get(f"tp_{mode}_block_s", 0.0))
    if pure:
        per_block = max(0.0, per_block - ov.get("tp_fsdp1_hooks_block_s", 0.0))
    return gas * per_block * local.n_layers


def tp_microbatch_dispatch(local: ModelConfig, compiled: bool, calib: Calibration) -> float | None:
    """Host seconds to issue one micro-batch of ``local``'s tensor-parallel blocks, from the per-block issue time
    ``scaletool calibrate`` measures on its host (:mod:`scaletool.predict.calibrate_tp`: the blocks alone, no head,
    loss or optimizer); None where the calibration has no such measurement (the fitted whole-step figure,
    :func:`_tp_dispatch`, stands then)."""
    per_block = calib.overheads.get(tp_overhead_key("compiled" if compiled else "eager", local.attention))
    return None if per_block is None else per_block * local.n_layers


def _flops(cfg: ModelConfig, T: int, tokens: int, global_tokens: int, frac: float) -> tuple[float, float]:
    """Model FLOPs (causal convention) and hardware FLOPs (computed, recomputation included) per step."""
    fl = flops_per_token(cfg, T, tokens=tokens)
    conv = fl["convention"]
    head = 2 * cfg.d_model * cfg.vocab_size if cfg.task == "lm" else 0
    recompute = frac * (fl[f"forward_{conv}_computed"] - head) * global_tokens
    return fl["train"] * global_tokens, fl[f"train_{conv}_computed"] * global_tokens + recompute


def _option_notes(recipe: Recipe, local: ModelConfig, tokens: int, cast_once: int, dispatch: float, compiled: bool,
                  N: int, G: int, calib: Calibration, eager: float = 0.0) -> list[str]:
    """The assumptions that only some recipes' options add: FP8, casts once per step, tensor parallelism's
    host dispatch, eager blocks' issue time, several nodes."""
    t, p, kind = recipe.train, recipe.parallel, kind_with_forms(recipe.parallel.engine)
    gas, tp = t.grad_accum_steps, p.tensor_parallel if kind.distributed else 1
    assumptions: list[str] = []
    if t.float8 != "none":
        n8 = len(swapped_shapes(gemm_shapes(local, tokens)))
        fp8 = calib.gemm_fp8_tflops
        assumptions.append(
            f"float8 {t.float8}: {n8} GEMM shapes of the blocks at the FP8 rate ("
            + (f"calibrated, {fp8['max_tflops']:.0f} TFLOP/s x s/(s+{fp8['half_dim']:.0f})" if fp8 else
               f"not calibrated: {FP8_OVER_BF16:g} x the bf16 curve, the datasheet FP8/bf16 ratio")
            + f"), their FP8 casts' traffic ({CAST_BYTES_PER_ELEMENT} B per operand element) at HBM bandwidth; "
            "heads and router in bf16" + ("; FSDP2's FP8 all-gather (half the gathered bytes) not modelled in the "
                                          "collectives" if kind.float8_all_gather and t.float8 == "tensorwise" else ""))
    if cast_once:
        assumptions.append(f"train.weight_cast=step: {cast_once / 1e6:,.0f} M linear parameters cast to 16 bits once "
                           f"per optimizer step ({CAST_BYTES_PER_PARAM} B each), not at each of the {gas} micro-batches")
    if dispatch:
        assumptions.append(f"tensor parallelism: {dispatch / gas / local.n_layers * 1e3:.1f} ms of host dispatch "
                           f"per block ({'compiled' if compiled else 'eager'}), overlapped with the device's work; "
                           "the step is the larger of the two" + ("; async TP not modelled" if p.async_tp else "")
                           + ("; measured for the DTensor plan: parallel.tp_local_ops (far fewer DTensor ops) "
                              "not modelled" if p.tp_local_ops else "")
                           + ("; pure tensor parallelism (no FSDP2): FSDP2's per-block hooks taken off"
                              if p.pure_tensor_parallel(N, tp) else ""))
    if eager:
        assumptions.append(f"eager: {eager / gas / local.n_layers * 1e3:.2f} ms of host issue time per block and "
                           "micro-batch (calibrated, analytic.host), overlapped with the device's work; the step is "
                           "the larger of the two")
    if N > G:
        c = calib.collectives
        assumptions.append(f"{G} GPUs per node; collectives across nodes at {c['inter_node_gb_s']:g} GB/s bus bandwidth "
                           f"per GPU ({c.get('inter_node_source', 'assumed, not measured')}), NCCL's ring or "
                           "hierarchical algorithm, whichever is faster, each collective with its fixed cost as "
                           "NCCL's tuner counts it (a ring step 3.4 us over NVLink, 14 us across nodes; analytic.network)")
    return assumptions


def predict_step(recipe: Recipe, calib: Calibration, *, world_size: int | None = None,
                 gpus_per_node: int | None = None, compiled: bool | None = None) -> dict:
    """Predicted step time of the recipe's own layout on ``world_size`` GPUs (default: the recipe's),
    ``gpus_per_node`` of them per node (default: all on one node up to 8). ``compiled`` None reads
    ``train.compile``. Returns terms (seconds per optimizer step), step_s, tokens/s, MFU, HFU, the
    bound and the assumptions, JSON-ready."""
    cfg, t, p = recipe.model, recipe.train, recipe.parallel
    engine, kind = p.engine, kind_with_forms(p.engine)
    N = kind.ranks(world_size or p.world_size)
    tp = p.tensor_parallel if kind.distributed else 1
    if N % tp:
        raise ValueError(f"tensor_parallel={tp} does not divide world_size={N}")
    dp, G = N // tp, gpus_per_node or min(N, 8)
    # what runs compiled: memory.compile_scope, the rule the memory estimate reads (SCOPE_NOTES)
    scope = compile_scope(p.engine, t.compile if compiled is None else compiled, t.compile_scope, p.zero_stage)
    compiled = scope in ("model", "block")
    B, T, gas, ac = t.micro_batch_size, recipe.seq_len, t.grad_accum_steps, t.activation_checkpointing
    tokens = B * T
    local = tensor_parallel_config(cfg, tp)
    cast_once = cast_once_params(local) if t.weight_cast == "step" and casts_once(engine, cfg.dtype, t.float8) else 0
    c = _compute(local, cfg, kind, tokens, T, ac, t.selective_every, compiled, calib, t.float8, cast_once,
                 head_eager=scope == "block")
    hbm = calib.hbm_gb_s * 1e9
    psi = param_counts(local)["total"]
    sharded_states, sharded_grads = kind.shards_optimizer(p.zero_stage), kind.shards_gradients(p.zero_stage)
    optimizer = OPTIMIZER_BYTES_PER_PARAM * (psi / dp if sharded_states else psi) / hbm
    accumulate = ACCUMULATE_BYTES_PER_PARAM * (psi / dp if sharded_grads else psi) * (gas - 1) / hbm
    totals, tp_exposed, own, notes = _communication(recipe, local, N, tp, G, c, gas, calib)
    ov = calib.overheads
    host = ov.get("step_s", 0.0) + gas * ov.get("micro_batch_s", 0.0) + own.host_s
    dp_exposed = own.exposed_s
    compute_terms = {"gemm_forward_s": gas * c["gemm_forward"], "gemm_backward_s": gas * c["gemm_backward"],
                     "attention_s": gas * c["attention"], "recompute_s": gas * c["recompute"]}
    per_step_casts = CAST_BYTES_PER_PARAM * cast_once / hbm  # train.weight_cast=step: once per optimizer step
    memory_terms = {"elementwise_s": gas * c["elementwise"] + per_step_casts, "optimizer_s": optimizer,
                    "grad_accumulation_s": accumulate, "engine_copies_s": own.device_s}
    exposed = tp_exposed + dp_exposed
    # --- expert parallelism (scaletool.analytic.expert_parallel): the busiest rank's extra expert GEMMs and
    # the dropless split sizes' host reads; its all-to-alls are among the data-parallel rows above
    ep_terms, ep_notes = ep_analytic.predicted_terms(recipe, dp, tokens, c["recompute_fraction"], calib)
    exposed += sum(ep_terms.values())
    # --- end expert parallelism
    device = sum(compute_terms.values()) + sum(memory_terms.values()) + exposed + host
    dispatch = _tp_dispatch(local, tp, gas, compiled, p.async_tp, calib, pure=p.pure_tensor_parallel(N, tp))
    # eager blocks issued from Python (analytic.host); tensor parallelism's fitted dispatch already counts them
    eager = 0.0 if tp > 1 else eager_dispatch_s(local, range(local.n_layers), gas, kind.autocast, compiled, calib)
    step = max(device, dispatch + eager + host)
    terms = {**compute_terms, **memory_terms, "comm/tp_exposed_s": tp_exposed, "comm/dp_exposed_s": dp_exposed,
             **totals, **ep_terms, "host_overhead_s": host, "tp_dispatch_s": dispatch, "eager_dispatch_s": eager}
    bounds = {"compute": sum(compute_terms.values()), "memory bandwidth": sum(memory_terms.values()),
              "exposed communication": exposed, "host dispatch (tensor parallelism)": dispatch,
              "host dispatch (eager)": eager + host if eager and eager + dispatch + host > device else 0.0}
    global_tokens = tokens * gas * dp
    model_flops, hw_flops = _flops(cfg, T, tokens, global_tokens, c["recompute_fraction"])
    peak = calib.peak_tflops * 1e12
    g = calib.gemm_tflops
    assumptions = notes + [
        f"GEMM rate {g['max_tflops']:.0f} TFLOP/s x s/(s+{g['half_dim']:.0f}), s the smallest GEMM dimension; "
        "backward = 2 x forward at the same shapes",
        f"attention {c['att_rate'] / 1e12:.0f} TFLOP/s (fused SDPA forward + backward, head dims "
        f"{local.qk_head_dim}/{local.v_dim}, T={T:,}" + (", ALiBi's dense score bias path" if c["bias"] else "") + ")",
        f"element-wise traffic {c['factor']:g} x eager saved activations + logits at {calib.hbm_gb_s:.0f} GB/s "
        f"({'compiled' if compiled else 'eager'})",
        f"optimizer {OPTIMIZER_BYTES_PER_PARAM} B per fp32 parameter on the rank (fused AdamW + clipping)",
    ]
    assumptions += _option_notes(recipe, local, tokens, cast_once, dispatch, compiled, N, G, calib, eager) + ep_notes
    assumptions += SCOPE_NOTES.get(scope, [])
    return {
        "engine": engine, "world_size": N, "tensor_parallel": tp, "data_parallel": dp, "gpus_per_node": G,
        "compiled": bool(compiled), "micro_batch_size": B, "grad_accum_steps": gas, "seq_len": T,
        "activation_checkpointing": ac, "terms": {k: float(v) for k, v in terms.items()}, "step_s": step,
        "tokens_per_step": global_tokens, "tokens_per_s": global_tokens / step,
        "tokens_per_s_per_gpu": global_tokens / step / N, "mfu": model_flops / (step * N * peak),
        "hfu": hw_flops / (step * N * peak), "bound": max(bounds, key=bounds.get),
        "calibration": calib.source, "calibration_name": calib.name, "assumptions": assumptions,
    }


#: What the allocator needs beyond the estimate's live tensors: the caching allocator's fragmentation
#: and block rounding, the CUDA context and library workspaces that ``mem_get_info`` counts as used.
#: Measured on an 80 GB H100: mha-1b at micro-batch 20 eager is estimated at 74.8 GiB, under the
#: 79.2 GiB the card reports, and runs out of memory (micro-batch 16 fits).
ALLOCATOR_RESERVE_FRACTION = 0.08
ALLOCATOR_RESERVE_MIN_BYTES = 2 * 2**30


def fits(total_bytes: float, card_bytes: float) -> tuple[bool, float]:
    """Whether an estimated peak of ``total_bytes`` fits a card of ``card_bytes`` (what the card reports),
    keeping the allocator's reserve: (fits, margin_bytes), the margin negative by how much it does not."""
    reserve = max(ALLOCATOR_RESERVE_FRACTION * card_bytes, ALLOCATOR_RESERVE_MIN_BYTES)
    margin = card_bytes - reserve - total_bytes
    return margin >= 0, margin
