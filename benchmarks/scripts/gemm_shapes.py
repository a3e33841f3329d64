"""How fast cuBLAS runs a recipe's matmuls, and its attention kernels, at the recipe's shapes.

Usage: python benchmarks/scripts/gemm_shapes.py RECIPE [--set k=v ...]
Prints one JSON object. For every Linear of one block (and the LM head) at M = micro_batch × seq_len
tokens: the forward GEMM, the input-gradient GEMM and the weight-gradient GEMM, each timed alone
in bf16 (CUDA events, median of 20 after warm-up), as TFLOP/s; the block's total with every
projection separate (as the model runs them) and, as a what-if, with the projections that share an
input concatenated into one GEMM (q/k/v, MLA's wq + wkv_a, SwiGLU's w1 + w3); a square 8192³ GEMM
as the card's practical ceiling; and causal SDPA forward + backward per backend at the recipe's
head dims. This is what bounds MFU from above: a step cannot beat its matmuls and attention, so
``mfu_ceiling`` is the recipe's training FLOPs over (n_layers × the block's GEMMs + the LM head +
n_layers × the fastest attention backend), against the card's profile peak, with element-wise
work, the optimizer and communication all taken as free.
"""
from __future__ import annotations

import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from scaletool.analytic import flops_per_token
from scaletool.config import load_recipe
from scaletool.measure.hardware import peak_for
from scaletool.model import build_model

args = sys.argv[1:]
r = load_recipe(args[0], [args[i + 1] for i, a in enumerate(args) if a == "--set"] + ["model.n_layers=1"])
cfg = r.model
M = r.train.micro_batch_size * r.seq_len
dev = "cuda"
bf16 = torch.bfloat16


def timed(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() over reps runs (after 3 warm-up runs)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def linear_ms(k_in: int, n_out: int) -> dict:
    """fwd Y = X Wᵀ, dgrad dX = dY W, wgrad dW = dYᵀ X for X (M, k_in), W (n_out, k_in)."""
    x = torch.randn(M, k_in, device=dev, dtype=bf16)
    w = torch.randn(n_out, k_in, device=dev, dtype=bf16)
    dy = torch.randn(M, n_out, device=dev, dtype=bf16)
    flops = 2 * M * k_in * n_out
    out = {}
    for name, fn in (("fwd", lambda: F.linear(x, w)), ("dgrad", lambda: dy @ w), ("wgrad", lambda: dy.t() @ x)):
        ms = timed(fn)
        out[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
    out["ms"] = round(sum(v["ms"] for v in out.values()), 4)
    return out


model = build_model(cfg, "meta")
block = model.layers[0]
linears = {n: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
attn, ffn = block.attn, block.ffn
groups = []
if cfg.attention == "mla":
    groups.append(["attn.wq" if cfg.q_lora_rank == 0 else "attn.wq_a", "attn.wkv_a"])
else:
    groups.append(["attn.wq", "attn.wk", "attn.wv"])
if cfg.ffn == "swiglu":
    groups.append(["ffn.w1", "ffn.w3"])

separate = {n: linear_ms(m.in_features, m.out_features) for n, m in linears.items()}
fused = dict(separate)
for g in groups:
    for n in g:
        fused.pop(n)
    fused["+".join(g)] = linear_ms(linears[g[0]].in_features, sum(linears[n].out_features for n in g))
head = linear_ms(cfg.d_model, cfg.vocab_size) if cfg.task == "lm" else None

block_flops = 6 * M * sum(m.in_features * m.out_features for m in linears.values())
sep_ms, fused_ms = sum(v["ms"] for v in separate.values()), sum(v["ms"] for v in fused.values())
n = 8192
a = torch.randn(n, n, device=dev, dtype=bf16)
square_ms = timed(lambda: a @ a)

# causal attention, forward + backward, per backend
qk, v_dim, H, KV = cfg.qk_head_dim, cfg.v_dim, cfg.n_heads, cfg.n_kv_heads
B, T = r.train.micro_batch_size, r.seq_len
q = torch.randn(B, H, T, qk, device=dev, dtype=bf16, requires_grad=True)
k = torch.randn(B, KV, T, qk, device=dev, dtype=bf16, requires_grad=True)
v = torch.randn(B, KV, T, v_dim, device=dev, dtype=bf16, requires_grad=True)
do = torch.randn(B, H, T, v_dim, device=dev, dtype=bf16)
attn_flops = 3 * 2 * B * H * T * T * (qk + v_dim) / 2  # fwd + 2×fwd for bwd, causal half
attention = {}
for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                 ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
    def run(be=be):
        with sdpa_kernel([be]):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
        y.backward(do)
    try:
        ms = timed(run, reps=10)
        attention[name] = {"ms_fwd_bwd": round(ms, 3), "tflops": round(attn_flops / ms / 1e9, 1)}
    except RuntimeError as e:
        attention[name] = {"error": str(e).splitlines()[0][:160]}

base = load_recipe(args[0], [args[i + 1] for i, a in enumerate(args) if a == "--set"])  # all its layers
L = base.model.n_layers
best_attn = min(v["ms_fwd_bwd"] for v in attention.values() if "ms_fwd_bwd" in v)
floor_ms = L * (sep_ms + best_attn) + (head["ms"] if head else 0.0)
step_flops = flops_per_token(base.model, base.seq_len)["train"] * M
peak = peak_for("cuda", torch.cuda.get_device_name(), "bf16").tflops

print(json.dumps({
    "recipe": args[0], "device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": M,
    "square_8192_tflops": round(2 * n**3 / square_ms / 1e9, 1),
    "block_separate": {"ms": round(sep_ms, 3), "tflops": round(block_flops / sep_ms / 1e9, 1), "gemms": separate},
    "block_fused": {"ms": round(fused_ms, 3), "tflops": round(block_flops / fused_ms / 1e9, 1), "gemms": fused},
    "lm_head": head,
    "attention_fwd_bwd": attention,
    "step_floor_ms": round(floor_ms, 2),
    "mfu_ceiling": round(step_flops / floor_ms / 1e9 / peak, 4) if peak else None,
}, indent=1))
