"""Measured parameters and FLOPs, to set against the analytic model.

Two independent counters: ``FlopCounterMode`` (matmuls and SDPA at dispatch, forward and backward; we
register an SDPA formula that allows unequal head counts and d_qk != d_v) and fvcore (JIT-traced
forward, with an added SDPA handler, norms off, multiply-adds doubled to FLOPs). Both count every T²
score, so they compare with the analytic "full" convention. Decoding counts one step at position
seq_len - 1 per decode mode (:func:`decode_flops`). MoE counts the capacity dispatch's computed FLOPs.
On cpu or cuda, :func:`memory_check` refuses a count that would not fit before anything is built.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from scaletool.analytic.estimate import model_summary
from scaletool.analytic.flops import decode_flops_per_token, flops_per_token
from scaletool.analytic.memory import count_memory
from scaletool.analytic.params import param_counts
from scaletool.analytic.pipeline import peak_bytes
from scaletool.config import ModelConfig, Recipe
from scaletool.errors import RecipeError
from scaletool.fmt import gib
from scaletool.kinds.attention import attention_kind
from scaletool.measure.available import available_memory
from scaletool.measure.sdpa_flops import _flop_counter_mapping, _sdpa_fwd_flops
from scaletool.model import build_model
from scaletool.stats import rel_error
from scaletool.threads import pin_threads


def _example_inputs(recipe: Recipe, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    cfg, T = recipe.model, recipe.seq_len
    if cfg.task == "lm":
        x = torch.zeros(batch, T, dtype=torch.long, device=device)
        return x, x
    return (torch.zeros(batch, T, cfg.n_features, device=device),
            torch.zeros(batch, cfg.horizon, device=device))


def flop_counter_flops(model, recipe: Recipe, batch: int = 1, device="meta") -> dict:
    """Forward and forward+backward FLOPs of one batch, from FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    x, y = _example_inputs(recipe, batch, device)
    counter = FlopCounterMode(display=False, custom_mapping=_flop_counter_mapping())
    with counter:  # one pass: read the total after the forward, then again after the backward
        loss = model(x, y)
        forward = counter.get_total_flops()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return {"forward": forward, "train": counter.get_total_flops()}


def _fvcore_sdpa_handle(inputs: list, outputs: list) -> int:
    from fvcore.nn.jit_handles import get_shape

    q, k, v = (get_shape(t) for t in inputs[:3])
    return _sdpa_fwd_flops(q, k, v) // 2  # fvcore's unit: one multiply-add


def _no_flops(inputs: list, outputs: list) -> int:
    return 0


def fvcore_flops(model, recipe: Recipe, batch: int = 1, device="meta") -> dict:
    """Forward FLOPs from fvcore (multiply-adds × 2), with the per-operator breakdown."""
    from fvcore.nn import FlopCountAnalysis

    x, _ = _example_inputs(recipe, batch, device)
    # fvcore's tracer logs every op it has no handler for (norms, softmax...), and the JIT warns
    # about tracing data-dependent shapes; none of that changes the count.
    logging.getLogger("fvcore").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        fa = FlopCountAnalysis(model, (x,))
        fa.set_op_handle("aten::scaled_dot_product_attention", _fvcore_sdpa_handle)
        # norms are element-wise in the analytic convention (FlopCounterMode counts none); fvcore would add
        # 5 per element for LayerNorm (norm: layernorm) and BatchNorm (the regression embedding). A None
        # handle does not replace a default one in fvcore 0.1.5, so they count zero instead.
        fa.set_op_handle("aten::layer_norm", _no_flops, "aten::batch_norm", _no_flops)
        fa.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
        macs = fa.total()
        by_op = {k: 2 * v for k, v in fa.by_operator().items()}
    return {"forward": 2 * macs, "by_operator": by_op}


DEVICES = ("meta", "cpu", "cuda")


