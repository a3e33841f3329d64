"""torchtitan beside scaletool: the same shapes, settings, data and card, in one process.

Usage (from the repository root; torchrun for N GPUs, FSDP2 over all of them)::

    python benchmarks/scripts/peers/torchtitan_train.py recipes/mha-1b.yaml --out peer-mha-1b.json
    torchrun --nproc-per-node 4 benchmarks/scripts/peers/torchtitan_train.py recipes/mla-1b.yaml --out x4.json
    python benchmarks/scripts/peers/torchtitan_train.py recipes/mla-1b.yaml --dry-run   # CPU: mapping, counts
    torchrun --nproc-per-node 2 benchmarks/scripts/peers/torchtitan_train.py recipes/mha-1b.yaml --tp 2 --out tp2.json
    python benchmarks/scripts/peers/torchtitan_train.py recipes/mla-1b.yaml --tp 2 --dry-run  # CPU: per-rank shares

What runs, in this order, each on the same pre-drawn synthetic token batches:

1. **torchtitan** (0.3.0): its own model classes built from its own config builders at exactly the
   recipe's shapes (mha/gqa/mqa -> ``Llama3Model``; mla -> ``DeepSeekV3Model`` with every layer
   dense, no MoE, no multi-token prediction), on the meta device; its FLOP count
   (``get_nparams_and_flops``); its own ``parallelize_llama`` / ``parallelize_deepseekv3`` (per-block
   ``torch.compile``, FSDP2 with bf16 parameters and fp32 gradient reduction, activation
   checkpointing off); ``init_weights``; then the step its ``Trainer.train_step`` takes: FlexAttention
   (torchtitan's default backend) with its block-causal mask from positions (one document per
   sequence, so built once; the trainer rebuilds it per batch for packed documents), the compiled sum
   cross-entropy over the global token count, backward, its ``clip_grad_norm_`` (max norm = the
   recipe's ``train.grad_clip``), fused AdamW. By default the forward-backward is captured in a CUDA
   graph, as torchtitan's trainer does (``--no-cuda-graphs`` turns it off).
2. **scaletool** with the same settings: ``parallel.engine=fsdp`` (FSDP2, bf16 params, fp32
   reduce), ``train.compile_scope=block``, checkpointing off, the same clip and fused AdamW, built
   with :func:`scaletool.engines.make_engine` and driven by the same timed loop.
   ``--also-recipe`` adds scaletool with the recipe's own settings (on one GPU: engine single,
   whole-model compile), its best figure.

Each step is timed with CUDA events, read after the loop (no sync inside it); on several ranks a
step takes the slowest rank's time. Warm-up (compilation, CUDA-graph capture, autotuning) is
excluded by :func:`scaletool.stats.settled_start`; figures are the median with p10/p90 and n.
tokens/s per GPU = micro-batch × seq_len / step time. MFU under both conventions, against the
card's peak from scaletool's hardware profiles: scaletool's (``analytic.flops_per_token``: 6 × matmul
parameters + causal attention, with the full-attention figure beside it) and torchtitan's
(``get_nparams_and_flops``: 6 × non-embedding parameters + 6·L·H·(d_qk + d_v)·T, full attention).
Peak memory is ``torch.cuda.max_memory_allocated`` (max over ranks), reset between the runs.

``--tp N`` (N divides the world size): tensor parallelism over groups of N ranks, FSDP2 over the rest, on
both sides. torchtitan: its own sharding plan (``set_llama3_sharding_config`` /
``set_deepseek_v3_sharding_config`` with sequence parallelism, its default) applied by the same
``parallelize_llama`` / ``parallelize_deepseekv3`` (``Module.parallelize`` before compile and FSDP2), the
head's vocabulary-sharded logits into its loss-parallel cross-entropy. scaletool:
``parallel.tensor_parallel=N`` (loss parallel always; ``--set parallel.tp_local_ops=true`` for its
local-ops form). The ranks of a TP group read the same batches; the global batch is micro-batch × world /
N sequences, so tokens/s per GPU = micro-batch × seq_len × (world / N) / world / step time. ``--async-tp``
turns on async TP on both sides (compiled only). With ``--dry-run``, ``--tp N`` also applies both plans on
the meta device over a fake N-rank group and records each side's per-rank parameter share.

One JSON document (``--out``, and stdout) holds the card, date, versions, command, settings,
parameter counts, FLOPs per token and both results with their ratio.

torch: torchtitan 0.3.0 is pinned to torch 2.14. On torch 2.11 two of its calls fail: its FSDP helpers
import ``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.13), and its FlexAttention masks pass
``create_block_mask(..., separate_full_blocks=True)`` (torch 2.12). On an older torch this script
stops with those reasons unless ``--torch-compat`` is given, which shims both (:data:`COMPAT`: a
placeholder that raises if constructed, which torchtitan's ``partial_dtensor`` FSDP path selected here
never does; a keyword that accepts True, older torch's only behaviour, and raises on False) and
records them under ``compat`` in the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletool.analytic.comm import tensor_parallel_config, tensor_parallel_replicated
from scaletool.analytic.flops import flops_per_token
from scaletool.analytic.params import param_counts
from scaletool.config import ModelConfig, Recipe, RecipeError, load_recipe
from scaletool.stats import compare, settled_start, spread

TORCHTITAN_VERSION = "0.3.0"
#: what torchtitan 0.3.0 needs of torch that 2.11 lacks, and what --torch-compat does about it (each
#: shim raises rather than guess if torchtitan ever uses it in a way this torch cannot honour)
COMPAT = {
    "DataParallelMeshDims": ("torch.distributed.fsdp.DataParallelMeshDims (torch >= 2.13)",
                             "defined as a placeholder that raises if constructed: torchtitan builds one only for "
                             "spmd_backend full_dtensor or spmd_types; this run's partial_dtensor passes None"),
    "separate_full_blocks": ("create_block_mask(..., separate_full_blocks=) (torch >= 2.12)",
                             "accepted when True, what torchtitan passes and what older torch always does; False "
                             "raises"),
}


# ---------------------------------------------------------------------------------------------
# Our recipe -> torchtitan's model arguments (pure: no torchtitan import)


def torchtitan_shapes(cfg: ModelConfig) -> dict:
    """torchtitan's model family and arguments at the recipe's shapes.

    mha/gqa/mqa -> ``llama3`` (a GQA attention with fused q/k/v, as torchtitan's own flavors), mla ->
    ``deepseek_v3`` with every layer dense. Raises one RecipeError line per feature the peers cannot
    express (an equal comparison needs equal models).
    """
    problems = []
    if cfg.task != "lm":
        problems.append(f"model.task: {cfg.task}; torchtitan's decoders are language models (task=lm)")
    if cfg.ffn != "swiglu":
        problems.append(f"model.ffn: {cfg.ffn}; the peers are dense SwiGLU decoders")
    if cfg.norm != "rmsnorm":
        problems.append(f"model.norm: {cfg.norm}; torchtitan's decoders use RMSNorm")
    if cfg.qkv_bias:
        problems.append("model.qkv_bias: torchtitan's Llama-3 attention has no q/k/v bias")
    if cfg.dropout:
        problems.append(f"model.dropout: {cfg.dropout}; torchtitan's decoders have no dropout")
    if cfg.attention != "mla" and cfg.qk_rope_head_dim != cfg.head_dim:
        problems.append(f"model.qk_rope_head_dim: {cfg.qk_rope_head_dim}; torchtitan's Llama-3 rotates the whole "
                        f"head (head_dim={cfg.head_dim})")
    if problems:
        raise RecipeError(problems)
    out = {"family": "deepseek_v3" if cfg.attention == "mla" else "llama3", "dim": cfg.d_model,
           "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "vocab_size": cfg.vocab_size,
           "hidden_dim": cfg.intermediate_size, "rope_theta": cfg.rope_theta, "max_seq_len": cfg.max_seq_len,
           "norm_eps": cfg.norm_eps, "enable_weight_tying": cfg.tie_embeddings}
    if cfg.attention == "mla":
        out.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)
    else:
        out.update(n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim)
    return out


# ---------------------------------------------------------------------------------------------
# torchtitan: import, config, build


def ensure_torch_api(allow_compat: bool) -> list[str]:
    """Make torchtitan 0.3.0 run on this torch, or say why it cannot. Call before importing torchtitan.

    Returns a note for each shim applied (:data:`COMPAT`)."""
    import inspect

    import torch.distributed.fsdp as fsdp
    from torch.nn.attention import flex_attention

    missing = [k for k, absent in (("DataParallelMeshDims", not hasattr(fsdp, "DataParallelMeshDims")),
               ("separate_full_blocks", "separate_full_blocks" not in
                inspect.signature(flex_attention.create_block_mask).parameters)) if absent]
    if missing and not allow_compat:
        raise RecipeError([f"torch {torch.__version__}: torchtitan {TORCHTITAN_VERSION} needs {COMPAT[k][0]}; pass "
                           "--torch-compat to shim it (recorded in the JSON)" for k in missing])
    if "DataParallelMeshDims" in missing:
        class DataParallelMeshDims:
            def __init__(self, *args, **kwargs):
                raise RuntimeError("torchtitan built DataParallelMeshDims, which this torch lacks: the --torch-compat "
                                   "placeholder does not implement it")

        fsdp.DataParallelMeshDims = DataParallelMeshDims
    if "separate_full_blocks" in missing:
        original = flex_attention.create_block_mask

        def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:
                raise RuntimeError("create_block_mask(separate_full_blocks=False) needs torch >= 2.12")
            return original(*args, **kwargs)

        flex_attention.create_block_mask = create_block_mask
    return [f"{COMPAT[k][0]}: {COMPAT[k][1]}" for k in missing]


def torchtitan_config(cfg: ModelConfig, attn_backend: str, tp: int = 1):
    """torchtitan's ``Llama3Model.Config`` or ``DeepSeekV3Model.Config`` at the recipe's shapes.

    Built from torchtitan's own builders (``make_gqa_config``/``make_ffn_config`` for Llama-3,
    ``build_mla_moe_layers`` with ``n_dense_layers = n_layers`` for DeepSeek-V3) with its Llama-3
    initialisation scheme (truncated normal 0.02, depth-scaled output projections); no RoPE scaling.
    ``tp`` > 1: with torchtitan's tensor-parallel sharding plan (sequence parallel), as its trainer sets it.
    """
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
    from torchtitan.models.common.param_init import depth_scaled_std

    s = torchtitan_shapes(cfg)
    d, V = s["dim"], s["vocab_size"]
    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}

    def depth(layer_id: int) -> dict:
        return {"weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer_id)), "bias": nn.init.zeros_}

    def rms(n: int):
        return RMSNorm.Config(normalized_shape=n, eps=s["norm_eps"], param_init=norm_init)

    rope_dim = s["qk_rope_head_dim"] if s["family"] == "deepseek_v3" else s["head_dim"]
    rope = ComplexRoPE.Config(dim=rope_dim, max_seq_len=s["max_seq_len"], theta=s["rope_theta"], scaling="none")
    head = dict(dim=d, vocab_size=V, enable_weight_tying=s["enable_weight_tying"],
                tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=d,
                                                param_init={"weight": partial(nn.init.normal_, std=1.0)}),
                norm=rms(d), lm_head=Linear.Config(in_features=d, out_features=V, param_init=linear))
    if s["family"] == "llama3":
        from torchtitan.models.llama3 import Llama3Model
        from torchtitan.models.llama3.model import Llama3TransformerBlock

        layers = [Llama3TransformerBlock.Config(
            attention_norm=rms(d), ffn_norm=rms(d),
            attention=make_gqa_config(dim=d, n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"], head_dim=s["head_dim"],
                                      wqkv_param_init=linear, wo_param_init=depth(i), fuse_qkv=True, rope=rope,
                                      inner_attention=get_attention_config(attn_backend)),
            feed_forward=make_ffn_config(dim=d, hidden_dim=s["hidden_dim"], w1_param_init=linear,
                                         w2w3_param_init=depth(i)))
            for i in range(s["n_layers"])]
        out = Llama3Model.Config(layers=layers, **head)
        if tp > 1:
            from torchtitan.models.llama3.sharding import set_llama3_sharding_config
            set_llama3_sharding_config(out, enable_sp=True)
        return out
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers

    # n_dense_layers = n_layers: every block takes the dense SwiGLU; the MoE arguments are then unused
    layers = build_mla_moe_layers(
        n_layers=s["n_layers"], n_dense_layers=s["n_layers"], dim=d, n_heads=s["n_heads"],
        q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"], mscale=1.0,
        dense_hidden_dim=s["hidden_dim"], moe_hidden_dim=s["hidden_dim"], num_experts=1, num_shared_experts=0,
        router_top_k=1, router_score_func="softmax", attn_backend=attn_backend, moe_comm_backend="standard",
        non_blocking_capacity_factor=None, linear_init=linear, norm_init=norm_init, depth_init=depth,
        depth_experts_init=lambda i: {}, rope=rope)
    for block in layers:  # build_mla_moe_layers' norms take torchtitan's default eps
        block.attention_norm, block.ffn_norm, block.attention.kv_norm = rms(d), rms(d), rms(s["kv_lora_rank"])
        if s["q_lora_rank"]:
            block.attention.q_norm = rms(s["q_lora_rank"])
    out = DeepSeekV3Model.Config(layers=layers, **head)
    if tp > 1:
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
        set_deepseek_v3_sharding_config(out, enable_sp=True, enable_ep=False)
    return out


def torchtitan_counts(cfg: ModelConfig, seq_len: int, attn_backend: str) -> dict:
    """Parameters of torchtitan's model built on meta, and its FLOPs per token."""
    tt_cfg = torchtitan_config(cfg, attn_backend)
    with torch.device("meta"):
        model = tt_cfg.build()
    params, flops = tt_cfg.get_nparams_and_flops(model, seq_len)
    return {"params": int(params), "flops_per_token": float(flops), "model_class": type(model).__name__}


