"""The one-pass split gradient add (scaletool.kernels.split_add): where it declines, and on a CUDA machine with
Triton the kernel bit for bit against the two add_ calls it replaces, inside weight_cast's hook too."""
from __future__ import annotations

import pytest
import torch

from scaletool.engines import weight_cast
from scaletool.kernels import split_add

CUDA_TRITON = split_add.triton is not None and torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA_TRITON, reason="needs a CUDA device and Triton")


def test_it_declines_cpu_tensors_and_mismatched_gradients():
    g = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    assert split_add.supports([None, None], g) is not None  # CPU, or no Triton
    with pytest.raises(ValueError, match="split_add_"):
        split_add.split_add_([None, None], g)
    if CUDA_TRITON:
        gc = g.cuda()
        half = torch.zeros(3, 4, 8, device="cuda")
        assert split_add.supports([None, None], gc) is None and split_add.supports([half, half.clone()], gc) is None
        assert "one gradient exists" in split_add.supports([half, None], gc)
        assert "fp32" in split_add.supports([half.bfloat16(), half], gc)
        assert "fp32" in split_add.supports([half[..., :4], half], gc)
        assert "contiguous 16-bit" in split_add.supports([None, None], gc.float())
        assert "equal halves" in split_add.supports([None, None], torch.randn(3, 4, 15, device="cuda", dtype=torch.bfloat16))


def test_the_hook_splits_the_gradient_where_the_kernel_declines():
    w1, w3 = (torch.nn.Parameter(torch.randn(2, 3, 5)) for _ in range(2))
    w16 = torch.cat([w1, w3], -1).detach().bfloat16().requires_grad_(True)
    w16.register_post_accumulate_grad_hook(weight_cast._accumulate_split([w1, w3], -1))
    g = torch.randn(2, 3, 10, dtype=torch.bfloat16)
    for _ in range(2):
        w16.backward(g)
    assert w16.grad is None
    assert torch.equal(w1.grad, 2 * g[..., :5].float()) and torch.equal(w3.grad, 2 * g[..., 5:].float())


@cuda_only
@pytest.mark.parametrize("shape", [(16, 2048, 2048), (3, 5, 2 * 1000), (1, 1, 2 * 3)])
def test_the_kernel_equals_two_add_calls_bit_for_bit(shape):
    torch.manual_seed(0)
    g1, g2 = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    half = shape[-1] // 2
    fresh = split_add.split_add_([None, None], g1)
    assert [t.dtype for t in fresh] == [torch.float32] * 2 and all(t.is_contiguous() for t in fresh)
    assert torch.equal(fresh[0], g1[..., :half].float()) and torch.equal(fresh[1], g1[..., half:].float())
    want = [fresh[0].clone().add_(g2[..., :half]), fresh[1].clone().add_(g2[..., half:])]
    again = split_add.split_add_(fresh, g2)
    assert again[0] is fresh[0] and again[1] is fresh[1]  # in place
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])


@cuda_only
def test_the_hook_takes_the_kernel_on_cuda_and_keeps_the_numbers():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 64, 96, device="cuda")) for _ in range(2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    w16 = torch.cat(params, -1).detach().bfloat16().requires_grad_(True)
    w16.register_post_accumulate_grad_hook(weight_cast._accumulate_split(params, -1))
    for _ in range(3):
        g = torch.randn(4, 64, 192, device="cuda", dtype=torch.bfloat16)
        w16.backward(g)
        for p, part in zip(ref, g.split(96, -1)):  # what the hook did before the kernel
            weight_cast._add_grad(p, part)
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(params, ref))
