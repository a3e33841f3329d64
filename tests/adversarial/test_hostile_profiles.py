"""Hardware profiles in `$SCALETOOL_PROFILES` and `~/.config/scaletool/profiles`, read by nearly every command:
a FIFO named `*.yaml` there once blocked every command, `memory_gib: 1e300` overflowed in every command and
peaks of 1e308 divided by zero in `estimate`. Each is now one `error:` line naming the file, at once."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hostile import invoke

GOOD = "name: Mine\ndevice: cuda\nmatch: ['Mine GPU']\npeak_tflops: {bf16: 100}\nmemory_gib: 80\n"


def _profile(text: str | bytes):
    def make(d: Path) -> None:
        (d / "p.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    return make


CASES = {
    "a FIFO": (lambda d: os.mkfifo(d / "p.yaml"), "not a regular file"),
    "a link to /dev/zero": (lambda d: (d / "p.yaml").symlink_to("/dev/zero"), "not a regular file"),
    "a directory": (lambda d: (d / "p.yaml").mkdir(), "not a regular file"),
    "memory 1e300": (_profile(GOOD.replace("memory_gib: 80", "memory_gib: 1e300")), "memory_gib"),
    "memory a 400-digit int": (_profile(GOOD.replace("memory_gib: 80", "memory_gib: 1" + "0" * 400)), "memory_gib"),
    "memory a string": (_profile(GOOD.replace("memory_gib: 80", "memory_gib: '80'")), "memory_gib"),
    "memory NaN": (_profile(GOOD.replace("memory_gib: 80", "memory_gib: .nan")), "memory_gib"),
    "peak 1e308": (_profile(GOOD.replace("bf16: 100", "bf16: 1e308")), "peak_tflops.bf16"),
    "peak true": (_profile(GOOD.replace("bf16: 100", "bf16: true")), "peak_tflops.bf16"),
    "bandwidth -1": (_profile(GOOD + "peak_bandwidth_gb_s: -1\n"), "peak_bandwidth_gb_s"),
    "bandwidth 1e-300": (_profile(GOOD + "peak_bandwidth_gb_s: 1.0e-300\n"), "peak_bandwidth_gb_s"),
    "memory 1e-300": (_profile(GOOD.replace("memory_gib: 80", "memory_gib: 1e-300")), "memory_gib"),
    "match a number": (_profile(GOOD.replace("['Mine GPU']", "[1]")), "match"),
    "deep nesting": (_profile(GOOD + "reference: " + "[" * 20_000 + "]" * 20_000 + "\n"), "p.yaml"),
    "not UTF-8": (_profile(b"\xff\xfe"), "UTF-8"),
    "an escape sequence in the name": (_profile(GOOD.replace("name: Mine", "name: \"Mine\\e[2J\"")), "control"),
    "a newline in the reference": (_profile(GOOD + "reference: \"a\\nb\"\n"), "control"),
    "larger than 64 KiB": (_profile(GOOD + "#" * 70_000 + "\n"), "larger than 64 KiB"),
    "power limit 0": (_profile(GOOD + "power_limit_w: 0\npower_curve: gh100\n"), "power_limit_w"),
    "power limit NaN": (_profile(GOOD + "power_limit_w: .nan\n"), "power_limit_w"),
    "power limit below the die's static draw": (_profile(GOOD + "power_limit_w: 60\npower_curve: gh100\n"),
                                                "static draw"),
    "an unknown power curve": (_profile(GOOD + "power_limit_w: 500\npower_curve: gb100\n"), "power_curve"),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("where", ["SCALETOOL_PROFILES", "XDG_CONFIG_HOME"])
@pytest.mark.parametrize("command", [["hardware"], ["estimate", "tiny"], ["plan", "tiny", "--gpus", "2"]])
def test_a_hostile_profile_is_one_line_naming_it_in_every_command(tmp_path, monkeypatch, name, where, command):
    make, expected = CASES[name]
    folder = tmp_path / "profiles" if where == "SCALETOOL_PROFILES" else tmp_path / "cfg" / "scaletool" / "profiles"
    folder.mkdir(parents=True)
    make(folder)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    if where == "SCALETOOL_PROFILES":
        monkeypatch.setenv("SCALETOOL_PROFILES", str(folder))
    else:
        monkeypatch.delenv("SCALETOOL_PROFILES", raising=False)
    lines, _ = invoke(command, within=tmp_path)
    assert len(lines) == 1 and str(folder / "p.yaml") in lines[0] and expected in lines[0], lines


def test_a_valid_user_profile_still_loads(tmp_path, monkeypatch):
    """Exponent floats without a dot (1e2: a string to PyYAML, a number to YAML 1.2 and to anyone writing it)
    are numbers."""
    from scaletool.measure.hardware import load_profiles

    (tmp_path / "p.yaml").write_text(GOOD.replace("bf16: 100", "bf16: 1e2"))
    monkeypatch.setenv("SCALETOOL_PROFILES", str(tmp_path))
    mine = next(p for p in load_profiles() if p.name == "Mine")
    assert mine.memory_bytes == 80 * 2**30 and mine.peak_tflops == {"bf16": 100.0}
