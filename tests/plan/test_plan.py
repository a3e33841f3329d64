"""scaletool plan: the layouts fit the card by the memory estimate, rank by predicted tokens/s, and are
commands launch accepts; bad input is one error line; --verify runs real training processes."""
from __future__ import annotations

import json
import math
import os
import shlex
import sys

import pytest
from click.testing import CliRunner
from conftest import run_cli

from scaletool import api
from scaletool.analytic.memory import recipe_memory
from scaletool.analytic.pipeline import stage_memory
from scaletool.analytic.step import fits
from scaletool.cli import main
from scaletool.config import load_recipe
from scaletool.plan.space import largest_fitting, micro_batches


def _plan(*argv: str) -> dict:
    res = CliRunner().invoke(main, ["plan", *argv, "--json"], prog_name="scaletool")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


@pytest.fixture(scope="module")
def big():
    return _plan("llama3-405b-dense", "--gpus", "1024", "--price-per-gpu-hour", "2.5", "--top", "8")


def test_a_1024_gpu_plan_lists_fitting_layouts_fastest_first(big):
    rows = big["layouts"]
    assert big["kind"] == "plan" and big["nodes"] == 128 and big["gpus_per_node"] == 8 and 1 <= len(rows) <= 8
    rates = [r["prediction"]["tokens_per_s"] for r in rows]
    assert rates == sorted(rates, reverse=True) and rates[-1] > 0
    for r in rows:
        ok, margin = fits(r["memory_bytes"], big["card_bytes"])
        assert ok and 0 < r["memory_bytes"] < big["card_bytes"] and r["margin_bytes"] == int(margin) >= 0
        assert r["prediction"]["bound"] and r["prediction"]["step_s"] > 0
        assert r["data_parallel"] * r["tensor_parallel"] * r["pipeline_parallel"] == 1024 and 8 % r["tensor_parallel"] == 0
        assert math.isclose(r["cost_per_million_tokens"], 2.5 * 1024 / 3600 / r["prediction"]["tokens_per_s"] * 1e6)
    assert any("inter-node" in line for line in big["assumptions"])  # what crossing nodes assumes is stated
    assert big["elapsed_s"] > 0 and big["considered"]["predicted"] == big["fitting_layouts"] >= len(rows)


def test_each_layout_is_the_recipe_its_command_sets(big):
    """Applying the command's --set keys to the recipe gives the layout, and the memory estimate of that
    recipe is the memory the plan fitted."""
    for r in big["layouts"]:
        argv = shlex.split(r["command"])
        assert argv == r["argv"] and argv[:4] == ["scaletool", "launch", "torchrun", "llama3-405b-dense"]
        assert argv[argv.index("--nnodes") + 1] == "128" and argv[argv.index("--nproc-per-node") + 1] == "8"
        rec = load_recipe("llama3-405b-dense", _sets(argv))
        assert (rec.parallel.engine, rec.parallel.tensor_parallel, rec.train.micro_batch_size) == \
            (r["engine"], r["tensor_parallel"], r["micro_batch_size"])
        assert (rec.train.activation_checkpointing, rec.train.compile) == (r["activation_checkpointing"], r["compiled"])
        if r["engine"] == "deepspeed":
            assert rec.parallel.zero_stage == r["zero_stage"]
        assert (rec.parallel.pipeline_parallel, rec.parallel.pipeline_microbatches or 0) == \
            (r["pipeline_parallel"], r["pipeline_microbatches"])
        if r["pipeline_parallel"] > 1:  # a pipeline layout's memory is its largest stage's, as estimate says
            stages = stage_memory(rec, 1024)
            assert max(x["total_bytes"] for x in stages) == r["memory_bytes"]
            assert r["pipeline"]["stage_memory_bytes"] == [x["total_bytes"] for x in stages]
            assert api.estimate(rec, world_size=1024, hardware=None).memory.recipe.total_bytes == r["memory_bytes"]
        else:
            assert recipe_memory(rec, 1024)["total_bytes"] == r["memory_bytes"]
        assert r["command_problems"] == []


