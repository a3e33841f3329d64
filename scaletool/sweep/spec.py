"""Sweep files: a base recipe, the keys to vary, the modes to run. Validated once, like recipes.

A sweep file is YAML::

    recipe: ../mha-1b.yaml            # base recipe, relative to this file, or a shipped recipe's name (tiny)
    name: mla-compression             # default: the file's stem
    label: H100 bf16                  # how reports name this results dir
    set: {train.steps: 12}            # overrides applied to every point
    grid: {model.intermediate_size: [2048, 4096]}        # cartesian product
    zip: {model.attention: [mha, mla], model.kv_lora_rank: [0, 256]}  # or a list of point dicts
    modes: [estimate, count, train, decode]   # and profile
    args: {decode: [--contexts, "512,1024"]}   # extra CLI arguments per mode
    timeout_s: 900                    # per run; or {train: 1800, count: 300}
    repeats: 3                        # timed modes run 3 times, as 3 processes
    nproc_per_node: 1                 # > 1: train and profile points run distributed
    match_params: {key: model.intermediate_size, target: ../mla-1b.yaml, multiple_of: 64}

Every problem becomes one line of a :class:`~scaletool.config.RecipeError` (the CLI exits with 2).
"""
from __future__ import annotations

import difflib
import itertools
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from scaletool.config import SECTIONS, Recipe, RecipeError, apply_overrides, recipe_from_dict
from scaletool.errors import shorten, validation_lines
from scaletool.resources import RECIPE, SWEEP, find_recipe, shipped
from scaletool.results.sweep import MODES, TIMED_MODES, Mode
from scaletool.yaml_input import read_yaml

__all__ = ["MODES", "TIMED_MODES", "Mode", "Sweep", "SweepFile", "load_sweep", "slug"]
# Arguments the runner passes itself; a sweep file setting them would produce a second, conflicting copy.
RESERVED_ARGS = {"--json", "--out", "--set", "--nproc-per-node", "--result-file"}
DEFAULT_TIMEOUT_S = 1800.0
MAX_POINTS = 10_000  # each point is at least one process; a larger grid is a mistake, planned or not


def slug(text: str, limit: int = 80, sep: str = "-") -> str:
    """``text`` as one safe path component: letters, digits and ``._=-`` only (runs of anything else
    become ``sep``), no leading dot or separator (never ``.``, ``..`` or a hidden name), at most ``limit``
    characters; may be empty."""
    s = re.sub(r"[^A-Za-z0-9._=-]+", sep, text)[:limit]
    return s.lstrip("._=-" + sep).rstrip("." + sep)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MatchParams(_Strict):
    """Equal-budget adjustment: per point, solve ``key`` so the parameter count meets ``target``."""

    key: Literal["model.intermediate_size", "model.n_layers"]
    target: int | str | dict[str, Any] = Field(
        description="a parameter count, a recipe path (relative to the sweep file) whose count is the "
        "target, or a mapping of dotted overrides naming a reference point on the base recipe")
    multiple_of: int | None = Field(None, gt=0, description="default 64 for intermediate_size, 1 for n_layers")
    params: Literal["total", "non_embedding"] = "total"


class SweepFile(_Strict):
    recipe: str
    name: str | None = None
    label: str | None = None
    description: str | None = None
    set: dict[str, Any] = Field(default_factory=dict)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    zip: dict[str, list[Any]] | list[dict[str, Any]] | None = None
    modes: list[Mode] = Field(min_length=1)
    args: dict[Mode, list[str]] = Field(default_factory=dict)
    timeout_s: float | dict[Mode, float] = DEFAULT_TIMEOUT_S
    repeats: int = Field(1, gt=0, le=1000, description="runs of each timed mode (train, decode, profile) per point")
    nproc_per_node: int = Field(1, gt=0)
    match_params: MatchParams | None = None

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _positive_seconds(cls, v: Any) -> Any:
        """One line per bad timeout: 0 or less would time every run out at once, NaN or inf never."""
        if isinstance(v, dict):
            bad = [k for k in v if k not in MODES]
            if bad:
                raise ValueError(f"{', '.join(map(str, bad))[:100]}: not a mode (modes: {', '.join(MODES)})")
            return {k: _seconds(x, f"{k}: ") for k, x in v.items()}
        return _seconds(v)


def _seconds(v: Any, where: str = "") -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}expected a number of seconds, got {type(v).__name__}")
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}must be a positive, finite number of seconds, got {v}")
    return float(v)


