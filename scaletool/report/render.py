"""Write the report: ``report.md`` (+ ``plots/*.png``), a self-contained ``report.html`` and ``results.csv``.

Every string that came from a user (labels, recipe values, error text) is escaped: by jinja2's
autoescaping in HTML, by :func:`md_escape` in markdown, and against spreadsheet formulas in CSV.
"""
from __future__ import annotations

import base64
import re
from datetime import datetime, timezone
from pathlib import Path

from scaletool import __version__
from scaletool.errors import RecipeError, shorten
from scaletool.fmt import refuse_link, refused, write_atomic
from scaletool.report import claims, dynamics, prediction, tables
from scaletool.report.data import ResultsSet, load
from scaletool.report.findings import all_findings
from scaletool.report.plots import Plot, all_plots
from scaletool.report.results_csv import write_csv
from scaletool.report.tables import Table
from scaletool.results.report import ReportResult

TABLES = (tables.estimate_table, tables.count_table, tables.train_table, prediction.prediction_table,
          dynamics.dynamics_table, tables.scaling_table,
          tables.moe_table, tables.decode_table, tables.budget_table, claims.claim_table, tables.breakdown_table,
          tables.failures_table)


def all_tables(rs: ResultsSet) -> list[Table]:
    """Every table the data has, in page order (the price-transformer claim only when that model is there)."""
    return [t for t in (build(rs) for build in TABLES) if t is not None]


def build_report(dirs: list[Path], out: Path) -> ReportResult:
    """Read ``dirs``, write the report files into ``out``; return their paths, findings and warnings."""
    rs = load(dirs)
    tabs = all_tables(rs)
    plots = all_plots(rs) + dynamics.dynamics_plots(rs) + prediction.prediction_plots(rs)
    findings = all_findings(rs)
    recomputed = rs.recomputed_lines()  # after everything that may compute has run
    plot_dir = out / "plots"
    context = {"sources": _sources(rs), "tables": tabs, "plots": plots, "findings": findings,
               "warnings": rs.warnings, "recomputed": recomputed, "version": __version__,
               "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:  # each file whole or not at all: a full disk leaves the previous report's files as they were
        refuse_link(plot_dir)
        plot_dir.mkdir(parents=True, exist_ok=True)
        for p in plots:
            write_atomic(plot_dir / f"{p.key}.png", p.png)
        write_atomic(out / "report.md", render_markdown(context))
        write_atomic(out / "report.html", render_html(context))
        n_csv = write_csv(rs, out / "results.csv")
    except OSError as e:
        if refused(e):
            raise RecipeError(f"{shorten(str(e.filename))}: {e.strerror}") from None
        raise RecipeError(f"{shorten(str(out))}: cannot write the report: {e.strerror or e}") from None
    return ReportResult(report_md=str(out / "report.md"), report_html=str(out / "report.html"),
                        results_csv=str(out / "results.csv"), plots=[str(plot_dir / f"{p.key}.png") for p in plots],
                        tables=[t.key for t in tabs], csv_rows=n_csv, findings=findings, warnings=rs.warnings,
                        recomputed=recomputed)


def _sources(rs: ResultsSet) -> list[dict]:
    out = []
    for s in rs.sources:
        counts: dict[str, int] = {}
        for r in rs.rows:
            if r.source == s["label"]:
                counts[r.status] = counts.get(r.status, 0) + 1
        out.append({**s, "counts": ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))})
    return out


_MD_SPECIAL = re.compile(r"([\\`*\[\]|#])")
_ENTITY = re.compile(r"&(?=#?\w+;)")  # an & that a renderer would read as the start of an entity


def md_escape(s: object) -> str:
    """Inline-safe markdown, readable as plain text: ``<`` (which opens raw HTML, passed through by
    renderers) and an ``&`` that would start an entity are escaped; ``>`` opens nothing inline and stays
    as written (``runs > 1``), quoted only at the start, where it would open a quote; markup characters
    are quoted."""
    text = _ENTITY.sub("&amp;", str(s)).replace("<", "&lt;").replace("\r", " ").replace("\n", " ")
    text = _MD_SPECIAL.sub(r"\\\1", text)
    return "\\" + text if text.startswith(">") else text


def md_table(t: Table) -> str:
    head = "| " + " | ".join(md_escape(c.full) for c in t.columns) + " |"
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
    for group, plots in plot_groups(ctx["plots"]):
        lines += ["", f"## {md_escape(group_title(group))}", ""]
        for p in plots:
            lines += [f"### {md_escape(p.title)}", "", f"![{md_escape(p.title)}](plots/{p.key}.png)", ""]
            lines += [md_escape(p.caption), ""] if p.caption else []
    if ctx.get("recomputed"):
        lines += ["", "## Computed, not recorded", ""] + [f"- {md_escape(w)}" for w in ctx["recomputed"]]
    if ctx["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- {md_escape(w)}" for w in ctx["warnings"]]
    return "\n".join(lines).rstrip() + "\n"


def plot_groups(plots: list[Plot]) -> list[tuple[str, list[Plot]]]:
    """Plots by section, in order of first appearance: the general ones (group "") and each section's."""
    groups: dict[str, list[Plot]] = {}
    for p in plots:
        groups.setdefault(p.group, []).append(p)
    return list(groups.items())


def group_title(group: str) -> str:
    return f"Plots: {group}" if group else "Plots"


def render_html(ctx: dict) -> str:
    from jinja2 import Environment, PackageLoader

    env = Environment(loader=PackageLoader("scaletool", "templates"), autoescape=True,
                      trim_blocks=True, lstrip_blocks=True)
    plots = [{"id": "plots" + (f"-{re.sub(r'[^a-z0-9]+', '-', group.lower())}" if group else ""),
              "title": group_title(group),
              "plots": [{"title": p.title, "caption": p.caption, "key": p.key, "data": base64.b64encode(p.png).decode()}
                        for p in items]} for group, items in plot_groups(ctx["plots"])]
    tabs = [{"key": t.key, "title": t.title, "note": t.note, "columns": _html_columns(t), "groups": t.groups(),
             "grouped": any(c.group for c in t.columns), "rows": t.formatted()} for t in ctx["tables"]]
    return env.get_template("report.html.j2").render(**{**ctx, "plots": plots, "tables": tabs})


def _html_columns(t: Table) -> list[dict]:
    """Columns with ``starts``: the first of a new group, which HTML marks with a rule on its left."""
    return [{"name": c.name, "kind": c.kind, "group": c.group,
             "starts": i > 0 and c.group != t.columns[i - 1].group} for i, c in enumerate(t.columns)]
