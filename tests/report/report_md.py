"""Reading the report's markdown tables back in tests: {header: cell} rows, unescaped."""
from __future__ import annotations

import re

from scaletool.report.render import md_escape


def md_section(md: str, title: str) -> str:
    return md.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def md_rows(section: str) -> list[dict[str, str]]:
    """The section's markdown table as {header: cell} rows (headers and cells unescaped)."""
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]

    def cells(line: str) -> list[str]:
        return [re.sub(r"\\(.)", r"\1", c.strip()) for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    head = cells(lines[0])
    return [dict(zip(head, cells(ln))) for ln in lines[2:]]


def md_row(section: str, **match: str) -> dict[str, str]:
    got = [r for r in md_rows(section) if all(r[k] == md_escape(v).replace("\\", "") for k, v in match.items())]
    assert len(got) == 1, (match, got)
    return got[0]
