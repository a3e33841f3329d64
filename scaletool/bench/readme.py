"""A results folder's README, generated from its records: ``python -m scaletool.bench readme RUNDIR...``.

A run folder (``benchmarks/results/STUDY/CARD-DATE[-LABEL]/``, or any ``--out`` of the runner) holds the
records a study left: the runner's ``runs.jsonl`` (each command, its status and the environment it ran
in, the commit included), the commands' result files (committed packed in the folder's ``records.jsonl.xz``,
read through :mod:`scaletool.records` as if loose), and for runs older than the runner's records a
``provenance.json`` naming the commit. The README says which commit and cards, lists the commands and
summarises each loose record and the first :data:`LISTED` bundled ones (tokens/s with its spread and count for a
training result, the record counts of a sweep file), counting the rest; nothing in it is typed by hand, so it is
regenerated, never edited. Notes about a study (its question, what was tried and not adopted) live in the study's own
``README.md`` one level up.
"""
from __future__ import annotations

import json
import stat
from pathlib import Path

from scaletool import records
from scaletool.bench.study import ROOT
from scaletool.errors import RecipeError, shorten
from scaletool.fmt import write_atomic

RESULTS = ROOT / "benchmarks" / "results"
PROVENANCE = "provenance.json"
README = "README.md"
_MAX_FILES = 2000
#: bundled files described in the README's table; the rest are counted (``unpack`` writes them all)
LISTED = 5


def _lstat_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _text(record: records.Record) -> str | None:
    """A record's text (loose: a regular file under the size limit, as UTF-8; bundled: its entry); else None."""
    try:
        return record.text()
    except RecipeError:
        return None


def _json_lines(text: str) -> list:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line) if line.strip() else None)
        except ValueError:
            out.append(None)
    return [r for r in out if r is not None]


def _cell(text: object, limit: int = 90) -> str:
    """One table cell: control characters escaped, '|' escaped, cut to ``limit``."""
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text)).replace("|", "\\|")
    return shorten(s, limit)


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) < 1e300 else None


def _spread(m: dict | None) -> str | None:
    """``median (p10–p90, n=N)`` of a timing summary, when it has one."""
    if not isinstance(m, dict) or _num(m.get("median")) is None:
        return None
    lo, hi, n = _num(m.get("p10")), _num(m.get("p90")), m.get("n")
    text = f"{m['median']:,.0f}"
    if lo is not None and hi is not None:
        text += f" ({lo:,.0f}–{hi:,.0f}"
        text += f", n={n})" if isinstance(n, int) and not isinstance(n, bool) else ")"
    return text


#: decode points and first-line characters a README's row shows (the records hold the rest)
POINTS, PREVIEW = 4, 40


def _train_summary(r: dict) -> str | None:
    m = r.get("metrics")
    if not isinstance(m, dict) or _num(m.get("throughput/tokens_per_s_per_gpu")) is None:
        return None
    rec = r.get("recipe") if isinstance(r.get("recipe"), dict) else {}
    par = rec.get("parallel") if isinstance(rec.get("parallel"), dict) else {}
    env = r.get("environment") if isinstance(r.get("environment"), dict) else {}
    timing = r.get("timing") if isinstance(r.get("timing"), dict) else {}
    world = env.get("world_size")
    world = world if isinstance(world, int) and world > 0 else 1
    tps = timing.get("tokens_per_s")  # the whole job's: per GPU, each figure over the world size
    per_gpu = ({k: (v / world if k in ("median", "p10", "p90") and _num(v) is not None else v) for k, v in tps.items()}
               if isinstance(tps, dict) else None)
    rate = _spread(per_gpu) or f"{m['throughput/tokens_per_s_per_gpu']:,.0f}"
    model = rec.get("model") if isinstance(rec.get("model"), dict) else {}
    what = model.get("attention") or model.get("name") or "?"
    parts = [f"{_cell(what, 30)} d{_cell(model.get('d_model', '?'), 8)}, {_cell(par.get('engine', '?'), 12)}"
             f" × {env.get('world_size', '?')}: {rate} tok/s per GPU"]
    peak = _num(r.get("peak_memory_bytes"))
    if peak:
        parts.append(f"peak {peak / 2**30:.2f} GiB")
    if r.get("status") not in (None, "completed"):
        parts.append(f"status {_cell(r.get('status'), 20)}")
    return ", ".join(parts)


