"""Imports flow one way: the layering contract of the package, checked on every import statement.

Layers, highest first. A module may import from its own top-level room (``scaletool.train.*`` from
``scaletool.train``) and from any room in a lower layer; rooms in the same layer are independent
unless an edge below allows it. Imports inside functions count like module-level ones: a lazy import
is still a dependency.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import scaletool

LAYERS: list[set[str]] = [
    {"__main__"},
    {"bench"},  # the benchmark-suite runner: reads the CLI's command names, runs commands as processes
    {"cli"},
    {"api"},
    {"report"},
    {"profile", "sweep", "plan"},
    {"train", "decode", "launch"},
    {"predict"},  # the step model's lookups, calibration, validation against recorded and published runs
    {"engines", "measure"},
    {"model", "analytic", "hf"},
    {"config", "kernels"},
    {"kinds"},  # torch-free: each attention kind's and engine's keys, rules and closed forms
    {"yaml_input"},  # the bounded safe YAML loader and dotted overrides, below the recipe schema
    {"results"},
    {"stats"},
    {"records"},  # the run folders' record files, loose or in their xz bundle: every reader of benchmarks/results
    {"errors", "fmt", "threads", "resources", "allocator", "__init__"},
]
#: same-layer imports that are part of the design: (importer, imported)
ALLOWED_SIDEWAYS: set[tuple[str, str]] = {
    ("resources", "errors"),  # a name that is neither a file nor a shipped recipe is a RecipeError line
    ("train", "launch"),  # a run over local ranks starts them under torchrun (scaletool.train.run)
}
#: known violations being removed; each entry names the module pair. Keep this empty.
PENDING: set[tuple[str, str]] = set()

PKG = Path(scaletool.__file__).parent


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(room: str) -> int:
    for i, rooms in enumerate(LAYERS):
        if room in rooms:
            return i
    raise AssertionError(f"room scaletool.{room} is in no layer of tests/test_layering.py: place it")


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        yield name, path


def _imports(name: str, path: Path):
    """(module imported, line) for every import statement, in functions too; ``from a import b`` names the
    module ``a.b`` where ``b`` is a module of the package (``from scaletool import analytic`` imports
    scaletool.analytic), else ``a``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    known = _module_names()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            yield from ((sub, node.lineno) for sub in subs)
            if len(subs) < len(node.names):
                yield target, node.lineno


def violations() -> list[str]:
    out = []
    for name, path in _modules():
        src_room = _room(name)
        for target, line in _imports(name, path):
            if target != "scaletool" and not target.startswith("scaletool."):
                continue
            dst_room = _room(target)
            if dst_room == src_room:
                continue
            a, b = _layer(src_room), _layer(dst_room)
            ok = b > a or (b == a and (src_room, dst_room) in ALLOWED_SIDEWAYS)
            if target == "scaletool" and b >= a:  # `from scaletool import __version__`
                ok = True
            if not ok and not any(name.startswith(p) and target.startswith(q) for p, q in PENDING):
                out.append(f"{path.relative_to(PKG.parent)}:{line}: scaletool.{src_room} (layer {a}) imports "
                           f"{target} (layer {b})")
    return out


def test_imports_flow_one_way():
    assert violations() == []


def test_every_room_has_a_layer():
    rooms = {_room(n) for n, _ in _modules()}
    for r in rooms:
        _layer(r)


def test_pending_exceptions_are_still_needed():
    """An entry of PENDING that no import needs any more must be deleted (the list only shrinks)."""
    global PENDING
    saved = PENDING
    try:
        for p, q in sorted(saved):
            PENDING = saved - {(p, q)}
            assert any(f"{p.replace('.', '/')}" in v and q in v for v in violations()), \
                f"PENDING entry ({p}, {q}) is no longer needed: remove it"
    finally:
        PENDING = saved


def test_the_contract_catches_an_upward_import(tmp_path, monkeypatch):
    """The check is not vacuous: a model module importing the CLI is reported."""
    fake = tmp_path / "scaletool"
    (fake / "model").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "model" / "__init__.py").write_text("")
    (fake / "model" / "bad.py").write_text("def f():\n    from scaletool.cli import main\n")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    found = violations()
    assert len(found) == 1 and "model/bad.py:2" in found[0] and "scaletool.cli" in found[0]


#: functions allowed past MAX_FUNCTION_LINES, each with the reason it reads best whole. Keep it short.
LONG_FUNCTIONS: dict[str, str] = {}
MAX_FUNCTION_LINES = 80


def long_functions() -> list[str]:
    out = []
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                where = f"{name}.{node.name}"
                if n > MAX_FUNCTION_LINES and where not in LONG_FUNCTIONS:
                    out.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: {node.name} is {n} lines")
    return out


def test_no_function_is_longer_than_about_80_lines():
    """A function past 80 lines splits into named steps, or says here why it reads best whole."""
    assert long_functions() == []


MAX_MODULE_LINES = 500


def test_no_module_is_longer_than_500_lines():
    """A module past 500 lines splits by what its parts answer (analytic.pipeline: the split and memory;
    analytic.pipeline_time: the step)."""
    assert [f"{name}: {n} lines" for name, path in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES] == []


# ---------------------------------------------------------------------------------------------
# What runs at import time: cycles, torch-free rooms, the model free of distributed code


#: rooms that never import torch, not even through another module at import time: ``estimate``,
#: ``recipe check`` and the recipe schema stay fast and run where torch is absent
TORCH_FREE = ("scaletool.kinds", "scaletool.analytic", "scaletool.config", "scaletool.yaml_input")


def _module_names() -> set[str]:
    return {name for name, _ in _modules()}


