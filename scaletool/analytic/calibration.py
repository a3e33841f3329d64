"""Calibration: the measured rates of one card and its interconnect that the step-time model reads.

A calibration is a YAML file (shipped ones in ``profiles/calibrations/``, or any path): GEMM rate as
a saturating curve of the GEMM's smallest dimension, the fused attention kernel's rate by head dims,
HBM copy bandwidth, the element-wise traffic factors, bus bandwidth per collective and group size
(intra-node; one inter-node figure) and the host overheads. Where no calibration exists,
:func:`default_calibration` scales a hardware profile's datasheet peaks by the ratios measured on the
H100 SXM. Torch-free: the measuring side is ``scaletool.measure.calibrate``.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from scaletool.errors import RecipeError
from scaletool.resources import data_dir

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

#: What the shipped H100 SXM calibration measured against its datasheet (989 TFLOP/s dense bf16,
#: 3,350 GB/s HBM, NVLink 4 at 450 GB/s a direction); :func:`default_calibration` applies them to a
#: profile that has no calibration of its own.
DATASHEET_RATIOS = {"gemm_max": 0.83, "attention": 0.30, "hbm": 0.895, "bus": 0.75}
#: dense FP8 over dense bf16 tensor-core peak (H100 SXM 1979 / 989 TFLOP/s): the FP8 GEMM rate where no
#: calibration measured one
FP8_OVER_BF16 = 2.0


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

    def gemm_rate(self, m: float, n: float, k: float) -> float:
        """FLOP/s of an (m×k)·(k×n) bf16 GEMM."""
        s = max(1.0, min(m, n, k))
        g = self.gemm_tflops
        return g["max_tflops"] * 1e12 * s / (s + g["half_dim"])

    def gemm_rate_fp8(self, m: float, n: float, k: float) -> float:
        """FLOP/s of the same GEMM in FP8 (torch._scaled_mm): calibrated, else twice the bf16 rate."""
        g = self.gemm_fp8_tflops
        if not g:
            return FP8_OVER_BF16 * self.gemm_rate(m, n, k)
        s = max(1.0, min(m, n, k))
        return g["max_tflops"] * 1e12 * s / (s + g["half_dim"])

    def attention_rate(self, qk_dim: int, v_dim: int) -> float:
        """FLOP/s (causal convention) of fused SDPA forward + backward at these head dims."""
        table = self.attention_tflops
        key = f"{qk_dim}/{v_dim}"
        if key in table:
            return float(table[key]) * 1e12
        dims = [k for k in table if k != "default"]
        if dims:  # the nearest measured head dims
            near = min(dims, key=lambda k: abs(int(k.split("/")[0]) - qk_dim) + abs(int(k.split("/")[1]) - v_dim))
            if "default" not in table:
                return float(table[near]) * 1e12
        return float(table.get("default", next(iter(table.values())))) * 1e12

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


def _positive(where: str, value, problems: list[str]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        problems.append(f"{where}: a positive number, got {value!r}")


def calibration_from_dict(raw: dict, source: str) -> Calibration:
    """Validate a parsed calibration file; every problem is one line of the RecipeError."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: a calibration is a mapping (name, gemm_tflops, ...), got {type(raw).__name__}")
    known = {f for f in Calibration.__dataclass_fields__}
    problems = [f"{source}: {k}: unknown key; known keys: {', '.join(sorted(known))}" for k in raw if k not in known]
    for key in ("name", "source", "gemm_tflops", "attention_tflops", "hbm_gb_s", "collectives", "overheads"):
        if key not in raw:
            problems.append(f"{source}: {key}: missing")
    if problems:
        raise RecipeError(problems)
    g, c = raw["gemm_tflops"], raw["collectives"]
    if not isinstance(g, dict):
        problems.append(f"{source}: gemm_tflops: a mapping with max_tflops and half_dim")
    else:
        _positive(f"{source}: gemm_tflops.max_tflops", g.get("max_tflops"), problems)
        _positive(f"{source}: gemm_tflops.half_dim", g.get("half_dim"), problems)
    g8 = raw.get("gemm_fp8_tflops")
    if g8 is not None:
        if not isinstance(g8, dict):
            problems.append(f"{source}: gemm_fp8_tflops: a mapping with max_tflops and half_dim")
        else:
            _positive(f"{source}: gemm_fp8_tflops.max_tflops", g8.get("max_tflops"), problems)
            _positive(f"{source}: gemm_fp8_tflops.half_dim", g8.get("half_dim"), problems)
    if not isinstance(raw["attention_tflops"], dict) or not raw["attention_tflops"]:
        problems.append(f"{source}: attention_tflops: a mapping of 'qk/v' head dims (or 'default') to TFLOP/s")
    else:
        for k, v in raw["attention_tflops"].items():
            _positive(f"{source}: attention_tflops.{k}", v, problems)
    _positive(f"{source}: hbm_gb_s", raw["hbm_gb_s"], problems)
    _positive(f"{source}: peak_tflops", raw.get("peak_tflops", 989.0), problems)
    if not isinstance(c, dict) or not isinstance(c.get("intra_node_gb_s"), dict) or "all_reduce" not in c["intra_node_gb_s"]:
        problems.append(f"{source}: collectives: needs intra_node_gb_s.all_reduce ({{ranks: GB/s}}) and inter_node_gb_s")
    else:
        _positive(f"{source}: collectives.inter_node_gb_s", c.get("inter_node_gb_s"), problems)
        for op, table in c["intra_node_gb_s"].items():
            if op not in COLLECTIVE_OPS or not isinstance(table, dict) or not table:
                problems.append(f"{source}: collectives.intra_node_gb_s.{op}: one of {', '.join(COLLECTIVE_OPS)}, "
                                "mapping group sizes to GB/s")
                continue
            for r, v in table.items():
                if not str(r).isdigit() or int(r) < 2:
                    problems.append(f"{source}: collectives.intra_node_gb_s.{op}: group size {r!r} is not an integer >= 2")
                _positive(f"{source}: collectives.intra_node_gb_s.{op}.{r}", v, problems)
    if not isinstance(raw["overheads"], dict):
        problems.append(f"{source}: overheads: a mapping of names to seconds")
    if problems:
        raise RecipeError(problems)
    c = {**c, "intra_node_gb_s": {op: {int(r): float(v) for r, v in t.items()} for op, t in c["intra_node_gb_s"].items()}}
    return Calibration(**{**raw, "collectives": c})


