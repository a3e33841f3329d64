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


def _w_uv(H, V, C, nope=8, dtype=torch.float32, device="cpu"):
    """W_UV as the model hands it over: value rows of wkv_b's (H·(nope+V), C) weight, a strided view."""
    g = torch.Generator(device=device).manual_seed(3)
    wkv_b = torch.randn(H * (nope + V), C, generator=g, device=device).to(dtype)
    return wkv_b.view(H, nope + V, C)[:, nope:]


def test_w_uv_maps_each_heads_latent_sum_to_its_values():
    q_lat, q_pe, c_kv, k_pe = _inputs(2, 4, 32, 16, 9, torch.float32)
    w_uv = _w_uv(4, 12, 32)
    out = kernels.latent_attention(q_lat, q_pe, c_kv, k_pe, 0.3, kernel="torch", w_uv=w_uv)
    y_lat = kernels.latent_attention(q_lat, q_pe, c_kv, k_pe, 0.3, kernel="torch")
    assert out.shape == (2, 4, 12)
    for b in range(2):
        for h in range(4):
            torch.testing.assert_close(out[b, h], w_uv[h] @ y_lat[b, h])


def test_auto_falls_back_to_the_reference_where_the_kernel_cannot_run():
    assert kernels.triton_supports(torch.device("cpu"), torch.bfloat16, 512, 64) is not None
    q_lat, q_pe, c_kv, k_pe = _inputs(1, 2, 32, 8, 5, torch.float32)
    torch.testing.assert_close(kernels.latent_attention(q_lat, q_pe, c_kv, k_pe, 0.2),
                               kernels.latent_attention_reference(q_lat, q_pe, c_kv, k_pe, 0.2))


