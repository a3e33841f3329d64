"""Device kernels the model calls, each beside its plain-torch reference (no model code here).

- :mod:`.mla_decode`: attention of one query per sequence over an MLA latent cache (Triton split-KV,
  with the torch reference CPUs run).
- :mod:`.gemv`: the linear layers of a decode step's few rows (Triton; F.linear elsewhere).
- :mod:`.split_add`: a joined 16-bit gradient added into its two fp32 parts in one pass (MoE experts' w1|w3
  under ``train.weight_cast=step``).
"""
