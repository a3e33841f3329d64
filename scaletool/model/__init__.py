"""The model family: single-device PyTorch modules, no distributed imports."""
from scaletool.model.attention import MLA, Attention
from scaletool.model.transformer import Block, Transformer, build_model

__all__ = ["Attention", "MLA", "Block", "Transformer", "build_model"]