def test_the_largest_micro_batch_listed_is_the_boundary(big):
    """The largest micro-batch of a family fits; one more sequence (a pipeline layout: one more per pipeline
    micro-batch) does not (the search is not timid)."""
    top = big["layouts"][0]
    rec = load_recipe("llama3-405b-dense", _sets(top["argv"]))
    key = ("engine", "tensor_parallel", "activation_checkpointing", "compiled", "pipeline_parallel", "pipeline_schedule",
           "pipeline_microbatches")
    same = [r for r in big["layouts"] if all(r[k] == top[k] for k in key)]
    largest = max(r["micro_batch_size"] for r in same)
    step = top["pipeline_microbatches"] or 1
    bigger = load_recipe("llama3-405b-dense", [*_sets(top["argv"]), f"train.micro_batch_size={largest + step}"])
    grown = rec.model_copy(update={"train": bigger.train})
    if top["pipeline_parallel"] > 1:
        total = max(x["total_bytes"] for x in stage_memory(grown, 1024))
    else:
        total = recipe_memory(grown, 1024)["total_bytes"]
    assert fits(total, big["card_bytes"])[0] is False


def test_a_launch_dry_run_accepts_the_command(big):
    argv = big["layouts"][0]["argv"]
    res = CliRunner().invoke(main, [*argv[1:], "--dry-run", "--json"], prog_name="scaletool")
    assert res.exit_code == 0, res.output
    assert "--nnodes=128" in " ".join(json.loads(res.stdout)["argv"]) or "128" in json.loads(res.stdout)["argv"]


def test_a_moe_model_plans_at_1024_gpus():
    res = _plan("deepseek-v3", "--gpus", "1024", "--hardware", "h200")
    assert res["hardware"] == "H200" and res["layouts"]
    assert all(r["tensor_parallel"] == 1 for r in res["layouts"])  # tensor parallelism does not split MoE layers
    assert any("tensor parallelism" in n for n in res["notes"])


def test_a_global_batch_is_reached_by_every_layout():
    res = _plan("mla-1b", "--gpus", "16", "--global-batch-tokens", str(2**21), "--top", "50")
    assert res["layouts"]
    for r in res["layouts"]:
        assert r["micro_batch_size"] * r["grad_accum_steps"] * res["seq_len"] * r["data_parallel"] == 2**21
        assert r["global_batch_tokens"] == 2**21


def test_attention_variants_are_planned_too():
    res = _plan("mla-1b", "--gpus", "8", "--attention-variants", "--top", "500", "--seq-len", "1024")
    kinds = {r["attention"] for r in res["layouts"]}
    assert "mla" in kinds and len(kinds) >= 2 and res["seq_len"] == 1024
    mha = next(r for r in res["layouts"] if r["attention"] == "mha")
    assert "model.attention=mha" in _sets(mha["argv"])


def test_search_helpers():
    assert largest_fitting(lambda m: m <= 37, 4096) == 37
    assert largest_fitting(lambda m: m <= 37, 20) == 20
    assert largest_fitting(lambda m: False, 8) == 0
    assert micro_batches(6, None) == [1, 2, 4, 6]
    assert micro_batches(6, 12) == [1, 2, 4, 6]  # divisors of 12 up to 6: powers of two and the largest
    assert micro_batches(5, 12) == [1, 2, 4]


def test_the_table_fits_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    res = CliRunner().invoke(main, ["plan", "llama3-405b-dense", "--gpus", "1024", "--price-per-gpu-hour", "2"],
                             prog_name="scaletool")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    table = lines[:lines.index(next(x for x in lines if x.startswith("Commands")))]
    assert max(len(x) for x in table if "scaletool launch" not in x) <= 80
    assert "scaletool launch torchrun llama3-405b-dense" in res.stdout and "Assumptions:" in res.stdout