def _decode_summary(r: dict) -> str | None:
    points = r.get("points")
    if not isinstance(points, list) or not points or not all(isinstance(p, dict) for p in points):
        return None
    cells = []
    for p in points[:POINTS]:
        rate = _num(p.get("decode_tokens_per_s"))
        if rate is None:
            continue
        spread = _num(p.get("decode_tokens_per_s_spread"))
        cells.append(f"batch {_cell(p.get('batch'), 8)} × {_cell(p.get('context'), 8)}: {rate:,.0f} tok/s"
                     + (f" (±{100 * spread:.1f}%)" if spread is not None else ""))
    if not cells:
        return None
    more = f"; {len(points) - POINTS} more" if len(points) > POINTS else ""
    recipe = f"{_cell(r.get('recipe'), 40)} " if isinstance(r.get("recipe"), str) else ""
    return f"decode {recipe}{_cell(r.get('attention', ''), 8)}: " + "; ".join(cells) + more


def summarise(path: Path, text: str | None) -> str:
    """What one record file holds, in a line (``text``: the file's, None where it could not be read)."""
    if text is None:
        return "not read (not a regular file, too large, or not UTF-8)"
    if path.suffix == ".jsonl":
        recs = [r for r in _json_lines(text) if isinstance(r, dict)]
        if path.name.endswith(".results.jsonl"):
            modes: dict[str, int] = {}
            for r in recs:
                key = f"{r.get('mode', '?')} {r.get('status', '?')}"
                modes[key] = modes.get(key, 0) + 1
            return f"sweep records: {len(recs)} ({', '.join(f'{v} {k}' for k, v in sorted(modes.items()))})"
        return f"{len(recs)} JSON lines"
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError:
            return "not JSON"
        if isinstance(data, dict):
            keys = _cell(", ".join(map(str, list(data)[:5])), 50) + (", ..." if len(data) > 5 else "")
            return _train_summary(data) or _decode_summary(data) or f"JSON, keys: {keys}"
        return f"JSON {type(data).__name__} of {len(data) if isinstance(data, list) else 1}"
    lines = text.splitlines()
    first = next((line for line in lines if line.strip()), "")
    return f"{len(lines)} lines: {_cell(first, PREVIEW)}"


def _commits(runs: list[dict], prov: dict | None) -> list[str]:
    out = []
    for r in runs:
        env = r.get("environment") if isinstance(r.get("environment"), dict) else {}
        c = env.get("commit")
        if isinstance(c, str):
            how = "tree differed, not recorded" if env.get("tree_differs_from_commit") else "clean tree"
            if env.get("tree_diff"):
                how = f"the tree's difference recorded in [{_cell(env['tree_diff'])}]({_cell(env['tree_diff'])})"
            out.append(f"`{_cell(c[:12], 40)}` (runner's; {how})")
    if isinstance(prov, dict) and isinstance(prov.get("commit"), str):
        out.append(f"`{_cell(prov['commit'][:12], 40)}` ({_cell(prov.get('note', PROVENANCE), 200)})")
    return list(dict.fromkeys(out))


