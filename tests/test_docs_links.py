"""Every relative link in README.md and docs/ points to a file of the repository (and, with a #fragment into a
Markdown file, to one of its headings), so the documentation never sends a reader nowhere."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in md.read_text().splitlines() if line.startswith("#")}


def _links(md: Path):
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # links inside code blocks are not links
    for target in LINK.findall(text):
        if not re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            yield target


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file(md):
    broken = []
    for target in _links(md):
        path, _, fragment = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert broken == [], f"{md.relative_to(ROOT)}: broken links"


def test_the_readme_stays_short_and_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    linked = {t.partition("#")[0] for t in _links(ROOT / "README.md")}
    for doc in ("docs/cli.md", "docs/recipes.md", "docs/findings.md", "docs/benchmarks.md"):
        assert doc in linked, doc
