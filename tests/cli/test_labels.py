"""Figures carry the labels they are: the rule of thumb is neither measured nor exact, one unit per
memory figure, a CPU rank is a process, and report.md reads as plain text."""
from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import RECIPES

from scaletool.cli import main
from scaletool.report.render import md_escape
from scaletool.results.train import TrainResult
from scaletool.train.summary import headline


def test_count_puts_the_rule_of_thumb_on_a_line_naming_each_figure():
    res = CliRunner().invoke(main, ["count", str(RECIPES / "tiny.yaml")])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    (i,) = [i for i, x in enumerate(lines) if "12·d²·L" in x]
    assert lines[i].startswith("rule of thumb 12·d²·L = ") and "non-embedding (exact)" in lines[i + 1]
    header = next(x for x in res.output.splitlines() if "measured" in x and "exact" in x)
    assert "12·d²·L" not in header


@pytest.mark.parametrize("view", [[], ["--detail"]])
def test_estimate_states_the_recipe_memory_in_the_table_unit(view):
    res = CliRunner().invoke(main, ["estimate", str(RECIPES / "deepseek-v3.yaml"), *view])
    assert res.exit_code == 0, res.output
    if view:
        assert "Training memory per GPU, TiB (world size 1)" in res.output
    lines = res.output.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("This recipe ("))
    text = " ".join(lines[i:i + 2])  # the summary puts the figure on the next line
    assert " TiB per GPU" in text and "GiB" not in text and "at the block" not in text
    assert "(at block " in text


def test_the_cpu_train_line_says_per_process():
    cpu = TrainResult(status="completed", threads=2, metrics={"flops/achieved_tflops_per_gpu": 0.0164})
    gpu = TrainResult(status="completed", metrics={"flops/achieved_tflops_per_gpu": 400.0})
    assert "0.0164 TFLOP/s per process" in headline(cpu) and "GPU" not in headline(cpu)
    assert "400 TFLOP/s per GPU" in headline(gpu)


def test_markdown_escapes_what_would_render_and_keeps_the_rest_readable():
    assert md_escape("(runs > 1)") == "(runs > 1)"
    assert md_escape("<script>x</script>") == "&lt;script>x&lt;/script>"
    assert md_escape("a &amp; b & c") == "a &amp;amp; b & c"
    assert md_escape("> quoted") == "\\> quoted"
    assert md_escape("a|b*c") == "a\\|b\\*c"
