"""What a card without a calibration of its own is predicted with, the datasheet default, says how well the same
rule does where it can be checked: the H100 SXM's default re-predicting the committed dense H100 runs. The figures
its source states are the ones those runs give (they went stale once: 48 runs, 1.9% / 17.7% while the runs had
grown to 91 at 2.6% / 15.1%)."""
from __future__ import annotations

import statistics

from scaletool.analytic.calibration import DATASHEET_DEFAULT_ERROR, default_calibration
from scaletool.measure.hardware import profile_named
from scaletool.predict.validation import validate


def test_the_default_states_the_error_the_committed_h100_runs_give():
    cal = default_calibration(profile_named("H100 SXM"))
    rows = [r for r in validate(None, cal)["runs"] if "H100" in r["card"] and not r.get("outside")]
    errors = [abs(r["rel_error"]) for r in rows]
    n, median, worst = DATASHEET_DEFAULT_ERROR
    assert len(errors) == n
    assert round(statistics.median(errors), 3) == median and round(max(errors), 3) == worst
    assert f"the {n} committed dense H100 runs: median {median:.1%}, worst {worst:.1%}" in cal.source
