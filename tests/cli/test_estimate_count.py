"""`scaletool estimate` and `scaletool count` through the real command line: typed results, the memory
table (its columns add up, it fits 80 columns), the same keys for the same figures, device and memory
refusals as one error line."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from conftest import RECIPES, run_cli
from rich.console import Console

from scaletool import api
from scaletool.analytic.timeline import COMPONENTS, PHASES
from scaletool.cli import main
from scaletool.cli.estimate import MEMORY_COLUMNS, UNITS, memory_table, memory_unit
from scaletool.results import load_result

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"


def cli_json(*args: str) -> dict:
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_estimate_json_is_the_typed_result():
    est = cli_json("estimate", str(RECIPES / "mla-1b.yaml"))
    assert est["kind"] == "estimate" and est["schema_version"] == 2
    assert est["params"]["total"] == 904_996_864
    assert est["kv_cache"]["bytes_per_token"] == (512 + 64) * 16 * 2
    assert est["flops"]["per_token"]["train"] > 6 * est["params"]["matmul"]
    assert {row["label"] for row in est["memory"]["engines"]} == {"single", "ddp", "fsdp", "zero1", "zero2", "zero3"}
    typed = load_result(est)
    assert typed.memory.recipe.phase in PHASES and typed == api.estimate(RECIPES / "mla-1b.yaml")


def test_every_memory_row_is_the_sum_of_its_components():
    """In the JSON, for every engine: each phase's components sum to that phase, the larger is the total."""
    est = cli_json("estimate", str(RECIPES / "mha-1b.yaml"), "--world-size", "2")
    rows = est["memory"]["engines"] + [est["memory"]["recipe"]]
    assert len(rows) == 2 * 5 + 1  # no single on 2 GPUs
    for row in rows:
        sums = {phase: sum(comp.values()) for phase, comp in row["phases"].items()}
        assert set(row["phases"]["backward"]) == set(COMPONENTS)
        assert row["total_bytes"] == sums[row["phase"]] == max(sums.values()), row["label"]


def _rendered_rows(text: str) -> list[list[str]]:
    """The memory table's data rows as cells (engine and ckpt carried down to the step row)."""
    lines = text[text.index("Training memory per GPU"):].splitlines()
    rows, engine, ckpt = [], None, None
    for line in lines[3:]:
        cells = line.split()
        if len(cells) == 10:
            engine, ckpt = cells[0], cells[1]
        elif len(cells) == 8 and cells[0].rstrip("*") in ("bwd", "step"):
            cells = [engine, ckpt, *cells]
        else:
            continue
        rows.append(cells)
    return rows


@pytest.mark.parametrize("recipe, world", [("mha-1b.yaml", 1), ("mla-1b.yaml", 4), ("tiny.yaml", 1)])
def test_rendered_memory_table_adds_up_to_the_json_totals_and_fits_80_columns(recipe, world):
    est = api.estimate(RECIPES / recipe, world_size=world)
    con = Console(width=80, record=True, file=open("/dev/null", "w"))
    unit = memory_unit(est.memory.engines)
    con.print(memory_table(est, world, unit))
    text = con.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    size = dict(UNITS)[unit[0]]
    rows = _rendered_rows(text)
    assert len(rows) == 2 * len(est.memory.engines)
    by_key = {(r.label, r.activation_checkpointing): r for r in est.memory.engines}
    half = 0.005 * size  # each figure is rounded to 0.01 of the unit
    for cells in rows:
        row = by_key[(cells[0], cells[1])]
        phase = "backward" if cells[2].startswith("bwd") else "optimizer_step"
        assert cells[2].endswith("*") == (phase == row.phase)
        shown = [float(c) * size for c in cells[3:9]]
        comp = getattr(row.phases, phase)
        for (_, name), value in zip(MEMORY_COLUMNS, shown):
            assert abs(value - getattr(comp, name)) <= half
        total = float(cells[9]) * size
        assert abs(sum(shown) - total) <= 7 * half  # the columns add up to the total shown
        assert abs(total - comp.total) <= half
        if phase == row.phase:
            assert abs(total - row.total_bytes) <= half


@pytest.mark.parametrize("args", [["estimate", "mla-1b.yaml"], ["estimate", "deepseek-v3.yaml"],
                                  ["estimate", "mla-1b.yaml", "--detail"], ["estimate", "deepseek-v3.yaml", "--detail"],
                                  ["count", "mla-1b.yaml"], ["count", "deepseek-v3.yaml", "--no-fvcore"]])
