"""scaletool installed as a user installs it: a wheel (non-editable) and an editable install, each run from
another directory, find the shipped recipes, sweeps, hardware profiles and documentation pages; shipped names
work everywhere.

Both installs reuse this environment's packages (torch and the rest): the wheel goes to a ``pip install
--target`` folder put first on PYTHONPATH; the editable install goes into a venv that sees this
environment's site-packages through a ``.pth`` line. Nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RECIPES, ROOT

from scaletool import resources
from scaletool.errors import RecipeError

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

# The tree a build needs, without what is large or written by runs.
_IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", "benchmarks",
                                 ".pytest_cache", ".ruff_cache")

# What a fresh process of the installed scaletool reports about where it reads from.
PROBE = """
import json, scaletool
from scaletool import resources
from scaletool.measure.hardware import peak_for
from scaletool.sweep.spec import load_sweep

p = peak_for("cuda", "NVIDIA H100 80GB HBM3", "bf16")
print(json.dumps({"package": scaletool.__file__, "llama3-8b": str(resources.find_recipe("llama3-8b")),
                  "quickstart": str(load_sweep("quickstart").path), "peak": [p.tflops, p.profile, p.source],
                  "recipes": sorted(resources.shipped("recipe")), "sweeps": sorted(resources.shipped("sweep"))}))
"""


def _pip(python: str, *args: str, cwd: Path) -> None:
    res = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "--no-input", *args], cwd=cwd,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PIP_NO_INDEX": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _clean_env(**extra: str) -> dict:
    """The environment without this checkout on PYTHONPATH (the tests run with it there)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SCALETOOL_PROFILES")}
    return {**env, "XDG_CONFIG_HOME": extra.pop("XDG_CONFIG_HOME", "/nonexistent"), **extra}


