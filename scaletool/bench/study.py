"""A study of the benchmark suite: a YAML file that lists commands as data, and its validation.

A study names the GPUs it needs, the recipes it uses and its commands; each command is an argument list
(never a shell string) whose first word is ``scaletool``, ``python`` or ``torchrun``, and names the result
it leaves in the study's output directory. ``{out}`` in an argument is that directory; a command's
``matrix`` expands it into one command per combination of its variables (``{recipe}``, ...).
"""
from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from scaletool.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"
PROGRAMS = ("scaletool", "python", "torchrun")
_MAX_BYTES = 1 << 20
_VAR = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]*$")
_STUDY_KEYS = {"name", "description", "gpus", "recipes", "commands"}
_COMMAND_KEYS = {"name", "argv", "stdout", "result", "timeout_s", "env", "matrix", "inputs", "cwd"}
#: arguments that name a file of this repository (checked to exist): these prefixes or suffixes
_PATH_PREFIXES = ("recipes/", "benchmarks/", "tests/", "scaletool/", "launch/", "profiles/")
_PATH_SUFFIXES = (".py", ".yaml", ".yml", ".jsonl")


class StudyError(Exception):
    """A study that cannot be used: one line per problem in ``problems``."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Command:
    """One command of a study, its variables substituted (``{out}`` stays until the run knows it)."""

    name: str
    argv: tuple[str, ...]
    result: str  # path relative to the study's output directory
    stdout: bool  # the command's stdout is the result (written only when it succeeds)
    timeout_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    inputs: tuple[tuple[str, str], ...] = ()  # (repository file, path under the output directory)
    cwd: str = "repo"  # "repo" (the repository root) or "out" (the output directory)


@dataclass(frozen=True)
class Study:
    name: str
    description: str
    gpus: int
    recipes: tuple[str, ...]
    commands: tuple[Command, ...]
    path: Path


def study_names() -> list[str]:
    return sorted(p.stem for p in STUDIES.glob("*.yaml")) if STUDIES.is_dir() else []


def find_study(name_or_path: str) -> Path:
    """A study file: a path to a YAML file, or the name of one in benchmarks/studies."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    if _NAME.match(name_or_path) and (STUDIES / f"{name_or_path}.yaml").is_file():
        return STUDIES / f"{name_or_path}.yaml"
    names = study_names()
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    shown = name_or_path if len(name_or_path) <= 60 else name_or_path[:57] + "..."
    raise StudyError([f"{shown}: no such study; {hint}studies: {', '.join(names) or 'none'}"])


def load_study(name_or_path: str) -> Study:
    path = find_study(name_or_path)
    try:
        if path.stat().st_size > _MAX_BYTES:
            raise StudyError([f"{path}: larger than 1 MiB, not a study"])
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise StudyError([f"{path}: cannot be read as YAML: {' '.join(str(e).split())[:200]}"]) from None
    return parse_study(raw, path)


def parse_study(raw, path: Path) -> Study:
    where = path.name
    if not isinstance(raw, dict):
        raise StudyError([f"{where}: a study is a mapping with the keys {', '.join(sorted(_STUDY_KEYS))}"])
    problems = [f"{where}: unknown key {k!r}{_did_you_mean(k, _STUDY_KEYS)}" for k in raw if k not in _STUDY_KEYS]
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not _NAME.match(name):
        problems.append(f"{where}: name must be letters, digits and ._=- (got {name!r:.60})")
    gpus = raw.get("gpus", 0)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or not 0 <= gpus <= 1024:
        problems.append(f"{where}: gpus must be a whole number from 0 to 1024 (got {gpus!r:.40})")
    recipes = raw.get("recipes", [])
    if not isinstance(recipes, list) or not all(isinstance(r, str) for r in recipes):
        problems.append(f"{where}: recipes must be a list of recipe paths")
        recipes = []
    problems += [f"{where}: recipe {r!r} is not a file of this repository" for r in recipes if not _repo_file(r)]
    commands: list[Command] = []
    raw_commands = raw.get("commands")
    if not isinstance(raw_commands, list) or not raw_commands:
        problems.append(f"{where}: commands must be a non-empty list")
        raw_commands = []
    for i, c in enumerate(raw_commands):
        try:
            commands += _expand(c, f"{where}: command {i + 1}")
        except StudyError as e:
            problems += e.problems
    seen: set[str] = set()
    for c in commands:
        if c.name in seen:
            problems.append(f"{where}: two commands are named {c.name!r}")
        seen.add(c.name)
    results = [c.result for c in commands]
    problems += [f"{where}: two commands leave the result {r!r}" for r in sorted({r for r in results if results.count(r) > 1})]
    if problems:
        raise StudyError(problems)
    desc = raw.get("description", "")
    return Study(name=name, description=" ".join(str(desc).split()), gpus=gpus, recipes=tuple(recipes),
                 commands=tuple(commands), path=path)


