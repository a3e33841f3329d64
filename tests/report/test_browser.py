"""The report as a reader sees it: rendered in a real headless Chromium at 1,400 px wide.

No console errors, every plot loads, no table makes the page wider than the viewport (a wide table
scrolls inside its own box) and its first column stays in view while it scrolls. Skipped when no
Chromium is installed, unless ``SCALETOOL_REQUIRE_BROWSER=1`` (CI sets it), which makes that a failure.
``SCALETOOL_REPORT_SCREENSHOT=FILE`` also saves a full-page PNG to look at.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import report_synth as synth
from conftest import unpacked_fixture
from report_browser import Browser, find_chromium

from scaletool import api

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

WIDTH = 1400

LAYOUT = """(() => {
  const vw = document.documentElement.clientWidth;
  const boxes = [...document.querySelectorAll('table')].map(t => {
    const box = t.parentElement, r = box.getBoundingClientRect();
    return {id: t.closest('div').previousElementSibling.id || '', left: r.left, right: r.right,
            inner: box.scrollWidth, visible: box.clientWidth, scrolls: getComputedStyle(box).overflowX};
  });
  return {vw, page: document.documentElement.scrollWidth, boxes,
          images: [...document.images].map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0}))};
})()"""

STICKY = """(() => {
  const boxes = [...document.querySelectorAll('.scroll')].filter(b => b.scrollWidth > b.clientWidth);
  const box = boxes.sort((a, b) => b.scrollWidth - a.scrollWidth)[0];
  const row = box.querySelector('tbody tr'), lead = row.cells[0], other = row.cells[row.cells.length - 1];
  const before = [lead.getBoundingClientRect().left, other.getBoundingClientRect().left];
  box.scrollLeft = box.scrollWidth;
  const after = [lead.getBoundingClientRect().left, other.getBoundingClientRect().left];
  return {box: box.getBoundingClientRect().left, before, after};
})()"""


def chromium_or_skip() -> str:
    exe = find_chromium()
    if exe is None:
        why = "no Chromium found (Debian package `chromium`, or set SCALETOOL_CHROMIUM)"
        if os.environ.get("SCALETOOL_REQUIRE_BROWSER") == "1":
            pytest.fail(f"SCALETOOL_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why + "; SCALETOOL_REQUIRE_BROWSER=1 makes this a failure")
    return exe


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    exe = chromium_or_skip()
    d = tmp_path_factory.mktemp("browser")
    res = api.report([unpacked_fixture("price"), synth.showcase(d / "showcase"), synth.dynamics_showcase(d / "dynamics")],
                     d / "out")
    with Browser(exe, width=WIDTH) as b:
        b.load(Path(res.report_html))
        if os.environ.get("SCALETOOL_REPORT_SCREENSHOT"):
            b.screenshot(Path(os.environ["SCALETOOL_REPORT_SCREENSHOT"]))
        yield b, res


def test_no_console_errors_and_every_plot_loads(page):
    b, res = page
    assert b.console_errors() == []
    images = b.evaluate(LAYOUT)["images"]
    assert len(images) == len(res.plots) >= 13  # the training-dynamics section's five among them
    assert [i["alt"] for i in images if not i["ok"]] == []


def test_no_table_is_wider_than_the_viewport(page):
    b, _ = page
    got = b.evaluate(LAYOUT)
    assert got["vw"] <= WIDTH and got["page"] <= got["vw"]  # the page itself never scrolls sideways
    assert got["boxes"] and all(x["right"] <= got["vw"] + 0.5 and x["scrolls"] == "auto" for x in got["boxes"])
    # the check means something: some tables are wider than the screen and scroll inside their box
    assert any(x["inner"] > x["visible"] for x in got["boxes"])


def test_the_first_column_stays_while_a_wide_table_scrolls(page):
    b, _ = page
    got = b.evaluate(STICKY)
    assert got["after"][1] < got["before"][1] - 100  # the table did scroll
    assert abs(got["after"][0] - got["box"]) <= 2 and abs(got["before"][0] - got["after"][0]) <= 2


def test_require_browser_turns_a_missing_chromium_into_a_failure(monkeypatch):
    import report_browser

    monkeypatch.delenv("SCALETOOL_CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert report_browser.find_chromium() is None
    monkeypatch.setenv("SCALETOOL_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="SCALETOOL_REQUIRE_BROWSER=1 but no Chromium found"):
        chromium_or_skip()
    monkeypatch.delenv("SCALETOOL_REQUIRE_BROWSER")
    with pytest.raises(pytest.skip.Exception, match="no Chromium found"):
        chromium_or_skip()