def full_import_graph() -> dict[str, set[str]]:
    """Every scaletool module -> the scaletool modules it imports anywhere (module level or inside functions,
    a lazy import is still a dependency), with the packages above each (importing ``a.b`` runs ``a``); an
    edge to one's own package is left out (the package runs before its modules: no cycle)."""
    known = _module_names()
    graph = {}
    for name, path in _modules():
        out = set()
        for target, _ in _imports(name, path):
            parts = target.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known)
        graph[name] = {t for t in out if t != name and not name.startswith(t + ".")}
    return graph


def any_import_cycles(graph: dict[str, set[str]] | None = None) -> list[str]:
    """Import cycles anywhere in the package (one per strongly connected group found, as a path)."""
    graph = full_import_graph() if graph is None else graph
    cycles, state = [], {}

    def dfs(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                dfs(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            dfs(node, [node])
    return cycles


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules ``name`` imports when it is imported: statements at module level (not in functions, not
    under ``if TYPE_CHECKING``), ``from a import b`` naming the submodule ``a.b`` where there is one, and
    the packages above each imported scaletool module (importing ``a.b`` runs ``a`` first)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()

    def visit(stmts):
        for node in stmts:
            if isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = next(t for t, line in _imports(name, path) if line == node.lineno) if node.level else node.module
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)

    visit(tree.body)
    for target in list(out):
        parts = target.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in known)
    return out - {name}


def _graph() -> dict[str, set[str]]:
    known = _module_names()
    return {name: _module_level_imports(name, path, known) for name, path in _modules()}


def import_cycles() -> list[str]:
    """Cycles of module-level imports between modules of one room (a package's own modules and its
    ``__init__`` re-exports excepted: the package runs before its modules, so that edge is no cycle)."""
    graph = _graph()
    edges = {a: {b for b in bs if b in graph and _room(a) == _room(b) and not a.startswith(b + ".")}
             for a, bs in graph.items()}
    cycles, state = [], {}

    def dfs(node, path):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                dfs(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            dfs(node, [node])
    return cycles


def torch_imports(roots: tuple[str, ...] = TORCH_FREE) -> list[str]:
    """The import chain from each torch-free module to torch, one line per module that reaches it."""
    graph = _graph()
    out = []
    for start in sorted(n for n in graph if any(n == r or n.startswith(r + ".") for r in roots)):
        seen, stack = {start: [start]}, [start]
        while stack:
            node = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == "torch" or nxt.startswith("torch."):
                    out.append(" -> ".join(seen[node] + [nxt]))
                    stack.clear()
                    break
                if nxt in graph and nxt not in seen:
                    seen[nxt] = seen[node] + [nxt]
                    stack.append(nxt)
    return out


def test_no_import_cycle_inside_a_room():
    assert import_cycles() == []


def test_no_import_cycle_anywhere():
    """No module reaches itself through imports, lazy ones included (a cycle hides an order of import
    that works only by luck, and a room that two others each need)."""
    assert any_import_cycles() == []


def test_from_package_import_module_counts_as_importing_the_module(tmp_path, monkeypatch):
    """``from scaletool import cli`` in the model is an upward import, and two modules importing each other
    inside functions are a cycle."""
    fake = tmp_path / "scaletool"
    for room in ("model", "cli", "analytic"):
        (fake / room).mkdir(parents=True)
        (fake / room / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "model" / "bad.py").write_text("from scaletool import cli\n")
    (fake / "analytic" / "a.py").write_text("def f():\n    from scaletool.analytic import b\n")
    (fake / "analytic" / "b.py").write_text("def g():\n    from scaletool.analytic.a import f\n")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    found = violations()
    assert len(found) == 1 and "model/bad.py:1" in found[0] and "scaletool.cli" in found[0]
    assert any_import_cycles() == ["scaletool.analytic.a -> scaletool.analytic.b -> scaletool.analytic.a"]


def test_torch_free_rooms_never_import_torch():
    assert torch_imports() == []


def test_torch_free_rooms_import_without_torch_in_a_fresh_interpreter():
    code = f"import sys; import {', '.join(TORCH_FREE)}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent, env={**os.environ, "PYTHONPATH": str(PKG.parent)})
    assert out.stdout.strip() == "[]"


def test_the_model_never_imports_torch_distributed():
    """The model is single-device code; what makes it distributed is applied from scaletool.engines."""
    found = []
    for name, path in _modules():
        if _room(name) != "model":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.relative_to(PKG.parent)}:{node.lineno}: {n}" for n in names
                      if n == "torch.distributed" or n.startswith("torch.distributed.")]
    assert found == []


def test_the_import_checks_are_not_vacuous(tmp_path, monkeypatch):
    """A cycle, torch reached from analytic through another module, and torch.distributed in the model are reported."""
    fake = tmp_path / "scaletool"
    for room in ("analytic", "model", "fmt"):
        (fake / room).mkdir(parents=True)
        (fake / room / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "analytic" / "a.py").write_text("from scaletool.analytic import b\n")
    (fake / "analytic" / "b.py").write_text("from scaletool.analytic.a import x\nfrom scaletool.fmt import c\n")
    (fake / "fmt" / "c.py").write_text("import torch\n")
    (fake / "model" / "m.py").write_text("def f():\n    from torch.distributed import all_reduce\n")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    assert import_cycles() == ["scaletool.analytic.a -> scaletool.analytic.b -> scaletool.analytic.a"]
    assert "scaletool.analytic.b -> scaletool.fmt.c -> torch" in torch_imports()
    with pytest.raises(AssertionError, match="torch.distributed"):
        test_the_model_never_imports_torch_distributed()