def check_device(device: str) -> None:
    """One RecipeError line for a device this machine cannot count on."""
    if device not in DEVICES:
        raise RecipeError(f"device {str(device)[:40]!r}: expected one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise RecipeError(f"device cuda: no CUDA device is visible here (torch {torch.__version__}, {build}); "
                          "count on cpu, or on meta, which allocates nothing")


#: headroom over the estimate before a count is refused: on a CPU the process grew 1.26x the estimate
#: (tiny recipe, batch 4000: 4.64 GiB of resident memory for 3.69 GiB estimated; the allocator keeps
#: freed blocks and kernels allocate workspaces the closed form does not count)
COUNT_MEMORY_HEADROOM = 1.3


def memory_check(recipe: Recipe, device: str, batch: int) -> dict | None:
    """What counting on ``device`` needs (weights, gradients, activations at ``batch``), refused with the
    figures when it (with :data:`COUNT_MEMORY_HEADROOM`) exceeds what is available; None on meta."""
    if device == "meta":
        return None
    need = count_memory(recipe.model, batch, recipe.seq_len)
    avail, source = available_memory(device)
    parts = {k: v for k, v in need.items() if k != "total_bytes"}
    if avail is not None and need["total_bytes"] * COUNT_MEMORY_HEADROOM > avail:
        shown = ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if v)
        raise RecipeError(f"counting on {device} at batch {batch} needs about {gib(need['total_bytes'])} ({shown}; "
                          f"{COUNT_MEMORY_HEADROOM:g}x that to be safe), but {gib(avail)} is available ({source}); "
                          "lower the batch, or count on meta, which allocates nothing")
    return {"required_bytes": need["total_bytes"], "components": parts, "available_bytes": avail,
            "available_source": source}


def count(recipe: Recipe, *, device: str = "meta", batch: int = 1, fvcore: bool = True,
          module_depth: int | None = -1, progress=None) -> dict:
    """Build the model (on ``meta`` unless told otherwise) and measure it against the analytic model.

    On cpu or cuda the memory the count needs is estimated first (:func:`memory_check`) and a count
    that would not fit is refused before anything is allocated. Returns the ``count`` result's
    document (:class:`scaletool.results.count.CountResult`). ``module_depth`` other than -1 adds the
    per-module tree (``modules``, :mod:`scaletool.measure.count_modules`) cut below that depth (None: all).
    ``progress(done, total, description)`` hears of each stage (building, each counter, the module tree)."""
    check_device(device)
    memory = memory_check(recipe, device, batch)
    if device == "cpu":  # its share of the cores, never torch's default of all of them
        pin_threads()
    cfg, T = recipe.model, recipe.seq_len
    stages = ["building the model", "FlopCounterMode: forward and backward"]
    stages += ["fvcore: tracing the forward"] if fvcore else []
    stages += ["FlopCounterMode: one decoded token per decode mode"] if cfg.task == "lm" else []
    stages += ["FlopCounterMode: FLOPs per module"] if module_depth != -1 else []
    say = _stages(progress, stages, f"count on {device}")
    say("building the model")
    model = build_model(cfg, device, seed=recipe.train.seed, sdpa_backend=recipe.train.sdpa_backend)
    # meta tensors carry no data, but dropout would still draw masks on a real device
    model.train(device == "meta")
    n_measured = model.num_params()
    exact = param_counts(cfg)
    tokens = batch * T
    per_tok = flops_per_token(cfg, T, tokens=tokens)  # one MoE dispatch per forward: batch·T tokens

    out: dict[str, Any] = {
        "device": device, "batch": batch, "seq_len": T, "model": model_summary(cfg), "memory": memory,
        # estimate's parameter breakdown under its own keys, and what the built module holds
        "params": {**exact, "measured": n_measured, "rel_error": rel_error(n_measured, exact["total"]),
                   "by_module": _params_by_module(model)},
    }
    out["flops"] = _flops(model, recipe, batch, device, per_tok, fvcore, say)
    if module_depth != -1:
        from scaletool.measure.count_modules import module_tree

        say("FlopCounterMode: FLOPs per module")
        x, y = _example_inputs(recipe, batch, device)
        out["modules"] = module_tree(model, recipe, x, y, depth=module_depth)
    say(None)
    return out


