"""Fused attention's FLOPs for the counters: FlopCounterMode and fvcore see SDPA's fused kernels as one op
each, so its forward and backward FLOPs are given here by formula (shared by :mod:`.count` and
:mod:`.count_modules`)."""
from __future__ import annotations

import torch


def _sdpa_fwd_flops(q_shape, k_shape, v_shape) -> int:
    """2·B·H·T·S·(d_qk + d_v): QKᵀ plus AV, H from q so GQA/MQA count every query head."""
    B, H, T, dqk = q_shape
    S, dv = k_shape[-2], v_shape[-1]
    return 2 * B * H * T * S * (dqk + dv)


def _sdpa_formula(backward: bool):
    def formula(query, key, value, *args, out_shape=None, **kwargs) -> int:
        f = _sdpa_fwd_flops(query, key, value)
        return 2 * f if backward else f  # backward: dQ, dK, dV and dP, two matmuls per forward one
    return formula


def _flop_counter_mapping() -> dict:
    aten = torch.ops.aten
    mapping = {}
    fwd = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    for name in fwd:
        op = getattr(aten, name, None)
        if op is not None:
            mapping[op] = _sdpa_formula(False)
        bwd = getattr(aten, name + "_backward", None)
        if bwd is not None:
            mapping[bwd] = _bwd_formula
    return mapping


def _bwd_formula(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return 2 * _sdpa_fwd_flops(query, key, value)
