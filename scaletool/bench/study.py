"""A study of the benchmark suite: a YAML file that lists commands as data, and its validation.

A study names the GPUs it needs, the recipes it uses and its commands; each command is an argument list
(never a shell string) whose first word is ``scaletool``, ``python`` or ``torchrun``, and names the result
it leaves in the study's output directory. ``{out}`` in an argument is that directory; a command's
``matrix`` expands it into one command per combination of its variables (``{recipe}``, ...).
"""
from __future__ import annotations

import difflib
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from scaletool import records
from scaletool.cli import COMMANDS
from scaletool.errors import RecipeError, echo, shorten
from scaletool.resources import read_bounded
from scaletool.yaml_input import load_yaml_text

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"
PROGRAMS = ("scaletool", "python", "torchrun")
_MAX_BYTES = 1 << 20
#: the most commands a study's matrices may expand to (a matrix of six 100-value lists is 10^12)
MAX_COMMANDS = 10_000
_VAR = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]*$")
_STUDY_KEYS = {"name", "description", "gpus", "recipes", "commands"}
_COMMAND_KEYS = {"name", "argv", "stdout", "result", "timeout_s", "env", "matrix", "inputs", "cwd"}
#: arguments that name a file of this repository (checked to exist): these prefixes or suffixes
_PATH_PREFIXES = ("recipes/", "benchmarks/", "tests/", "scaletool/", "launch/", "profiles/")
_PATH_SUFFIXES = (".py", ".yaml", ".yml", ".jsonl")


def _text(v):
    """A YAML scalar written where a string belongs: strings as they are, numbers as written (a matrix of
    ``[1, 2]``); booleans, null and containers are refused."""
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ValueError("expected a string or a number")
    return str(v)


Text = Annotated[str, BeforeValidator(_text)]


def shown(path: Path) -> str:
    return shorten(path)


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
    """Read a study through the bounded YAML reader (size, aliases expanded, depth: a 1 KB alias bomb is one
    error line, not unbounded memory) and validate it."""
    path = find_study(name_or_path)
    try:
        raw = load_yaml_text(read_bounded(path, _MAX_BYTES, "a study").decode("utf-8"), shown(path))
    except UnicodeDecodeError as e:
        raise StudyError([f"{shown(path)}: not a UTF-8 text file (byte {e.start})"]) from None
    except RecipeError as e:
        raise StudyError(e.problems) from None
    return parse_study(raw, path)


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    from_: Text = Field(alias="from")
    to: Text


class _CommandSpec(BaseModel):
    """One entry of ``commands``: the shapes of its keys (what they mean is checked once variables are in)."""
    model_config = ConfigDict(extra="forbid")
    name: Text = ""
    argv: list[Text] = Field(min_length=1)
    stdout: Text | None = None
    result: Text | None = None
    timeout_s: Annotated[float, Field(gt=0, lt=1e6, allow_inf_nan=False, strict=True)] | \
        Annotated[int, Field(gt=0, lt=1e6, strict=True)] | None = None
    env: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], Text] = {}
    matrix: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")],
                 Annotated[list[Text | dict[str, Text]], Field(min_length=1)]] | None = None
    inputs: list[_Input] = []
    cwd: Literal["repo", "out"] = "repo"


class _StudySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=_NAME.pattern, max_length=200, strict=True)] | None = None
    description: Annotated[str, Field(max_length=4000, strict=True)] = ""
    gpus: Annotated[int, Field(ge=0, le=1024, strict=True)] = 0
    recipes: list[Annotated[str, Field(strict=True)]] = []
    commands: Annotated[list[Any], Field(min_length=1)]  # each validated alone: every command's problems at once


def _problems(e: ValidationError, where: str, keys: dict[str, set[str]]) -> list[str]:
    """One line per problem of a pydantic ValidationError: where, which key, what is wrong (a did-you-mean for
    an unknown key, the value echoed and cut)."""
    out = []
    for err in e.errors(include_url=False):
        loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-", "constrained-", "str", "int",
                                                                        "float", "dict", "list"))]
        place = f"{where}: {'.'.join(loc)}" if loc else where
        if err["type"] == "extra_forbidden" and len(loc) == 1:
            scope = "command" if "command" in where.rsplit(": ", 1)[-1] else "study"
            out.append(f"{where}: unknown key {loc[-1]!r}{_did_you_mean(loc[-1], keys[scope])}")
        elif err["type"] == "missing":
            out.append(f"{place}: missing")
        else:
            out.append(f"{place}: {err['msg'][0].lower() + err['msg'][1:]} (got {echo(err.get('input'))})")
    return list(dict.fromkeys(out))


