"""The decoder-only family and the sequence-regression model.

Pre-norm blocks: x + attn(norm(x)), then x + ffn(norm(x)). ``task=lm`` embeds tokens and ends in a
(optionally tied) LM head with next-token cross-entropy; ``task=regression`` embeds groups of
continuous features, batch-normalises them, runs the same blocks without the causal mask and maps
the last time step to ``horizon`` outputs (MSE loss).

Build on ``meta`` to count without memory; ``build_model`` materialises and initialises.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletool.config import ModelConfig
from scaletool.model.attention import DecodeMode, make_attention
from scaletool.model.layers import RotaryEmbedding, make_norm
from scaletool.model.moe import MoE, aux_loss, make_ffn


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, sdpa_backend: str = "auto", layer_id: int = 0):
        super().__init__()
        self.attn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = make_attention(cfg, sdpa_backend)
        self.ffn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = make_ffn(cfg, layer_id)  # dense FeedForward, or MoE (ffn=moe past first_k_dense_replace)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: bool = True) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin, causal))
        return x + self.drop(self.ffn(self.ffn_norm(x)))

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, pos: int | torch.Tensor,
             mode: DecodeMode) -> torch.Tensor:
        """Inference: causal attention over ``cache`` (appended to), no dropout."""
        x = x + self.attn.decode(self.attn_norm(x), cos, sin, cache, pos, mode)
        return x + self.ffn(self.ffn_norm(x))


class FeatureEmbedding(nn.Module):
    """Embed groups of related features separately, concatenate to d_model, batch-normalise.

    Group g of ``feature_groups[g]`` features gets its own Linear to ``group_widths[g]`` channels
    (with bias); no positional encoding here, RoPE acts inside attention.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.sizes = list(cfg.feature_groups)
        self.proj = nn.ModuleList(nn.Linear(s, w) for s, w in zip(self.sizes, cfg.group_widths))
        self.bn = nn.BatchNorm1d(cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, n_features)
        parts = [p(chunk) for p, chunk in zip(self.proj, x.split(self.sizes, dim=-1))]
        h = torch.cat(parts, dim=-1)  # (B, T, d)
        return self.bn(h.transpose(1, 2)).transpose(1, 2)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, sdpa_backend: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.causal = cfg.task == "lm"
        if cfg.task == "lm":
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        else:
            self.feature_embed = FeatureEmbedding(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg, sdpa_backend, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        if cfg.task == "lm":
            self.output = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        else:
            self.head = nn.Linear(cfg.d_model, cfg.horizon)

    # -- parameters -----------------------------------------------------------------------------

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once each (a tied head shares the embedding).

        ``non_embedding=True`` drops the vocabulary matrices (token embedding and an untied LM head),
        as Kaplan et al. count N; it is what 12·d²·L approximates.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.cfg.task == "lm":
            n -= self.tok_embeddings.weight.numel()
            if self.output is not None:
                n -= self.output.weight.numel()
        return n

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, 0.02) for matrices and embeddings, output projections scaled by 1/sqrt(2L)
        (GPT-2), norms to one, biases to zero; RoPE tables recomputed (needed after ``to_empty``)."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device=next(self.parameters()).device).manual_seed(seed)
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, mod in self.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                s = out_std if name.endswith(("attn.wo", "ffn.w2", "shared.w2")) else std
                nn.init.normal_(mod.weight, 0.0, s, generator=gen)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, MoE):  # stacked expert weights, same stds as the dense FFN
                mod.init_weights(std, out_std, gen)
            elif isinstance(mod, (nn.RMSNorm, nn.LayerNorm, nn.BatchNorm1d)):
                mod.reset_parameters()
                if isinstance(mod, nn.BatchNorm1d):
                    mod.reset_running_stats()
        self.rope.reset_parameters()

    # -- forward ---------------------------------------------------------------------------------

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) or features (B, T, n_features) -> hidden states (B, T, d)."""
        h = self.tok_embeddings(inputs) if self.cfg.task == "lm" else self.feature_embed(inputs)
        if h.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(h.device.type):
            # a 16-bit residual stream, as under FSDP2's mixed-precision policy and DeepSpeed (and
            # Megatron by default): the fp32 embedding output would otherwise keep every residual
            # add and norm input in fp32, twice the element-wise traffic of the step
            h = h.to(torch.get_autocast_dtype(h.device.type))
        return self.drop(h)

    def hidden_states(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        """Input of every block and the final normed output; for monitors and tests."""
        h = self.embed(inputs)
        cos, sin = self.rope(0, h.shape[1])
        states = []
        for layer in self.layers:
            states.append(h)
            h = layer(h, cos, sin, self.causal)
        states.append(self.norm(h))
        return states

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None,
                return_features: bool = False):
        """lm: logits (B, T, vocab), or the mean next-token cross-entropy when ``targets`` (B, T) is given.

        regression: predictions (B, horizon) (with the pooled last-step features (B, d) when
        ``return_features``), or the MSE when ``targets`` (B, horizon) is given.
        """
        h = self.embed(inputs)
        cos, sin = self.rope(0, h.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin, self.causal)
        h = self.norm(h)
        if self.cfg.task == "lm":
            logits = self.lm_head(h)
            if targets is None:
                return logits
            return self._with_aux_loss(F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1)))
        feats = h[:, -1]  # (B, d): the last time step
        preds = self.head(feats)
        if targets is not None:
            return self._with_aux_loss(F.mse_loss(preds.float(), targets.float()))
        return (preds, feats) if return_features else preds

    def _with_aux_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The training loss plus the MoE balance losses of this forward (α·Σ over MoE layers; each MoE
        module keeps its last one). Dense models and α = 0 add nothing."""
        aux = aux_loss(self)
        return loss if aux is None else loss + aux

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden states (..., d) -> logits (..., vocab), through the tied or untied head."""
        return F.linear(h, self.tok_embeddings.weight if self.output is None else self.output.weight)

    # -- incremental decoding (task=lm) ----------------------------------------------------------

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: int | torch.Tensor, caches, mode: DecodeMode = DecodeMode(),
             all_logits: bool = False) -> torch.Tensor:
        """Run tokens (B, T) at positions pos.. against per-layer ``caches`` (appending to them).

        Returns logits (B, vocab) of the last position, or (B, T, vocab) with ``all_logits``. The
        caches come from ``scaletool.decode.cache.make_caches`` (built for ``mode.mla``); positions
        must fit the RoPE table (see :meth:`extend_rope`). ``pos`` is an int, or a 0-dim integer
        device tensor for one token per call over the static caches (CUDA-graph friendly: no host
        reads; the caller keeps pos below the caches' length and the RoPE table).
        """
        T = tokens.shape[1]
        if isinstance(pos, torch.Tensor):
            if T != 1:
                raise ValueError(f"a device-tensor position decodes one token per call, got {T}")
            at = pos.reshape(1)
            cos, sin = self.rope.cos.index_select(0, at), self.rope.sin.index_select(0, at)
        else:
            if pos + T > self.rope.max_seq_len:
                raise ValueError(f"positions up to {pos + T} exceed the RoPE table ({self.rope.max_seq_len}); "
                                 "call extend_rope first")
            cos, sin = self.rope(pos, T)
        h = self.tok_embeddings(tokens)
        for layer, cache in zip(self.layers, caches):
            h = layer.step(h, cos, sin, cache, pos, mode)
        return self.lm_head(self.norm(h if all_logits else h[:, -1]))

    def extend_rope(self, max_len: int) -> None:
        """Grow the RoPE tables to ``max_len`` positions (plain extrapolation, no frequency scaling).

        The tables are computed, not learned, so longer ones cost nothing but memory; a model trained
        at max_seq_len is not known to generalise past it, but the cost of decoding is the same.
        """
        if max_len > self.rope.max_seq_len:
            with torch.device(self.rope.cos.device):
                self.rope = RotaryEmbedding(self.rope.dim, max_len, self.rope.theta)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", *, seed: int | None = 0,
                sdpa_backend: str = "auto") -> Transformer:
    """Construct on ``meta`` (no memory), then materialise on ``device`` and initialise.

    ``device='meta'`` returns the shapes only, which is all counting needs.
    """
    with torch.device("meta"):
        model = Transformer(cfg, sdpa_backend)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
