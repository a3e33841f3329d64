"""Tiny models of every cache layout, built from recipes/tiny.yaml (imported by the decode tests)."""
from __future__ import annotations

from conftest import RECIPES

from scaletool.config import load_recipe
from scaletool.model import build_model

# (label, recipe overrides, mla_mode): every cache layout the decoder has.
_NOT_MLA = {"model.kv_lora_rank": 0, "model.qk_nope_head_dim": None, "model.v_head_dim": None,
            "model.qk_rope_head_dim": None}
VARIANTS = {
    "mha": ({"model.attention": "mha", **_NOT_MLA}, "absorbed"),
    "gqa": ({"model.attention": "gqa", "model.n_kv_heads": 2, **_NOT_MLA}, "absorbed"),
    "mqa": ({"model.attention": "mqa", **_NOT_MLA}, "absorbed"),
    "mla": ({}, "absorbed"),
    "mla-naive": ({}, "naive"),
}


def tiny_cfg(label: str, **extra):
    overrides, _ = VARIANTS[label]
    return load_recipe(RECIPES / "tiny.yaml", extra={**overrides, **extra}).model


def tiny_model(label: str, seed: int = 0, **extra):
    """(cfg, fp32 model in eval mode, mla_mode) for one cache layout."""
    cfg = tiny_cfg(label, **extra)
    return cfg, build_model(cfg, "cpu", seed=seed).eval(), VARIANTS[label][1]