def parse_study(raw, path: Path) -> Study:
    where = path.name
    if not isinstance(raw, dict):
        raise StudyError([f"{where}: a study is a mapping with the keys {', '.join(sorted(_STUDY_KEYS))}"])
    try:
        spec = _StudySpec.model_validate(raw)
    except ValidationError as e:
        raise StudyError(_problems(e, where, {"study": _STUDY_KEYS, "command": _COMMAND_KEYS})) from None
    name = spec.name or path.stem
    problems = [] if _NAME.match(name) else [f"{where}: name must be letters, digits and ._=- (got {echo(name)})"]
    problems += [f"{where}: recipe {echo(r)} is not a file of this repository" for r in spec.recipes if not _repo_file(r)]
    specs: list[tuple[int, _CommandSpec]] = []
    keys = {"study": _STUDY_KEYS, "command": _COMMAND_KEYS}
    for i, c in enumerate(spec.commands):
        if not isinstance(c, dict):
            problems.append(f"{where}: command {i + 1}: a command is a mapping with name and argv")
            continue
        try:
            specs.append((i, _CommandSpec.model_validate(c)))
        except ValidationError as e:
            problems += _problems(e, f"{where}: command {i + 1}", keys)
    total = sum(_matrix_size(c.matrix) for _, c in specs)
    if total > MAX_COMMANDS:
        raise StudyError([f"{where}: its matrices expand to {total:,} commands; a study runs at most {MAX_COMMANDS:,}"])
    commands: list[Command] = []
    for i, c in specs:
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
    return Study(name=name, description=" ".join(spec.description.split()), gpus=spec.gpus,
                 recipes=tuple(spec.recipes), commands=tuple(commands), path=path)


def _matrix_size(matrix: dict | None) -> int:
    """How many commands a matrix expands to (the product of its lists' lengths), without expanding it."""
    return math.prod(len(v) for v in (matrix or {}).values())


def _expand(c: _CommandSpec, where: str) -> list[Command]:
    matrix = c.matrix or {}
    out = []
    for combo in itertools.product(*matrix.values()):
        values: dict[str, str] = {}
        for var, v in zip(matrix, combo):
            if isinstance(v, dict):
                values.update({str(k): str(x) for k, x in v.items()})
            else:
                values[var] = str(v)
        out.append(_command(c, values, where))
    return out


def _subst(text: str, values: dict[str, str], where: str) -> str:
    def one(m: re.Match) -> str:
        if m.group(1) == "out":
            return m.group(0)
        if m.group(1) not in values:
            raise StudyError([f"{where}: {{{m.group(1)}}} is no variable of this command"])
        return values[m.group(1)]
    return _VAR.sub(one, str(text))


def _command(c: _CommandSpec, values: dict[str, str], where: str) -> Command:
    name = _subst(c.name, values, where)
    where = f"{where} ({name or 'no name'})"
    problems = []
    if not _NAME.match(name):
        problems.append(f"{where}: name must be letters, digits and ._=- (got {echo(name)})")
    argv = [_subst(a, values, f"{where}: argv") for a in c.argv]
    problems += _check_argv(argv, where)
    if (c.stdout is None) == (c.result is None):
        problems.append(f"{where}: give exactly one of stdout (its stdout is the result) or result (a file it writes)")
    result = _subst(c.stdout if c.stdout is not None else c.result or "", values, where)
    if result.startswith("/") or ".." in Path(result).parts or not result:
        problems.append(f"{where}: the result must be a relative path inside the output directory (got {echo(result)})")
    inputs = []
    for item in c.inputs:
        src, dst = _subst(item.from_, values, where), _subst(item.to, values, where)
        if not _repo_file(src):
            problems.append(f"{where}: input {echo(src)} is not a file of this repository")
        if dst.startswith("/") or ".." in Path(dst).parts or not dst:
            problems.append(f"{where}: input destination {echo(dst)} must be a relative path inside the output directory")
        inputs.append((src, dst))
    if problems:
        raise StudyError(problems)
    return Command(name=name, argv=tuple(argv), result=result, stdout=c.stdout is not None, timeout_s=c.timeout_s,
                   env={k: _subst(v, values, where) for k, v in c.env.items()}, inputs=tuple(inputs), cwd=c.cwd)


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
    return not p.is_absolute() and ".." not in p.parts and ((ROOT / p).exists() or records.exists(ROOT / p))


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