# ---------------------------------------------------------------------------------------------
# The timed loop both frameworks go through


def timed_steps(step: Callable[[], torch.Tensor], steps: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Run ``step`` ``steps`` times; (seconds per step, losses), both read after the loop.

    CUDA: one pair of events around each step and no synchronisation inside the loop. CPU: wall time
    (the dry smoke path only)."""
    cuda = device.type == "cuda"
    marks, losses = [], []
    for _ in range(steps):
        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            start.record()
        losses.append(step())
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        marks.append((start, end))
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in marks]
    else:
        times = [b - a for a, b in marks]
    return times, [float(x) for x in torch.stack(losses).float().cpu()]


def synthetic_batches(recipe: Recipe, device: torch.device, n: int = 4, tp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of uniform random tokens (inputs, next-token labels), the same on every framework
    (seeded by data-parallel rank, so data-parallel ranks see different data as a loader gives, and the
    ``tp`` neighbouring ranks of a tensor-parallel group the same)."""
    B, T, V = recipe.train.micro_batch_size, recipe.seq_len, recipe.model.vocab_size
    g = torch.Generator().manual_seed(recipe.train.seed + (dist.get_rank() // tp if dist.is_initialized() else 0))
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (B, T + 1), generator=g)
        out.append((x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)))
    return out


def release(device: torch.device, dynamo_config: bytes) -> None:
    """Free what the last run left (compiled graphs, caches) and restore Dynamo's settings (torchtitan's
    ``apply_compile`` sets ``capture_scalar_outputs`` globally) before the next run is measured."""
    gc.collect()
    torch._dynamo.reset()
    torch._dynamo.config.load_config(dynamo_config)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------------------------
# The two runs


def run_torchtitan(recipe: Recipe, batches, steps: int, device: torch.device, args) -> dict:
    """torchtitan's build, parallelize and train step (see the module docstring) at the recipe's shapes."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    cfg, t = recipe.model, recipe.train
    world, tp = dist.get_world_size(), args.tp
    dp = world // tp
    compile_on = device.type == "cuda" and not args.eager
    compile_cfg = CompileConfig(enable=compile_on, components=["model", "loss"],
                                enable_async_tensor_parallel=args.async_tp and compile_on)
    training = TrainingConfig(local_batch_size=t.micro_batch_size, seq_len=recipe.seq_len, max_norm=t.grad_clip,
                              mixed_precision_param="bfloat16", mixed_precision_reduce="float32",
                              disable_cuda_graphs=not args.cuda_graphs)
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=dp,
                                    tensor_parallel_degree=tp, enable_sequence_parallel=True)
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend("partial_dtensor")
    tt_cfg = torchtitan_config(cfg, args.attn_backend, tp)
    with torch.device("meta"):
        model = tt_cfg.build()
    if cfg.attention == "mla":
        from torchtitan.models.deepseek_v3 import parallelize_deepseekv3 as parallelize
    else:
        from torchtitan.models.llama3 import parallelize_llama as parallelize
    model = parallelize(model, parallel_dims=dims, training=training, parallelism=parallelism,
                        compile_config=compile_cfg, ac_config=None, dump_folder=str(args.tmp))
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                            fused=device.type == "cuda")
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(), compile_config=compile_cfg)
    context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)

    def fwd_bwd(inputs, labels, global_valid_tokens, extra):
        with context():
            pred = model(inputs, **extra)
            loss, _ = loss_fn(pred, labels, global_valid_tokens)
            del pred
            loss.backward()
        return loss

    if args.cuda_graphs and device.type == "cuda":
        from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
        fwd_bwd = wrap_with_cuda_graph(fwd_bwd)
    B, T = t.micro_batch_size, recipe.seq_len
    # One document per sequence: the same positions, so the same mask, every step. Built once here;
    # torchtitan's trainer rebuilds it per batch (packed documents vary), which on torch < 2.13 also
    # breaks its CUDA-graph replay (a new mask closure compares unequal to the captured one).
    positions = torch.arange(T, device=device).expand(B, T)
    extra = {"positions": positions, "attention_masks": model.get_attention_masks(positions=positions)}
    local_tokens = torch.tensor(B * T, device=device)
    mesh = dims.get_optional_mesh("batch")
    i = 0

    def step() -> torch.Tensor:
        nonlocal i
        inputs, labels = batches[i % len(batches)]
        i += 1
        opt.zero_grad(set_to_none=not args.cuda_graphs)
        tokens = dist_utils.dist_sum_tensor(local_tokens, mesh) if mesh is not None else local_tokens
        loss = fwd_bwd(inputs, labels, tokens, extra).detach().clone()  # the graph output is overwritten next replay
        dist_utils.clip_grad_norm_(params, t.grad_clip, foreach=True)
        opt.step()
        return loss * dp  # the loss is summed over this data-parallel rank's tokens / all of their tokens

    try:
        return {"times": timed_steps(step, steps, device)}
    finally:
        if args.cuda_graphs and device.type == "cuda":
            from torchtitan.distributed.cudagraph import cudagraph_teardown
            cudagraph_teardown()


def scaletool_recipe(recipe: Recipe, equal: bool, tp: int = 1, async_tp: bool = False) -> Recipe:
    """The recipe scaletool runs: with ``equal``, torchtitan's settings (FSDP2, per-block compile, AC off,
    tensor parallelism over ``tp`` ranks)."""
    from scaletool import api

    if not equal:
        return recipe
    return api.resolve(recipe, ["parallel.engine=fsdp", "train.compile=true", "train.compile_scope=block",
                                "train.activation_checkpointing=none", f"parallel.tensor_parallel={tp}",
                                f"parallel.async_tp={str(async_tp).lower()}"])


def run_scaletool(recipe: Recipe, batches, steps: int, device: torch.device, args) -> dict:
    """scaletool's engine (``make_engine``) on the same batches, through the same timed loop."""
    from scaletool.engines import init_distributed, make_engine

    if args.eager or device.type != "cuda":
        from scaletool import api
        recipe = api.resolve(recipe, ["train.compile=false", "parallel.async_tp=false"])
    env = init_distributed(recipe.parallel.engine)
    engine = make_engine(recipe, env)
    lr = recipe.train.lr

    i = 0

    def step() -> torch.Tensor:
        nonlocal i
        inputs, labels = batches[i % len(batches)]
        i += 1
        loss, _ = engine.train_step([(inputs, labels)], lr)
        return loss

    return {"times": timed_steps(step, steps, device)}


