"""The host's issue time in eager mode: seconds per block that bound a step whose device work is smaller.

Each op of an eager block's forward and backward is launched from Python; the device runs ahead only while its
queue holds work, so a micro-batch whose blocks' GPU work is shorter than the host's time to issue them runs at
the host's pace (PyTorch's performance tuning guide: "CPU-bound" small batches; the reason CUDA graphs and
``torch.compile`` exist). The figure per block is measured, not fitted to step times: ``scaletool calibrate
--recipe R`` runs the recipe's block at one sequence of at most 128 tokens, at one and at three blocks, in a loop
that never waits on the device, on every GPU of the host at once (:mod:`scaletool.predict.calibrate_host`).

Compiled blocks issue a few fused kernels instead of hundreds of ops: their issue time is not charged here
(the compiled rows of the committed validation are device-bound). Tensor parallelism's DTensor dispatch is its
own fitted figure (``tp_*_block_s``, :func:`scaletool.analytic.step._tp_dispatch`), which replaces this one.
"""
from __future__ import annotations

from scaletool.analytic.calibration import Calibration
from scaletool.config import ModelConfig

MODES = ("autocast", "bf16")


def overhead_key(mode: str, attention: str, moe: bool) -> str:
    """The calibration key of one measured figure: ``eager_<mode>_block[_mla][_moe]_s``. MHA, GQA and MQA issue
    the same ops (only the head counts differ); MLA's latent path and an MoE layer's router and experts issue more."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    return f"eager_{mode}_block{'_mla' if attention == 'mla' else ''}{'_moe' if moe else ''}_s"


def tp_overhead_key(mode: str, attention: str) -> str:
    """The calibration key of a tensor-parallel block's issue time per micro-batch (``scaletool calibrate``'s TP
    probe, :mod:`scaletool.predict.calibrate_tp`): ``tp_<eager|compiled>_microbatch_block[_mla]_s``."""
    return f"tp_{mode}_microbatch_block{'_mla' if attention == 'mla' else ''}_s"


#: a tensor-parallel step's measured parts (:mod:`scaletool.predict.calibrate_tp`, ``probe_step``): per block and
#: micro-batch, per micro-batch besides the blocks, per block and optimizer step, per step
TP_STEP_PARTS = ("block", "head", "update_block", "update")


def tp_step_key(part: str, mode: str, attention: str) -> str:
    """The calibration key of one measured part of a tensor-parallel step's issue time (TP over every rank, no
    FSDP2): ``tp_<eager|compiled>_step_<part>[_mla]_s``."""
    if part not in TP_STEP_PARTS:
        raise ValueError(f"part {part!r}: one of {', '.join(TP_STEP_PARTS)}")
    return f"tp_{mode}_step_{part}{'_mla' if attention == 'mla' else ''}_s"


def tp_step_dispatch_s(n_layers: int, gas: int, mode: str, attention: str, calib: Calibration) -> float | None:
    """Host seconds to issue a tensor-parallel step of ``n_layers`` blocks and ``gas`` micro-batches from the parts
    ``scaletool calibrate`` measured on its host, g·(L·b + h) + L·u + c; None where the calibration has not all four."""
    ov = calib.overheads
    got = [ov.get(tp_step_key(part, mode, attention)) for part in TP_STEP_PARTS]
    if any(v is None for v in got):
        return None
    b, h, u, c = got
    return max(0.0, gas * (n_layers * b + h) + n_layers * u + c)


def block_dispatch_s(attention: str, moe: bool, autocast: bool, calib: Calibration) -> float:
    """Host seconds to issue one eager block's forward and backward for an engine that computes under autocast
    (``autocast``) or on 16-bit weights; the closest measured figure (the attention's, then MHA's, then the
    dense block's), 0 where the calibration has none."""
    mode = "autocast" if autocast else "bf16"
    ov = calib.overheads
    for key in dict.fromkeys((overhead_key(mode, attention, moe), overhead_key(mode, "mha", moe),
                              overhead_key(mode, attention, False), overhead_key(mode, "mha", False))):
        if key in ov:
            return float(ov[key])
    return 0.0


def eager_dispatch_s(cfg: ModelConfig, layers, micro_batches: int, autocast: bool, compiled: bool,
                     calib: Calibration) -> float:
    """Host issue seconds of ``micro_batches`` forward + backward passes over the eager blocks ``layers`` (layer
    indices; 0 compiled). An MoE model's leading dense layers are charged at the dense block's figure."""
    if compiled or micro_batches <= 0:
        return 0.0
    moe = cfg.ffn == "moe"
    per = {m: block_dispatch_s(cfg.attention, m, autocast, calib) for m in {False, moe}}
    return micro_batches * sum(per[moe and i >= cfg.first_k_dense_replace] for i in layers)