class Sweep:
    """A validated sweep file with its base recipe loaded (as a raw mapping, ``set`` applied)."""

    def __init__(self, path: Path, spec: SweepFile, base_raw: dict, target_params: int | None,
                 target_source: str | None):
        self.path = path
        self.spec = spec
        self.base_raw = base_raw
        self.target_params = target_params
        self.target_source = target_source

    @property
    def name(self) -> str:
        return self.spec.name or self.path.stem

    @property
    def dirname(self) -> str:
        """The default results directory's name: the name as a safe slug (``../../x`` gives ``x``)."""
        return slug(self.name) or "sweep"

    @property
    def base_recipe_path(self) -> Path:
        return base_recipe_file(self.path, self.spec.recipe).resolve()

    def timeout(self, mode: str) -> float:
        t = self.spec.timeout_s
        return t.get(mode, DEFAULT_TIMEOUT_S) if isinstance(t, dict) else t

    def repeats(self, mode: str) -> int:
        """Runs per point of ``mode``: ``repeats`` for timed modes, 1 for the exact ones."""
        return self.spec.repeats if mode in TIMED_MODES else 1

    def ranks(self, mode: str) -> int:
        """Processes per run of ``mode`` on this node (train and profile start nproc_per_node ranks)."""
        return self.spec.nproc_per_node if mode in ("train", "profile") else 1

    def mode_args(self, mode: str) -> list[str]:
        args = list(self.spec.args.get(mode, []))
        if self.ranks(mode) > 1:
            args += ["--nproc-per-node", str(self.spec.nproc_per_node)]
        return args

    def point_values(self) -> list[dict[str, Any]]:
        """The grid's cartesian product times the zipped points, as {dotted key: value} dicts."""
        keys = list(self.spec.grid)
        grid = [dict(zip(keys, combo)) for combo in itertools.product(*(self.spec.grid[k] for k in keys))]
        return [{**z, **g} for z in zipped_points(self.spec.zip) for g in grid]


def zipped_points(z) -> list[dict[str, Any]]:
    if z is None:
        return [{}]
    if isinstance(z, list):
        return [dict(p) for p in z]
    keys = list(z)
    return [dict(zip(keys, vals)) for vals in zip(*(z[k] for k in keys))]


def check_key(key: str) -> str | None:
    """A problem with dotted recipe key ``key`` (unknown section or field, with a did-you-mean), or None."""
    parts = key.split(".")
    cls: Any = Recipe
    for i, part in enumerate(parts):
        fields = cls.model_fields
        if part not in fields:
            hint = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.6)
            where = ".".join(parts[:i]) or "a recipe"
            tip = f"; did you mean '{hint[0]}'?" if hint else f"; {where} has {', '.join(fields)}"
            return f"{key}: unknown key '{part}'{tip}"
        ann = fields[part].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        elif i < len(parts) - 1:
            if typing.get_origin(ann) is dict:  # free-form mapping (parallel.deepspeed): any sub-key
                return None
            return f"{key}: '{'.'.join(parts[:i + 1])}' is a value, not a section"
    return None


def _pydantic_lines(exc: ValidationError, source: str) -> list[str]:
    def known(parent: tuple) -> list[str]:
        return list(SweepFile.model_fields) if not parent else list(MatchParams.model_fields)

    return validation_lines(exc, source, root="sweep", known=known,
                            show_input=lambda err: not isinstance(err.get("input"), (dict, list))
                            and err["type"] != "value_error")


