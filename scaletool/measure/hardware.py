"""Accelerator peaks for MFU and decoding's roofline: the shipped profiles, extended or replaced by the user's.

A profile is a YAML file (:class:`ProfileFile`): the device kind (``cuda`` or ``cpu``), substrings of
``torch.cuda.get_device_name()`` that select it (``match``, with optional ``exclude``), dense peak TFLOP/s
per dtype, the peak device-memory bandwidth (``peak_bandwidth_gb_s``), the memory one device offers
(``memory_gib``, what ``scaletool plan`` fits layouts into), optionally the board's power limit and the
die whose clock-power curve applies (``power_limit_w``, ``power_curve``) and a ``reference``. Profiles are
read from, highest precedence first:

1. every directory in ``$SCALETOOL_PROFILES`` (``os.pathsep``-separated),
2. ``$XDG_CONFIG_HOME/scaletool/profiles`` (default ``~/.config/scaletool/profiles``),
3. the shipped ``profiles/*.yaml`` (:func:`scaletool.resources.data_dir`).

A user profile with a shipped profile's ``name`` replaces it; the others extend the list, and user
profiles are tried first when matching a device. Every file is validated; a bad one is a RecipeError
with one line per problem (MFU is never computed from a profile that did not validate). An unknown
GPU gets no invented peak: :func:`peak_for` returns ``None`` with a warning, and MFU stays null,
unless the user passes ``--peak-tflops``.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scaletool.errors import RecipeError, shorten, validation_lines
from scaletool.resources import data_dir, read_bounded
from scaletool.results.hardware import HardwareProfile

#: the card ``estimate`` and ``plan`` predict for when none is named (a shipped profile's name)
DEFAULT_HARDWARE = "H100 SXM"

PROFILES_ENV = "SCALETOOL_PROFILES"
# Far beyond any card either way (from a mega-FLOP/s to an exa-FLOP/s card, a KB/s to a PB/s memory, a KiB to
# a PiB), so a real datasheet always passes and a corrupt figure (1e308, whose bytes overflow; 1e-300, whose
# times do) never reaches MFU, decode or plan.
TFLOPS = Annotated[float, Field(ge=1e-6, le=1e6, allow_inf_nan=False, strict=True)]
GB_S = Annotated[float, Field(ge=1e-6, le=1e7, allow_inf_nan=False, strict=True)]
GIB = Annotated[float, Field(ge=1e-6, le=1e6, allow_inf_nan=False, strict=True)]
# printed by `scaletool hardware` and in results: no control characters (an escape sequence would drive the terminal)
NO_CONTROL = r"^[^\x00-\x1f\x7f-\x9f]*$"
Text = Annotated[str, Field(max_length=1000, strict=True, pattern=NO_CONTROL)]


class ProfileFile(BaseModel):
    """What a profile file holds."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200, strict=True, pattern=NO_CONTROL)
    device: Literal["cuda", "cpu"]
    match: list[Text] = Field(default=[], max_length=100)
    exclude: list[Text] = Field(default=[], max_length=100)
    peak_tflops: dict[Literal["bf16", "fp16", "fp32", "fp8"], TFLOPS] = {}  # fp8: dense FP8 tensor cores
    peak_bandwidth_gb_s: GB_S | None = None
    memory_gib: GIB | None = None
    # the board's power limit (W) and the die whose measured clock-power curve applies (analytic.power): a
    # limit below the curve's reference lowers the datasheet-default GEMM and attention rates
    power_limit_w: Annotated[float, Field(ge=1, le=1e5, allow_inf_nan=False, strict=True)] | None = None
    power_curve: Literal["gh100"] | None = None
    reference: Text = ""

    @model_validator(mode="after")
    def _check(self) -> ProfileFile:
        if self.device == "cuda" and not any(m.strip() for m in self.match):
            raise RecipeError("match: a cuda profile needs at least one substring of the GPU's name "
                              "(torch.cuda.get_device_name(), e.g. 'H100 80GB HBM3')")
        if self.power_curve and self.power_limit_w is not None:
            from scaletool.analytic.power import CURVES

            c = CURVES[self.power_curve]
            if self.power_limit_w * c["draw_share"] <= c["static_w"]:
                raise RecipeError(f"power_limit_w: {self.power_limit_w:g} W is at or below the {self.power_curve} die's "
                                  f"static draw ({c['static_w']:g} W): no sustained clock to predict from")
        return self


def user_dirs(environ=None) -> list[Path]:
    """Directories of user profiles, highest precedence first (they need not exist)."""
    e = os.environ if environ is None else environ
    dirs = [Path(d).expanduser() for d in e.get(PROFILES_ENV, "").split(os.pathsep) if d]
    config_home = Path(e.get("XDG_CONFIG_HOME") or Path.home() / ".config").expanduser()
    return dirs + [config_home / "scaletool" / "profiles"]


def _problems(exc: ValidationError, source: str) -> list[str]:
    return validation_lines(exc, source, root="profile", known=lambda parent: list(ProfileFile.model_fields),
                            show_input=lambda err: True,
                            messages={"string_pattern_mismatch": "text without control characters"})


