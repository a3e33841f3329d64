"""On CUDA, the fused attention kernels the training path dispatches to (flash for MHA/GQA, cuDNN for
MLA's 192/128 head dims, cuDNN or memory-efficient for ALiBi's float bias, which flash refuses) must
keep the causal mask: changing later tokens never changes earlier logits, and the fused output matches
the plain softmax reference. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from scaletool.config import recipe_from_dict
from scaletool.model import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = {
    "mha": {"attention": "mha"},
    "gqa": {"attention": "gqa", "n_kv_heads": 2},
    "mla": {"attention": "mla", "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128},
    "mla-per_head": {"attention": "mla", "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                     "v_head_dim": 128, "mla_rope": "per_head"},
    "gqa-alibi": {"attention": "gqa", "n_kv_heads": 2, "position_encoding": "alibi"},
}


def model_for(name: str):
    cfg = recipe_from_dict({"model": {"d_model": 512, "n_layers": 2, "n_heads": 4, "head_dim": 128,
                                      "intermediate_size": 512, "vocab_size": 1000, "max_seq_len": 512,
                                      **SHAPES[name]}}).model
    return build_model(cfg, "cuda", seed=0)


@pytest.mark.parametrize("name", list(SHAPES))
def test_future_tokens_do_not_change_earlier_logits(name):
    model = model_for(name)
    x = torch.randint(0, 1000, (2, 256), device="cuda")
    y = x.clone()
    y[:, 128:] = torch.randint(0, 1000, (2, 128), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        a, b = model(x).float(), model(y).float()
    assert (a[:, :128] - b[:, :128]).abs().max().item() < 1e-3  # identical up to kernel nondeterminism
    assert (a[:, 128:] - b[:, 128:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_attention_matches_reference(name):
    model = model_for(name).eval()
    attn = model.layers[0].attn
    x = torch.randn(2, 256, 512, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        positions = model.positions(0, 256, 256, torch.bfloat16)
        q, k, v = attn.qkv(x, positions)
        fused = attn(x, positions)
    probs = attn.probs(x, model.positions(0, 256, 256, torch.float32))  # fp32 reference
    if v.shape[2] != probs.shape[1]:
        v = v.repeat_interleave(probs.shape[1] // v.shape[2], dim=2)
    ref = attn.wo(torch.einsum("bhts,bshd->bthd", probs, v.float()).reshape(2, 256, -1))
    err = (fused.float() - ref).norm() / ref.norm()
    assert err < 2e-2, err
