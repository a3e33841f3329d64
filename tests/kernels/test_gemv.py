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


def test_the_fused_layer_is_its_plain_composition_where_the_kernel_cannot_run():
    """fused_linear off the one-row kernel (a CPU, several rows) is silu(gate)·up or RMSNorm, F.linear, + residual;
    the operator under torch.compile keeps the shapes, and says where the kernel declines."""
    torch.manual_seed(0)
    x, w, g, r = torch.randn(1, 1, 32), torch.randn(40, 32), torch.rand(32) + 0.5, torch.randn(1, 1, 40)
    want = r + F.linear(F.rms_norm(x, (32,), g, 1e-5), w)
    assert torch.equal(gemv.fused_linear(x, w, g, 1e-5, residual=r), want)
    x2 = torch.randn(2, 1, 64)
    gate, up = x2.chunk(2, -1)
    assert torch.equal(gemv.fused_linear(x2, w, glu=True), F.linear(F.silu(gate) * up, w))
    assert "rows" in gemv.supports_fused(x2, w, None, True, None)
    assert gemv.supports_fused(x, w, g, False, r) is not None  # CPU (or no Triton)

    def f(x, w, g, r):
        return torch.ops.scaletool.gemv_fused(x, w, g, 1e-5, False, r) * 2

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, g, r)
    torch.testing.assert_close(out, 2 * want)
    torch.library.opcheck(torch.ops.scaletool.gemv_fused, (x, w, g, 1e-5, False, r))
    torch.library.opcheck(torch.ops.scaletool.gemv_fused, (x2[:1], w, None, 0.0, True, None))


@pytest.mark.skipif(not CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("n, k, norm, glu, residual", [
    (3648, 2048, True, False, False),  # mla-1b's joined query and latent projection after the block's RMSNorm
    (11264, 2048, True, False, False),  # its joined SwiGLU gate and up
    (2048, 2048, False, False, True),  # the attention's output projection adding the residual
    (2048, 5632, False, True, True),  # w2 of silu(gate)·up, adding the residual
    (40, 24, True, True, True), (100, 8192, True, False, True)])
def test_the_fused_kernel_matches_its_plain_composition(n, k, norm, glu, residual):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 1, 2 * k if glu else k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    g = (torch.rand(k, device="cuda", generator=gen) + 0.5).to(torch.bfloat16) if norm else None
    r = torch.randn(1, 1, n, device="cuda", generator=gen).to(torch.bfloat16) if residual else None
    assert gemv.supports_fused(x, w, g, glu, r) is None
    got = gemv.fused_linear(x, w, g, 1e-5, glu, r)
    want = gemv.fused_reference(x.float(), w.float(), None if g is None else g.float(), 1e-5, glu,
                                None if r is None else r.float())
    assert got.shape == (1, 1, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)
    assert "rows" in gemv.supports_fused(x.expand(2, 1, -1).contiguous(), w, g, glu, r)