@pytest.mark.parametrize("argv, needle", [
    (["tiny", "--gpus", "0"], "at least 1 GPU"),
    (["tiny", "--gpus", "-4"], "at least 1 GPU"),
    (["tiny", "--gpus", "12", "--gpus-per-node", "8"], "not a whole number of nodes"),
    (["tiny", "--gpus", "8", "--gpus-per-node", "0"], "gpus per node"),
    (["tiny", "--gpus", "8", "--hardware", "h900"], "known: A100, CPU, H100 96GB, H100 PCIe, H100 SXM, H200, H800"),
    (["tiny", "--gpus", "8", "--hardware", "cpu"], "no memory_gib"),
    (["llama3-405b-dense", "--gpus", "8"], "GiB more than fits"),
    (["tiny", "--gpus", "8", "--global-batch-tokens", "100"], "multiple of 64"),
    (["tiny", "--gpus", "8", "--global-batch-tokens", "0"], "at least 1"),
    (["tiny", "--gpus", "8", "--seq-len", "100000"], "exceeds model.max_seq_len"),
    (["tiny", "--gpus", "8", "--seq-len", "0"], "seq_len"),
    (["tiny", "--gpus", "8", "--price-per-gpu-hour", "nan"], "finite"),
    (["tiny", "--gpus", "8", "--price-per-gpu-hour", "0"], "price-per-gpu-hour"),
    (["tiny", "--gpus", "8", "--top", "0"], "--top"),
    (["tiny", "--gpus", "8", "--verify", "-1"], "--verify"),
    (["tiny"], "--gpus"),
    (["no-such-recipe", "--gpus", "8"], "shipped recipes"),
    (["tiny", "--gpus", "8", "--set", "model.n_heads=3"], "n_heads"),
])
def test_bad_input_is_one_error_line_and_exit_2(argv, needle):
    res = CliRunner().invoke(main, ["plan", *argv], prog_name="scaletool")
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert res.stdout == ""