def shipped_calibrations() -> dict[str, Path]:
    """Shipped calibration files by stem (``h100-sxm``, ``h200``)."""
    folder = data_dir("profiles") / "calibrations"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


def read_calibration(path: Path, source: str | None = None) -> Calibration:
    source = source or str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{source}: cannot read: {e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{source}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    return calibration_from_dict(raw, source)


def load_calibration(name_or_path: str) -> Calibration:
    """A shipped calibration by file stem or ``name`` (case-insensitive: ``h100-sxm``, ``H100 SXM``), or a
    YAML file's path. Unknown: a RecipeError listing the known ones."""
    shipped = shipped_calibrations()
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise RecipeError(f"calibration file {name_or_path!r} does not exist")
        return read_calibration(path)
    key = name_or_path.strip().lower().removesuffix(".yaml")
    if key in shipped:
        return read_calibration(shipped[key], f"shipped:{key}.yaml")
    for stem, p in shipped.items():
        cal = read_calibration(p, f"shipped:{stem}.yaml")
        if key in (cal.name.lower(), cal.hardware.lower()):
            return cal
    close = difflib.get_close_matches(key, list(shipped), n=1)
    tip = f"; did you mean '{close[0]}'?" if close else ""
    raise RecipeError(f"unknown calibration {name_or_path!r}: known ones are {', '.join(shipped) or 'none'} "
                      f"(or a calibration YAML's path; `scaletool calibrate` writes one){tip}")


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
    The H100 SXM's own default predicts its committed runs within the error docs/prediction.md states."""
    peak = (getattr(hardware_profile, "peak_tflops", None) or {}).get("bf16")
    if not peak:
        raise RecipeError(f"hardware profile {getattr(hardware_profile, 'name', hardware_profile)!r} has no bf16 peak: "
                          "a step-time prediction needs one (or a calibration: `scaletool calibrate`)")
    bw = getattr(hardware_profile, "peak_bandwidth_bytes_per_s", None) or 2.0e12
    base = load_calibration("h100-sxm")
    r = DATASHEET_RATIOS
    bus = 450.0 * r["bus"]
    return Calibration(
        name=f"{hardware_profile.name} (datasheet default)",
        source=(f"datasheet default: {peak:g} TFLOP/s bf16, {bw / 1e9:g} GB/s HBM, NVLink 4 at 450 GB/s x {r['bus']} "
                "(ratios measured on an H100 SXM; error measured on the 48 committed dense H100 runs: median 1.9%, "
                "worst 17.7% |error| in tokens/s per GPU; `scaletool docs prediction`)"),
        gemm_tflops={"max_tflops": peak * r["gemm_max"], "half_dim": base.gemm_tflops["half_dim"]},
        attention_tflops={"default": peak * r["attention"]},
        hbm_gb_s=bw / 1e9 * r["hbm"],
        collectives={"intra_node_gb_s": {op: {2: bus, 8: bus} for op in COLLECTIVE_OPS},
                     "inter_node_gb_s": base.collectives["inter_node_gb_s"],
                     "source": "datasheet: NVLink 4, 450 GB/s a direction, 75% bus efficiency assumed"},
        overheads=dict(base.overheads), peak_tflops=peak, elementwise=dict(base.elementwise),
        memory_gib=None, hardware=hardware_profile.name)