def test_human_output_fits_80_columns(args):
    res = CliRunner(env={"COLUMNS": "80"}).invoke(main, [args[0], str(RECIPES / args[1]), *args[2:]])
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    assert "…" not in res.output


def _size(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * dict(UNITS)[unit]


@pytest.mark.parametrize("recipe, world", [("mla-1b.yaml", 1), ("deepseek-v3.yaml", 1), ("tiny.yaml", 4)])
def test_estimate_summary_is_short_and_its_figures_are_the_json(recipe, world):
    """The default view fits about 20 lines of 80 columns; each engine's peaks (without and with checkpointing)
    and their phases are the JSON's, the ledger is left to --detail."""
    args = ["estimate", str(RECIPES / recipe), "--world-size", str(world)]
    res = CliRunner(env={"COLUMNS": "80"}).invoke(main, args)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    # a model too large for one card adds the GPUs each engine needs (tests/cli/test_estimate_hf.py)
    summary = lines[:next((i for i, ln in enumerate(lines) if ln.startswith("Does not fit one")), len(lines))]
    assert len(summary) <= 22 and len(lines) - len(summary) <= 5
    assert max(len(line) for line in lines) <= 80 and "…" not in res.output
    assert "Training memory per GPU" not in res.output and "--detail" in res.output
    est = cli_json(*args)
    assert f"{est['params']['total']:,} total" in res.output
    assert f"{est['kv_cache']['bytes_per_token']:,} B/token" in res.output
    rows = {(r["label"], r["activation_checkpointing"]): r for r in est["memory"]["engines"]}
    labels = {label for label, _ in rows}
    predicted = {row["label"]: row for row in est["prediction"]["rows"]}
    seen = set()
    for line in lines:
        cells = line.split()
        if cells and cells[0] in labels and len(cells) in (10, 11):  # tokens/s with or without an SI prefix
            seen.add(cells[0])
            pred = predicted[cells[0]]
            if pred["activation_checkpointing"] is None:  # no checkpointing fits the card: no speed to show
                assert cells[-4:] == ["-", "-", "no", "fit"] and pred["tokens_per_s_per_gpu"] is None
            else:  # the predicted MFU beside the memory, at the checkpointing it was predicted with
                assert cells[-2] == f"{100 * pred['mfu']:.0f}%"
                assert cells[-1] == {"none": "none", "selective": "sel", "full": "full"}[pred["activation_checkpointing"]]
            for ac, (value, unit, at) in zip(("none", "full"), (cells[1:4], cells[4:7])):
                row = rows[(cells[0], ac)]
                assert {"bwd": "backward", "step": "optimizer_step"}[at] == row["phase"]
                assert abs(_size(f"{value} {unit}") - row["total_bytes"]) <= 0.01 * row["total_bytes"]
    assert seen == labels
    detail = CliRunner().invoke(main, [*args, "--detail"])
    assert detail.exit_code == 0 and "Training memory per GPU" in detail.output
    assert len(detail.output.splitlines()) > 2 * len(lines)


def test_estimate_table_and_overrides():
    res = CliRunner().invoke(main, ["estimate", str(RECIPES / "mha-1b.yaml"), "--set", "model.attention=gqa",
                                    "--set", "model.n_kv_heads=4", "--world-size", "8", "--detail"])
    assert res.exit_code == 0, res.output
    for text in ("Parameters", "12·d²·L", "FLOPs per token", "KV cache", "zero3", "world size 8", "bwd*",
                 "This recipe's engine (single) runs one process: the rows above are for 8 GPUs"):
        assert text in res.output


def test_count_and_estimate_share_key_names_for_the_same_figures():
    """count --json has params.total, and every figure both report sits under the same key."""
    r = RECIPES / "tiny.yaml"
    est = cli_json("estimate", str(r))
    cnt = cli_json("count", str(r), "--no-fvcore")
    assert cnt["kind"] == "count" and cnt["schema_version"] == 2
    assert cnt["params"]["total"] == cnt["params"]["measured"] == est["params"]["total"]
    for key, value in est["params"].items():
        assert cnt["params"][key] == value, key
    assert cnt["model"] == est["model"] and cnt["seq_len"] == est["seq_len"]
    assert cnt["flops"]["per_token"]["train"] == est["flops"]["per_token"]["train"]  # a dense model
    assert cnt["memory"] is None  # meta allocates nothing
    assert "analytic" not in cnt["params"]


def test_count_human_output_names_the_conventions():
    res = CliRunner().invoke(main, ["count", str(RECIPES / "tiny.yaml")])
    assert res.exit_code == 0, res.output
    assert "FlopCounterMode" in res.output and "fvcore" in res.output and "causal" in res.output


def test_count_405b_on_meta_allocates_no_weights():
    """A >400B dense recipe is counted through the real CLI without the 800 GB its weights would need."""
    code = ("import json, resource, subprocess, sys;"
            "p = subprocess.run([sys.executable, '-m', 'scaletool', 'count', sys.argv[1], '--json'],"
            " capture_output=True, text=True);"
            "print(json.dumps({'rc': p.returncode, 'out': p.stdout, 'err': p.stderr[-2000:],"
            " 'maxrss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", code, str(RECIPES / "llama3-405b-dense.yaml")],
                          capture_output=True, text=True, timeout=300)
    res = json.loads(proc.stdout)
    assert res["rc"] == 0, res["err"]
    out = json.loads(res["out"])
    assert out["params"]["measured"] == out["params"]["total"] > 400e9
    assert abs(out["flops"]["flop_counter"]["train_rel_error"]) < 0.01
    assert res["maxrss_kb"] < 4 * 2**20  # under 4 GiB resident: nothing was materialised