def test_lengths_mask_the_positions_past_each_sequence():
    q_lat, q_pe, c_kv, k_pe = _inputs(3, 4, 32, 16, 12, torch.float32)
    lengths = torch.tensor([12, 5, 1])
    out = kernels.latent_attention(q_lat, q_pe, c_kv, k_pe, 0.3, kernel="torch", lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        want = kernels.latent_attention_reference(q_lat[b:b + 1], q_pe[b:b + 1], c_kv[b:b + 1, :n], k_pe[b:b + 1, :n], 0.3)
        torch.testing.assert_close(out[b:b + 1], want)
    one = kernels.latent_attention(q_lat, q_pe, c_kv, k_pe, 0.3, kernel="torch", lengths=torch.tensor(5))
    torch.testing.assert_close(one, kernels.latent_attention_reference(q_lat, q_pe, c_kv[:, :5], k_pe[:, :5], 0.3))


@pytest.mark.parametrize("B,H,S", [(1, 16, 5), (1, 16, 32768), (130, 16, 32768), (2000, 16, 4096), (3, 128, 4096),
                                   (7, 20, 333)])
@pytest.mark.parametrize("cfg", [kernels.KernelConfig(), kernels.KernelConfig(block_s=32, programs_per_sm=1),
                                 kernels.KernelConfig(programs_per_sm=16, min_split=64)])
def test_splits_cover_the_sequence_in_whole_tiles_and_none_is_empty(B, H, S, cfg):
    n, split_len = cfg.splits(B, H, S, sms=132)
    assert split_len % cfg.block_s == 0 and (n - 1) * split_len < S <= n * split_len
    assert n == 1 or split_len >= min(cfg.min_split, S)
    programs = B * n * -(-H // 16)
    assert n == 1 or programs <= cfg.programs_per_sm * 132 + B * -(-H // 16)  # splits stop at the target


def test_a_static_cache_a_few_rows_past_the_tuned_splits_gets_one_short_split_more_where_the_merge_applies_w_uv():
    cfg = kernels.KernelConfig(n_splits=64)
    assert cfg.splits(1, 16, 4096, 132) == (64, 64)
    assert cfg.splits(1, 16, 4131, 132) == (65, 64)  # 4,096 + the decode's 35 extra positions
    assert cfg.splits(8, 16, 32803, 132) == (65, 512)
    assert cfg.splits(9, 16, 4131, 132) == (33, 128)  # past MERGE_UP_MAX_ROWS the serial merge: tiles rounded up
    assert cfg.splits(1, 16, 4096 + 100, 132) == (33, 128)  # more than one short split: rounded up as before


def test_merging_splits_equals_one_softmax_over_all_keys():
    q_lat, q_pe, c_kv, k_pe = _inputs(2, 3, 16, 8, 10, torch.float32)
    whole = kernels.latent_attention_reference(q_lat, q_pe, c_kv, k_pe, 0.5)
    parts, lse = [], []
    for lo, hi in ((0, 4), (4, 10), (10, 10)):  # the last split is empty, as past a sequence's length
        s = (torch.einsum("bhc,bsc->bhs", q_lat, c_kv[:, lo:hi]) + torch.einsum("bhr,bsr->bhs", q_pe, k_pe[:, lo:hi])) * 0.5
        if hi > lo:
            parts.append(s.softmax(-1) @ c_kv[:, lo:hi])
            lse.append(torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0)))
        else:
            parts.append(torch.zeros_like(whole))
            lse.append(torch.full(whole.shape[:2], float("-inf")))
    merged = kernels.merge_splits(torch.stack(parts, 1), torch.stack(lse, 1))
    torch.testing.assert_close(merged, whole)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,H,S", [(3, 16, 1000), (1, 16, 5), (130, 16, 4096), (2, 20, 333), (4, 4, 64)])
def test_triton_kernel_matches_the_reference(B, H, S):
    q_lat, q_pe, c_kv, k_pe = _inputs(B, H, 512, 64, S, torch.bfloat16, device="cuda")
    got = kernels.latent_attention(q_lat, q_pe, c_kv, k_pe, 1 / 192 ** 0.5, kernel="triton")
    want = kernels.latent_attention_reference(q_lat.float(), q_pe.float(), c_kv.float(), k_pe.float(), 1 / 192 ** 0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("cfg", [None, kernels.KernelConfig(block_s=32, num_warps=4, num_stages=3),
                                 kernels.KernelConfig(programs_per_sm=16, min_split=64)])
def test_triton_kernel_reads_device_lengths(cfg):
    B, H, S = 5, 16, 3000
    q_lat, q_pe, c_kv, k_pe = _inputs(B, H, 512, 64, S, torch.bfloat16, device="cuda", seed=1)
    lengths = torch.tensor([3000, 1, 64, 65, 2999], device="cuda", dtype=torch.int32)
    got = kernels.latent_attention_triton(q_lat, q_pe, c_kv, k_pe, 0.07, lengths=lengths, config=cfg)
    want = kernels.latent_attention_reference(q_lat.float(), q_pe.float(), c_kv.float(), k_pe.float(), 0.07,
                                              lengths=lengths)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("cfg", [kernels.KernelConfig(block_s=16, max_registers=168),
                                 kernels.KernelConfig(block_s=32, max_registers=128, n_splits=1, direct=True)])
def test_a_register_cap_spills_but_gives_the_references_answer(cfg):
    B, H, S = 4, 16, 1000
    q_lat, q_pe, c_kv, k_pe = _inputs(B, H, 512, 64, S, torch.bfloat16, device="cuda", seed=2)
    lengths = torch.tensor([1000, 1, 65, 999], device="cuda", dtype=torch.int32)
    got = kernels.latent_attention_triton(q_lat, q_pe, c_kv, k_pe, 0.07, lengths=lengths, config=cfg)
    want = kernels.latent_attention_reference(q_lat.float(), q_pe.float(), c_kv.float(), k_pe.float(), 0.07,
                                              lengths=lengths)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,splits,C", [(1, 1, 512), (3, 37, 512), (2, 600, 64)])
def test_fused_merge_equals_the_torch_merge(B, splits, C):
    g = torch.Generator(device="cuda").manual_seed(5)
    o_part = torch.randn(B, splits, 16, C, generator=g, device="cuda")
    lse = torch.randn(B, splits, 16, generator=g, device="cuda") * 4
    lse[:, splits // 2 + 1:] = float("-inf")  # trailing splits past the sequence's length
    out = kernels.merge_splits_triton(o_part, lse, torch.bfloat16)
    torch.testing.assert_close(out.float(), kernels.merge_splits(o_part, lse), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,S", [(1, 100), (300, 1024)])
def test_direct_single_split_store_matches_the_reference(B, S):
    q_lat, q_pe, c_kv, k_pe = _inputs(B, 16, 512, 64, S, torch.bfloat16, device="cuda")
    cfg = kernels.KernelConfig(n_splits=1, direct=True)
    lengths = torch.full((B,), S - 3, device="cuda")
    got = kernels.latent_attention_triton(q_lat, q_pe, c_kv, k_pe, 0.07, lengths=lengths, config=cfg)
    want = kernels.latent_attention_reference(q_lat, q_pe, c_kv, k_pe, 0.07, lengths)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,splits,V", [(1, 32, 128), (3, 37, 128), (8, 1, 128), (2, 5, 48)])
def test_merge_with_w_uv_equals_the_merge_then_the_up_projection(B, splits, V):
    g = torch.Generator(device="cuda").manual_seed(5)
    o_part = torch.randn(B, splits, 16, 512, generator=g, device="cuda")
    lse = torch.randn(B, splits, 16, generator=g, device="cuda") * 4
    lse[:, splits // 2 + 1:] = float("-inf")  # trailing splits past the sequence's length
    w_uv = _w_uv(16, V, 512, nope=128, dtype=torch.bfloat16, device="cuda")
    out = kernels.merge_up_triton(o_part, lse, w_uv, torch.bfloat16)
    want = kernels.up_project(kernels.merge_splits(o_part, lse), w_uv.float())
    torch.testing.assert_close(out.float(), want, atol=0.1, rtol=2e-2)  # bf16 output, values up to ~100


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("block_c", [32, 64, 128, 512])
def test_the_merge_up_sums_its_channel_blocks_in_a_fixed_order_and_leaves_its_counters_at_zero(block_c):
    """Each head's C / block_c programs arrive in any order; the last sums their parts in block order, so two
    calls give the same bits, and the counters it was given are zero again after it (reusable)."""
    g = torch.Generator(device="cuda").manual_seed(6)
    o_part = torch.randn(2, 57, 16, 512, generator=g, device="cuda")
    lse = torch.randn(2, 57, 16, generator=g, device="cuda") * 4
    w_uv = _w_uv(16, 128, 512, nope=128, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(2 * 16, device="cuda", dtype=torch.int32)
    outs = [kernels.merge_up_triton(o_part, lse, w_uv, torch.bfloat16, counters=counters, block_c=block_c)
            for _ in range(3)]
    assert not counters.any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    want = kernels.up_project(kernels.merge_splits(o_part, lse), w_uv.float())
    torch.testing.assert_close(outs[0].float(), want, atol=0.1, rtol=2e-2)
    with pytest.raises(ValueError, match="must divide"):
        kernels.merge_up_triton(o_part, lse, w_uv, torch.bfloat16, block_c=96)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,S,cfg", [(1, 4096, None), (1, 100, kernels.KernelConfig(n_splits=1, direct=True)),
                                     (20, 2000, None), (4, 333, kernels.KernelConfig(n_splits=3))])
def test_triton_kernel_with_w_uv_matches_the_reference(B, S, cfg):
    """Split at a few sequences (the merge applies W_UV), one direct split, and past MERGE_UP_MAX_ROWS."""
    q_lat, q_pe, c_kv, k_pe = _inputs(B, 16, 512, 64, S, torch.bfloat16, device="cuda", seed=2)
    w_uv = _w_uv(16, 128, 512, nope=128, dtype=torch.bfloat16, device="cuda") * 0.05
    lengths = torch.full((B,), S - 1, device="cuda", dtype=torch.int32)
    got = kernels.latent_attention_triton(q_lat, q_pe, c_kv, k_pe, 0.07, lengths=lengths, config=cfg, w_uv=w_uv)
    want = kernels.up_project(kernels.latent_attention_reference(q_lat.float(), q_pe.float(), c_kv.float(),
                                                                 k_pe.float(), 0.07, lengths), w_uv.float())
    assert got.shape == (B, 16, 128) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not kernels.triton_available() or not torch.cuda.get_device_capability() >= (9, 0),
                    reason="needs a Hopper GPU (programmatic dependent launch) and Triton")
@pytest.mark.parametrize("B,S,length,cfg", [(1, 4131, 4100, None), (1, 4131, 4131, None), (3, 700, 65, None),
                                            (2, 333, 200, kernels.KernelConfig(n_splits=3, block_s=32))])
def test_under_pdl_the_kernel_sees_the_row_the_launch_before_it_wrote(B, S, length, cfg):
    """This step's cache row (at length - 1) written by the two launches just before the attention kernel:
    Triton kernels under PDL that let the next kernel start before they store, in a CUDA graph as the decode
    step runs. The result is the reference's over the new row, not the stale one. (A version of the kernel
    that loaded each split's first tile before its wait and reloaded that row after it passed this and was
    slower: decode-preload-h100.)"""
    import triton
    import triton.language as tl

    from scaletool.kernels import pdl

    @triton.jit
    def write_row(src, dst, row, s_b, s_s, N: tl.constexpr, USE_PDL: tl.constexpr):
        pdl.start(USE_PDL)  # waits, then lets the attention kernel start before this one stores
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, N)
        tl.store(dst + b * s_b + row * s_s + offs, tl.load(src + b * N + offs))

    q_lat, q_pe, c_kv, k_pe = _inputs(B, 16, 512, 64, S, torch.bfloat16, device="cuda", seed=7)
    lengths = torch.full((B,), length, device="cuda", dtype=torch.int32)
    new_kv = torch.randn(B, 512, device="cuda", dtype=torch.bfloat16) * 20  # a row whose score dominates or
    new_pe = torch.randn(B, 64, device="cuda", dtype=torch.bfloat16) * 20  # vanishes, head by head

    def step():
        for src, dst in ((new_kv, c_kv), (new_pe, k_pe)):
            write_row[(B,)](src, dst, length - 1, dst.stride(0), dst.stride(1), N=src.shape[1], **pdl.launch(dst.device))
        return kernels.latent_attention_triton(q_lat, q_pe, c_kv, k_pe, 0.07, lengths=lengths, config=cfg)

    with pdl.enabled(True):
        assert pdl.launch(c_kv.device)["USE_PDL"]
        first = step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    new_kv.neg_()  # the row the replay writes differs from the one before
    new_pe.neg_()
    graph.replay()
    torch.cuda.synchronize()
    want = kernels.latent_attention_reference(q_lat.float(), q_pe.float(), c_kv.float(), k_pe.float(), 0.07, lengths)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert not torch.allclose(first.float(), want, atol=2e-2, rtol=2e-2)  # the new row changed the answer


def test_the_absorbed_query_is_each_heads_product_and_an_operator_with_shapes():
    g = torch.Generator().manual_seed(4)
    w_uk = torch.randn(4 * 20, 32, generator=g).view(4, 20, 32)[:, :12]  # W_UK: key rows of wkv_b, a strided view
    q_nope = torch.randn(3, 4, 16, generator=g)[:, :, :12]
    out = kernels.absorb_query(q_nope, w_uk)
    for b in range(3):
        for h in range(4):
            torch.testing.assert_close(out[b, h], q_nope[b, h] @ w_uk[h])
    torch.library.opcheck(torch.ops.scaletool.mla_absorb_q, (q_nope, w_uk))
    f = torch.compile(kernels.absorb_query, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(q_nope, w_uk), out)


def test_the_up_projection_writes_batch_major_values_with_one_batched_gemm():
    g = torch.Generator().manual_seed(7)
    y, w = torch.randn(5, 4, 32, generator=g), torch.randn(4, 12, 32, generator=g)
    out = kernels.up_project(y, w)
    assert out.shape == (5, 4, 12) and out.is_contiguous()
    torch.testing.assert_close(out, torch.einsum("bhc,hvc->bhv", y, w))
    f = torch.compile(kernels.up_project, fullgraph=True, backend="aot_eager")  # the tracer's form
    torch.testing.assert_close(f(y, w), out)


def test_the_absorbed_query_keeps_the_batched_gemms_head_major_layout_and_the_kernel_reads_it_as_it_is():
    """No contiguous copy of q_lat: (B, H, C) over an (H, B, C) tensor, which the attention accepts."""
    g = torch.Generator().manual_seed(5)
    w_uk, q_nope = torch.randn(4, 12, 32, generator=g), torch.randn(3, 4, 12, generator=g)
    out = kernels.absorb_query(q_nope, w_uk)
    assert out.shape == (3, 4, 32) and not out.is_contiguous() and out.transpose(0, 1).is_contiguous()
    assert torch.ops.scaletool.mla_absorb_q(q_nope, w_uk).shape == (4, 3, 32)
    _, q_pe, c_kv, k_pe = _inputs(3, 4, 32, 16, 9, torch.float32)
    got = kernels.latent_attention(out, q_pe, c_kv, k_pe, 0.3, kernel="auto")
    torch.testing.assert_close(got, kernels.latent_attention_reference(out.contiguous(), q_pe, c_kv, k_pe, 0.3))


@pytest.mark.skipif(not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,H,N,C", [(1, 16, 128, 512), (8, 16, 128, 512), (3, 20, 100, 96)])
def test_triton_absorbed_query_matches_the_einsum(B, H, N, C):
    g = torch.Generator(device="cuda").manual_seed(6)
    w_uk = (torch.randn(H * (N + 128), C, generator=g, device="cuda") / N**0.5).to(torch.bfloat16)
    w_uk = w_uk.view(H, N + 128, C)[:, :N]
    q_nope = torch.randn(B, H * (N + 64), generator=g, device="cuda").to(torch.bfloat16).view(B, H, N + 64)[:, :, :N]
    got = kernels.absorb_query_triton(q_nope, w_uk)
    want = torch.einsum("bhn,hnc->bhc", q_nope.float(), w_uk.float())
    assert got.dtype == torch.bfloat16 and got.shape == (B, H, C)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_the_kernel_is_a_custom_operator_with_a_fake_implementation():
    """opcheck runs the registered operator (on a CPU: its reference body) through schema, fake-tensor
    and autograd-registration checks; a compiled call keeps it in one graph."""
    q_lat, q_pe, c_kv, k_pe = _inputs(2, 4, 32, 16, 9, torch.float32)
    for lengths in (torch.tensor(5), None):
        torch.library.opcheck(torch.ops.scaletool.mla_decode, (q_lat, q_pe, c_kv, k_pe, 0.3, lengths))
    w_uv = _w_uv(4, 12, 32)
    torch.library.opcheck(torch.ops.scaletool.mla_decode, (q_lat, q_pe, c_kv, k_pe, 0.3, torch.tensor(5), w_uv))
    g = torch.compile(lambda *a: torch.ops.scaletool.mla_decode(*a), fullgraph=True, backend="aot_eager")
    assert g(q_lat, q_pe, c_kv, k_pe, 0.3, None, w_uv).shape == (2, 4, 12)
    f = torch.compile(lambda *a: torch.ops.scaletool.mla_decode(*a), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(q_lat, q_pe, c_kv, k_pe, 0.3, torch.tensor(5)),
                               kernels.latent_attention_reference(q_lat, q_pe, c_kv, k_pe, 0.3, torch.tensor(5)))