def _expand(c, where: str) -> list[Command]:
    if not isinstance(c, dict):
        raise StudyError([f"{where}: a command is a mapping with name and argv"])
    problems = [f"{where}: unknown key {k!r}{_did_you_mean(k, _COMMAND_KEYS)}" for k in c if k not in _COMMAND_KEYS]
    matrix = c.get("matrix") or {}
    if not isinstance(matrix, dict) or not all(isinstance(v, list) and v for v in matrix.values()):
        raise StudyError(problems + [f"{where}: matrix must map each variable to a non-empty list"])
    if problems:
        raise StudyError(problems)
    out = []
    for combo in itertools.product(*matrix.values()):
        values: dict[str, str] = {}
        for var, v in zip(matrix, combo):
            if isinstance(v, dict):
                values.update({str(k): _scalar(x, f"{where}: matrix {var}") for k, x in v.items()})
            else:
                values[var] = _scalar(v, f"{where}: matrix {var}")
        out.append(_command(c, values, where))
    return out


def _scalar(v, where: str) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise StudyError([f"{where}: values must be strings or numbers (got {v!r:.40})"])
    return str(v)


def _subst(text, values: dict[str, str], where: str) -> str:
    if not isinstance(text, (str, int, float)) or isinstance(text, bool):
        raise StudyError([f"{where}: expected a string (got {text!r:.40})"])

    def one(m: re.Match) -> str:
        if m.group(1) == "out":
            return m.group(0)
        if m.group(1) not in values:
            raise StudyError([f"{where}: {{{m.group(1)}}} is no variable of this command"])
        return values[m.group(1)]
    return _VAR.sub(one, str(text))


def _command(c: dict, values: dict[str, str], where: str) -> Command:
    name = _subst(c.get("name", ""), values, where)
    where = f"{where} ({name or 'no name'})"
    problems = []
    if not _NAME.match(name):
        problems.append(f"{where}: name must be letters, digits and ._=- (got {name!r:.60})")
    argv = c.get("argv")
    if not isinstance(argv, list) or not argv:
        raise StudyError(problems + [f"{where}: argv must be a non-empty list of arguments (no shell strings)"])
    argv = [_subst(a, values, f"{where}: argv") for a in argv]
    problems += _check_argv(argv, where)
    if ("stdout" in c) == ("result" in c):
        problems.append(f"{where}: give exactly one of stdout (its stdout is the result) or result (a file it writes)")
    result = _subst(c.get("stdout", c.get("result", "")), values, where)
    if result.startswith("/") or ".." in Path(result).parts or not result:
        problems.append(f"{where}: the result must be a relative path inside the output directory (got {result!r:.60})")
    timeout = c.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6):
        problems.append(f"{where}: timeout_s must be a positive number of seconds")
    env = c.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and k.isidentifier() for k in env):
        problems.append(f"{where}: env must map variable names to values")
        env = {}
    inputs = []
    for item in c.get("inputs") or []:
        if not isinstance(item, dict) or set(item) != {"from", "to"}:
            problems.append(f"{where}: each input is {{from: REPOSITORY_FILE, to: PATH_UNDER_OUT}}")
            continue
        src, dst = _subst(item["from"], values, where), _subst(item["to"], values, where)
        if not _repo_file(src):
            problems.append(f"{where}: input {src!r} is not a file of this repository")
        if dst.startswith("/") or ".." in Path(dst).parts:
            problems.append(f"{where}: input destination {dst!r} must be a relative path inside the output directory")
        inputs.append((src, dst))
    cwd = c.get("cwd", "repo")
    if cwd not in ("repo", "out"):
        problems.append(f"{where}: cwd is 'repo' or 'out' (got {cwd!r:.40})")
    if problems:
        raise StudyError(problems)
    return Command(name=name, argv=tuple(argv), result=result, stdout="stdout" in c, timeout_s=timeout,
                   env={k: _subst(v, values, where) for k, v in env.items()}, inputs=tuple(inputs), cwd=cwd)


def _check_argv(argv: list[str], where: str) -> list[str]:
    problems = []
    if argv[0] not in PROGRAMS:
        problems.append(f"{where}: argv starts with one of {', '.join(PROGRAMS)} (got {argv[0]!r:.40})")
    if argv[0] == "scaletool" and (len(argv) < 2 or argv[1] not in COMMANDS):
        got = argv[1] if len(argv) > 1 else "nothing"
        problems.append(f"{where}: 'scaletool {got:.40}' is no scaletool command{_did_you_mean(got, COMMANDS)}")
    for a in argv[1:]:
        if "{out}" in a or a.startswith("-"):
            continue
        looks_like_path = a.startswith(_PATH_PREFIXES) or (a.endswith(_PATH_SUFFIXES) and "/" in a)
        if looks_like_path and not _repo_file(a):
            problems.append(f"{where}: {a!r} is not a file of this repository")
    return problems


def _repo_file(rel: str) -> bool:
    p = Path(rel)
    return not p.is_absolute() and ".." not in p.parts and (ROOT / p).exists()


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
