"""Docstrings say what the code does and why in a few lines: none in scaletool/ runs past 20 lines
(history and measured numbers belong in the benchmark documents and commit messages)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "scaletool"
MAX_LINES = 20


def long_docstrings(root: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc.splitlines()) > limit:
                    where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 1)}"
                    found.append(f"{where} {getattr(node, 'name', '<module>')}: {len(doc.splitlines())} lines")
    return found


def test_no_docstring_in_scaletool_runs_past_20_lines():
    assert long_docstrings(PACKAGE, MAX_LINES) == []


def test_the_check_finds_a_long_docstring(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"line {i}" for i in range(MAX_LINES + 1))
    (pkg / "m.py").write_text(f'"""Short."""\n\n\ndef f():\n    """{body}"""\n', encoding="utf-8")
    assert long_docstrings(pkg, MAX_LINES) == [f"pkg/m.py:4 f: {MAX_LINES + 1} lines"]
