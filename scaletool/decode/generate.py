"""Prefill and autoregressive decoding over static caches: greedy, temperature and top-k sampling.

The decode loop keeps every token on the device: sampling uses the exponential-race form of
categorical sampling (argmax of p / E with E ~ Exp(1), as gpt-fast does) instead of
``torch.multinomial``, and the end-token check reads back to the host only every ``check_every``
steps, so a step never waits for the previous one to finish on the GPU.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from scaletool.config import ModelConfig, RecipeError
from scaletool.model.attention import DecodeMode
from scaletool.model.cache import make_caches
from scaletool.model.transformer import Transformer


def require_lm(cfg: ModelConfig) -> None:
    """Decoding generates tokens: refuse the regression model with one clear line."""
    if cfg.task != "lm":
        raise RecipeError(f"decode is for task=lm; this recipe has task={cfg.task} "
                          "(a regression model predicts values, it has no tokens to generate)")


def prefill(model: Transformer, tokens: torch.Tensor, caches: nn.ModuleList, start_pos: int = 0,
            chunk: int = 4096, mode: DecodeMode = DecodeMode()) -> torch.Tensor:
    """Feed a prompt (B, T) into the caches in chunks of ``chunk`` tokens; logits of its last token (B, vocab).

    Chunking bounds the activation memory of long prompts (a 32K prompt in one piece would need
    a T × d_ff activation and fused-attention workspace for all of it at once).
    """
    logits = None
    for s in range(0, tokens.shape[1], chunk):
        logits = model.step(tokens[:, s:s + chunk], start_pos + s, caches, mode)
    return logits


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens (B,) from logits (B, vocab): greedy at temperature 0, else softmax(logits / T) over the top k."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(-1)


def decode(model: Transformer, caches: nn.ModuleList, token: torch.Tensor, start_pos: int, steps: int, *,
           temperature: float = 0.0, top_k: int | None = None, end_token: int | None = None,
           check_every: int = 16, generator: torch.Generator | None = None,
           mode: DecodeMode = DecodeMode()) -> torch.Tensor:
    """Generate up to ``steps`` tokens after ``token`` (B,), which sits at position ``start_pos``.

    Returns (B, n) tokens, n <= steps: the loop stops early once every sequence has produced
    ``end_token`` (checked every ``check_every`` steps, the only host syncs); a finished sequence
    is padded with it.
    """
    out = torch.empty(token.shape[0], steps, dtype=torch.long, device=token.device)
    done = None if end_token is None else token == end_token
    for i in range(steps):
        if done is not None and i % check_every == 0 and bool(done.all()):
            return out[:, :i]
        token = sample(model.step(token[:, None], start_pos + i, caches, mode), temperature, top_k, generator)
        if done is not None:
            token = token.masked_fill(done, end_token)
            done |= token == end_token
        out[:, i] = token
    return out


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, end_token: int | None = None, mla_mode: str | None = None,
             kernel: str = "auto", seed: int | None = None, chunk: int = 4096) -> torch.Tensor:
    """Prompt (B, T) -> prompt and up to ``max_new_tokens`` generated tokens (B, T + n).

    Allocates caches for exactly T + max_new_tokens positions (growing the RoPE or sinusoid tables if
    that passes max_seq_len), prefills the prompt, samples the first new token from its logits and
    decodes the rest; ``mla_mode`` None is the model's default; ``seed`` makes sampling reproducible.
    """
    require_lm(model.cfg)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    B, T = prompt.shape
    mode = DecodeMode(mla_mode, kernel).resolved(model.cfg)
    model.extend_positions(T + max_new_tokens)
    weight = next(model.parameters())
    caches = make_caches(model.cfg, B, T + max_new_tokens, dtype=weight.dtype, device=weight.device,
                         mla_mode=mode.mla)
    gen = None if seed is None else torch.Generator(device=weight.device).manual_seed(seed)
    first = sample(prefill(model, prompt, caches, chunk=chunk, mode=mode), temperature, top_k, gen)
    rest = decode(model, caches, first, T, max_new_tokens - 1, temperature=temperature, top_k=top_k,
                  end_token=end_token, generator=gen, mode=mode)
    return torch.cat([prompt, first[:, None], rest], dim=1)
