"""The lint configuration in pyproject.toml (ruff) holds for the whole tree."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"


ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    res = subprocess.run([ruff, "check", "--no-cache", "scaletool", "tests", "recipes", "launch"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
