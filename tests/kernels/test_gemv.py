"""The decode-step GEMV (scaletool.kernels.gemv): where it runs and where F.linear serves, the modules it
routes, the custom operator under torch.compile, and the Triton kernel against F.linear (on a CUDA
machine with Triton; skipped elsewhere). tests/decode/test_steps.py runs it inside a captured,
compiled decode step."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletool.kernels import gemv

CUDA_TRITON = gemv.triton is not None and torch.cuda.is_available()


def test_it_declines_what_it_was_not_written_for():
    w = torch.randn(64, 32)
    assert gemv.supports(torch.randn(1, 32), w) is not None  # CPU (or no Triton)
    if CUDA_TRITON:
        wc = w.to("cuda", torch.bfloat16)
        assert gemv.supports(torch.randn(1, 32, device="cuda", dtype=torch.bfloat16), wc) is None
        assert "rows" in gemv.supports(torch.randn(9, 32, device="cuda", dtype=torch.bfloat16), wc)
        assert "16-bit" in gemv.supports(torch.randn(1, 32, device="cuda"), w.cuda())
        assert "contiguous" in gemv.supports(torch.randn(1, 64, device="cuda", dtype=torch.bfloat16), wc.t())


def test_linear_is_f_linear_where_the_kernel_cannot_run():
    x, w = torch.randn(2, 3, 32), torch.randn(48, 32)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))


def test_install_routes_bias_free_linears_only_and_changes_no_result_on_cpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 4, bias=False))
    x = torch.randn(1, 16)
    want = model(x)
    assert gemv.install(model) == 2 and gemv.install(model) == 2  # idempotent
    assert "forward" in vars(model[0]) and "forward" in vars(model[3]) and "forward" not in vars(model[2])
    assert torch.equal(model(x), want)
    loss = model(torch.randn(5, 16)).sum()  # prefill-sized inputs and autograd go through F.linear
    loss.backward()
    assert model[0].weight.grad is not None


def test_the_operator_has_shapes_for_the_tracer():
    def f(x, w):
        return torch.ops.scaletool.gemv(x, w) * 2

    x, w = torch.randn(1, 1, 32), torch.randn(40, 32)
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w)
    assert out.shape == (1, 1, 40)
    torch.testing.assert_close(out, 2 * F.linear(x, w))


@pytest.mark.skipif(not CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("n, k", [(3072, 2048), (576, 2048), (2048, 5632), (11264, 2048), (32000, 2048), (40, 24),
                                  (100, 8192), (64, 9000)])  # one row: whole rows of W up to ROW_MAX_K, then tiles
def test_kernel_matches_f_linear(rows, n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 1, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    want = F.linear(x.float(), w.float())
    got = gemv.gemv_triton(x, w)
    assert got.shape == (rows, 1, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not CUDA_TRITON, reason="needs CUDA and Triton")
def test_a_chain_under_programmatic_dependent_launch_reads_each_input_after_it_is_written():
    """Each GEMV's input is the one before's output; captured with PDL (Hopper: each may be scheduled while
    the one before runs, and waits before reading x), the replay gives F.linear's chain."""
    from scaletool.kernels import pdl

    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [(torch.randn(2048, 2048, device="cuda", generator=g) / 2048**0.5).to(torch.bfloat16) for _ in range(8)]
    x = torch.randn(1, 2048, device="cuda", generator=g).to(torch.bfloat16)

    def chain():
        y = x
        for w in ws:
            y = gemv.gemv_triton(y, w)
        return y

    with pdl.enabled(True):
        chain()  # autotuning before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    assert pdl.launch(x.device)["USE_PDL"] is False  # the block restored the setting
    for _ in range(3):
        graph.replay()
    want = x.float()
    for w in ws:
        want = F.linear(want, w.float()).to(torch.bfloat16).float()
    torch.testing.assert_close(out.float(), want, atol=5e-2, rtol=5e-2)