def base_recipe_file(sweep_path: Path, recipe: str) -> Path:
    """The file a sweep's ``recipe:`` names: a path relative to the sweep file where one is there, else a
    shipped recipe by name (``tiny``, ``mla-1b``), as every command takes it; a name that is neither is
    one line naming the closest shipped recipe."""
    local = sweep_path.parent / recipe
    try:
        if local.exists():
            return local
    except OSError as e:  # a name too long for the filesystem, say
        raise RecipeError(f"{shorten(recipe)}: cannot read: {e.strerror or e}") from None
    # a bare name (tiny, tiny.yaml) is a shipped recipe; never a path from the working directory
    bare = Path(recipe)
    name = (bare.stem if bare.suffix in (".yaml", ".yml") else bare.name) if len(bare.parts) == 1 else None
    recipes = shipped(RECIPE)
    if name in recipes:
        return recipes[name]
    close = difflib.get_close_matches(name or recipe, list(recipes), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise RecipeError(f"{shorten(recipe)}: no such file next to the sweep file ({shorten(str(local))}), "
                      f"nor a shipped recipe{hint}")


def load_sweep(path: str | Path, overrides: list[tuple[str, Any]] = ()) -> Sweep:
    """Read and validate a sweep file; ``overrides`` (from ``--set``) apply to every point after ``set``."""
    src = str(path)
    path = find_recipe(path, SWEEP)  # a file, or a shipped sweep by name
    raw = read_yaml(path, SECTIONS)
    if raw and set(raw) <= set(SECTIONS):
        raise RecipeError(f"{src}: this is a recipe, not a sweep file; sweep it from a sweep file whose "
                          f"`recipe:` names it (see recipes/sweeps/)")
    try:
        spec = SweepFile.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(_pydantic_lines(e, src)) from None

    problems: list[str] = []
    varied: dict[str, str] = {}
    for section, keys in (("set", list(spec.set) + [k for k, _ in overrides]), ("grid", list(spec.grid)),
                          ("zip", sorted({k for p in zipped_points(spec.zip) for k in p}))):
        for key in keys:
            p = check_key(key)
            if p:
                problems.append(f"{src}: {section}: {p}")
            if section != "set":
                if key in varied and varied[key] != section:
                    problems.append(f"{src}: {key}: varied by both {varied[key]} and {section}")
                varied[key] = section
    for key, vals in spec.grid.items():
        if not vals:
            problems.append(f"{src}: grid.{key}: empty list of values")
    if isinstance(spec.zip, dict):
        lengths = {k: len(v) for k, v in spec.zip.items()}
        if len(set(lengths.values())) > 1:
            problems.append(f"{src}: zip: lists must have equal lengths, got "
                            + ", ".join(f"{k}={n}" for k, n in lengths.items()))
        if any(n == 0 for n in lengths.values()):
            problems.append(f"{src}: zip: empty list of values")
    elif isinstance(spec.zip, list) and not spec.zip:
        problems.append(f"{src}: zip: empty list of points")
    sizes = [len(v) for v in spec.grid.values()]
    zipped = (len(spec.zip) if isinstance(spec.zip, list) else min(map(len, spec.zip.values()), default=1)) \
        if spec.zip else 1
    n_points = math.prod(sizes) * zipped  # from the lengths alone: nothing is enumerated before this check
    if n_points > MAX_POINTS:
        factors = [*map(str, sizes), *([f"zip {zipped}"] if spec.zip else [])]
        shape = " x ".join(factors) if len(factors) <= 8 else f"the product of {len(factors)} lists"
        count = f"{n_points:,}" if n_points < 10**15 else f"about 10^{int(math.log10(n_points))}"
        problems.append(f"{src}: {count} points ({shape}); a sweep plans at most {MAX_POINTS:,}: split it into "
                        "several sweep files or vary fewer values")
    if len(set(spec.modes)) != len(spec.modes):
        problems.append(f"{src}: modes: listed twice: {', '.join(m for m in MODES if spec.modes.count(m) > 1)}")
    for mode, args in spec.args.items():
        if mode not in spec.modes:
            problems.append(f"{src}: args.{mode}: mode {mode} is not in modes {spec.modes}")
        clash = sorted({a.split("=")[0] for a in args} & RESERVED_ARGS)
        if clash:
            problems.append(f"{src}: args.{mode}: {', '.join(clash)} is set by the sweep itself "
                            "(use set: for recipe keys, nproc_per_node: for launching)")
    mp = spec.match_params
    if mp and mp.key in varied:
        problems.append(f"{src}: match_params.key: {mp.key} is also varied by the {varied[mp.key]}; "
                        "the solver sets it per point")
    if mp and mp.key in spec.set:
        problems.append(f"{src}: match_params.key: {mp.key} is also fixed by set; the solver sets it per point")

    base_raw: dict = {}
    try:
        base_path = base_recipe_file(path, spec.recipe)
        base_raw = apply_overrides(read_yaml(base_path, SECTIONS), list(spec.set.items()) + list(overrides))
        recipe_from_dict(base_raw, str(base_path))
    except RecipeError as e:
        problems.extend(f"{src}: recipe: {p}" for p in e.problems)

    target = source = None
    if mp and not problems:
        try:
            target, source = _resolve_target(mp, path, base_raw)
        except RecipeError as e:
            problems.extend(f"{src}: match_params.target: {p}" for p in e.problems)
    if problems:
        raise RecipeError(problems)
    return Sweep(path, spec, base_raw, target, source)


def _resolve_target(mp: MatchParams, path: Path, base_raw: dict) -> tuple[int, str]:
    from scaletool.analytic.params import param_counts

    t = mp.target
    if isinstance(t, bool):
        raise RecipeError(f"expected a parameter count, a recipe path or a mapping of overrides, got {t!r}")
    if isinstance(t, int):
        if t <= 0:
            raise RecipeError(f"must be a positive parameter count, got {t}")
        return t, f"{t:,} parameters"
    if isinstance(t, str):
        ref_path = base_recipe_file(path, t)
        ref = recipe_from_dict(read_yaml(ref_path, SECTIONS), str(ref_path))
        return param_counts(ref.model)[mp.params], t
    bad = [p for p in (check_key(k) for k in t) if p]
    if bad:
        raise RecipeError(bad)
    ref = recipe_from_dict(apply_overrides(base_raw, list(t.items())), "reference point")
    return param_counts(ref.model)[mp.params], "base recipe with " + " ".join(f"{k}={v}" for k, v in t.items())
