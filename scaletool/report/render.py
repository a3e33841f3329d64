"""Write the report: ``report.md`` (+ ``plots/*.png``), a self-contained ``report.html`` and ``results.csv``.

Every string that came from a user (labels, recipe values, error text) is escaped: by jinja2's
autoescaping in HTML, by :func:`md_escape` in markdown, and against spreadsheet formulas in CSV.
"""
from __future__ import annotations

import base64
import csv
import html
import re
from datetime import datetime, timezone
from pathlib import Path

from scaletool import __version__
from scaletool.report.data import ResultsSet, load
from scaletool.report.findings import all_findings
from scaletool.report.plots import all_plots
from scaletool.report.tables import Table, all_tables, decode_points

# Result subtrees left out of results.csv: per-operator and per-step detail, kept in results.jsonl.
CSV_SKIP = {"by_operator", "by_module", "per_layer", "notes", "history", "engines", "recipe", "per_rank",
            "environment", "nvml", "points", "measure", "hardware"}


def build_report(dirs: list[Path], out: Path) -> dict:
    """Read ``dirs``, write the report files into ``out``; return their paths, findings and warnings."""
    rs = load(dirs)
    out.mkdir(parents=True, exist_ok=True)
    tables = all_tables(rs)
    plots = all_plots(rs)
    findings = all_findings(rs)
    plot_dir = out / "plots"
    plot_dir.mkdir(exist_ok=True)
    for p in plots:
        (plot_dir / f"{p.key}.png").write_bytes(p.png)
    context = {"sources": _sources(rs), "tables": tables, "plots": plots, "findings": findings,
               "warnings": rs.warnings, "version": __version__,
               "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    (out / "report.md").write_text(render_markdown(context))
    (out / "report.html").write_text(render_html(context))
    n_csv = write_csv(rs, out / "results.csv")
    return {"report_md": str(out / "report.md"), "report_html": str(out / "report.html"),
            "results_csv": str(out / "results.csv"), "plots": [str(plot_dir / f"{p.key}.png") for p in plots],
            "tables": [t.key for t in tables], "csv_rows": n_csv, "findings": findings, "warnings": rs.warnings}


def _sources(rs: ResultsSet) -> list[dict]:
    out = []
    for s in rs.sources:
        rows = [r for r in rs.rows if r.source == s["label"]]
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        out.append({**s, "counts": ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))})
    return out


_MD_SPECIAL = re.compile(r"([\\`*\[\]|#])")


def md_escape(s: object) -> str:
    """Inline-safe markdown: HTML escaped (renderers pass raw HTML through), markup characters quoted."""
    text = html.escape(str(s), quote=False).replace("\r", " ").replace("\n", " ")
    return _MD_SPECIAL.sub(r"\\\1", text)


def md_table(t: Table) -> str:
    head = "| " + " | ".join(md_escape(c.name) for c in t.columns) + " |"
    align = "|" + "|".join(":--" if c.kind == "text" else "--:" for c in t.columns) + "|"
    body = ["| " + " | ".join(md_escape(v) for v in row) + " |" for row in t.formatted()]
    return "\n".join([head, align, *body])


def render_markdown(ctx: dict) -> str:
    lines = ["# scaletool report", "",
             f"Generated {ctx['generated']} by scaletool {ctx['version']} from:", ""]
    for s in ctx["sources"]:
        what = " — ".join(md_escape(x) for x in (s["name"], s["description"]) if x)
        lines.append(f"- **{md_escape(s['label'])}**: {md_escape(s['path'])}" + (f" ({what})" if what else "")
                     + f"; {md_escape(s['counts'])}")
    lines += ["", "## Findings", ""]
    lines += [f"- {md_escape(f)}" for f in ctx["findings"]] or ["- (no comparisons in this data)"]
    for t in ctx["tables"]:
        lines += ["", f"## {md_escape(t.title)}", ""]
        if t.note:
            lines += [md_escape(t.note), ""]
        lines.append(md_table(t))
    if ctx["plots"]:
        lines += ["", "## Plots", ""]
        for p in ctx["plots"]:
            lines += [f"![{md_escape(p.title)}](plots/{p.key}.png)", ""]
    if ctx["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- {md_escape(w)}" for w in ctx["warnings"]]
    return "\n".join(lines).rstrip() + "\n"


def render_html(ctx: dict) -> str:
    from jinja2 import Environment, PackageLoader

    env = Environment(loader=PackageLoader("scaletool", "templates"), autoescape=True,
                      trim_blocks=True, lstrip_blocks=True)
    plots = [{"title": p.title, "key": p.key, "data": base64.b64encode(p.png).decode()} for p in ctx["plots"]]
    tables = [{"key": t.key, "title": t.title, "note": t.note, "columns": t.columns, "rows": t.formatted()}
              for t in ctx["tables"]]
    return env.get_template("report.html.j2").render(**{**ctx, "plots": plots, "tables": tables})


def _csv_safe(v: object) -> object:
    """Quote text a spreadsheet would run as a formula."""
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return v


def _flatten(d: dict, prefix: str, out: dict) -> None:
    for k, v in d.items():
        if k in CSV_SKIP:
            continue
        if isinstance(v, dict):
            _flatten(v, f"{prefix}{k}.", out)
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v


def csv_rows(rs: ResultsSet) -> list[dict]:
    """One row per (results dir, point, mode); a decode run gives one row per measured point."""
    rows = []
    for r in rs.rows:
        base = {"source": r.source, "point": r.label, "mode": r.mode, "status": r.status, "key": r.record["key"],
                "reason": r.record.get("reason") or r.record.get("error"), "wall_s": r.record.get("wall_s")}
        if r.recipe is not None:
            base.update({"attention": r.attention, "kv_lora_rank": r.kv_lora_rank,
                         "intermediate_size": r.intermediate_size, "compression_ratio": r.compression_ratio})
        _flatten({f"values.{k}": v for k, v in r.record.get("values", {}).items()}, "", base)
        _flatten(r.record.get("match_params") or {}, "match_params.", base)
        _flatten(r.result, "result.", base)
        subs = decode_points(r) if r.mode == "decode" and r.ok else []
        for p in subs:
            row = dict(base)
            _flatten(p, "result.point.", row)
            rows.append(row)
        if not subs:
            rows.append(base)
    return rows


def write_csv(rs: ResultsSet, path: Path) -> int:
    rows = csv_rows(rs)
    fixed = ["source", "point", "mode", "status", "key", "reason", "wall_s", "attention", "kv_lora_rank",
             "intermediate_size", "compression_ratio"]
    rest = sorted({k for row in rows for k in row} - set(fixed))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fixed + rest)
        w.writeheader()
        for row in rows:
            w.writerow({k: _csv_safe(v) for k, v in row.items()})
    return len(rows)

