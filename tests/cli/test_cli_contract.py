"""What every command promises a user at the command line: help that is fast (no torch import) and has
examples, and one error format, ``error: ...`` with exit status 2, for click's usage errors and ours."""
from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner
from conftest import ROOT

from scaletool.cli import COMMANDS, main

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

#: command modules that still import torch at module level (their owners move the imports into the
#: functions that run); an entry no longer needed fails test_pending_entries_are_still_needed. Keep empty.
HEAVY_AT_IMPORT_PENDING: set[str] = set()
#: commands whose --help has no example yet (their owners add one or two). Keep empty.
NO_EXAMPLES_PENDING: set[str] = set()
HEAVY = ("torch", "deepspeed", "matplotlib", "numpy")


def _all_commands() -> dict[str, click.Command]:
    """Every command path ('recipe check' for subcommands) -> command."""
    ctx = click.Context(main)
    out = {}
    for name in COMMANDS:
        cmd = main.get_command(ctx, name)
        out[name] = cmd
        if isinstance(cmd, click.Group):
            out.update({f"{name} {sub}": c for sub, c in cmd.commands.items()})
    return out


# Runs each command line in a child forked from one interpreter that has imported only scaletool.cli (and
# checked that this imports nothing heavy): fresh module state per command line at a fraction of the cost
# of a new interpreter each. A meta-path spy records, for each heavy module, the scaletool modules on the
# stack when it is first imported, and blocks the import.
PROBE = r"""
import json, os, sys
HEAVY = %r
from scaletool.cli import main
import scaletool.config, scaletool.api, rich.console, rich.table  # light, shared by every child: import once
assert not [m for m in HEAVY if m in sys.modules], "importing scaletool.cli imports a heavy module"

class Spy:
    found = {}
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and name not in self.found:
            f, chain = sys._getframe(), []
            while f is not None:
                mod = f.f_globals.get("__name__", "")
                if mod.startswith("scaletool") and mod not in chain:
                    chain.append(mod)
                f = f.f_back
            self.found[name] = chain
        if name in HEAVY:  # recorded; not importing it keeps the probe fast (the command then fails)
            raise ModuleNotFoundError(f"{name} blocked by the probe")
        return None

results = {}
for argv in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1), os.dup2(null, 2)
        spy = Spy()
        sys.meta_path.insert(0, spy)
        try:
            main.main(argv, prog_name="scaletool")
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # a blocked import the command did not expect
            code = repr(e)
        os.write(w, json.dumps({"exit": code, "heavy": spy.found}).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as fp:
        results[" ".join(argv)] = json.loads(fp.read())
    os.waitpid(pid, 0)
print(json.dumps(results))
"""
FAST_ARGV = [["--help"], *([c, "--help"] for c in COMMANDS), ["recipe", "check", "--help"], ["launch", "torchrun", "--help"],
             ["recipe", "check", "tiny"], ["schema", "hardware"]]


@pytest.fixture(scope="module")
def probed() -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE % (HEAVY,), json.dumps(FAST_ARGV)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


@pytest.mark.parametrize("argv", [" ".join(a) for a in FAST_ARGV])
def test_help_and_recipe_check_never_import_heavy_modules(probed, argv):
    got = probed[argv]
    assert got["heavy"] or got["exit"] in (0, None), got
    for module, chain in got["heavy"].items():
        culprits = {n.split(".")[2] for n in chain if n.startswith("scaletool.cli.") and n.count(".") == 2}
        assert culprits and culprits <= HEAVY_AT_IMPORT_PENDING, \
            f"`scaletool {argv}` imports {module} through {' <- '.join(chain)}"


@pytest.mark.parametrize("name", sorted(HEAVY_AT_IMPORT_PENDING))
def test_pending_entries_are_still_needed(probed, name):
    chains = probed[f"{name} --help"]["heavy"].values()
    assert any(f"scaletool.cli.{name}" in chain for chain in chains), \
        f"scaletool.cli.{name} no longer imports a heavy module: remove it from HEAVY_AT_IMPORT_PENDING"


@pytest.mark.parametrize("path", sorted(_all_commands()))
def test_every_command_has_examples_in_its_help(path):
    text = _all_commands()[path].help or ""
    has = "Example" in text and f"scaletool {path}" in text
    assert has != (path in NO_EXAMPLES_PENDING), (
        f"scaletool {path} --help has no 'Examples:' with `scaletool {path} ...`" if not has
        else f"scaletool {path} has examples now: remove it from NO_EXAMPLES_PENDING")


# -- one error format -------------------------------------------------------------------------------


def _invoke(*argv: str):
    return CliRunner().invoke(main, list(argv), prog_name="scaletool")


