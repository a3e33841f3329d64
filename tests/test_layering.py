"""Imports flow one way: the layering contract of the package, checked on every import statement.

Layers, highest first. A module may import from its own top-level room (``scaletool.train.*`` from
``scaletool.train``) and from any room in a lower layer; rooms in the same layer are independent
unless an edge below allows it. Imports inside functions count like module-level ones: a lazy import
is still a dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

import scaletool

LAYERS: list[set[str]] = [
    {"__main__"},
    {"cli"},
    {"api"},
    {"report"},
    {"profile", "sweep"},
    {"train", "decode", "launch"},
    {"engines", "measure"},
    {"model", "analytic", "hf"},
    {"config", "kernels"},
    {"kinds"},  # torch-free: each attention kind's and engine's keys, rules and closed forms
    {"yaml_input"},  # the bounded safe YAML loader and dotted overrides, below the recipe schema
    {"results"},
    {"stats"},
    {"errors", "fmt", "threads", "resources", "__init__"},
]
#: same-layer imports that are part of the design: (importer, imported)
ALLOWED_SIDEWAYS: set[tuple[str, str]] = {
    ("resources", "errors"),  # a name that is neither a file nor a shipped recipe is a RecipeError line
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
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
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
    """Issue 18: a function past 80 lines splits into named steps, or says here why it reads best whole."""
    assert long_functions() == []
