"""The result of ``scaletool report``: where the report went and what it found."""
from __future__ import annotations

from typing import ClassVar, Literal

from scaletool.results.base import Result, register


@register
class ReportResult(Result):
    """Paths of the files written, the tables and plots they hold, the findings and the warnings."""

    SCHEMA_VERSION: ClassVar[int] = 1
    kind: Literal["report"] = "report"
    report_md: str
    report_html: str
    results_csv: str
    plots: list[str]  # PNG paths, one per plot drawn
    tables: list[str]  # table keys in page order (estimate, count, train, ...)
    csv_rows: int
    findings: list[str]
    warnings: list[str]
    recomputed: list[str] = []  # figures computed by the closed forms where no result recorded them
