"""The analytic model: closed forms, config in, numbers out. No model is instantiated here.

Conventions, stated once:
- FLOPs are floating-point operations, a multiply-add counts as 2.
- "causal" attention FLOPs count the T²/2 scores a causal mask leaves (PaLM, Chowdhery et al. 2022,
  appendix B); "full" counts all T² (what FlopCounterMode and fvcore measure, since SDPA computes
  the masked tiles' cost away only inside fused kernels).
- Matmul parameters are the weights of every Linear layer, the LM head included (tied or not); the
  token-embedding and learned-position lookups are gathers, no matmul; norms, biases, position
  tables added to the embeddings and ALiBi's score bias are element-wise (not counted).
- Each attention kind's own closed forms (parameters by projection, cache per token, decode FLOPs)
  live with the kind, ``scaletool.kinds.attention``; this package sums them over the model.
- Mixture of experts (ffn=moe): "active" parameters are those one token multiplies (dense parts,
  router, shared experts, its top-k routed experts); ``matmul_params`` and the FLOPs count those.
  The dropless dispatch (``moe_dispatch: dropless``) computes exactly k experts per token, so FLOPs
  *computed* (what a FLOP counter sees, the ``*_computed`` keys) equal *useful* FLOPs (the MFU
  convention, the plain keys). The capacity dispatch computes every expert's full capacity buffer:
  E·C/N ≈ capacity_factor·k routed experts per token computed, k useful.
Import each name from its module (this package re-exports nothing); :mod:`.engines` gives the engine kinds their forms.
"""