@pytest.mark.parametrize("argv, line", [
    (["estimate", "tiny", "--jsn"], "error: no such option '--jsn'. (Did you mean one of: '--json', '--set'?); "
                                    "try 'scaletool estimate --help'"),
    (["estimate"], "error: missing argument 'RECIPE'; try 'scaletool estimate --help'"),
    (["estimat", "tiny"], "error: no such command 'estimat'; did you mean 'estimate'?; try 'scaletool --help'"),
    (["frobnicate"], "error: no such command 'frobnicate'; commands: estimate, plan, count, "),
    (["estimate", "tiny", "--world-size", "two"], "error: invalid value for '--world-size' / '--gpus': 'two' is not a valid "
                                                  "integer range; try 'scaletool estimate --help'"),
    (["launch", "torchrun", "tiny", "--nnodes", "0"], "error: invalid value for '--nnodes': 0 is not in the range "
                                                      "x>=1; try 'scaletool launch torchrun --help'"),
    (["sweep", "quickstart", "--mode", "fly"], "error: invalid value for '--mode': 'fly' is not one of 'estimate', "),
    (["recipe", "chek", "tiny"], "error: no such command 'chek'. Did you mean 'check'?; try 'scaletool recipe --help'"),
    (["schema", "a", "b"], "error: got unexpected extra argument (b); try 'scaletool schema --help'"),
    (["--result-file"], "error: option '--result-file' requires an argument"),
    (["estimate", "no-such-recipe"], "error: no-such-recipe: no such file, nor a shipped recipe; shipped recipes: "),
])
def test_usage_and_recipe_errors_are_one_error_line_and_exit_2(argv, line):
    res = _invoke(*argv)
    assert res.exit_code == 2, res.output
    assert len(res.output.splitlines()) == 1 and res.output.startswith(line), res.output
    assert "Usage:" not in res.output and "Traceback" not in res.output


def test_several_recipe_problems_are_one_line_each():
    res = _invoke("estimate", "tiny", "--set", "model.d_modl=3", "--set", "train.stepz=1")
    assert res.exit_code == 2
    assert [ln.split(":")[0] for ln in res.output.splitlines()] == ["error", "error"]


def test_a_real_process_writes_the_error_line_to_stderr_only():
    res = subprocess.run([sys.executable, "-m", "scaletool", "hardware", "--frobnicate"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.splitlines() == ["error: no such option '--frobnicate'; try 'python -m scaletool hardware --help'"]


def test_help_and_a_bare_group_still_print_help():
    assert _invoke("--help").output.startswith("Usage: scaletool [OPTIONS] COMMAND [ARGS]...")
    bare = _invoke("recipe")
    assert "Usage: scaletool recipe" in bare.output and "error:" not in bare.output
    assert _invoke("--version").output == "scaletool, version 0.1.0\n"


# -- scaletool schema --------------------------------------------------------------------------------


def test_schema_lists_every_registered_kind():
    from scaletool.results import registered

    res = _invoke("schema", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["kinds"]
    assert [r["kind"] for r in rows] == sorted(registered()) and {"hardware", "launch"} <= {r["kind"] for r in rows}
    assert all(r["description"] and r["schema_version"] >= 1 for r in rows)
    table = _invoke("schema").output
    assert all(f"{r['kind']}" in table for r in rows)


@pytest.mark.parametrize("kind, argv", [("hardware", ["hardware", "--json"]),
                                        ("launch", ["launch", "slurm", "tiny", "--dry-run", "--json"])])
def test_a_schema_describes_what_the_command_prints(kind, argv):
    res = _invoke("schema", kind)
    assert res.exit_code == 0, res.output
    schema = json.loads(res.output)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["kind"]["const"] == kind
    doc = json.loads(_invoke(*argv).output)
    assert set(doc) == set(schema["properties"])  # --json is the typed result, every field of it
    assert set(schema.get("required", ())) <= set(doc)


def test_schema_of_an_unknown_kind_is_one_line():
    res = _invoke("schema", "hardwre")
    assert res.exit_code == 2
    assert res.output.startswith("error: hardwre: no typed result of that kind; did you mean 'hardware'? known: ")


def test_docs_python_api_example_runs_without_torch():
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text[text.index("## Python API"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    check = "\nimport sys\nassert 'torch' not in sys.modules, 'the API example imported torch'\n"
    res = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True, timeout=120,
                         cwd=ROOT.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines()[0] == "8030261248 131072"  # Llama-3-8B: parameters, KV bytes per token (bf16)
    assert res.stdout.splitlines()[-1].startswith("H100 SXM ")