#: a profile file is a dozen lines; a larger one is the wrong file
MAX_PROFILE_BYTES = 1 << 16


def read_profile(path: Path, source: str) -> HardwareProfile:
    """Validate one profile file; every problem is one line of the RecipeError. The file is read only if it is
    a regular file of at most :data:`MAX_PROFILE_BYTES` (a FIFO or device named ``*.yaml`` is refused, never
    waited on), with the bounded safe YAML loader."""
    from scaletool.yaml_input import exponent_floats, load_yaml_text

    try:
        blob = read_bounded(path, MAX_PROFILE_BYTES, "a hardware profile")
    except RecipeError as e:
        raise RecipeError([f"hardware profile {p}" for p in e.problems]) from None
    try:
        raw = exponent_floats(load_yaml_text(blob.decode("utf-8"), source))
    except UnicodeDecodeError as e:
        raise RecipeError(f"{source}: not UTF-8 text (byte {e.start})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: a profile is a mapping (name, device, match, peak_tflops, ...), "
                          f"got {type(raw).__name__}")
    try:
        f = ProfileFile.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(_problems(e, source)) from None
    return HardwareProfile(name=f.name, device=f.device, match=tuple(f.match), exclude=tuple(f.exclude),
                           peak_tflops={k: float(v) for k, v in f.peak_tflops.items()},
                           peak_bandwidth_bytes_per_s=f.peak_bandwidth_gb_s * 1e9 if f.peak_bandwidth_gb_s else None,
                           memory_bytes=int(f.memory_gib * 2**30) if f.memory_gib else None,
                           power_limit_w=float(f.power_limit_w) if f.power_limit_w else None,
                           power_curve=f.power_curve, reference=f.reference, source=source)


def _read_dir(directory: Path, label: str) -> tuple[list[HardwareProfile], list[str]]:
    profiles, problems = [], []
    try:
        paths = sorted(directory.glob("*.yaml")) if directory.is_dir() else []
    except OSError as e:  # an unreadable directory
        return [], [f"{shorten(directory)}: cannot list hardware profiles: {e.strerror or e}"]
    for path in paths:
        try:
            profiles.append(read_profile(path, label.format(path=path, name=path.name)))
        except RecipeError as e:
            problems += e.problems
    return profiles, problems


def load_profiles(environ=None) -> list[HardwareProfile]:
    """Every profile in matching order (user profiles first); a user profile replaces the shipped one
    of the same name. Invalid files raise one RecipeError with a line per problem."""
    user, problems = [], []
    for d in user_dirs(environ):
        found, bad = _read_dir(d, "{path}")
        user += found
        problems += bad
    shipped, bad = _read_dir(data_dir("profiles"), "shipped:{name}")
    problems += bad
    seen: dict[str, HardwareProfile] = {}
    for p in user:
        if p.name in seen:
            problems.append(f"{p.source}: name '{p.name}' is also defined by {seen[p.name].source}")
        seen[p.name] = p
    if problems:
        raise RecipeError(problems)
    by_name = {p.name: p for p in shipped}
    user = [p.model_copy(update={"replaces": by_name[p.name].source}) if p.name in by_name else p for p in user]
    return user + [p for p in shipped if p.name not in seen]


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
        return Peak(None, None, "none", f"unknown accelerator '{device_name}': no hardware profile matches it "
                    "(`scaletool hardware` lists them and says how to add one), so MFU is null; pass "
                    "--peak-tflops to set the peak")
    value = prof.peak_tflops.get(dtype)
    if value is None:
        why = ("no CPU peak is assumed" if device_type == "cpu"
               else f"profile {prof.source} has no {dtype} peak")
        return Peak(None, label, prof.source, f"{why}: MFU is null; pass --peak-tflops to set the peak")
    return Peak(value, label, prof.source)


def profile_for(device_type: str, device_name: str,
                profiles: list[HardwareProfile] | None = None) -> HardwareProfile | None:
    """The first profile (user profiles first) that matches this device, or None."""
    profiles = load_profiles() if profiles is None else profiles
    return next((p for p in profiles if p.matches(device_type, device_name)), None)


def profile_named(name: str, profiles: list[HardwareProfile] | None = None) -> HardwareProfile:
    """The profile called ``name`` (its name or its file's stem, any case: ``H100 SXM``, ``h100-sxm``);
    an unknown name is a RecipeError listing the known ones."""
    profiles = load_profiles() if profiles is None else profiles
    key = name.strip().lower()
    for p in profiles:
        stem = Path(p.source.rsplit(":", 1)[-1]).stem.lower()
        if key in (p.name.lower(), stem):
            return p
    close = difflib.get_close_matches(key, [p.name.lower() for p in profiles], n=1)
    tip = f"did you mean '{next(p.name for p in profiles if p.name.lower() == close[0])}'? " if close else ""
    raise RecipeError(f"hardware {name.strip()[:60]!r}: unknown; {tip}known: {', '.join(p.name for p in profiles)} "
                      "(`scaletool hardware` lists them and says how to add one)")