def generate(run_dir: Path) -> str:
    """The README text of one run folder (deterministic: the same records give the same text). Record files in
    the folder's bundle are listed like loose ones, each with what it holds, and link the bundle.
    Raises RecipeError where the bundle cannot be read."""
    run_dir = Path(run_dir)
    recs = {r.rel: r for r in records.records(run_dir)}
    others = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if _lstat_regular(p)}
    others -= {README, records.BUNDLE, *recs}
    files = sorted([*recs, *others], key=lambda rel: rel.split("/"))[:_MAX_FILES]
    runs_text = _text(recs["runs.jsonl"]) if "runs.jsonl" in recs else None
    runs = [r for r in _json_lines(runs_text or "") if isinstance(r, dict)]
    prov_text = _text(recs[PROVENANCE]) if PROVENANCE in recs else None
    try:
        prov = json.loads(prov_text) if prov_text else None
    except ValueError:
        prov = None
    study = run_dir.parent.name if run_dir.parent.parent.name == "results" else "?"
    lines = [f"# {_cell(study if study != '?' else run_dir.name)}: {_cell(run_dir.name)}", "",
             "Generated by `python -m scaletool.bench readme`"
             + ("; study: [../README.md](../README.md)." if (run_dir.parent / README).exists() and study != "?" else ".")]
    if any(r.bundled for r in recs.values()):  # how to read it: benchmarks/README.md
        lines.append(f"An unlinked file is in [{records.BUNDLE}]({records.BUNDLE}) (`python -m scaletool.bench unpack`).")
    commits = _commits(runs, prov)
    lines += ["", "**Commit:** " + ("; ".join(commits) if commits else "not recorded")]
    cards = sorted({", ".join(map(str, r["environment"].get("cards") or [])) or "CPU" for r in runs
                    if isinstance(r.get("environment"), dict)} - {""})
    if cards:
        lines.append("**Cards:** " + "; ".join(_cell(c, 120) for c in cards))
    versions = sorted({f"torch {r['environment'].get('torch')}, CUDA {r['environment'].get('cuda')}" for r in runs
                       if isinstance(r.get("environment"), dict)})
    if versions:
        lines.append("**Versions:** " + "; ".join(_cell(v, 60) for v in versions))
    if runs:
        lines += ["", "| command | status | wall s |", "|---|---|---|"]
        for r in runs:  # its result file: the study's command says (runs.jsonl too)
            wall = _num(r.get("wall_s"))
            lines.append(f"| {_cell(r.get('command', '?'), 40)} | {_cell(r.get('status', '?'), 12)} | "
                         f"{'' if wall is None else f'{wall:.1f}'} |")
    lines += ["", "| file | what it holds |", "|---|---|"]
    listed = more = 0
    for rel in files:
        if rel in ("runs.jsonl", PROVENANCE):
            continue
        rec = recs.get(rel)
        if rec is not None and rec.bundled and listed == LISTED:
            more += 1  # counted, not described
            continue
        if rec is not None and rec.bundled:
            listed += 1
            where = _cell(rel, 80)  # in the bundle (the line above the table says so); a loose file is linked
        else:
            where = f"[{_cell(rel, 80)}]({_cell(rel, 200)})"
        what = summarise(Path(rel), _text(rec)) if rec is not None else _other(run_dir / rel)
        lines.append(f"| {where} | {what} |")
    if more:
        lines.append(f"| … | {more} more in {records.BUNDLE} |")
    return "\n".join(lines) + "\n"


def _other(path: Path) -> str:
    """What a file that is not a record holds (a table or report in Markdown, a calibration, a tree's diff)."""
    try:
        text = records.read_loose(path)
    except RecipeError:
        return "not read (not a regular file, too large, or not UTF-8)"
    lines = text.splitlines()
    first = next((line for line in lines if line.strip()), "")
    return f"{len(lines)} lines: {_cell(first, PREVIEW)}"


def run_dirs(root: Path = RESULTS) -> list[Path]:
    """Every committed run folder: ``results/STUDY/RUN/``."""
    return sorted(p for p in root.glob("*/*") if p.is_dir() and not p.is_symlink())


def write(run_dir: Path) -> Path:
    """Write ``RUNDIR/README.md`` (never through a link). Raises OSError."""
    target = Path(run_dir) / README
    write_atomic(target, generate(run_dir))
    return target
