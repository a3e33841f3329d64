"""Hardware profiles: shipped ones, user files that extend or replace them, and validation, one line per problem."""
from __future__ import annotations

import pytest
import yaml

from scaletool.errors import RecipeError
from scaletool.measure.hardware import load_profiles, peak_for, profile_for, user_dirs

RTX = {"name": "RTX 4090", "device": "cuda", "match": ["RTX 4090"], "peak_tflops": {"bf16": 165.2, "fp32": 82.6},
       "peak_bandwidth_gb_s": 1008, "reference": "Ada whitepaper"}


def _write(directory, name, content):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(content if isinstance(content, str) else yaml.safe_dump(content))


@pytest.fixture
def env(tmp_path):
    """An environment naming one user directory and an empty config home."""
    return {"SCALETOOL_PROFILES": str(tmp_path / "mine"), "XDG_CONFIG_HOME": str(tmp_path / "config")}


def test_shipped_profiles_have_unique_names_and_a_reference():
    profiles = load_profiles({"XDG_CONFIG_HOME": "/nonexistent"})
    names = [p.name for p in profiles]
    assert len(names) == len(set(names)) and {"H100 SXM", "H100 PCIe", "H200", "A100", "CPU"} <= set(names)
    assert all(p.reference and p.source.startswith("shipped:") for p in profiles)


def test_user_dirs_precedence(tmp_path):
    dirs = user_dirs({"SCALETOOL_PROFILES": f"{tmp_path}/a:{tmp_path}/b", "XDG_CONFIG_HOME": f"{tmp_path}/c"})
    assert dirs == [tmp_path / "a", tmp_path / "b", tmp_path / "c" / "scaletool" / "profiles"]
    assert user_dirs({"HOME": str(tmp_path)})[-1].parts[-3:] == (".config", "scaletool", "profiles")


def test_a_user_profile_extends_the_list_and_gets_its_gpu(tmp_path, env):
    _write(tmp_path / "config" / "scaletool" / "profiles", "rtx.yaml", RTX)
    profiles = load_profiles(env)
    assert profiles[0].name == "RTX 4090" and profiles[0].source.endswith("rtx.yaml")
    p = peak_for("cuda", "NVIDIA GeForce RTX 4090", "bf16", profiles=profiles)
    assert (p.tflops, p.profile, p.warning) == (165.2, "RTX 4090", None)
    assert profile_for("cuda", "NVIDIA GeForce RTX 4090", profiles).peak_bandwidth_bytes_per_s == 1008e9
    assert peak_for("cuda", "NVIDIA GeForce RTX 4090", "fp16", profiles=profiles).tflops is None  # none given


def test_a_user_profile_with_a_shipped_name_replaces_it_and_the_first_directory_wins(tmp_path, env):
    mine = {"name": "H100 SXM", "device": "cuda", "match": ["H100 80GB HBM3"], "peak_tflops": {"bf16": 900}}
    _write(tmp_path / "mine", "h100.yaml", mine)
    _write(tmp_path / "config" / "scaletool" / "profiles", "other.yaml", RTX)
    profiles = load_profiles(env)
    h100 = [p for p in profiles if p.name == "H100 SXM"]
    assert len(h100) == 1 and h100[0].replaces == "shipped:h100-sxm.yaml"
    assert [p.name for p in profiles[:2]] == ["H100 SXM", "RTX 4090"]  # $SCALETOOL_PROFILES, then config home
    assert peak_for("cuda", "NVIDIA H100 80GB HBM3", "bf16", profiles=profiles).tflops == 900


def test_a_user_profile_matching_a_shipped_gpu_is_tried_first(tmp_path, env):
    _write(tmp_path / "mine", "any-h100.yaml", {"name": "my H100", "device": "cuda", "match": ["H100"],
                                                 "peak_tflops": {"bf16": 800}})
    assert peak_for("cuda", "NVIDIA H100 PCIe", "bf16", profiles=load_profiles(env)).profile == "my H100"


@pytest.mark.parametrize("content, lines", [
    ({**RTX, "peak_tflops": {"bf16": -1, "int8": 3}, "peak_bandwidh_gb_s": 1},
     ["peak_tflops.bf16: Input should be greater than or equal to 0.000001 (got -1)",
      "peak_tflops.int8.[key]: Input should be 'bf16', 'fp16', 'fp32' or 'fp8'",
      "peak_bandwidh_gb_s: unknown key; did you mean 'peak_bandwidth_gb_s'?"]),
    ({**RTX, "peak_tflops": {"bf16": float("inf")}, "peak_bandwidth_gb_s": 0},
     ["peak_tflops.bf16: Input should be a finite number",
      "peak_bandwidth_gb_s: Input should be greater than or equal to 0.000001"]),
    ({**RTX, "peak_tflops": {"fp32": float("nan")}}, ["peak_tflops.fp32: Input should be a finite number"]),
    ({"name": "X", "device": "cuda", "peak_tflops": {"bf16": 1}},
     ["match: a cuda profile needs at least one substring of the GPU's name"]),
    ({"name": "X", "device": "tpu", "match": ["X"]}, ["device: Input should be 'cuda' or 'cpu'"]),
    ("name: [unclosed\n", ["malformed YAML at line"]),
    ("- a list\n", ["a profile is a mapping"]),
    ({"device": "cuda", "match": ["X"], "peak_tflops": {"bf16": "x" * 500}},
     ["name: Field required", "peak_tflops.bf16: Input should be a valid number"]),
])
def test_invalid_profiles_are_one_line_per_problem(tmp_path, env, content, lines):
    _write(tmp_path / "mine", "bad.yaml", content)
    with pytest.raises(RecipeError) as e:
        load_profiles(env)
    problems = e.value.problems
    assert len(problems) == len(lines), problems
    for problem, expected in zip(problems, lines):
        assert problem.startswith(f"{tmp_path / 'mine' / 'bad.yaml'}: ") and expected in problem
        assert len(problem) < 300  # never the whole bad input


def test_problems_of_several_files_and_duplicate_names_are_all_reported(tmp_path, env):
    _write(tmp_path / "mine", "a.yaml", RTX)
    _write(tmp_path / "mine", "b.yaml", RTX)
    _write(tmp_path / "mine", "c.yaml", {**RTX, "name": "other", "colour": 1})
    with pytest.raises(RecipeError) as e:
        load_profiles(env)
    assert len(e.value.problems) == 2
    assert "c.yaml: colour: unknown key" in e.value.problems[0]
    assert e.value.problems[1].endswith(f"b.yaml: name 'RTX 4090' is also defined by {tmp_path / 'mine' / 'a.yaml'}")