def test_verify_runs_the_best_layouts_here_and_measures_them(tmp_path):
    """A real subprocess: the plan, then one real training run on this machine; --json is all of stdout."""
    proc = run_cli("plan", "tiny", "--gpus", "4", "--global-batch-tokens", "8192", "--verify", "1", "--json",
                   timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["kind"] == "plan" and len(doc["verify"]) == 1 and doc["verify_notes"]
    v = doc["verify"][0]
    # the plan's 2,048 tokens per GPU carry over to this machine's ranks (2 CPU ranks where there are 2 cores):
    # 32 sequences of 64 per data-parallel rank
    ranks = min(2, os.cpu_count() or 1)
    assert (f"global batch {2048 * ranks:,} tokens here: the plan's 2,048 per GPU on {ranks} "
            f"rank{'s' if ranks > 1 else ''}") in doc["verify_notes"]
    mb = int(v["command"].split("train.micro_batch_size=")[1].split()[0])
    assert f"train.grad_accum_steps={32 // mb}" in v["command"]
    assert v["status"] == "completed" and v["message"] is None, v
    m = v["measured_tokens_per_s"]
    assert m["n"] >= 1 and 0 < m["p10"] <= m["median"] <= m["p90"]
    assert v["predicted_tokens_per_s"] > 0 and math.isfinite(v["rel_error_tokens_per_s"])
    assert math.isclose(v["rel_error_tokens_per_s"], v["predicted_tokens_per_s"] / m["median"] - 1)
    assert v["predicted_memory_bytes"] > 0
    if v["measured_peak_memory_bytes"] is None:  # the CPU has no allocator peak: no memory error either
        assert v["rel_error_memory"] is None and any("CUDA only" in n for n in doc["verify_notes"])
    else:
        assert v["measured_peak_memory_bytes"] > 0 and math.isfinite(v["rel_error_memory"])
    assert v["command"].startswith("scaletool train tiny") and "--set" in v["command"]
    assert list(tmp_path.iterdir()) == []  # the runs went to a temporary directory, removed


def test_verify_out_keeps_each_run_and_refuses_a_used_directory(tmp_path):
    """--verify-out DIR: each verified layout's run stays in DIR/layout<rank> with its summary.json (what
    calibrate --validate reads); a directory with something in it, a file, or no --verify: one error line, exit 2,
    nothing run or written."""
    keep = tmp_path / "kept"
    proc = run_cli("plan", "tiny", "--gpus", "1", "--verify", "1", "--verify-out", str(keep), "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    summary = json.loads((keep / "layout1" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["kind"] == "train"
    assert doc["verify"][0]["measured_tokens_per_s"]["median"] == pytest.approx(summary["timing"]["tokens_per_s"]["median"])
    assert any(str(keep) in n and "calibrate --validate" in n for n in doc["verify_notes"])
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    for argv, needle in ((["--verify", "1", "--verify-out", str(keep)], "not empty"),
                         (["--verify", "1", "--verify-out", str(a_file)], "not a directory"),
                         (["--verify-out", str(tmp_path / "new")], "needs --verify")):
        res = CliRunner().invoke(main, ["plan", "tiny", "--gpus", "1", *argv], prog_name="scaletool")
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert sorted(p.name for p in keep.iterdir()) == ["layout1"] and a_file.read_text() == "mine\n"
    assert not (tmp_path / "new").exists()


def test_verify_interrupted_keeps_what_it_measured_and_stops_the_run(tmp_path):
    """SIGTERM while the second layout trains: the first layout's measurement is delivered, the second and the
    rest are marked not run, exit status 130, and no process of the stopped run is left (a real subprocess)."""
    import signal
    import subprocess
    import time

    from conftest import ROOT

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "scaletool", "plan", "tiny", "--gpus", "2", "--verify", "3", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    seen = []
    for line in proc.stderr:  # each layout: a line before it, a line with its outcome after it
        seen.append(line)
        if line.startswith("verify 2/"):
            break
    else:
        pytest.fail("".join(seen))
    time.sleep(1)  # the second run has started (its outcome is not awaited: it is stopped either way)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + err
    doc = json.loads(out)
    first, *rest = doc["verify"]
    assert seen[1].startswith("verify 1: ") and "tok/s" in seen[1]
    assert first["status"] == "completed" and first["measured_tokens_per_s"]["n"] >= 1
    assert len(rest) == 2 and all(v["status"] == "not run" and v["measured_tokens_per_s"] is None for v in rest)
    assert any(n.startswith("interrupted during layout 2: 2 of 3 not run") for n in doc["verify_notes"])
    leftover = []
    for pid in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if str(tmp_path) in cmd:
            leftover.append(cmd)
    assert leftover == [] and list(tmp_path.glob("scaletool-verify-*")) == []  # its temporary runs removed


def test_a_stopped_verification_takes_its_whole_process_tree_with_it():
    """A run whose rank sits in a session of its own and ignores SIGTERM (as a torchrun worker in a long compile
    can): stopping the run leaves no process of it behind (real processes, real signals)."""
    import subprocess

    from scaletool.plan.verify import _alive, _stop

    rank = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(600)")
    agent = ("import subprocess, sys, time; "
             f"c = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True, stdout=subprocess.PIPE); "
             "c.stdout.readline(); print(c.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(proc.stdout.readline())
    assert _alive(worker)
    _stop(proc, grace_s=2)
    assert proc.returncode is not None and not _alive(worker)


def test_progress_line_goes_to_stderr_once_the_search_is_slow(capsys):
    from scaletool.cli.plan import Progress

    p = Progress(enabled=True)
    p.start -= 5  # as if the search had run for 5 s
    p.search(3, 10)
    p.done()
    err = capsys.readouterr().err
    assert "planning: 3/10" in err and err.endswith("\r\033[K")
    quiet = Progress(enabled=False)
    quiet.start -= 5
    quiet.search(3, 10)
    assert capsys.readouterr().err == ""


def test_python_api_plans_without_torch():
    code = ("import sys; from scaletool import api; r = api.plan('mla-1b', gpus=16); "
            "assert r.layouts and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    import subprocess
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_single_gpu_layouts_that_accumulate_cast_the_weights_once_per_step():
    """With a fixed global batch, ``single`` accumulates: its layouts run train.weight_cast=step (the same
    numbers, fewer casts), the estimate holds every gradient through the step, and the command says so;
    engines that do not take it run micro-batch even when the recipe says step."""
    doc = _plan("mha-1b", "--gpus", "1", "--global-batch-tokens", "262144", "--hardware", "h100-sxm", "--top", "50")
    rows = doc["layouts"]
    for row in rows:
        accumulating = row["engine"] == "single" and row["grad_accum_steps"] > 1
        assert row["weight_cast"] == ("step" if accumulating else "micro-batch"), row
        assert ("train.weight_cast=step" in _sets(row["argv"])) == accumulating
    top = rows[0]
    assert (top["engine"], top["micro_batch_size"], top["grad_accum_steps"]) == ("single", 16, 8)
    r = load_recipe("mha-1b", ["train.micro_batch_size=16", "train.grad_accum_steps=8", "train.weight_cast=step"])
    assert top["memory_bytes"] == recipe_memory(r, 1, compiled=True)["total_bytes"]
    load_recipe("mha-1b", _sets(top["argv"]))  # a command launch accepts
    kept = _plan("mha-1b", "--gpus", "1", "--global-batch-tokens", "262144", "--set", "train.weight_cast=micro-batch")
    assert {row["weight_cast"] for row in kept["layouts"]} == {"micro-batch"}
    two = _plan("mha-1b", "--gpus", "2", "--global-batch-tokens", "262144", "--set", "train.weight_cast=step",
                "--top", "50")
    assert all(row["weight_cast"] == "micro-batch" for row in two["layouts"])
    for row in two["layouts"]:
        load_recipe("mha-1b", _sets(row["argv"]))  # no layout keeps step under an engine that refuses it


def test_the_micro_batch_without_accumulation_is_checked_on_its_own():
    """With a fixed global batch, ``single`` holds every gradient through an accumulated step, so the micro-batch
    that needs no accumulation can fit where smaller ones do not: tiny at 8 positions with a wide FFN, 4
    sequences per step, on a card whose usable memory (less the 2 GiB reserve) sits between the two."""
    from scaletool.analytic.calibration import load_calibration
    from scaletool.plan.build import make_plan, make_request
    from scaletool.plan.space import Family, MemoryModel

    r = load_recipe("tiny", ["model.dtype=bf16", "train.seq_len=8", "model.intermediate_size=4096"])
    fam = Family("mla", "single", "single", 0, 1, "none", False)
    mem = MemoryModel(r, 1)
    whole, halves, quarters = mem.total(fam, 4, 1), mem.total(fam, 2, 2), mem.total(fam, 1, 4)
    assert whole < min(halves, quarters)
    card = 2 * 2**30 + (whole + min(halves, quarters)) // 2
    assert fits(whole, card)[0] and not fits(min(halves, quarters), card)[0]
    req = make_request(1, 1, "test card", card_bytes=card, calibration=load_calibration("h100-sxm"),
                       global_batch_tokens=32, labels=("single",), compiled=(False,), top=50)
    rows = make_plan(r, "tiny", (), req)["layouts"]
    none = [row for row in rows if row["activation_checkpointing"] == "none"]
    assert [(row["micro_batch_size"], row["grad_accum_steps"], row["weight_cast"]) for row in none] == [
        (4, 1, "micro-batch")]


def test_pipeline_and_expert_parallel_layouts_at_2048_gpus():
    """deepseek-v3 on 2,048 H100s: pipeline × expert-parallel layouts are searched and listed with their bubble and
    exposed all-to-all, the best with stages is set beside the best without, and its prediction is the one
    estimate makes for the recipe its command sets (one prediction per layout)."""
    res = _plan("deepseek-v3", "--gpus", "2048", "--top", "5")
    rows = res["layouts"]
    pp = [r for r in rows if r["pipeline_parallel"] > 1]
    assert pp and all(r["expert_parallel"] and r["exposed_all_to_all_s"] > 0 for r in pp)
    for r in pp:
        assert 0 < r["pipeline"]["bubble_fraction"] < 1 and r["pipeline"]["bubble_s"] > 0
        assert r["data_parallel"] * r["pipeline_parallel"] == 2048
        rec = load_recipe("deepseek-v3", _sets(r["argv"]))
        assert rec.engine_problems(2048) == [] and r["command_problems"] == []
        est = api.estimate(rec, world_size=2048)
        assert est.pipeline.step_s == pytest.approx(r["prediction"]["step_s"], rel=1e-9)
        assert est.prediction.rows[0]["tokens_per_s_per_gpu"] == pytest.approx(
            r["prediction"]["tokens_per_s_per_gpu"], rel=1e-9)
    cmp = res["pipeline_comparison"]
    assert cmp["with_pipeline"]["pipeline_parallel"] > 1 and cmp["without_pipeline"]["pipeline_parallel"] == 1
    assert cmp["speedup"] == pytest.approx(cmp["with_pipeline"]["tokens_per_s_per_gpu"]
                                           / cmp["without_pipeline"]["tokens_per_s_per_gpu"])


def test_estimate_of_a_pipeline_recipe_is_per_stage_and_refuses_stages_that_do_not_divide():
    """estimate with pipeline stages: its recipe memory is the largest stage's, its --json pipeline block names
    the stages; stages that do not divide --world-size are one error line before any prediction."""
    sets = ["--set", "parallel.engine=fsdp", "--set", "parallel.pipeline_parallel=2", "--set", "model.n_layers=4"]
    ok = run_cli("estimate", "tiny", *sets, "--world-size", "4", "--json")
    assert ok.returncode == 0, ok.stderr
    est = json.loads(ok.stdout)
    stages = est["pipeline"]["stages"]
    assert len(stages) == 2 and sorted(i for s in stages for i in s["layers"]) == [0, 1, 2, 3]
    assert est["memory"]["recipe"]["total_bytes"] == max(s["total_bytes"] for s in stages)
    assert est["pipeline"]["bounding_stage"] in (0, 1) and 0 < est["pipeline"]["bubble_fraction"] < 1
    bad = run_cli("estimate", "tiny", *sets, "--world-size", "3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: parallel.pipeline_parallel: 2 does not divide the world size 3 (pipeline ranks × data-parallel ranks) "
        "(set --world-size)"]


def test_layouts_predicted_within_the_models_error_are_said_to_be_unordered():
    """The listed layouts whose predicted tokens/s lie within the model's median |error| of the best are named
    in --json (``within_error``) and in a note; none when the first stands apart; the verify hint only where
    --verify can run them (one node)."""
    from scaletool.analytic.step import MEDIAN_ABS_ERROR
    from scaletool.plan.build import order_notes, within_error

    def rows(*rates):
        return [{"prediction": {"tokens_per_s_per_gpu": r}} for r in rates]
    e = MEDIAN_ABS_ERROR
    assert within_error(rows(100.0, 100.0 * (1 - e / 2), 100.0 * (1 - 2 * e))) == [1, 2]
    assert within_error(rows(100.0, 100.0 * (1 - 2 * e))) == []  # the first stands apart
    assert within_error(rows(100.0)) == [] and within_error([]) == [] and within_error(rows(0.0, 0.0)) == []
    assert "--verify 3" in order_notes([1, 2, 3], True)[0] and "--verify" not in order_notes([1, 2], False)[0]
    assert order_notes([], True) == []

    plan = _plan("mla-1b", "--gpus", "4", "--gpus-per-node", "4", "--hardware", "h200")
    best = plan["layouts"][0]["prediction"]["tokens_per_s_per_gpu"]
    expect = [row["rank"] for row in plan["layouts"]
              if row["prediction"]["tokens_per_s_per_gpu"] >= best * (1 - MEDIAN_ABS_ERROR)]
    assert plan["within_error"] == (expect if len(expect) > 1 else [])
    assert len(plan["within_error"]) > 1  # ZeRO-1 and ZeRO-2 are predicted alike: never ordered by the model
    (note,) = [n for n in plan["notes"] if "does not settle their order" in n]
    assert note.startswith(", ".join(f"#{r}" for r in plan["within_error"]))


def test_a_verified_run_whose_allocator_retried_says_so_and_is_not_claimed():
    from scaletool.plan.verify import outcome_line
    from scaletool.predict.claims import outside
    v = {"rank": 3, "layout": "fsdp mb12", "status": "completed", "message": None, "rel_error_tokens_per_s": 0.35,
         "measured_tokens_per_s": {"median": 17107, "p10": 16264, "p90": 17315, "n": 7},
         "measured_peak_memory_bytes": 1 << 37, "rel_error_memory": -0.001}
    assert "allocator" not in outcome_line(v) and "allocator retried 18 times" in outcome_line(v | {"alloc_retries": 18})
    row = {"predicted_step_s": 1.0, "float8": "none", "moe_dispatch": None, "async_tp": False, "tp_local_ops": False}
    assert outside(row) is None and outside(row | {"alloc_retries": 0}) is None
    assert outside(row | {"alloc_retries": 18}) == "allocator"