def _stages(progress, stages: list[str], name: str):
    """``say(stage)`` reports ``stage`` (None: all done) to ``progress`` as ``[k/n] name: stage``."""
    def say(stage: str | None) -> None:
        if progress is None:
            return
        if stage is None:
            progress(len(stages), len(stages), f"{name}: done")
            return
        k = stages.index(stage)
        progress(k, len(stages), f"[{k + 1}/{len(stages)}] {name}: {stage}")
    return say


def _flops(model, recipe: Recipe, batch: int, device: str, per_tok: dict, fvcore: bool, say=None) -> dict:
    """Both counters against the closed forms for one batch of ``batch`` sequences, with notes."""
    cfg, T = recipe.model, recipe.seq_len
    tokens = batch * T
    say = say or (lambda stage: None)
    say("FlopCounterMode: forward and backward")
    fc = flop_counter_flops(model, recipe, batch, device)
    analytic_fwd_full = per_tok["forward_full_computed"] * tokens
    analytic_train_full = per_tok["train_full_computed"] * tokens
    flops: dict[str, Any] = {
        "tokens": tokens,
        "per_token": per_tok,
        "analytic": {
            "forward_full": analytic_fwd_full, "train_full": analytic_train_full,
            "forward_causal": per_tok["forward_causal"] * tokens,
            "train_causal": per_tok["train_causal"] * tokens,
            "train_6N": per_tok["dense_6N"] * tokens,
        },
        "flop_counter": {
            "forward": fc["forward"], "train": fc["train"],
            "forward_rel_error": rel_error(fc["forward"], analytic_fwd_full),
            "train_rel_error": rel_error(fc["train"], analytic_train_full),
        },
    }
    if fvcore:
        say("fvcore: tracing the forward")
        fv = fvcore_flops(model, recipe, batch, device)
        flops["fvcore"] = {"forward": fv["forward"], "forward_rel_error": rel_error(fv["forward"], analytic_fwd_full),
                           "by_operator": fv["by_operator"]}
    causal_gap = rel_error(per_tok["train_causal"] * tokens, analytic_train_full)
    flops["notes"] = [
        "fvcore and FlopCounterMode count all T² attention scores; they are compared with the analytic "
        "'full' convention.",
        f"The causal convention (MFU) counts half the attention scores: {100 * causal_gap:+.2f}% "
        f"against the measured training FLOPs at seq_len {T}.",
        f"6·N·T alone (no attention term) is {100 * rel_error(per_tok['dense_6N'], per_tok['train_full']):+.2f}% "
        "off the full training count.",
    ]
    if "moe" in per_tok:
        mo = per_tok["moe"]
        flops["analytic"]["train_full_useful"] = per_tok["train_full"] * tokens
        if cfg.moe_dispatch == "dropless":
            flops["notes"].append(f"MoE: the dropless dispatch computes exactly the {cfg.num_experts_per_tok} useful "
                                  "routed experts per token: computed training FLOPs are the useful ones (MFU).")
        else:
            flops["notes"].append(
                f"MoE: the capacity dispatch computes {mo['routed_experts_per_token_computed']:.3g} routed experts per "
                f"token (capacity_factor {cfg.capacity_factor}, {tokens} tokens per dispatch); {cfg.num_experts_per_tok} "
                f"are useful. The useful training FLOPs (the MFU convention) are "
                f"{100 * rel_error(per_tok['train_full'], per_tok['train_full_computed']):+.2f}% off the computed ones.")
    if cfg.task == "regression":
        flops["notes"].append("regression: the first feature Linear needs no input gradient, so measured "
                              "training FLOPs sit slightly under 3 × forward.")
    else:
        say("FlopCounterMode: one decoded token per decode mode")
        flops["decode"] = decode_flops(model, cfg, recipe.seq_len, device)
    return flops


