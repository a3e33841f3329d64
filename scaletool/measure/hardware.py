"""Accelerator peaks for MFU, read from ``profiles/*.yaml`` and matched by device name.

A profile names the device kind (``cuda`` or ``cpu``), substrings of ``torch.cuda.get_device_name()``
that select it (``match``, with optional ``exclude``), dense peak TFLOP/s per dtype and the peak
device-memory bandwidth (``peak_bandwidth_gb_s``, for decoding's roofline). An unknown
GPU gets no invented peak: :func:`peak_for` returns ``None`` with a warning, and MFU stays null,
unless the user passes ``--peak-tflops``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: str
    match: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    peak_tflops: dict[str, float] = field(default_factory=dict)
    peak_bandwidth_bytes_per_s: float | None = None  # device memory (HBM), datasheet
    source: str = ""

    def matches(self, device_name: str) -> bool:
        n = device_name.lower()
        return (any(m.lower() in n for m in self.match)
                and not any(x.lower() in n for x in self.exclude))


def load_profiles(directory: Path = PROFILES_DIR) -> list[HardwareProfile]:
    out = []
    for path in sorted(directory.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        out.append(HardwareProfile(name=raw["name"], device=raw["device"], match=tuple(raw.get("match", ())),
                                   exclude=tuple(raw.get("exclude", ())),
                                   peak_tflops={k: float(v) for k, v in (raw.get("peak_tflops") or {}).items()},
                                   peak_bandwidth_bytes_per_s=(float(raw["peak_bandwidth_gb_s"]) * 1e9
                                                               if raw.get("peak_bandwidth_gb_s") else None),
                                   source=path.name))
    return out


@dataclass(frozen=True)
class Peak:
    """The peak used for MFU: ``tflops`` is None when unknown; ``warning`` says why."""
    tflops: float | None
    profile: str | None
    source: str
    warning: str | None = None


def peak_for(device_type: str, device_name: str, dtype: str, override_tflops: float | None = None,
             profiles: list[HardwareProfile] | None = None) -> Peak:
    """Dense peak TFLOP/s for ``dtype`` on this device; an explicit override always wins."""
    prof = profile_for(device_type, device_name, profiles)
    label = prof.name if prof else None
    if override_tflops is not None:
        return Peak(override_tflops, label, "--peak-tflops")
    if prof is None:
        return Peak(None, None, "none", f"unknown accelerator '{device_name}': no profile in {PROFILES_DIR} "
                    "matches it, so MFU is null; pass --peak-tflops to set the peak")
    value = prof.peak_tflops.get(dtype)
    if value is None:
        why = ("no CPU peak is assumed" if device_type == "cpu"
               else f"profile {prof.source} has no {dtype} peak")
        return Peak(None, label, prof.source, f"{why}: MFU is null; pass --peak-tflops to set the peak")
    return Peak(value, label, prof.source)


def profile_for(device_type: str, device_name: str,
                profiles: list[HardwareProfile] | None = None) -> HardwareProfile | None:
    """The profile that matches this device, or None."""
    profiles = load_profiles() if profiles is None else profiles
    return next((p for p in profiles if p.device == device_type and (device_type == "cpu" or p.matches(device_name))),
                None)
