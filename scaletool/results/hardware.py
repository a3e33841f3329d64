"""``scaletool hardware``: the accelerator profiles, where each comes from, and which one this machine matches."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from scaletool.results.base import Result, register


class HardwareProfile(BaseModel):
    """One accelerator's dense peaks, selected by substrings of ``torch.cuda.get_device_name()``."""

    model_config = ConfigDict(frozen=True)

    name: str
    device: Literal["cuda", "cpu"]
    match: tuple[str, ...] = Field((), description="a GPU whose name contains one of these (case-insensitive)")
    exclude: tuple[str, ...] = Field((), description="... and none of these")
    peak_tflops: dict[str, float] = Field({}, description="dense peak TFLOP/s by dtype (bf16, fp16, fp32); a dtype "
                                                          "left out has no assumed peak")
    peak_bandwidth_bytes_per_s: float | None = Field(None, description="device-memory (HBM) bandwidth, for "
                                                                       "decoding's roofline")
    memory_bytes: int | None = Field(None, description="device memory as torch reports it (total_memory), what "
                                                       "`scaletool plan` fits layouts into")
    power_limit_w: float | None = Field(None, description="the board's power limit (W), where the profile states it")
    power_curve: str | None = Field(None, description="the die whose measured clock-power curve applies (gh100): "
                                                      "a limit below 700 W lowers the default GEMM and attention rates")
    reference: str = Field("", description="where the figures come from (a datasheet)")
    source: str = Field("", description="the file it was read from: shipped:<file> or a user file's path")
    replaces: str | None = Field(None, description="the shipped profile of the same name this user profile replaces")

    def matches(self, device_type: str, device_name: str) -> bool:
        """Whether this profile describes ``device_name``: every CPU matches a cpu profile; a GPU needs
        one of ``match`` and none of ``exclude`` in its name (case-insensitive)."""
        if device_type != self.device:
            return False
        if device_type == "cpu":
            return True
        n = device_name.lower()
        return any(m.lower() in n for m in self.match) and not any(x.lower() in n for x in self.exclude)


class ThisMachine(BaseModel):
    device: Literal["cuda", "cpu"]
    device_name: str
    device_count: int | None = Field(description="CUDA devices visible (0: none); null when asked about a name")
    profile: str | None = Field(description="the matching profile's name; null for an unknown GPU")


@register
class HardwareResult(Result):
    kind: Literal["hardware"] = "hardware"
    profiles: list[HardwareProfile] = Field(description="in matching order: user profiles first, then the shipped ones")
    this_machine: ThisMachine
    user_dirs: list[str] = Field(description="directories searched for user profiles, highest precedence first "
                                             "(existing or not)")
