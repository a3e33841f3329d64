"""``scaletool docs``: the shipped documentation pages, listed and printed; an unknown topic is one error line."""
from __future__ import annotations

from click.testing import CliRunner
from conftest import ROOT

from scaletool.cli import main


def test_without_a_topic_every_page_is_listed_with_its_first_heading():
    res = CliRunner().invoke(main, ["docs"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    assert [ln.split()[0] for ln in lines[:-1]] == pages
    plan = next(ln for ln in lines if ln.startswith("plan "))
    assert plan.split(None, 1)[1] == "Planning a layout: `scaletool plan`"


def test_a_topic_prints_its_page_as_it_is():
    for arg in ("plan", "plan.md", "docs/plan.md"):
        res = CliRunner().invoke(main, ["docs", arg])
        assert res.exit_code == 0, res.output
        assert res.output == (ROOT / "docs" / "plan.md").read_text(encoding="utf-8")


def test_an_unknown_topic_is_exit_2_with_one_line_naming_the_closest_and_all():
    for arg, hint in (("plam", "did you mean 'plan'? "), ("../README", ""), ("zzz", "")):
        res = CliRunner().invoke(main, ["docs", arg])
        assert res.exit_code == 2
        assert len(res.output.splitlines()) == 1, res.output
        line = res.output.strip()
        assert line.startswith(f"error: {arg}: no such documentation page; {hint}topics: benchmarks, cli,"), line
        assert "plan, prediction, recipes" in line


def test_no_help_points_to_readme():
    res = CliRunner().invoke(main, ["--help"])
    assert "README" not in res.output and "scaletool docs recipes" in res.output
