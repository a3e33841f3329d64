"""Calibration: the measured rates of one card and its interconnect that the step-time model reads.

A calibration is a YAML file (shipped ones in ``profiles/calibrations/``, or any path): GEMM rate as
a saturating curve of the GEMM's smallest dimension, the fused attention kernel's rate by head dims,
HBM copy bandwidth, the element-wise traffic factors, bus bandwidth per collective and group size
(intra-node; one inter-node figure) and the host overheads. Where no calibration exists,
:func:`default_calibration` scales a hardware profile's datasheet peaks by the ratios measured on the
H100 SXM. Torch-free: the measuring side is ``scaletool.predict.calibrate``.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from scaletool.analytic.power import profile_clock_ratio
from scaletool.errors import RecipeError, echo, shorten
from scaletool.resources import data_dir, read_bounded

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

#: What the shipped H100 SXM calibration measured against its datasheet (989 TFLOP/s dense bf16,
#: 3,350 GB/s HBM, NVLink 4 at 450 GB/s a direction); :func:`default_calibration` applies them to a
#: profile that has no calibration of its own.
DATASHEET_RATIOS = {"gemm_max": 0.83, "attention": 0.30, "hbm": 0.895, "bus": 0.75}
#: dense FP8 over dense bf16 tensor-core peak (H100 SXM 1979 / 989 TFLOP/s): the FP8 GEMM rate where no
#: calibration measured one
FP8_OVER_BF16 = 2.0
#: The H100 SXM's own datasheet default re-predicting the committed dense H100 runs (``calibrate --validate``'s
#: set): runs, median and worst |error| in tokens/s per GPU, as a default calibration's source states them;
#: tests/predict/test_datasheet_default.py keeps them equal to what the runs give
DATASHEET_DEFAULT_ERROR = (91, 0.025, 0.151)


#: The sequence length an attention rate is read at when none is given (where single-T calibrations measured it).
ATTENTION_REFERENCE_SEQ = 2048
#: one H200, torch 2.11 (benchmarks/results/plan-verify/h200-2026-11-29-untuned/): a 32,768 x 1,600 x 50,257 bf16 head's
#: forward and backward GEMMs against the padded 50,304, by their summed time (eager 106-147 TFLOP/s against 660-703;
#: compiled 574-640)
UNALIGNED_GEMM = {"eager": 0.186, "compiled": 0.876}
#: ALiBi's bias path (SDPA handed the dense score bias, no causal kernel: 2x the work, a slower kernel) against the
#: causal kernel, time for time, where a calibration has no ``alibi`` entry: 2.96-3.27x measured at T = 2,048 ...
#: 8,192 on an H200 (benchmarks/results/attention-seq/README.md)
ALIBI_OVER_CAUSAL_TIME = 3.1
#: ``attention_tflops``' key of ALiBi's bias path (causal convention, any head dims), beside the 'qk/v' ones
ALIBI_KEY = "alibi"


def attention_at(entry, seq: int | None = None) -> float:
    """TFLOP/s of one head-dims entry of ``attention_tflops`` at sequence length ``seq``: a number is the rate at
    every T; a ``{T: rate}`` mapping (keys ints or digit strings, as YAML and JSON give them) is interpolated
    linearly in log2 T between the measured lengths and held at the nearest one beyond them."""
    if not isinstance(entry, dict):
        return float(entry)
    points = sorted((int(t), float(r)) for t, r in entry.items())
    x = math.log2(max(1, seq if seq is not None else ATTENTION_REFERENCE_SEQ))
    if x <= math.log2(points[0][0]):
        return points[0][1]
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
        if x <= math.log2(t1):
            w = (x - math.log2(t0)) / (math.log2(t1) - math.log2(t0))
            return r0 + w * (r1 - r0)
    return points[-1][1]


def curve_rate(g: dict, m: float, n: float, k: float) -> float:
    """FLOP/s of an (m×k)·(k×n) GEMM on a ``{"max_tflops", "half_dim"}`` curve: R·s/(s+h), s the smallest dimension."""
    s = max(1.0, min(m, n, k))
    return g["max_tflops"] * 1e12 * s / (s + g["half_dim"])


@dataclass(frozen=True)
class Calibration:
    """Rates of one card (+ its interconnect). Rates are TFLOP/s and GB/s (10^9 bytes/s)."""
    name: str
    source: str
    #: {"max_tflops": R, "half_dim": h}: a GEMM whose smallest dimension is s runs at R·s/(s+h);
    #: "points" keeps the measured shapes the curve was fitted to ({m, n, k, tflops}).
    gemm_tflops: dict
    #: fused causal SDPA forward + backward by "qk/v" head dims ("128/128"), and "default"
    attention_tflops: dict
    hbm_gb_s: float
    #: {"intra_node_gb_s": {op: {ranks: bus GB/s}}, "inter_node_gb_s": bus GB/s per GPU, "source": str}
    collectives: dict
    #: host seconds: "step_s", "micro_batch_s", and per engine ("ddp_micro_batch_s", "fsdp_per_block_s",
    #: "zero3_per_module_s", "zero12_step_s"); overlap: hidden fraction of overlappable communication
    overheads: dict
    peak_tflops: float = 989.0
    #: HBM bytes of element-wise work per byte of eager saved activations, eager and compiled
    elementwise: dict = field(default_factory=lambda: {"eager_bytes_factor": 10.0, "compiled_bytes_factor": 3.5})
    memory_gib: float | None = None  # what the card reports as total memory
    hardware: str = ""  # the hardware profile's name
    measured: dict = field(default_factory=dict)  # the raw figures (median, p10, p90, n) behind the rates
    #: FP8 GEMMs (train.float8), {"max_tflops", "half_dim"} as gemm_tflops; None: not calibrated, the bf16
    #: curve times FP8_OVER_BF16 (the datasheets' dense FP8 peak is twice the bf16 one)
    gemm_fp8_tflops: dict | None = None
    #: a GEMM with a dimension that is not a multiple of 16 bytes' elements (GPT-2's vocabulary of 50,257) runs at
    #: this fraction of the curve: eager (cuBLAS off its aligned kernels) and compiled (Inductor pads it)
    gemm_unaligned: dict = field(default_factory=lambda: dict(UNALIGNED_GEMM))
    #: the file it was read from (not a key of the file; "" when built in code)
    file: str = ""

    def gemm_rate(self, m: float, n: float, k: float) -> float:
        """FLOP/s of an (m×k)·(k×n) bf16 GEMM."""
        return curve_rate(self.gemm_tflops, m, n, k)

    def unaligned_factor(self, m: float, n: float, k: float, compiled: bool, element_bytes: int = 2) -> float:
        """The share of :meth:`gemm_rate` a GEMM keeps where a dimension is not a multiple of 16 bytes' elements
        (8 in 16 bits): ``gemm_unaligned``'s eager or compiled figure; 1 where every dimension is aligned."""
        per = max(1, 16 // element_bytes)
        if all(int(x) % per == 0 for x in (m, n, k)):
            return 1.0
        return float(self.gemm_unaligned["compiled" if compiled else "eager"])

    def gemm_rate_fp8(self, m: float, n: float, k: float) -> float:
        """FLOP/s of the same GEMM in FP8 (torch._scaled_mm): calibrated, else twice the bf16 rate."""
        g = self.gemm_fp8_tflops
        if not g:
            return FP8_OVER_BF16 * self.gemm_rate(m, n, k)
        return curve_rate(g, m, n, k)

    def attention_rate(self, qk_dim: int, v_dim: int, seq: int | None = None, bias: bool = False) -> float:
        """FLOP/s (causal convention) of fused SDPA forward + backward at these head dims and sequence length.
        An entry is one rate, or ``{T: rate}`` measured at several T: interpolated in log T between them, the
        nearest measured T's rate beyond their range; ``seq`` None reads it at :data:`ATTENTION_REFERENCE_SEQ`.
        ``bias``: ALiBi's dense score bias path, its ``alibi`` entry, else the causal rate over
        :data:`ALIBI_OVER_CAUSAL_TIME`."""
        table = self.attention_tflops
        if bias:
            if ALIBI_KEY in table:
                return attention_at(table[ALIBI_KEY], seq) * 1e12
            return self.attention_rate(qk_dim, v_dim, seq) / ALIBI_OVER_CAUSAL_TIME
        key = f"{qk_dim}/{v_dim}"
        if key in table:
            return attention_at(table[key], seq) * 1e12
        dims = [k for k in table if k not in ("default", ALIBI_KEY)]
        if dims and "default" not in table:  # the nearest measured head dims
            near = min(dims, key=lambda k: abs(int(k.split("/")[0]) - qk_dim) + abs(int(k.split("/")[1]) - v_dim))
            return attention_at(table[near], seq) * 1e12
        return attention_at(table.get("default", next(v for k, v in table.items() if k != ALIBI_KEY)), seq) * 1e12

    def bus_bandwidth(self, op: str, ranks: int, inter_node: bool = False) -> float:
        """Bytes/s of bus bandwidth (NCCL's convention) for ``op`` over ``ranks`` ranks."""
        c = self.collectives
        if inter_node:
            return float(c["inter_node_gb_s"]) * 1e9
        table = c["intra_node_gb_s"].get(op) or c["intra_node_gb_s"]["all_reduce"]
        sizes = sorted(int(r) for r in table)
        pick = max([r for r in sizes if r <= ranks] or sizes[:1])
        return float(table.get(pick, table.get(str(pick)))) * 1e9

    def to_dict(self) -> dict:
        return asdict(self)


#: Ranges a calibration's figures must lie in: far beyond any card (an exa-FLOP/s card, a PB/s link), so a
#: real measurement always passes and a corrupt one (1e308, a negative rate) never reaches the model.
MAX_TFLOPS = 1e6
#: The longest sequence an attention rate may be keyed by.
MAX_SEQ = 1 << 24
MAX_GB_S = 1e7
MAX_HALF_DIM = 1e7
MAX_GIB = 1e6
MAX_GROUP = 1 << 20  # ranks in one collective group
MAX_OVERHEAD_S = 3600.0  # host seconds per step (or per micro-batch, block, module)
MAX_BYTES_FACTOR = 1e3  # HBM bytes of element-wise work per byte of saved activations
ELEMENTWISE_KEYS = ("eager_bytes_factor", "compiled_bytes_factor")
_HEAD_DIMS = re.compile(r"[0-9]{1,6}/[0-9]{1,6}")


def _number(where: str, value, problems: list[str], *, high: float, low: float = 0.0, low_open: bool = True,
            what: str = "a positive number") -> None:
    """``value`` a real number (not a bool, a string or a container), finite, in ``(low, high]`` (``[low, high]``
    when not ``low_open``); otherwise one line naming the range. An integer too large for a float is refused
    before any conversion."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and isinstance(value, int):
        ok = -high <= value <= high  # a 400-digit integer never reaches float()
    ok = ok and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        problems.append(f"{where}: {what} (at most {high:g}), got {echo(value)}")


#: the smallest rate (TFLOP/s, GB/s) or size taken: a mega-FLOP/s card would still pass; 1e-300 would not, whose
#: step times overflow to infinity downstream
MIN_RATE = 1e-6


def _positive(where: str, value, problems: list[str], high: float = MAX_TFLOPS, low: float = MIN_RATE) -> None:
    _number(where, value, problems, high=high, low=low, low_open=False, what=f"a number of at least {low:g}")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _text(where: str, value, problems: list[str]) -> None:
    """Text, printed as it is by estimate, plan and calibrate: no control characters (escape sequences)."""
    if not isinstance(value, str) or _CONTROL.search(value):
        problems.append(f"{where}: text without control characters, got {echo(value)}")


def _group_size(r) -> int | None:
    """A collective's group size as a key: an int, or a string of ASCII digits ('²' is a digit to str.isdigit,
    not to int()), at least 2 and at most MAX_GROUP; None otherwise."""
    if isinstance(r, bool):
        return None
    if isinstance(r, str) and r.isascii() and r.isdigit() and len(r) <= 8:
        r = int(r)
    return r if isinstance(r, int) and 2 <= r <= MAX_GROUP else None


def _check_overheads(source: str, ov, problems: list[str]) -> None:
    """Host seconds (``*_s``, 0..MAX_OVERHEAD_S) and hidden fractions (``*_overlap``, 0..1) by name."""
    if not isinstance(ov, dict):
        problems.append(f"{source}: overheads: a mapping of names to seconds")
        return
    for k, v in ov.items():
        where = f"{source}: overheads.{k if isinstance(k, str) else echo(k)}"
        if not isinstance(k, str):
            problems.append(f"{where}: a name, got {echo(k)}")
        elif k.endswith("_overlap"):
            _number(where, v, problems, high=1.0, low_open=False, what="a fraction in 0..1 of the communication hidden")
        else:
            _number(where, v, problems, high=MAX_OVERHEAD_S, low_open=False, what="seconds, 0 or more")


def _check_curve(source: str, key: str, g, problems: list[str]) -> None:
    if not isinstance(g, dict):
        problems.append(f"{source}: {key}: a mapping with max_tflops and half_dim")
        return
    _positive(f"{source}: {key}.max_tflops", g.get("max_tflops"), problems)
    _positive(f"{source}: {key}.half_dim", g.get("half_dim"), problems, MAX_HALF_DIM)
    points = g.get("points", [])
    if not isinstance(points, list):
        problems.append(f"{source}: {key}.points: a list of the measured shapes, got {echo(points)}")


def _check_attention(source: str, table, problems: list[str]) -> None:
    if not isinstance(table, dict) or not set(table) - {ALIBI_KEY}:
        problems.append(f"{source}: attention_tflops: a mapping of 'qk/v' head dims (or 'default') to TFLOP/s")
        return
    for k, v in table.items():
        if not (k in ("default", ALIBI_KEY) or (isinstance(k, str) and _HEAD_DIMS.fullmatch(k))):
            problems.append(f"{source}: attention_tflops: {echo(k)} is not 'qk/v' head dims (e.g. '128/128'), "
                            f"'default' or '{ALIBI_KEY}'")
            continue
        if not isinstance(v, dict):
            _positive(f"{source}: attention_tflops.{k}", v, problems)
            continue
        if not v:
            problems.append(f"{source}: attention_tflops.{k}: a rate, or a mapping of sequence lengths to rates")
        for t, r in v.items():
            if not (isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= MAX_SEQ) and not (
                    isinstance(t, str) and t.isascii() and t.isdigit() and 1 <= int(t[:9]) <= MAX_SEQ):
                problems.append(f"{source}: attention_tflops.{k}: {echo(t)} is not a sequence length (1..{MAX_SEQ})")
                continue
            _positive(f"{source}: attention_tflops.{k}.{t}", r, problems)


def _check_collectives(source: str, c, problems: list[str]) -> None:
    if not isinstance(c, dict) or not isinstance(c.get("intra_node_gb_s"), dict) or "all_reduce" not in c["intra_node_gb_s"]:
        problems.append(f"{source}: collectives: needs intra_node_gb_s.all_reduce ({{ranks: GB/s}}) and inter_node_gb_s")
        return
    _positive(f"{source}: collectives.inter_node_gb_s", c.get("inter_node_gb_s"), problems, MAX_GB_S)
    if "source" in c:
        _text(f"{source}: collectives.source", c["source"], problems)
    for op, table in c["intra_node_gb_s"].items():
        if op not in COLLECTIVE_OPS or not isinstance(table, dict) or not table:
            problems.append(f"{source}: collectives.intra_node_gb_s.{echo(op)}: one of {', '.join(COLLECTIVE_OPS)}, "
                            "mapping group sizes to GB/s")
            continue
        for r, v in table.items():
            if _group_size(r) is None:
                problems.append(f"{source}: collectives.intra_node_gb_s.{op}: group size {echo(r)} is not an integer "
                                f"in 2..{MAX_GROUP}")
                continue
            _positive(f"{source}: collectives.intra_node_gb_s.{op}.{r}", v, problems, MAX_GB_S)


def _check_elementwise(source: str, e, problems: list[str]) -> None:
    if not isinstance(e, dict):
        problems.append(f"{source}: elementwise: a mapping of {' and '.join(ELEMENTWISE_KEYS)}")
        return
    for k in ELEMENTWISE_KEYS:
        if k not in e:
            problems.append(f"{source}: elementwise.{k}: missing")
        else:
            _positive(f"{source}: elementwise.{k}", e[k], problems, MAX_BYTES_FACTOR)


def _check_unaligned(source: str, g, problems: list[str]) -> None:
    if not isinstance(g, dict) or set(g) != set(UNALIGNED_GEMM):
        problems.append(f"{source}: gemm_unaligned: a mapping of {' and '.join(UNALIGNED_GEMM)}")
        return
    for k, v in g.items():
        _positive(f"{source}: gemm_unaligned.{k}", v, problems, 1.0)


def calibration_from_dict(raw: dict, source: str) -> Calibration:
    """Validate a parsed calibration file; every problem is one line of the RecipeError. Every figure the
    model reads is checked to be a finite number of its kind in its range (rates positive and at most
    :data:`MAX_TFLOPS` / :data:`MAX_GB_S`, seconds at least 0, overlaps in 0..1), so a corrupt file is
    refused here instead of turning into NaN, negative or infinite predictions."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: a calibration is a mapping (name, gemm_tflops, ...), got {type(raw).__name__}")
    known = {f for f in Calibration.__dataclass_fields__} - {"file"}
    problems = [f"{source}: {shorten(k, 60) if isinstance(k, str) else echo(k)}: unknown key; known keys: "
                f"{', '.join(sorted(known))}" for k in raw if k not in known]
    for key in ("name", "source", "gemm_tflops", "attention_tflops", "hbm_gb_s", "collectives", "overheads"):
        if key not in raw:
            problems.append(f"{source}: {key}: missing")
    if problems:
        raise RecipeError(problems)
    for key in ("name", "source", "hardware"):
        if key in raw:
            _text(f"{source}: {key}", raw[key], problems)
    _check_curve(source, "gemm_tflops", raw["gemm_tflops"], problems)
    if raw.get("gemm_fp8_tflops") is not None:
        _check_curve(source, "gemm_fp8_tflops", raw["gemm_fp8_tflops"], problems)
    _check_attention(source, raw["attention_tflops"], problems)
    _positive(f"{source}: hbm_gb_s", raw["hbm_gb_s"], problems, MAX_GB_S)
    _positive(f"{source}: peak_tflops", raw.get("peak_tflops", 989.0), problems)
    if raw.get("memory_gib") is not None:
        _positive(f"{source}: memory_gib", raw["memory_gib"], problems, MAX_GIB)
    _check_collectives(source, raw["collectives"], problems)
    _check_overheads(source, raw["overheads"], problems)
    if "elementwise" in raw:
        _check_elementwise(source, raw["elementwise"], problems)
    if "gemm_unaligned" in raw:
        _check_unaligned(source, raw["gemm_unaligned"], problems)
    if not isinstance(raw.get("measured", {}), dict):
        problems.append(f"{source}: measured: a mapping of the raw figures, got {echo(raw['measured'])}")
    if problems:
        raise RecipeError(problems)
    c = raw["collectives"]
    c = {**c, "intra_node_gb_s": {op: {_group_size(r): float(v) for r, v in t.items()}
                                  for op, t in c["intra_node_gb_s"].items()}}
    return Calibration(**{**raw, "collectives": c})


