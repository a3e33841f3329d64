"""Tiny models of every cache layout and decode path, built from recipes/tiny.yaml (imported by the decode tests)."""
from __future__ import annotations

from conftest import RECIPES

from scaletool.config import load_recipe
from scaletool.model import build_model

# (label, recipe overrides, mla_mode): every cache layout and decode path the decoder has, and the
# position encodings that act at decode time (ALiBi's bias over the cache, a learned and a fixed table,
# none) and the post-norm block.
_NOT_MLA = {"model.kv_lora_rank": 0, "model.qk_nope_head_dim": None, "model.v_head_dim": None,
            "model.qk_rope_head_dim": None}
_MHA = {"model.attention": "mha", **_NOT_MLA}
VARIANTS = {
    "mha": (_MHA, None),
    "gqa": ({"model.attention": "gqa", "model.n_kv_heads": 2, **_NOT_MLA}, None),
    "mqa": ({"model.attention": "mqa", **_NOT_MLA}, None),
    "mla": ({}, "absorbed"),
    "mla-naive": ({}, "naive"),
    "mla-expand": ({}, "expand"),
    "mla-per_head": ({"model.mla_rope": "per_head"}, "expand"),
    "mla-per_head-naive": ({"model.mla_rope": "per_head"}, "naive"),
    "gqa-alibi": ({"model.attention": "gqa", "model.n_kv_heads": 2, "model.position_encoding": "alibi", **_NOT_MLA}, None),
    "mha-learned": ({**_MHA, "model.position_encoding": "learned"}, None),
    "mha-sinusoidal": ({**_MHA, "model.position_encoding": "sinusoidal"}, None),
    "mha-nope-post": ({**_MHA, "model.position_encoding": "none", "model.norm_placement": "post"}, None),
}
#: one variant per cache layout (the position encodings and norms do not change what is cached)
LAYOUTS = ("mha", "gqa", "mqa", "mla", "mla-naive", "mla-per_head")


def tiny_cfg(label: str, **extra):
    overrides, _ = VARIANTS[label]
    return load_recipe(RECIPES / "tiny.yaml", extra={**overrides, **extra}).model


def tiny_model(label: str, seed: int = 0, **extra):
    """(cfg, fp32 model in eval mode, mla_mode) for one cache layout."""
    cfg = tiny_cfg(label, **extra)
    return cfg, build_model(cfg, "cpu", seed=seed).eval(), VARIANTS[label][1]
