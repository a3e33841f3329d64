"""Parameters and forward FLOPs per module, as a tree (``scaletool count --by module``).

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``, which records the FLOPs of every module
it sees called (its module tracker). Only the forward is given per module: the tracker attributes
backward operators by gradient hooks, and on this model some land on a neighbour (a leaf Linear, the
residual dropout), though each block's sum is right; the tree's root carries the whole forward and
backward. A module never called itself (a ModuleList) gets its children's sum; what a module computes
outside its children (the attention scores, the loss) is its ``own`` share, so at every node
``forward_flops == own_flops + sum(children)``. Parameters are counted once each, under the first
module that holds them (a tied head counts nowhere twice): ``params == own_params + sum(children)``.
Where a closed form for the module exists (the model, a block, its attention and dense FFN, the
head, the embedding, attention projections), it is given beside the measured figure.
"""
from __future__ import annotations

from typing import Any

import torch

from scaletool.analytic.flops import attention_flops_per_token, flops_per_token
from scaletool.analytic.params import ffn_params, moe_params, param_counts
from scaletool.config import Recipe
from scaletool.kinds.attention import matmul_params


def _analytic(recipe: Recipe, tokens: int) -> dict[str, dict[str, float]]:
    """Closed-form ``params`` and ``forward_flops`` (full attention, as counted) by module name."""
    cfg, T = recipe.model, recipe.seq_len
    p = param_counts(cfg)
    per_tok = flops_per_token(cfg, T, tokens=tokens)
    out: dict[str, dict[str, float]] = {"": {"params": p["total"], "forward_flops": per_tok["forward_full_computed"] * tokens}}
    if cfg.task != "lm":
        return out
    attn = p["per_layer"]["attention_by_projection"]
    attn_fwd = (2 * matmul_params(attn) + attention_flops_per_token(cfg, T, causal=False) / cfg.n_layers) * tokens
    head_fwd = 2 * cfg.vocab_size * cfg.d_model * tokens
    # an untied head is its own module (``output``); a tied one multiplies by the embedding's weight in the
    # model's own forward
    if cfg.tie_embeddings:
        out[""]["own_forward_flops"] = head_fwd
    out["tok_embeddings"] = {"params": p["embedding"], "forward_flops": 0}
    if not cfg.tie_embeddings:
        out["output"] = {"params": p["head"], "forward_flops": head_fwd}
    if p["final_norm"]:
        out["norm"] = {"params": p["final_norm"]}
    out["layers"] = {"params": p["total"] - p["embedding"] - p["position_embedding"] - p["final_norm"] - p["head"],
                     "forward_flops": per_tok["forward_full_computed"] * tokens - head_fwd}
    dense_ffn = ffn_params(cfg)
    moe = moe_params(cfg) if cfg.n_moe_layers else None
    for i in range(cfg.n_layers):
        out[f"layers.{i}.attn"] = {"params": sum(attn.values()), "forward_flops": attn_fwd}
        for name, n in attn.items():
            out[f"layers.{i}.attn.{name}"] = {"params": n}
        block = sum(attn.values()) + p["per_layer"]["norms"]
        if moe and i >= cfg.first_k_dense_replace:  # the dispatch's FLOPs depend on the routing: params only
            n = moe["gate"] + moe["routed"] + moe["shared"]
            out[f"layers.{i}.ffn"] = {"params": n}
            out[f"layers.{i}"] = {"params": block + n}
            continue
        out[f"layers.{i}.ffn"] = {"params": dense_ffn, "forward_flops": 2 * dense_ffn * tokens}
        out[f"layers.{i}"] = {"params": block + dense_ffn, "forward_flops": attn_fwd + 2 * dense_ffn * tokens}
    return out


def measured_forward_by_module(model, x, y) -> tuple[dict[str, float], float]:
    """FlopCounterMode's forward FLOPs by module name ('' the model) and its fwd+bwd total, one batch."""
    from torch.utils.flop_counter import FlopCounterMode

    from scaletool.measure.sdpa_flops import _flop_counter_mapping

    counter = FlopCounterMode(display=False, custom_mapping=_flop_counter_mapping())
    with counter:
        loss = model(x, y)
        counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
        loss.backward()
    total_train = counter.get_total_flops()
    model.zero_grad(set_to_none=True)
    root = type(model).__name__
    by_name = {}
    for key, flops in counts.items():
        if key == root:
            by_name[""] = flops
        elif key.startswith(root + "."):
            by_name[key[len(root) + 1:]] = flops
    by_name.setdefault("", counts.get("Global", 0))
    return by_name, total_train


def module_tree(model, recipe: Recipe, x, y, depth: int | None = None) -> dict[str, Any]:
    """The module tree of ``model`` with parameters and forward FLOPs (measured and closed form) per node,
    cut below ``depth`` (0: the model alone; None: every module). A cut node's figures include all below it,
    as its ``own`` share."""
    tokens = x.shape[0] * recipe.seq_len
    flops, total_train = measured_forward_by_module(model, x, y)
    closed = _analytic(recipe, tokens)
    owner: dict[int, str] = {}
    own_params: dict[str, int] = {}
    for name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            if id(p) not in owner:
                owner[id(p)] = name
                own_params[name] = own_params.get(name, 0) + p.numel()

    def node(name: str, mod: torch.nn.Module, level: int) -> dict[str, Any]:
        kids = [node(f"{name}.{c}" if name else c, m, level + 1) for c, m in mod.named_children()]
        child_flops = sum(k["forward_flops"] for k in kids)
        fwd = flops.get(name, child_flops)
        out = {"name": name, "type": type(mod).__name__,
               "params": own_params.get(name, 0) + sum(k["params"] for k in kids), "own_params": own_params.get(name, 0),
               "forward_flops": fwd, "own_flops": fwd - child_flops,
               "analytic": closed.get(name)}
        if depth is not None and level >= depth:  # cut here: the node's figures hold all below it
            out.update(children=[], own_params=out["params"], own_flops=fwd)
        else:
            out["children"] = kids
        return out

    tree = node("", model, 0)
    tree["train_flops"] = total_train
    tree["tokens"] = tokens
    return tree
