"""YAML alias bombs against the real command line, each in its own process with a short timeout:
a hang or runaway memory fails the test (subprocess.TimeoutExpired) instead of stalling the suite."""
from __future__ import annotations

import pytest
from hostile import RECIPES, assert_process_refused, run_scaletool
from test_hostile_recipes import alias_bomb

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

# a child that gets past validation would walk 9^9 values: far longer than this, and gigabytes
TIMEOUT_S = 300


@pytest.mark.parametrize("files, args, expected", [
    ({"r.yaml": alias_bomb() + "parallel: {engine: deepspeed, deepspeed: {comment: *b8}}\n"},
     ["recipe", "show", "r.yaml", "--json"], "error: r.yaml: more than 100,000 values"),
    ({"s.yaml": alias_bomb() + f"recipe: {RECIPES / 'tiny.yaml'}\nmodes: [estimate]\nset: {{model.notes: *b8}}\n"},
     ["sweep", "s.yaml", "--dry-run"], "error: s.yaml: more than 100,000 values"),
], ids=["recipe-show-json", "sweep-file"])  # --set bombs: test_hostile_overrides (in-process; startup is ~5 s)
def test_bombs_fail_fast_in_a_real_process(tmp_path, files, args, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = sorted(tmp_path.iterdir())
    lines = assert_process_refused(run_scaletool(*args, timeout=TIMEOUT_S, cwd=tmp_path))
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert sorted(tmp_path.iterdir()) == before
