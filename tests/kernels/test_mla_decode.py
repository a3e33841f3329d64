"""The absorbed latent-attention step: torch reference against explicit per-head attention, and the
fused Triton kernel against the reference (on a CUDA machine with Triton; skipped elsewhere)."""
from __future__ import annotations

import pytest
import torch

from scaletool.kernels import mla_decode as kernels


def _inputs(B, H, C, R, S, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)  # noqa: E731
    # Slices of longer buffers, as the cache hands them over (strided along batch).
    return mk(B, H, C), mk(B, H, R), mk(B, S + 7, C)[:, :S], mk(B, S + 7, R)[:, :S]


def test_reference_is_softmax_attention_with_the_latent_as_shared_key_and_value():
    q_lat, q_pe, c_kv, k_pe = _inputs(2, 4, 32, 16, 9, torch.float32)
    out = kernels.latent_attention(q_lat, q_pe, c_kv, k_pe, 0.3, kernel="torch")
    for b in range(2):
        for h in range(4):
            s = (c_kv[b] @ q_lat[b, h] + k_pe[b] @ q_pe[b, h]) * 0.3
            torch.testing.assert_close(out[b, h], s.softmax(0) @ c_kv[b])


def test_auto_falls_back_to_the_reference_where_the_kernel_cannot_run():
    assert kernels.triton_supports(torch.device("cpu"), torch.bfloat16, 512, 64) is not None
    q_lat, q_pe, c_kv, k_pe = _inputs(1, 2, 32, 8, 5, torch.float32)
    torch.testing.assert_close(kernels.latent_attention(q_lat, q_pe, c_kv, k_pe, 0.2),
                               kernels.latent_attention_reference(q_lat, q_pe, c_kv, k_pe, 0.2))


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,H,S", [(3, 16, 1000), (1, 16, 5), (130, 16, 4096), (2, 20, 333), (4, 4, 64)])
def test_triton_kernel_matches_the_reference(B, H, S):
    q_lat, q_pe, c_kv, k_pe = _inputs(B, H, 512, 64, S, torch.bfloat16, device="cuda")
    got = kernels.latent_attention(q_lat, q_pe, c_kv, k_pe, 1 / 192 ** 0.5, kernel="triton")
    want = kernels.latent_attention_reference(q_lat.float(), q_pe.float(), c_kv.float(), k_pe.float(), 1 / 192 ** 0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
