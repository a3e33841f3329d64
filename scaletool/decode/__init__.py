"""Decoding: preallocated KV caches, prefill + autoregressive generation, and their measurement."""