def shipped_calibrations() -> dict[str, Path]:
    """Shipped calibration files by stem (``h100-sxm``, ``h200``)."""
    folder = data_dir("profiles") / "calibrations"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


#: a calibration file holds a few hundred figures; a larger one is the wrong file
MAX_CALIBRATION_BYTES = 1 << 20


def read_calibration(path: Path, source: str | None = None) -> Calibration:
    """The calibration in the YAML file ``path``: read only if it is a regular file of at most
    :data:`MAX_CALIBRATION_BYTES` (never waiting on a FIFO or reading /dev/zero), parsed with the bounded
    safe loader and validated; ``file`` records which file it was."""
    from scaletool.yaml_input import exponent_floats, load_yaml_text

    source = source or shorten(str(path))
    try:
        blob = read_bounded(path, MAX_CALIBRATION_BYTES, "a calibration")
    except RecipeError as e:
        raise RecipeError([f"calibration {p}" for p in e.problems]) from None
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{source}: not UTF-8 text (byte {e.start})") from None
    cal = calibration_from_dict(exponent_floats(load_yaml_text(text, source)), source)
    return replace(cal, file=str(path))


def shipped_calibration(name: str) -> Calibration:
    """The shipped calibration of this file stem (``h100-sxm``) or ``name``/``hardware`` (``H100 SXM``), read
    from ``profiles/calibrations/`` only: a file of that name in the working directory is never it."""
    shipped = shipped_calibrations()
    key = name.strip().lower().removesuffix(".yaml").removesuffix(".yml")
    if key in shipped:
        return read_calibration(shipped[key], f"shipped:{key}.yaml")
    for stem, p in shipped.items():
        cal = read_calibration(p, f"shipped:{stem}.yaml")
        if key in (cal.name.lower(), cal.hardware.lower()):
            return cal
    close = difflib.get_close_matches(key, list(shipped), n=1)
    tip = f"; did you mean '{close[0]}'?" if close else ""
    raise RecipeError(f"unknown calibration {echo(name)}: known ones are {', '.join(shipped) or 'none'} "
                      f"(or a calibration YAML's path, e.g. ./mine.yaml; `scaletool calibrate` writes one){tip}")


