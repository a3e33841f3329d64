"""Results directories read back for the report: one :class:`Row` per latest (point, mode) record."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from scaletool import analytic
from scaletool.config import Recipe, RecipeError, recipe_from_dict
from scaletool.sweep.runner import SWEEP_META
from scaletool.sweep.store import RESULTS_FILE, latest_by_key, read_records

# Written by the profiler into a train run directory; see :func:`breakdown_of`.
BREAKDOWN_FILE = Path("profile") / "breakdown.json"


@dataclass
class Row:
    """One (point, mode) result with the axes every table and plot groups by."""

    source: str                 # the results dir's label
    record: dict
    recipe: Recipe | None
    run_dir: Path | None

    @property
    def mode(self) -> str:
        return self.record["mode"]

    @property
    def status(self) -> str:
        return self.record["status"]

    @property
    def label(self) -> str:
        return self.record["label"]

    @property
    def result(self) -> dict:
        r = self.record.get("result")
        return r if isinstance(r, dict) else {}

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.recipe is not None

    @property
    def attention(self) -> str | None:
        return self.recipe.model.attention if self.recipe else None

    @property
    def intermediate_size(self) -> int | None:
        return self.recipe.model.intermediate_size if self.recipe else None

    @property
    def kv_lora_rank(self) -> int | None:
        return self.recipe.model.kv_lora_rank if self.recipe and self.attention == "mla" else None

    @property
    def compression_ratio(self) -> float | None:
        """MHA-equivalent KV elements over cached ones (estimate's kv_cache.compression_ratio)."""
        kv = self.result.get("kv_cache") if self.mode == "estimate" else None
        if kv and "compression_ratio" in kv:
            return kv["compression_ratio"]
        return analytic.kv_cache(self.recipe.model)["compression_ratio"] if self.recipe else None

    @property
    def series_key(self) -> str:
        """The attention variant without the swept width: 'mha', 'gqa kv=4', 'mla'."""
        m = self.recipe.model
        return f"gqa kv={m.n_kv_heads}" if m.attention == "gqa" else m.attention

    @property
    def engine(self) -> str | None:
        """'single', 'ddp', 'fsdp' or 'zero<stage>'."""
        if not self.recipe:
            return None
        p = self.recipe.parallel
        return f"zero{p.zero_stage}" if p.engine == "deepspeed" else p.engine

    @property
    def world_size(self) -> int | None:
        """Ranks a train run really had (its summary), else None."""
        env = self.result.get("environment")
        return env.get("world_size") if isinstance(env, dict) else None

    def breakdown(self) -> dict[str, float] | None:
        return breakdown_of(self.run_dir) if self.run_dir else None


@dataclass
class ResultsSet:
    rows: list[Row] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)  # {label, path, name, description, base_recipe}
    warnings: list[str] = field(default_factory=list)

    def ok(self, mode: str) -> list[Row]:
        return [r for r in self.rows if r.mode == mode and r.ok]

    @property
    def multi(self) -> bool:
        return len(self.sources) > 1


def load(dirs: list[Path]) -> ResultsSet:
    """Read every results dir; labels come from the sweep's ``label`` or the dir name, made unique."""
    out = ResultsSet()
    used: set[str] = set()
    for d in dirs:
        d = Path(d)
        if not (d / RESULTS_FILE).is_file():
            raise RecipeError(f"{d}: no {RESULTS_FILE} here; is it a results directory of `scaletool sweep`?")
        meta = _read_meta(d, out.warnings)
        label = meta.get("label") or d.resolve().name
        base, n = label, 2
        while label in used:
            label, n = f"{base} ({n})", n + 1
        used.add(label)
        out.sources.append({"label": label, "path": str(d), "name": meta.get("name"),
                            "description": meta.get("description"), "base_recipe": meta.get("base_recipe")})
        records, warnings = read_records(d)
        out.warnings += warnings
        latest = _latest_per_point(list(latest_by_key(records).values()))
        if len(latest) < len(latest_by_key(records)):
            out.warnings.append(f"{d}: {len(latest_by_key(records)) - len(latest)} older result(s) of the same "
                                "points under an earlier recipe (a changed sweep or recipe schema) left out")
        for rec in latest:
            recipe = None
            if rec.get("recipe") is not None:
                try:
                    recipe = recipe_from_dict(rec["recipe"], f"{d}: {rec['label']}")
                except RecipeError as e:
                    out.warnings.append(f"{d}: {rec['label']} ({rec['mode']}): recorded recipe no longer "
                                        f"validates, left out: {e.problems[0]}")
                    continue
            run_dir = d / rec["run_dir"] if rec.get("run_dir") else None
            out.rows.append(Row(label, rec, recipe, run_dir))
    return out


def _latest_per_point(records: list[dict]) -> list[dict]:
    """One record per (sweep, point label, mode): the last written. Keys differ when the resolved
    recipe changed between runs (an edited base recipe, a new recipe field); the newest result wins."""
    out: dict[tuple, dict] = {}
    for rec in records:
        out[(rec.get("sweep"), rec["label"], rec["mode"])] = rec
    return list(out.values())


def _read_meta(d: Path, warnings: list[str]) -> dict:
    path = d / SWEEP_META
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError:
        warnings.append(f"{path}: unreadable, using the directory name as label")
        return {}
    return meta if isinstance(meta, dict) else {}


def breakdown_of(run_dir: Path) -> dict[str, float] | None:
    """Category time shares from ``<run dir>/profile/breakdown.json``, if the run was profiled.

    The hook: ``scaletool train``/``profile`` with ``profile.enabled`` write that file
    (:mod:`scaletool.profile.trace`); the report reads its ``categories`` mapping,
    ``{name: {"share": fraction of the profiled step, ...}}`` (attention, ffn_matmul, other_matmul,
    norm, optimizer, communication, idle, ...). Anything else in the file is ignored.
    """
    path = run_dir / BREAKDOWN_FILE
    if not path.is_file():
        return None
    try:
        cats = json.loads(path.read_text()).get("categories")
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(cats, dict):
        return None
    shares = {str(k): float(v["share"]) for k, v in cats.items()
              if isinstance(v, dict) and isinstance(v.get("share"), (int, float))}
    return shares or None
