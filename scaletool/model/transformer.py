"""The decoder-only family and the sequence-regression model.

Blocks (``model.norm_placement``):

- ``pre`` (default; GPT-2, Llama): x + attn(norm(x)), then x + ffn(norm(x)); a final norm after the
  last block.
- ``post`` (Vaswani et al. 2017 §3.1, BERT, GPT-1): x = norm(x + attn(x)), then x = norm(x + ffn(x)):
  the residual stream is normalised after every residual add, so the last block's second norm is the
  final normalisation and there is no separate final norm (fairseq builds none with
  ``normalize_before=False``, nor does Hugging Face's openai-gpt); BERT's extra LayerNorm of the
  embeddings is not part of it.

``task=lm`` embeds tokens and ends in a (optionally tied) LM head with next-token cross-entropy;
``task=regression`` embeds groups of continuous features, batch-normalises them, runs the same blocks
without the causal mask and maps the last time step to ``horizon`` outputs (MSE loss). Positions
(``model.position_encoding``, ``scaletool.model.positions``): RoPE and ALiBi act inside attention,
learned and sinusoidal tables are added to the embeddings.

Build on ``meta`` to count without memory; ``build_model`` materialises and initialises.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletool.config import ModelConfig
from scaletool.kinds.attention import position_kind
from scaletool.model.attention import DecodeMode, make_attention
from scaletool.model.layers import make_norm
from scaletool.model.moe import MoE, aux_loss, make_ffn
from scaletool.model.positions import ALiBi, Positions, RotaryEmbedding, SinusoidalTable


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, sdpa_backend: str = "auto", layer_id: int = 0):
        super().__init__()
        self.post = cfg.norm_placement == "post"
        self.attn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = make_attention(cfg, sdpa_backend)
        self.ffn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = make_ffn(cfg, layer_id)  # dense FeedForward, or MoE (ffn=moe past first_k_dense_replace)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def _residual(self, x: torch.Tensor, norm: nn.Module, f, drop) -> torch.Tensor:
        """One sub-layer with its residual: x + f(norm(x)) (pre) or norm(x + f(x)) (post)."""
        return norm(x + drop(f(x))) if self.post else x + drop(f(norm(x)))

    def forward(self, x: torch.Tensor, positions: Positions, causal: bool = True) -> torch.Tensor:
        x = self._residual(x, self.attn_norm, lambda h: self.attn(h, positions, causal), self.drop)
        return self._residual(x, self.ffn_norm, self.ffn, self.drop)

    def step(self, x: torch.Tensor, positions: Positions, cache, pos: int | torch.Tensor,
             mode: DecodeMode) -> torch.Tensor:
        """Inference: causal attention over ``cache`` (appended to), no dropout."""
        x = self._residual(x, self.attn_norm, lambda h: self.attn.decode(h, positions, cache, pos, mode), _identity)
        return self._residual(x, self.ffn_norm, self.ffn, _identity)

    @torch.no_grad()
    def attention_probs(self, x: torch.Tensor, positions: Positions, causal: bool = True) -> torch.Tensor:
        """Attention weights (B, H, T, T) of this block for block input ``x`` (its attention reads norm(x)
        pre-norm, x itself post-norm)."""
        return self.attn.probs(x if self.post else self.attn_norm(x), positions, causal)


class FeatureEmbedding(nn.Module):
    """Embed groups of related features separately, concatenate to d_model, batch-normalise.

    Group g of ``feature_groups[g]`` features gets its own Linear to ``group_widths[g]`` channels
    (with bias); positions are added after it (a table) or act inside attention (RoPE, ALiBi).
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
        pk = position_kind(cfg)
        if cfg.task == "lm":
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        else:
            self.feature_embed = FeatureEmbedding(cfg)
        # position tables added to the embeddings, RoPE tables or ALiBi slopes for attention (one of them, or none)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model) if pk.table == "learned" else None
        self.pos_table = SinusoidalTable(cfg.d_model, cfg.max_seq_len) if pk.table == "fixed" else None
        self.rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta) if pk.rotary else None
        self.alibi = ALiBi(cfg.n_heads) if pk.bias else None
        # Vaswani et al. §3.4 scale token embeddings by sqrt(d_model) before adding the sinusoids
        self.embed_scale = math.sqrt(cfg.d_model) if pk.table == "fixed" and cfg.task == "lm" else 1.0
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.layers = nn.ModuleList(Block(cfg, sdpa_backend, i) for i in range(cfg.n_layers))
        # post-norm blocks end normalised: no separate final norm (module docstring)
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.norm_placement == "pre" else nn.Identity()
        if cfg.task == "lm":
            self.output = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        else:
            self.head = nn.Linear(cfg.d_model, cfg.horizon)

    # -- parameters -----------------------------------------------------------------------------

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once each (a tied head shares the embedding).

        ``non_embedding=True`` drops the vocabulary matrices (token embedding and an untied LM head) and a
        learned position table, as Kaplan et al. count N; it is what 12·d²·L approximates.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            vocab = [self.tok_embeddings, self.output] if self.cfg.task == "lm" else []
            n -= sum(m.weight.numel() for m in (*vocab, self.pos_embeddings) if m is not None)
        return n

    def join_projections(self) -> int:
        """Join the projections that read one input into one layer each, for decoding: wq, wk, wv (MHA,
        GQA, MQA); wq (or wq_a) and wkv_a (MLA); SwiGLU's w1 and w3 (dense and shared-expert FFNs).
        The same numbers and parameter count, fewer GEMMs per step (``scaletool.model.layers.join_linears``);
        the joined layers replace their parts, so a joined model's state dict has the joined names.
        Returns how many groups were joined (0 when already joined)."""
        return sum(m.join_projections() for m in self.modules() if m is not self and hasattr(m, "join_projections"))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, 0.02) for matrices and embeddings (the learned position table too), output projections
        scaled by 1/sqrt(2L) (GPT-2), norms to one, biases to zero; position buffers recomputed (needed after
        ``to_empty``)."""
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
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self, device: str | torch.device | None = None) -> None:
        """Compute the position buffers (RoPE and sinusoid tables, ALiBi slopes: non-persistent, never in a
        checkpoint), first materialising them on ``device`` when given (a model built on meta)."""
        for mod in (self.rope, self.pos_table, self.alibi):
            if mod is not None:
                if device is not None:
                    mod.to_empty(device=device)
                mod.reset_parameters()

    # -- forward ---------------------------------------------------------------------------------

    def _embed(self, inputs: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """Tokens (B, T) or features (B, T, n_features) at positions start.. -> (B, T, d), position table added."""
        h = self.tok_embeddings(inputs) if self.cfg.task == "lm" else self.feature_embed(inputs)
        table = self.pos_embeddings.weight if self.pos_embeddings is not None else (
            self.pos_table.table if self.pos_table is not None else None)
        if table is None:
            return h
        T = inputs.shape[1]
        if isinstance(start, torch.Tensor):
            rows = table.index_select(0, start.reshape(1))
        elif start + T > table.shape[0]:
            raise ValueError(f"positions up to {start + T} exceed the {self.cfg.position_encoding} position table "
                             f"({table.shape[0]} rows)")
        else:
            rows = table[start:start + T]
        return h * self.embed_scale + rows.to(h.dtype)

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) or features (B, T, n_features) -> hidden states (B, T, d)."""
        h = self._embed(inputs)
        if h.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(h.device.type):
            # a 16-bit residual stream, as under FSDP2's mixed-precision policy and DeepSpeed (and
            # Megatron by default): the fp32 embedding output would otherwise keep every residual
            # add and norm input in fp32, twice the element-wise traffic of the step
            h = h.to(torch.get_autocast_dtype(h.device.type))
        return self.drop(h)

    def positions(self, start: int | torch.Tensor, length: int, n_keys: int, dtype: torch.dtype) -> Positions:
        """What attention needs for ``length`` queries at positions start.. over keys 0..n_keys-1 (an int start,
        or a 0-dim device tensor for one query): RoPE tables and the ALiBi bias in ``dtype``."""
        cos = sin = bias = None
        on_device = isinstance(start, torch.Tensor)
        if self.rope is not None:
            cos, sin = self.rope.at(start) if on_device else self.rope(start, length)
        if self.alibi is not None:
            q_pos = start.reshape(1) if on_device else torch.arange(start, start + length,
                                                                      device=self.alibi.slopes.device)
            bias = self.alibi.bias(q_pos, n_keys, self.causal).to(dtype)
        return Positions(cos, sin, bias, self.rope)

    def hidden_states(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        """Input of every block and the final normed output; for monitors and tests."""
        h = self.embed(inputs)
        positions = self.positions(0, h.shape[1], h.shape[1], h.dtype)
        states = []
        for layer in self.layers:
            states.append(h)
            h = layer(h, positions, self.causal)
        states.append(self.norm(h))
        return states

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None,
                return_features: bool = False):
        """lm: logits (B, T, vocab), or the mean next-token cross-entropy when ``targets`` (B, T) is given.

        regression: predictions (B, horizon) (with the pooled last-step features (B, d) when
        ``return_features``), or the MSE when ``targets`` (B, horizon) is given.
        """
        h = self.embed(inputs)
        positions = self.positions(0, h.shape[1], h.shape[1], h.dtype)  # one ALiBi bias for every layer
        for layer in self.layers:
            h = layer(h, positions, self.causal)
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
        """Normed hidden states (..., d) -> logits (..., vocab), through the tied or untied head.

        The untied head is called as a module, so an engine that partitions parameters and gathers them in
        module hooks (DeepSpeed ZeRO-3, FSDP2) has the weight whole here; reading ``output.weight`` directly
        would hand ZeRO-3's empty partition to the matmul under ``torch.compile``. The tied head reads the
        embedding's weight outside the embedding's forward: such engines register it as a parameter of
        the root module's forward (:mod:`scaletool.engines.deepspeed`; FSDP2 keeps the root's parameters,
        embedding included, unsharded from the root's forward through its backward)."""
        if self.output is not None:
            return self.output(h)
        return F.linear(h, self.tok_embeddings.weight)

    # -- incremental decoding (task=lm) ----------------------------------------------------------

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: int | torch.Tensor, caches, mode: DecodeMode = DecodeMode(),
             all_logits: bool = False) -> torch.Tensor:
        """Run tokens (B, T) at positions pos.. against per-layer ``caches`` (appending to them).

        Returns logits (B, vocab) of the last position, or (B, T, vocab) with ``all_logits``. The
        caches come from ``scaletool.model.cache.make_caches`` (built for ``mode.mla``); positions
        must fit the position tables (see :meth:`extend_positions`). ``pos`` is an int, or a 0-dim
        integer device tensor for one token per call over the static caches (CUDA-graph friendly: no
        host reads; the caller keeps pos below the caches' length and the tables).
        """
        T = tokens.shape[1]
        if isinstance(pos, torch.Tensor) and T != 1:
            raise ValueError(f"a device-tensor position decodes one token per call, got {T}")
        mode = mode.resolved(self.cfg)
        h = self._embed(tokens, pos)
        n_keys = caches[0].max_len if isinstance(pos, torch.Tensor) else pos + T
        positions = self.positions(pos, T, n_keys, h.dtype)
        for layer, cache in zip(self.layers, caches):
            h = layer.step(h, positions, cache, pos, mode)
        return self.lm_head(self.norm(h if all_logits else h[:, -1]))

    def extend_positions(self, max_len: int) -> int | None:
        """Grow the RoPE or sinusoid tables to ``max_len`` positions (plain extrapolation, no frequency
        scaling); returns ``max_len`` when a table grew, None when none needed to.

        Computed tables cost nothing but memory; a model trained at max_seq_len is not known to generalise
        past it, but the cost of decoding is the same. ALiBi and NoPE have no table; a learned table cannot
        grow (ValueError).
        """
        if not position_kind(self.cfg).extrapolates and max_len > self.cfg.max_seq_len:
            raise ValueError(f"position_encoding=learned: the table has max_seq_len={self.cfg.max_seq_len} rows, "
                             f"positions up to {max_len} cannot be encoded")
        grew = None
        for name in ("rope", "pos_table"):
            table = getattr(self, name)
            if table is not None and max_len > table.max_seq_len:
                setattr(self, name, table.grown(max_len))
                grew = max_len
        return grew


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
