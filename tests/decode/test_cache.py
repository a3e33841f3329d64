"""Static caches: layout, sizes against the analytic model, non-persistence, row replication."""
from __future__ import annotations

import pytest
import torch
from tiny_variants import VARIANTS, tiny_cfg

from scaletool.decode.bench import cache_bytes_per_token
from scaletool.model.cache import KVCache, LatentCache, cache_bytes, make_caches, replicate_first_row


@pytest.mark.parametrize("label", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_allocated_bytes_equal_the_analytic_bytes_per_token(label, dtype):
    cfg = tiny_cfg(label, **{"model.dtype": dtype})
    mode = VARIANTS[label][1]
    caches = make_caches(cfg, 3, 50, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], device="cpu",
                         mla_mode=mode)
    assert cache_bytes(caches) == cache_bytes_per_token(cfg, mode) * 3 * 50
    kind = LatentCache if mode in ("absorbed", "expand") else KVCache
    assert all(isinstance(c, kind) for c in caches) and len(caches) == cfg.n_layers


def test_mla_latent_cache_holds_only_c_kv_and_the_shared_rope_key():
    cfg = tiny_cfg("mla")
    (c,) = make_caches(cfg, 2, 10, dtype=torch.float32, device="cpu")[:1]
    assert c.names == ("c_kv", "k_pe")
    assert c.c_kv.shape == (2, 10, cfg.kv_lora_rank) and c.k_pe.shape == (2, 10, cfg.qk_rope_head_dim)
    naive = make_caches(cfg, 2, 10, dtype=torch.float32, device="cpu", mla_mode="naive")[0]
    assert naive.k.shape == (2, cfg.n_heads, 10, cfg.qk_head_dim) and naive.v.shape == (2, cfg.n_heads, 10, cfg.v_dim)
    expand = make_caches(cfg, 2, 10, dtype=torch.float32, device="cpu", mla_mode="expand")[0]
    assert expand.names == ("c_kv", "k_pe")  # expand reads the same latent cache as absorbed


def test_per_head_rope_mla_caches_the_latent_alone_and_refuses_absorbed():
    """Its RoPE keys come out of the latent, so c_kv is all a latent cache holds: kv_lora_rank numbers per
    token and layer, against kv_lora_rank + qk_rope_head_dim for the shared key."""
    cfg = tiny_cfg("mla-per_head")
    (c,) = make_caches(cfg, 2, 10, dtype=torch.float32, device="cpu")[:1]  # the default mode: expand
    assert c.names == ("c_kv",) and c.c_kv.shape == (2, 10, cfg.kv_lora_rank)
    assert cache_bytes_per_token(cfg, None) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) == \
        cache_bytes_per_token(tiny_cfg("mla"), None) * cfg.kv_lora_rank
    with pytest.raises(ValueError, match="mla_rope=per_head cannot absorb W_UK into the query"):
        make_caches(cfg, 1, 4, dtype=torch.float32, device="cpu", mla_mode="absorbed")


def test_update_writes_in_place_and_returns_the_prefix():
    c = KVCache(2, 8, 1, 4, 4, torch.float32, "cpu")
    k1, v1 = torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    k, v = c.update(0, k1, v1)
    assert k.shape == (1, 1, 3, 4) and torch.equal(k[0, 0], k1[0, :, 0])
    k2 = torch.randn(1, 1, 1, 4)
    k, _ = c.update(3, k2, k2)
    assert k.shape == (1, 1, 4, 4) and torch.equal(k[0, 0, 3], k2[0, 0, 0]) and torch.equal(k[0, 0, :3], k1[0, :, 0])
    assert not c.k[1].any()  # row 1 untouched


def test_caches_stay_out_of_state_dicts_and_follow_to():
    caches = make_caches(tiny_cfg("mla"), 1, 4, dtype=torch.float32, device="cpu")
    assert caches.state_dict() == {}
    assert caches.to(torch.bfloat16)[0].c_kv.dtype == torch.bfloat16


def test_replicate_first_row_copies_the_prompt_prefix_only():
    for label in ("mha", "mla", "mla-per_head"):
        caches = make_caches(tiny_cfg(label), 3, 6, dtype=torch.float32, device="cpu")
        for b in caches.buffers():
            b[0].normal_()
        replicate_first_row(caches, 4, 3)
        for b in caches.buffers():
            s = b[:, :, :4] if b.dim() == 4 else b[:, :4]
            rest = b[1:, :, 4:] if b.dim() == 4 else b[1:, 4:]
            assert torch.equal(s[1], s[0]) and torch.equal(s[2], s[0]) and not rest.any()


def test_a_device_position_writes_one_token_and_returns_the_whole_static_buffers():
    c = LatentCache(2, 6, {"c_kv": 4, "k_pe": 2}, torch.float32, "cpu")
    c_kv, k_pe = torch.randn(2, 1, 4), torch.randn(2, 1, 2)
    full_c, full_pe = c.update(torch.tensor(3), c_kv, k_pe)
    assert full_c.shape == (2, 6, 4) and full_pe.shape == (2, 6, 2)  # static: shape independent of the position
    assert torch.equal(full_c[:, 3], c_kv[:, 0]) and not full_c[:, :3].any() and not full_c[:, 4:].any()
    kv = KVCache(1, 5, 2, 3, 3, torch.float32, "cpu")
    k = torch.randn(1, 1, 2, 3)
    full_k, _ = kv.update(torch.tensor(4), k, k)
    assert full_k.shape == (1, 2, 5, 3) and torch.equal(full_k[0, :, 4], k[0, 0])
    ref = KVCache(1, 5, 2, 3, 3, torch.float32, "cpu")
    ref.update(4, k, k)  # the int path writes the same place
    assert torch.equal(ref.k, kv.k)


def test_bad_modes_are_rejected():
    with pytest.raises(ValueError, match="mla_mode"):
        make_caches(tiny_cfg("mla"), 1, 4, dtype=torch.float32, device="cpu", mla_mode="latent")
    with pytest.raises(ValueError, match="mla_mode naive is for attention=mla recipes; this one is gqa"):
        make_caches(tiny_cfg("gqa"), 1, 4, dtype=torch.float32, device="cpu", mla_mode="naive")
