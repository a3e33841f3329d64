"""`scaletool hardware`: the profiles, this machine's match, how to add one; bad user files exit 2."""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from scaletool.cli import main


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    d = tmp_path / "profiles"
    d.mkdir()
    monkeypatch.setenv("SCALETOOL_PROFILES", str(d))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return d


def test_json_lists_profiles_and_this_machine(user_dir):
    import torch

    res = CliRunner().invoke(main, ["hardware", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["kind"] == "hardware"
    h100 = next(p for p in doc["profiles"] if p["name"] == "H100 SXM")
    assert h100["peak_tflops"] == {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0}
    assert h100["peak_bandwidth_bytes_per_s"] == 3.35e12 and "datasheet" in h100["reference"]
    m = doc["this_machine"]
    if torch.cuda.is_available():
        assert m["device"] == "cuda" and m["device_name"] == torch.cuda.get_device_name(0)
    else:
        assert m == {"device": "cpu", "device_name": "cpu", "device_count": 0, "profile": "CPU"}
    assert doc["user_dirs"] == [str(user_dir), str(user_dir.parent / "config" / "scaletool" / "profiles")]


def test_table_names_the_match_and_says_how_to_add_a_profile(user_dir):
    (user_dir / "l4.yaml").write_text(yaml.safe_dump({"name": "L4", "device": "cuda", "match": ["NVIDIA L4"],
                                                      "peak_tflops": {"bf16": 121}, "reference": "L4 datasheet"}))
    res = CliRunner().invoke(main, ["hardware", "--device-name", "NVIDIA L4"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    row = next(ln for ln in lines if "│ L4 " in ln)
    assert "121" in row and str(user_dir / "l4.yaml") in row  # piped: whole rows, nothing folded at 80 columns
    assert f"this machine: NVIDIA L4 -> profile L4 ({user_dir / 'l4.yaml'}): 121 TFLOP/s bf16" in lines
    assert "To add a profile, or replace a shipped one (same name)" in res.output
    assert "name: RTX 4090" in res.output and str(user_dir.parent / "config" / "scaletool" / "profiles") in res.output


def test_an_unknown_gpu_is_named_with_what_to_do(user_dir):
    res = CliRunner().invoke(main, ["hardware", "--device-name", "Tesla T4"])
    assert res.exit_code == 0, res.output
    assert "this machine: Tesla T4: no profile matches it, so MFU is null" in res.output


def test_a_bad_user_profile_exits_2_with_one_line_per_problem(user_dir):
    (user_dir / "bad.yaml").write_text("name: X\ndevice: cuda\nmatch: [X]\npeak_tflops: {bf16: -3}\nflops: 1\n")
    res = CliRunner().invoke(main, ["hardware"])
    assert res.exit_code == 2
    assert res.output.splitlines() == [
        f"error: {user_dir / 'bad.yaml'}: peak_tflops.bf16: Input should be greater than or equal to 0.000001 (got -3)",
        f"error: {user_dir / 'bad.yaml'}: flops: unknown key; did you mean 'peak_tflops'?"]
