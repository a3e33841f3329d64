"""Decoding: preallocated KV caches, prefill + autoregressive generation, and their measurement.

Kept free of imports: the model's attention imports ``scaletool.decode.kernels``, and the rest of
this package imports the model.
"""