def is_path(name_or_path: str) -> bool:
    """Whether a ``--calibration`` value names a file: it has a directory part (``./cpu``, ``~/c.yaml``) or a
    ``.yaml``/``.yml`` suffix. A bare word (``cpu``, ``h100-sxm``) is a name, whatever files the working
    directory holds."""
    return os.sep in name_or_path or "/" in name_or_path or name_or_path.startswith("~") or \
        Path(name_or_path).suffix in (".yaml", ".yml")


def load_calibration(name_or_path: str) -> Calibration:
    """A calibration YAML's path (see :func:`is_path`), or a shipped calibration by file stem or ``name``
    (case-insensitive: ``h100-sxm``, ``H100 SXM``). Unknown: a RecipeError listing the known ones."""
    if is_path(name_or_path):
        path = Path(name_or_path).expanduser()
        bare = os.sep not in name_or_path and "/" not in name_or_path and not name_or_path.startswith("~")
        if bare and not os.path.lexists(path):
            return shipped_calibration(name_or_path)  # 'h100-sxm.yaml': the shipped file's own name
        return read_calibration(path)
    return shipped_calibration(name_or_path)


def calibration_for(hardware_name: str | None) -> Calibration | None:
    """The shipped calibration whose ``hardware`` is this hardware profile's name, or None."""
    for stem, p in shipped_calibrations().items():
        cal = read_calibration(p, f"shipped:{stem}.yaml")
        if hardware_name and cal.hardware.lower() == hardware_name.lower():
            return cal
    return None


