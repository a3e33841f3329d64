"""`scaletool count --by module`: parameters and forward FLOPs per module as a tree, measured with
FlopCounterMode's module hierarchy, beside the closed forms; the rows under every module add up to it."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import RECIPES

from scaletool.cli import main


def _count(*args: str) -> dict:
    res = CliRunner().invoke(main, ["count", *args, "--no-fvcore", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _walk(node):
    yield node
    for child in node["children"]:
        yield from _walk(child)


def test_module_sums_equal_the_totals_on_the_tiny_recipe():
    out = _count(str(RECIPES / "tiny.yaml"), "--by", "module", "--depth", "9")
    tree = out["modules"]
    assert tree["name"] == "" and tree["tokens"] == out["flops"]["tokens"]
    assert tree["params"] == out["params"]["total"] == out["params"]["measured"]
    assert tree["forward_flops"] == out["flops"]["flop_counter"]["forward"] > 0
    assert tree["train_flops"] == out["flops"]["flop_counter"]["train"]
    nodes = list(_walk(tree))
    names = {n["name"] for n in nodes}
    assert {"layers.0.attn.wq", "layers.1.ffn.w2", "tok_embeddings", "output"} <= names  # leaves are reached
    for n in nodes:
        assert n["params"] == n["own_params"] + sum(c["params"] for c in n["children"]), n["name"]
        assert n["forward_flops"] == n["own_flops"] + sum(c["forward_flops"] for c in n["children"]), n["name"]
        assert n["own_params"] >= 0 and n["own_flops"] >= 0, n["name"]
    # leaves own everything; a Linear's forward is 2 · its weights · tokens
    leaf = next(n for n in nodes if n["name"] == "layers.0.attn.wq")
    assert leaf["children"] == [] and leaf["own_params"] == leaf["params"] > 0
    assert leaf["forward_flops"] == 2 * leaf["params"] * tree["tokens"]
    # the closed forms beside the measured figures: equal for this dense model wherever one is given
    checked = 0
    for n in nodes:
        for key, value in (n["analytic"] or {}).items():
            if key in ("params", "forward_flops"):
                assert n[key] == pytest.approx(value, rel=1e-9), (n["name"], key)
                checked += 1
    assert checked >= 4 * 2 + 6  # model, layers, blocks, attention, FFN, projections...


def test_depth_cuts_the_tree_and_the_cut_nodes_keep_everything_below():
    full = _count(str(RECIPES / "tiny.yaml"), "--by", "module", "--depth", "9")["modules"]
    cut = _count(str(RECIPES / "tiny.yaml"), "--by", "module", "--depth", "1")["modules"]
    assert cut["params"] == full["params"] and cut["forward_flops"] == full["forward_flops"]
    assert [c["name"] for c in cut["children"]] == [c["name"] for c in full["children"]]
    for c in cut["children"]:
        assert c["children"] == [] and c["own_params"] == c["params"] and c["own_flops"] == c["forward_flops"]
    assert _count(str(RECIPES / "tiny.yaml"))["modules"] is None  # only when asked


def test_module_table_fits_80_columns_and_its_rows_add_up():
    res = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["count", str(RECIPES / "tiny.yaml"), "--no-fvcore",
                                                         "--by", "module", "--depth", "2"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in res.output
    start = next(i for i, line in enumerate(lines) if line.startswith("Per module"))
    rows = [line for line in lines[start + 3:] if line.startswith("  ") and "(" in line]
    # tiny's two identical blocks are one row, their figures summed (docs: `count --by module`)
    assert any("0–1 (Block ×2)" in r for r in rows) and any(line.split()[:1] == ["output"] for line in lines[start + 3:])
    assert not any("1 (Block)" in r for r in rows)
    assert "rope" not in res.output  # no parameters, no FLOPs: left out of the table
    # a tied head multiplies by the embedding's weight in the model's own forward: a row of its own
    tied = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["count", str(RECIPES / "tiny.yaml"), "--no-fvcore", "--by",
                                                          "module", "--depth", "2", "--set", "model.tie_embeddings=true"])
    assert tied.exit_code == 0, tied.output
    tied_rows = [line.split()[0] for line in tied.output.splitlines() if line.startswith("  ")]
    assert "(itself)" in tied_rows and "output" not in tied_rows


def test_by_and_depth_are_checked():
    res = CliRunner().invoke(main, ["count", str(RECIPES / "tiny.yaml"), "--by", "layer"])
    assert res.exit_code == 2 and "'layer' is not one of 'total', 'module'" in res.output
    res = CliRunner().invoke(main, ["count", str(RECIPES / "tiny.yaml"), "--by", "module", "--depth", "-1"])
    assert res.exit_code == 2 and "--depth" in res.output


def test_piped_count_says_each_stage_on_stderr_and_keeps_stdout_one_json_document():
    from conftest import run_cli

    res = run_cli("count", str(RECIPES / "tiny.yaml"), "--no-fvcore", "--by", "module", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["modules"]["name"] == ""
    assert "\r" not in res.stderr and "\x1b" not in res.stderr
    assert res.stderr.splitlines() == [
        "[1/4] count on meta: building the model", "[2/4] count on meta: FlopCounterMode: forward and backward",
        "[3/4] count on meta: FlopCounterMode: one decoded token per decode mode",
        "[4/4] count on meta: FlopCounterMode: FLOPs per module", "count on meta: done"]
