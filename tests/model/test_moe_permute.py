"""The dropless path's permutation and expert GEMMs: the gather permutation (its backward a gather, not a
scatter-add) and the fused gate/up GEMM against the earlier indexed path and the per-token definition,
and the whole layer captured by torch.compile in one graph (no host sync, no graph break)."""
from __future__ import annotations

import pytest
import torch
from test_moe import grads_of, moe_layer, per_token_reference

from scaletool.model.moe import _GatherRows, sort_by_expert


def test_gather_rows_backward_is_the_scatter_add_of_indexing():
    """The permutation's gather backward equals autograd's scatter-add of ``x[index]``, for the
    dispatch (each token's k copies summed) and the return (k = 1), with empty experts."""
    torch.manual_seed(0)
    N, k, E = 7, 3, 5
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    idx[idx == 4] = 3 if (idx == 3).sum() == 0 else idx[idx == 4]  # leaves an expert empty at times
    order, inverse, counts = sort_by_expert(idx, E)
    assert torch.equal(inverse[order], torch.arange(N * k)) and torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=E))
    assert torch.equal(idx.reshape(-1)[order], idx.reshape(-1).sort(stable=True).values)
    x = torch.randn(N, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: _GatherRows.apply(t, order // k, inverse, k), (x,))
    y = torch.randn(N * k, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(N * k, 4, dtype=torch.float64)
    cases = ((lambda t: _GatherRows.apply(t, order // k, inverse, k), x, order // k),
             (lambda t: _GatherRows.apply(t, inverse, order, 1), y, inverse))
    for fn, src, index in cases:
        torch.testing.assert_close(fn(src), src[index])
        a, = torch.autograd.grad((fn(src) * g).sum(), src)
        b, = torch.autograd.grad((src[index] * g).sum(), src)
        torch.testing.assert_close(a, b)


def _grouped_mm_on_cpu() -> bool:
    try:
        torch._grouped_mm(torch.ones(4, 16, dtype=torch.bfloat16), torch.ones(2, 16, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([2, 4], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("kw", [{}, {"num_experts_per_tok": 3, "scoring_func": "sigmoid", "norm_topk_prob": True},
                                {"n_shared_experts": 0, "num_experts_per_tok": 1}])
def test_gather_path_equals_indexed_path_and_reference(kw):
    """The gather permutation with gate/up fused against the earlier indexed path (advanced indexing,
    three GEMMs) and the per-token definition: outputs and every gradient, fp32 loop GEMMs."""
    torch.manual_seed(4)
    x = torch.randn(2, 9, 32, requires_grad=True)
    g = torch.randn(2, 9, 32)
    results = {}
    for permute in ("gather", "indexed"):
        moe = moe_layer(seed=5, aux_loss_alpha=0.01, **kw)
        moe.permute = permute
        out = moe(x)
        results[permute] = [out, moe.aux_loss, *grads_of(moe, out + moe.aux_loss, g, x), moe.tokens_per_expert]
    ref = per_token_reference(moe, x)
    torch.testing.assert_close(results["gather"][0], ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(results["gather"], results["indexed"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # compiles the layer twice (tens of seconds on a busy 2-core machine)
def test_whole_layer_compiles_in_one_graph_and_matches_on_cpu_grouped_mm():
    """Router, balance loss, gather permutation, fused grouped GEMMs and the shared expert: one graph
    with fullgraph=True, forward and backward, equal to the eager loop path. CPU bf16 uses
    torch._grouped_mm's composite fallback where this torch has one."""
    if not _grouped_mm_on_cpu():
        pytest.skip("torch._grouped_mm does not run on CPU in this torch")
    moe = moe_layer(seed=6, aux_loss_alpha=0.01).to(torch.bfloat16)
    moe.expert_impl = "grouped_mm"
    assert moe.expert_gemm(torch.bfloat16) == "grouped_mm"
    torch.manual_seed(0)
    x = torch.randn(2, 12, 32, dtype=torch.bfloat16)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(moe)(x)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    runs = {}
    for name, fn in (("compiled", compiled), ("loop", None)):
        moe.zero_grad()
        moe.expert_impl = "grouped_mm" if fn is not None else "loop"
        xx = x.clone().requires_grad_()
        out = (moe if fn is None else fn)(xx)
        (out.float().square().mean() + moe.aux_loss).backward()
        runs[name] = [out.float(), xx.grad.float(), moe.experts.w1.grad.float(), moe.gate.weight.grad.float()]
    for a, b in zip(runs["compiled"], runs["loop"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