def default_calibration(hardware_profile) -> Calibration:
    """A datasheet-derived calibration for a hardware profile (``HardwareProfile`` or anything with
    ``name``, ``peak_tflops`` and ``peak_bandwidth_bytes_per_s``): the profile's peaks times the ratios
    the H100 SXM calibration measured (:data:`DATASHEET_RATIOS`); NVLink-4-class interconnect assumed.
    The H100 SXM's own default predicts its committed runs within the error docs/prediction.md states. A profile
    with a power limit below 700 W on a die with a measured curve (``power_curve``) has its GEMM and attention
    rates scaled by the clock that limit leaves (:func:`scaletool.analytic.power.profile_clock_ratio`)."""
    peak = (getattr(hardware_profile, "peak_tflops", None) or {}).get("bf16")
    if not peak:
        raise RecipeError(f"hardware profile {getattr(hardware_profile, 'name', hardware_profile)!r} has no bf16 peak: "
                          "a step-time prediction needs one (or a calibration: `scaletool calibrate`)")
    bw = getattr(hardware_profile, "peak_bandwidth_bytes_per_s", None) or 2.0e12
    base = shipped_calibration("h100-sxm")
    r = DATASHEET_RATIOS
    bus = 450.0 * r["bus"]
    clock = profile_clock_ratio(hardware_profile)  # a power limit under the 700 W the ratios were measured at
    held = (f"; GEMM and attention at {clock:.3f} of the ratios' rates: the sustained clock a "
            f"{hardware_profile.power_limit_w:g} W limit leaves (analytic.power, measured on the die)") if clock < 1 else ""
    return Calibration(
        name=f"{hardware_profile.name} (datasheet default" + (f", {hardware_profile.power_limit_w:g} W: {clock:.3f} of the clock)"
                                                          if clock < 1 else ")"),
        source=(f"datasheet default: {peak:g} TFLOP/s bf16, {bw / 1e9:g} GB/s HBM, NVLink 4 at 450 GB/s x {r['bus']} "
                f"(ratios measured on an H100 SXM; its own default on the {DATASHEET_DEFAULT_ERROR[0]} committed dense "
                f"H100 runs: median {DATASHEET_DEFAULT_ERROR[1]:.1%}, worst {DATASHEET_DEFAULT_ERROR[2]:.1%} |error| in "
                f"tokens/s per GPU; `scaletool docs prediction`){held}"),
        gemm_tflops={"max_tflops": peak * r["gemm_max"] * clock, "half_dim": base.gemm_tflops["half_dim"]},
        attention_tflops={"default": peak * r["attention"] * clock},
        hbm_gb_s=bw / 1e9 * r["hbm"],
        collectives={"intra_node_gb_s": {op: {2: bus, 8: bus} for op in COLLECTIVE_OPS},
                     "inter_node_gb_s": base.collectives["inter_node_gb_s"],
                     "source": "datasheet: NVLink 4, 450 GB/s a direction, 75% bus efficiency assumed"},
        overheads=dict(base.overheads), peak_tflops=peak, elementwise=dict(base.elementwise),
        memory_gib=None, hardware=hardware_profile.name)