def _one_error(res, *needles: str) -> str:
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stdout == ""
    for n in needles:
        assert n in res.stderr, res.stderr
    return res.stderr


def test_device_is_a_choice_not_free_text():
    err = _one_error(run_cli("count", str(RECIPES / "tiny.yaml"), "--device", "tpu9"), "--device", "tpu9")
    assert "meta" in err and "cuda" in err and "privateuseone" not in err  # not torch's device list


def test_count_on_cuda_without_cuda_is_one_line():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    err = _one_error(run_cli("count", str(RECIPES / "tiny.yaml"), "--device", "cuda"), "device cuda")
    assert err.count("error:") == 1


def test_count_refuses_what_would_not_fit_before_building_anything():
    """`count --batch 100000 --device cpu` was once killed by the OOM killer at 13 GB, silently."""
    err = _one_error(run_cli("count", str(RECIPES / "tiny.yaml"), "--device", "cpu", "--batch", "100000"),
                     "needs about", "available", "activations", "count on meta")
    need = re.search(r"needs about ([\d.]+) GiB", err)
    assert need and float(need.group(1)) > 50


def test_help_teaches():
    res = run_cli("--help")
    assert res.returncode == 0
    for cmd in ("estimate", "count", "recipe"):
        assert cmd in res.stdout
    for cmd in ("estimate", "count"):
        assert "Examples:" in run_cli(cmd, "--help").stdout


def test_estimate_predicts_the_step_of_every_engine_beside_memory():
    """One prediction per memory-table engine at the world size, each the step model's for that engine."""
    from scaletool.analytic.step import predict_step
    from scaletool.measure.hardware import profile_named
    from scaletool.predict.prediction import calibration_for_device

    est = cli_json("estimate", str(RECIPES / "mla-1b.yaml"), "--world-size", "8", "--hardware", "h200")
    pred = est["prediction"]
    assert pred["hardware"] == "H200" and pred["world_size"] == 8
    assert [r["label"] for r in pred["rows"]] == [r["label"] for r in est["memory"]["engines"]
                                                   if r["activation_checkpointing"] == "none"]
    r = api.resolve(str(RECIPES / "mla-1b.yaml"))
    calib = calibration_for_device("cuda", profile_named("H200"))
    zero3 = r.model_copy(update={"parallel": r.parallel.model_copy(update={"engine": "deepspeed", "zero_stage": 3})})
    want = predict_step(zero3, calib, world_size=8)
    got = next(row for row in pred["rows"] if row["label"] == "zero3")
    assert got["step_s"] == pytest.approx(want["step_s"]) and got["bound"] == want["bound"]
    for row in pred["rows"]:
        assert row["step_s"] > 0 and 0 < row["mfu"] < 1
        assert row["tokens_per_s_per_gpu"] * 8 == pytest.approx(row["tokens_per_s"])
    text = CliRunner().invoke(main, ["estimate", "mla-1b", "--world-size", "8"]).output
    assert "tok/s/GPU, MFU: predicted on H100 SXM" in text  # the summary's columns
    text = CliRunner().invoke(main, ["estimate", "mla-1b", "--world-size", "8", "--detail"]).output
    assert "Predicted step on H100 SXM (world size 8)" in text and "tokens/s/GPU" in text


def test_estimate_with_an_unknown_card_is_one_line():
    res = CliRunner().invoke(main, ["estimate", "tiny", "--hardware", "h2000"])
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: hardware 'h2000': unknown; did you mean 'H200'?")