def decode_flops(model, cfg: ModelConfig, context: int, device="meta") -> dict[str, dict]:
    """FlopCounterMode's FLOPs for one decoded token (a batch-1 step at position context - 1 over ``context``
    cached positions) in every decode mode of the attention kind, by decode label, against the closed form.

    Absorbed MLA runs its torch reference here (the Triton kernel's work is the same arithmetic, but a
    FLOP counter sees no matmul inside it); caches are allocated on ``device`` (nothing on meta)."""
    from torch.utils.flop_counter import FlopCounterMode

    from scaletool.model.attention import DecodeMode
    from scaletool.model.cache import make_caches

    dtype = next(model.parameters()).dtype
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()  # decoding: no dropout, MoE routing without its training statistics
    out = {}
    try:
        for mode in attention_kind(cfg).decode_modes(cfg) or (None,):
            caches = make_caches(cfg, 1, context, dtype=dtype, device=device, mla_mode=mode)
            counter = FlopCounterMode(display=False, custom_mapping=_flop_counter_mapping())
            with counter:
                model.step(token, context - 1, caches, DecodeMode(mode, "torch"))
            want = decode_flops_per_token(cfg, context, mode)
            got = counter.get_total_flops()
            out[want["label"]] = {"mode": mode, "context": context, "analytic": want["total"], "flop_counter": got,
                                  "rel_error": rel_error(got, want["total"])}
    finally:
        model.train(was_training)
    return out


def _params_by_module(model) -> dict[str, int]:
    """Parameters per top-level component, layers summed."""
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        key = ".".join(["layers", *parts[2:-1]]) if parts[0] == "layers" else parts[0]
        out[key] = out.get(key, 0) + p.numel()
    return out



def train_memory_check(recipe: Recipe, nproc: int) -> dict | None:
    """Refuse, with the estimate and the budget, a training run of ``nproc`` local ranks that cannot fit.

    The estimate is the analytic peak per rank of the recipe's layout (``analytic.pipeline.peak_bytes``, the
    figure ``estimate`` and ``plan`` give: the engine's count, or a pipeline's largest stage), with the
    activations a compiled model saves where ``train.compile`` is on (fewer than eager's: a compiled mha-1b
    step at micro-batch 24 fits an 80 GB card that the eager estimate would refuse it). On CPU all ranks share this machine's
    memory (``nproc`` times the estimate against :func:`available_memory`); on CUDA each rank has its
    own GPU, whose free memory must hold one rank's share. Unknown memory: no check (None).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        per_rank = int(peak_bytes(recipe, nproc))  # the figure estimate and plan give (a pipeline's largest stage)
    except (RecipeError, ValueError, ZeroDivisionError, OverflowError):
        return None  # the run's own checks say what is wrong with the recipe
    if device == "cpu":
        need, (avail, source) = per_rank * nproc, available_memory("cpu")
        where = f"{nproc} CPU ranks" if nproc > 1 else "this CPU process"
    else:
        gpus = range(min(nproc, torch.cuda.device_count()))
        need = per_rank
        avail, source = min((torch.cuda.mem_get_info(i)[0] for i in gpus), default=None), \
            "free memory of the GPU (torch.cuda.mem_get_info)"
        where = "each GPU rank"
    if avail is not None and need > avail:
        t = recipe.train
        raise RecipeError(f"training needs about {gib(need)} for {where} (analytic estimate for parallel.engine="
                          f"{recipe.parallel.engine}{', compiled' if t.compile else ''}, micro_batch_size "
                          f"{t.micro_batch_size} x seq_len {recipe.seq_len}), but {gib(avail)} is available "
                          f"({source}); lower train.micro_batch_size or the model size, or set "
                          "train.activation_checkpointing")
    return {"required_bytes": need, "available_bytes": avail, "available_source": source}
