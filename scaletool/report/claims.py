"""The price-prediction transformer's stated attention-memory claim, checked.

The claim states "traditional attention memory = n_heads·seq²·head_dim = 663,552,000 vs MLA =
kv_lora_rank·seq + n_heads·head_dim = 46,592, a 14,000× saving". That sets an attention-score count
against a cache size. The report includes this check only when its data has the price transformer
(an MLA regression model in estimate mode): a table and a finding giving the real figures per
sequence, all layers: the KV cache MLA keeps (latent + shared RoPE key), the MHA-equivalent cache,
and the H·T² score matrix a naive attention materialises per layer (the same for MLA and MHA).
"""
from __future__ import annotations

from dataclasses import dataclass

from scaletool.analytic.kv import kv_cache
from scaletool.fmt import gib
from scaletool.report.data import ResultsSet, Row
from scaletool.report.tables import Column, Table

#: the document's configuration and its stated figures
CLAIM_CONFIG = {"n_heads": 8, "seq_len": 180, "head_dim": 64, "kv_lora_rank": 256}
CLAIM_STATED = {"traditional": 663_552_000, "mla": 46_592, "saving": 14_000}


@dataclass(frozen=True)
class ClaimFigures:
    claim_traditional: int  # n_heads·seq²·head_dim
    claim_mla: int  # kv_lora_rank·seq + n_heads·head_dim
    mla_cache: int  # elements, all layers, one sequence
    mha_cache: int
    scores: int  # H·T², one layer
    is_document_config: bool

    @property
    def claim_saving(self) -> float:
        return self.claim_traditional / self.claim_mla

    @property
    def real_saving(self) -> float:
        return self.mha_cache / self.mla_cache


def claim_rows(rs: ResultsSet) -> list[Row]:
    """One MLA regression estimate per distinct attention shape: the claim's figures do not depend on
    the FFN or anything else a sweep may vary alongside."""
    seen, out = set(), []
    for r in sorted(rs.ok("estimate"), key=rs.order):
        m = r.recipe.model
        if r.attention != "mla" or m.task != "regression":
            continue
        key = (r.source, m.n_heads, m.n_layers, r.recipe.seq_len, m.head_dim, m.kv_lora_rank, m.qk_nope_head_dim,
               m.qk_rope_head_dim, m.v_head_dim, m.dtype)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def claim_figures(r: Row) -> ClaimFigures:
    m, T = r.recipe.model, r.recipe.seq_len
    kv = kv_cache(m)
    cfg = {"n_heads": m.n_heads, "seq_len": T, "head_dim": m.head_dim, "kv_lora_rank": m.kv_lora_rank}
    return ClaimFigures(claim_traditional=m.n_heads * T * T * m.head_dim,
                        claim_mla=m.kv_lora_rank * T + m.n_heads * m.head_dim,
                        mla_cache=kv["elements_per_token_per_layer"] * T * m.n_layers,
                        mha_cache=kv["mha_equivalent_bytes_per_token"] // m.dtype_bytes * T,
                        scores=m.n_heads * T * T, is_document_config=cfg == CLAIM_CONFIG)


def claim_table(rs: ResultsSet) -> Table | None:
    """The claim's figures beside the real ones, per distinct attention shape of the price transformer."""
    rows = claim_rows(rs)
    if not rows:
        return None
    t = Table("claim", "The price transformer's attention-memory claim, checked",
              [Column("point")] + ([Column("source")] if rs.multi else [])
              + [Column("quantity"), Column("claim's formula"), Column("real")],
              note="Real figures per sequence at the recipe's seq_len and dtype, all layers unless marked.")
    for r in rows:
        c = claim_figures(r)
        stated = f" (document: {CLAIM_STATED['traditional']:,})" if c.is_document_config else ""
        b = r.recipe.model.dtype_bytes
        lead = [f"kv_lora_rank={r.kv_lora_rank}"] + ([r.source] if rs.multi else [])
        t.rows += [lead + row for row in (
            ["traditional: n_heads·seq²·head_dim", f"{c.claim_traditional:,}{stated}", ""],
            ["MLA: kv_lora_rank·seq + n_heads·head_dim", f"{c.claim_mla:,}", ""],
            ["saving", f"{c.claim_saving:,.0f}×", f"{c.real_saving:.2f}× (KV cache)"],
            ["MLA KV cache (latent + RoPE key)", "", f"{c.mla_cache:,} elements, {gib(c.mla_cache * b)}"],
            ["MHA-equivalent KV cache", "", f"{c.mha_cache:,} elements, {gib(c.mha_cache * b)}"],
            ["naive score matrix H·T², one layer (MLA = MHA)", "", f"{c.scores:,} elements, {gib(c.scores * b)}"],
        )]
    return t


def claim_findings(rs: ResultsSet) -> list[str]:
    out = []
    for r in claim_rows(rs):
        c, m = claim_figures(r), r.recipe.model
        stated = ""
        if c.is_document_config:
            stated = (f"The claim states {CLAIM_STATED['traditional']:,} vs {CLAIM_STATED['mla']:,}, "
                      f"a {CLAIM_STATED['saving']:,}× saving; its own formula n_heads·seq²·head_dim gives "
                      f"{c.claim_traditional:,}, and kv_lora_rank·seq + n_heads·head_dim gives {c.claim_mla:,}. ")
        where = (f"{r.source}: " if rs.multi else "") + f"kv_lora_rank={r.kv_lora_rank}"
        out.append(f"{where}: {stated}The comparison mixes an attention-score count with a cache size. "
                   f"Real figures at seq_len {r.recipe.seq_len}, {m.n_layers} layers: the KV cache is "
                   f"{c.mla_cache:,} elements for MLA against {c.mha_cache:,} for the MHA-equivalent, a "
                   f"{c.real_saving:.2f}× saving, not {c.claim_saving:,.0f}×; the naive score matrix "
                   f"(H·T² = {c.scores:,} elements per layer) is the same for both and fused SDPA never stores it.")
    return out