def _run(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    """The checkout as a build sees it (symbolic links kept), so building writes nothing into the checkout."""
    src = tmp_path_factory.mktemp("src") / "scaletool-src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=_IGNORE)
    return src


def test_wheel_ships_recipes_sweeps_and_profiles_and_runs_from_anywhere(source_copy, tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _pip(sys.executable, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source_copy),
         cwd=tmp_path)
    (wheel,) = wheels.glob("scaletool-*.whl")
    _pip(sys.executable, "install", "--no-deps", "--target", str(target), str(wheel), cwd=tmp_path)
    data = [p for d in ("recipes", "profiles", "templates") for p in (target / "scaletool" / d).rglob("*") if p.is_file()]
    assert all(p.suffix in (".yaml", ".j2", ".tsv") for p in data), data  # nothing of benchmarks (its scripts)
    assert {p.name for p in data if p.suffix == ".tsv"} == {"published-runs.tsv"}  # calibrate --validate --published
    shipped = {p.relative_to(target / "scaletool").as_posix() for p in data if p.suffix == ".yaml"}
    in_repo = {p.relative_to(ROOT).as_posix() for pat in ("recipes/*.yaml", "recipes/sweeps/*.yaml", "profiles/*.yaml",
                                                                  "profiles/calibrations/*.yaml")
               for p in ROOT.glob(pat)}
    assert shipped == in_repo  # every recipe, sweep and profile; nothing of benchmarks
    assert not (target / "scaletool" / "recipes").is_symlink()  # real files in the wheel
    docs = {p.name for p in (target / "scaletool" / "docs").iterdir()}
    assert docs == {p.name for p in ROOT.glob("docs/*.md")} and "plan.md" in docs  # the pages, not docs/benchmarks

    env = _clean_env(PYTHONPATH=str(target))
    probe = json.loads(_run([sys.executable, "-c", PROBE], elsewhere, env).stdout)
    pkg = target / "scaletool"
    assert probe["package"] == str(pkg / "__init__.py")
    assert probe["llama3-8b"] == str(pkg / "recipes" / "llama3-8b.yaml")
    assert probe["quickstart"] == str(pkg / "recipes" / "quickstart.yaml")  # `scaletool quickstart` finds its sweep
    assert probe["peak"] == [989.0, "H100 SXM", "shipped:h100-sxm.yaml"]  # a recipe run on an H100 gets its MFU peak
    assert "llama3-8b" in probe["recipes"] and "mla-compression" in probe["sweeps"]

    script = str(target / "bin" / "scaletool")  # the console script, as `pip install` writes it
    est = _run([script, "estimate", "llama3-8b", "--json"], elsewhere, env)
    assert est.returncode == 0, est.stderr
    assert json.loads(est.stdout)["params"]["total"] == 8_030_261_248  # Llama-3-8B, exactly
    hw = _run([script, "hardware", "--json"], elsewhere, env)
    assert hw.returncode == 0, hw.stderr
    doc = json.loads(hw.stdout)
    assert {p["name"] for p in doc["profiles"]} >= {"H100 SXM", "H100 PCIe", "H200", "A100", "CPU"}
    assert all(p["source"].startswith("shipped:") for p in doc["profiles"])
    page = _run([script, "docs", "plan"], elsewhere, env)
    assert page.returncode == 0, page.stderr
    assert page.stdout == (ROOT / "docs" / "plan.md").read_text(encoding="utf-8")
    sweep = _run([script, "sweep", "mla-compression", "--dry-run", "--json", "--out", str(tmp_path / "sw")],
                 elsewhere, env)
    assert sweep.returncode == 0, sweep.stderr
    assert not (tmp_path / "sw").exists()


def test_editable_install_reads_the_checkout_through_the_links(source_copy, tmp_path):
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (venv_site,) = venv.glob("lib/python*/site-packages")
    # this environment's packages (pip, setuptools, torch, ...) under the new venv's own
    (venv_site / "parent-env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    python = str(venv / "bin" / "python")
    _pip(python, "install", "--no-deps", "--no-build-isolation", "-e", str(source_copy), cwd=tmp_path)
    probe = _run([python, "-c", PROBE], elsewhere, _clean_env())
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    assert got["package"] == str(source_copy / "scaletool" / "__init__.py")
    assert Path(got["llama3-8b"]).resolve() == source_copy / "recipes" / "llama3-8b.yaml"
    assert got["peak"][1] == "H100 SXM"


# -- the lookup itself, in this checkout ----------------------------------------------------------


@pytest.mark.parametrize("arg, kind, shipped_as", [
    ("llama3-8b", "recipe", "llama3-8b.yaml"),
    ("llama3-8b.yaml", "recipe", "llama3-8b.yaml"),
    ("recipes/mla-1b.yaml", "recipe", "mla-1b.yaml"),        # README's paths work from any directory
    ("mla-compression", "sweep", "sweeps/mla-compression.yaml"),
    ("recipes/sweeps/ffn-width.yaml", "sweep", "sweeps/ffn-width.yaml"),
    ("quickstart", "sweep", "quickstart.yaml"),              # a sweep file among the recipes
    ("price-transformer", "recipe", "price-transformer.yaml"),  # both a recipe and a sweep: each loader gets its own
    ("price-transformer", "sweep", "sweeps/price-transformer.yaml"),
    ("mla-compression", "recipe", "sweeps/mla-compression.yaml"),  # the other kind: its loader says what it is
])
def test_shipped_names_resolve(arg, kind, shipped_as, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resources.find_recipe(arg, kind).resolve() == (RECIPES / shipped_as).resolve()


def test_an_existing_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("model: {d_model: 64}\n")
    assert resources.find_recipe("tiny") == Path("tiny")


@pytest.mark.parametrize("arg, line", [
    ("llama-8b", "llama-8b: no such file, nor a shipped recipe; did you mean 'llama3-8b'? shipped recipes: "
                 "deepseek-v2-lite, "),
    ("zzzzzz", "zzzzzz: no such file, nor a shipped recipe; shipped recipes: deepseek-v2-lite, "),
    ("somewhere/llama3-8b.yaml", "somewhere/llama3-8b.yaml: no such file"),
    ("/abs/llama3-8b.yaml", "/abs/llama3-8b.yaml: no such file"),
])
def test_unknown_names_are_one_line_with_the_shipped_names(arg, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as e:
        resources.find_recipe(arg)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(line)


def test_shipped_files_are_what_their_kind_says():
    """Every shipped recipe validates as a recipe and every shipped sweep as a sweep (the lookup's split)."""
    from scaletool.config import load_recipe
    from scaletool.sweep.spec import load_sweep

    recipes, sweeps = resources.shipped("recipe"), resources.shipped("sweep")
    assert "quickstart" in sweeps and "quickstart" not in recipes
    for name in recipes:
        load_recipe(name)
    for name in sweeps:
        assert load_sweep(name).path == sweeps[name]


@pytest.mark.parametrize("name", sorted(resources.shipped("sweep")))
def test_every_point_of_every_shipped_sweep_validates(name):
    """A shipped sweep whose point would be skipped as invalid (a mistyped key, a value its attention kind
    refuses) is a broken benchmark that only a GPU session would find: every point must build a recipe."""
    from scaletool.sweep.points import expand
    from scaletool.sweep.spec import load_sweep

    points = expand(load_sweep(name))
    assert points and not [(p.label, p.reason) for p in points if p.skipped]