# ---------------------------------------------------------------------------------------------
# Figures


def summarize(times_by_rank: list[list[float]], losses: list[float], warmup: int, tokens_per_step: int,
              flops: dict[str, float], peak_tflops: float | None, peak_bytes: int | None) -> dict:
    """Step time, tokens/s per GPU and MFU under every convention in ``flops`` (FLOPs per token);
    ``losses`` are this rank's (rank 0's in the document)."""
    per_step = [max(ts) for ts in zip(*times_by_rank)]  # a step ends when its slowest rank does
    start = settled_start(per_step, warmup)
    step_s = spread(per_step[start:])
    rate = step_s.inverse(tokens_per_step)
    out = {"step_s": step_s.model_dump(), "tokens_per_s_per_gpu": rate.model_dump(),
           "warmup_steps_excluded": start, "rule": f"settled_start(minimum={warmup}, tolerance=0.25)",
           "step_s_all": per_step, "loss_first": losses[0], "loss_last": losses[-1],
           "peak_memory_allocated_bytes": peak_bytes,
           "tflops_per_gpu": {k: rate.median * v / 1e12 for k, v in flops.items()},
           "mfu": {k: (rate.median * v / 1e12 / peak_tflops if peak_tflops else None) for k, v in flops.items()}}
    return out


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    try:
        from importlib.metadata import version
        out["torchtitan"] = version("torchtitan")
    except Exception:  # noqa: BLE001 -- a source checkout has no metadata; the module still says
        out["torchtitan"] = None
    try:
        out["scaletool_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                                 cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except OSError:
        out["scaletool_commit"] = None
    return out


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n  python benchmarks/scripts/peers/torchtitan_train.py recipes/mha-1b.yaml "
                                       "--out peer.json\n  torchrun --nproc-per-node 4 benchmarks/scripts/peers/"
                                       "torchtitan_train.py recipes/mla-1b.yaml --out x4.json --torch-compat")
    p.add_argument("recipe", help="a scaletool recipe (mha/gqa/mqa or mla, dense SwiGLU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, e.g. train.micro_batch_size=4 (repeatable)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the recipe's train.steps)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps always excluded before the settled rule (default: train.measure_warmup_steps)")
    p.add_argument("--only", choices=["both", "torchtitan", "scaletool"], default="both")
    p.add_argument("--also-recipe", action="store_true", help="also run scaletool with the recipe's own settings")
    p.add_argument("--attn-backend", choices=["flex", "flex_flash", "varlen"], default="flex",
                   help="torchtitan's attention backend (default flex, its default)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="torchtitan: do not capture the forward-backward in a CUDA graph (its trainer does by default)")
    p.add_argument("--eager", action="store_true", help="no torch.compile on either side")
    p.add_argument("--torch-compat", action="store_true", help="run torchtitan on a torch older than 2.13 "
                   "(see the module docstring)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism over N ranks on both sides (N divides the world size; default 1)")
    p.add_argument("--async-tp", action="store_true", help="with --tp: async TP on both sides (compiled only)")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the card's dense bf16 peak")
    p.add_argument("--dry-run", action="store_true", help="map the recipe and count parameters and FLOPs only "
                   "(meta device, no GPU)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON document here too")
    args = p.parse_args(argv)
    for name in ("steps", "warmup"):
        v = getattr(args, name)
        if v is not None and v < (1 if name == "steps" else 0):
            p.error(f"--{name}: {v} is too small")
    if args.tp < 1:
        p.error(f"--tp: {args.tp} is too small")
    if args.async_tp and (args.tp == 1 or args.eager):
        p.error("--async-tp: needs --tp > 1 and compile (no --eager)")
    if args.also_recipe and args.tp > 1:
        p.error("--also-recipe: not with --tp (the recipe's own run is not tensor-parallel)")
    return args


def plan(args) -> tuple[Recipe, dict]:
    """The recipe, its torchtitan mapping and both parameter and FLOP counts (no training)."""
    # with --tp the split comes first, so that overrides of the split's own keys (parallel.tp_local_ops) apply to it;
    # scaletool's tensor-parallel rules (heads, widths, vocabulary, sequence split over N) check the recipe
    split = ["parallel.engine=fsdp", f"parallel.tensor_parallel={args.tp}"] if args.tp > 1 else []
    recipe = load_recipe(args.recipe, [*split, *args.overrides])
    cfg, T = recipe.model, recipe.seq_len
    shapes = torchtitan_shapes(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not args.dry_run and world % args.tp:
        raise RecipeError(f"--tp {args.tp}: does not divide the world size {world} (torchrun --nproc-per-node)")
    ours = flops_per_token(cfg, T)
    doc = {"recipe": str(args.recipe), "overrides": args.overrides, "torchtitan_model": shapes,
           "params": {"scaletool_analytic": param_counts(cfg)["total"]},
           "flops_per_token": {"scaletool_causal": ours["train_causal"], "scaletool_full": ours["train_full"]}}
    if args.only == "scaletool" and not args.dry_run:  # torchtitan neither runs nor needs importing
        return recipe, doc
    doc["compat"] = ensure_torch_api(args.torch_compat)
    try:
        import torchtitan.models  # noqa: F401
    except ImportError as e:
        raise RecipeError(f"torchtitan {TORCHTITAN_VERSION} is not importable ({e}); install its wheels: "
                          "benchmarks/scripts/peers/README.md") from None
    tt = torchtitan_counts(cfg, T, args.attn_backend)
    doc["params"]["torchtitan_model"] = tt["params"]
    doc["flops_per_token"]["torchtitan"] = tt["flops_per_token"]
    if tt["params"] != doc["params"]["scaletool_analytic"]:
        raise RecipeError(f"torchtitan's {tt['model_class']} has {tt['params']:,} parameters, scaletool's model "
                          f"{doc['params']['scaletool_analytic']:,}: the shapes differ")
    if args.dry_run and args.tp > 1:
        doc["tp_shares"] = tp_shares(cfg, args.tp, args.attn_backend)
    return recipe, doc


def tp_shares(cfg: ModelConfig, tp: int, attn_backend: str) -> dict:
    """Both tensor-parallel plans applied on the meta device over a fake ``tp``-rank group (as rank 0):
    the parameters each side leaves a rank, and those it replicates, beside the analytic share."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims as tt_dims
    from torchtitan.distributed import utils as dist_utils

    from scaletool.engines.tp import apply_tensor_parallel
    from scaletool.model import build_model

    def shares(model: nn.Module) -> dict:
        params = list(model.parameters())
        return {"local": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
                "replicated": sum(p.numel() for p in params if not isinstance(p, DTensor) or
                                  all(isinstance(x, Replicate) for x in p.placements))}

    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    device_type = tt_dims.device_type
    try:
        tt_dims.device_type = "cpu"  # torchtitan's meshes default to the accelerator; this count needs none
        ours = build_model(cfg, "meta", seed=None)
        apply_tensor_parallel(ours, init_device_mesh("cpu", (tp,)), cfg)
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=tp,
                            spmd_backend="partial_dtensor")
        dist_utils.set_spmd_backend("partial_dtensor")
        with torch.device("meta"):
            theirs = torchtitan_config(cfg, attn_backend, tp).build()
        theirs.parallelize(dims)
        return {"tp": tp, "scaletool": shares(ours), "torchtitan": shares(theirs),
                "analytic_local": param_counts(tensor_parallel_config(cfg, tp))["total"],
                "analytic_replicated": sum(tensor_parallel_replicated(cfg))}
    finally:
        tt_dims.device_type = device_type
        dist.destroy_process_group()


def measure(recipe: Recipe, doc: dict, args) -> dict:
    """Both runs (or the one asked for) on this rank; rank 0's document gets every rank's times."""
    from scaletool.engines import init_distributed
    from scaletool.measure.hardware import peak_for

    env = init_distributed("fsdp")
    device = env.device
    steps = args.steps or recipe.train.steps
    warmup = recipe.train.measure_warmup_steps if args.warmup is None else args.warmup
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = peak_for(device.type, name, "bf16", args.peak_tflops)
    tp = args.tp
    tokens = recipe.train.micro_batch_size * recipe.seq_len // tp  # per GPU: a TP group shares one batch
    batches = synthetic_batches(recipe, device, tp=tp)
    runs: list[tuple[str, Callable]] = []
    if args.only in ("both", "torchtitan"):
        runs.append(("torchtitan", lambda: run_torchtitan(recipe, batches, steps, device, args)))
    if args.only in ("both", "scaletool"):
        runs.append(("scaletool", lambda: run_scaletool(scaletool_recipe(recipe, True, tp, args.async_tp), batches, steps,
                                                        device, args)))
    if args.also_recipe:
        runs.append(("scaletool_recipe", lambda: run_scaletool(recipe, batches, steps, device, args)))
    results, dynamo_config = {}, torch._dynamo.config.save_config()
    for label, run in runs:
        release(device, dynamo_config)
        times, losses = run()["times"]
        peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, (times, peak_bytes))
        results[label] = summarize([g[0] for g in gathered], losses, warmup, tokens, doc["flops_per_token"],
                                   peak.tflops, max((g[1] or 0) for g in gathered) or None)
        if env.is_main:
            r = results[label]
            print(f"{label}: {r['tokens_per_s_per_gpu']['median']:,.0f} tokens/s/GPU, step {r['step_s']['median']:.4f} s "
                  f"(n={r['step_s']['n']}), loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}", file=sys.stderr)
    doc.update(card=name, world_size=env.world_size, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               versions=versions(), command=[sys.executable, *sys.argv],
               launched_by_torchrun="TORCHELASTIC_RUN_ID" in os.environ,
               peak={"tflops": peak.tflops, "profile": peak.profile, "warning": peak.warning},
               settings={"micro_batch_size": recipe.train.micro_batch_size, "seq_len": recipe.seq_len, "steps": steps,
                         "measure_warmup_steps": warmup, "dtype": "bf16 params, fp32 reduce (FSDP2)",
                         "tensor_parallel": tp, "data_parallel": env.world_size // tp, "async_tp": args.async_tp,
                         "global_batch_sequences": recipe.train.micro_batch_size * env.world_size // tp,
                         "compile": "none" if args.eager else "per block", "activation_checkpointing": "none",
                         "grad_clip": recipe.train.grad_clip, "optimizer": "AdamW fused",
                         "torchtitan_attention": args.attn_backend, "torchtitan_cuda_graphs": args.cuda_graphs,
                         "torchtitan_spmd_backend": "partial_dtensor", "data": "synthetic uniform tokens"},
               results=results)
    if "torchtitan" in results and "scaletool" in results:
        a, b = (results[k]["tokens_per_s_per_gpu"] for k in ("scaletool", "torchtitan"))
        from scaletool.stats import Spread
        c = compare(Spread(**a), Spread(**b))
        doc["scaletool_over_torchtitan"] = {"tokens_per_s_ratio": a["median"] / b["median"],
                                            "finding": c.describe("faster", "slower")}
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recipe, doc = plan(args)
        if not args.dry_run:
            args.tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "torchtitan-peer"
            doc = measure(recipe, doc, args)
    except RecipeError as e:
        for line in e.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if not dist.is_initialized() or dist.get_rank() == 0:
        text = json.dumps(doc, indent=2)
        if args.out:
            args.out.write_text(text + "\n")
        print(text)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
