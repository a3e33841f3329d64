"""``scaletool calibrate`` end to end on the CPU: two real gloo processes measure the collectives, the
written file loads, and the step-time model runs on it; bad input is one error line and exit 2."""
from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_cli

from scaletool.analytic.calibration import load_calibration
from scaletool.analytic.host import TP_STEP_PARTS, tp_step_dispatch_s, tp_step_key
from scaletool.analytic.pipeline_time import pipeline_step
from scaletool.analytic.step import predict_step
from scaletool.config import load_recipe
from scaletool.predict.calibrate import REPS, fit_gemm_curve
from scaletool.predict.calibrate_comm import SPAWN_ATTEMPTS
from scaletool.predict.calibrate_tp import unresolved


@pytest.mark.distributed
def test_calibrate_on_cpu_with_two_processes_writes_a_calibration_the_model_reads(tmp_path):
    out = tmp_path / "cal.yaml"
    res = run_cli("calibrate", "--device", "cpu", "--gpus", "2", "--recipe", "tiny", "--out", str(out), "--json",
                  timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    printed = json.loads(res.stdout)
    assert printed["path"] == str(out)
    cal = load_calibration(str(out))
    raw = yaml.safe_load(out.read_text())
    m = raw["measured"]
    assert m["device"] == "cpu" and m["torch"] and m["date"] and "--gpus 2" in m["command"]
    assert {"median", "p10", "p90", "n"} <= set(m["hbm"]["gb_s"]) and m["hbm"]["gb_s"]["n"] == REPS
    assert all(g["tflops"]["n"] == REPS for g in m["gemm"])
    # the tiny recipe's own GEMM shapes were timed (d_model 64 -> FFN 192), and its attention head dims
    assert any((g["n"], g["k"]) == (192, 64) for g in m["gemm"])
    assert list(cal.attention_tflops)[0] == "24/16"
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert m["collectives"][op]["2"]["bus_gb_s"]["n"] == REPS, op
        assert cal.bus_bandwidth(op, 2) > 0
    assert cal.collectives["source"].startswith("measured gloo over 2")
    # the tiny recipe's eager block issue time, both ways an engine runs it, became overheads the model reads
    host = m["host_dispatch"]
    assert host["attention"] == "mla" and host["blocks"] == [1, 3]
    for mode in ("autocast", "bf16"):
        assert cal.overheads[f"eager_{mode}_block_mla_s"] == pytest.approx(max(0.0, host[mode]["block_s"]), abs=1e-6)
        assert host["per_process"][0][mode]["block_s"]["n"] > 1
    # with two processes: the tiny recipe's tensor-parallel block issue time per micro-batch (TP 2 over gloo, eager
    # on the CPU), an overhead the pipeline charges on each micro-batch of a PP x TP stage
    tp = m["tp_dispatch"]
    assert "skipped" not in tp, tp
    assert tp["tensor_parallel"] == 2 and tp["blocks"] == [1, 3] and "compiled" not in tp
    per_block = cal.overheads["tp_eager_microbatch_block_mla_s"]
    assert per_block == pytest.approx(max(0.0, tp["eager"]["block_s"]["median"]), abs=1e-6)
    assert tp["eager"]["block_s"]["n"] > 1 and len(tp["eager"]["iteration_s"]["3"]) == tp["eager"]["block_s"]["n"]
    # and the whole step's parts through the engine's train_step (TP over both ranks), which the model reads for TP
    # where each was told apart from the noise (calibrate_tp.unresolved), else recorded with the reason, not written
    step = tp["eager"]["step"]
    assert sorted(step["step_s"]) == ["1 blocks x 1", "1 blocks x 2", "3 blocks x 1", "3 blocks x 2"]
    assert step.get("unresolved") == unresolved({p: step[p] for p in TP_STEP_PARTS})
    for part in TP_STEP_PARTS:
        written = cal.overheads.get(tp_step_key(part, "eager", "mla"))
        assert written == (None if "unresolved" in step else pytest.approx(max(0, step[part]["value"]), abs=1e-6))
        assert step[part]["n"] == len(step["step_s"]["1 blocks x 1"]) > 1
    pure = load_recipe("tiny", ["parallel.engine=fsdp", "parallel.tensor_parallel=2", "train.compile=false"])
    measured = tp_step_dispatch_s(pure.model.n_layers, pure.train.grad_accum_steps, "eager", "mla", cal)
    assert (measured is None) == ("unresolved" in step)
    if measured is not None:
        assert predict_step(pure, cal, world_size=2)["terms"]["tp_dispatch_s"] == pytest.approx(measured, abs=1e-9)
    staged = load_recipe("tiny", ["parallel.engine=fsdp", "parallel.pipeline_parallel=2", "parallel.tensor_parallel=2",
                                  "train.micro_batch_size=4", "parallel.pipeline_microbatches=4", "train.compile=false"])
    ranks = pipeline_step(staged, cal, world_size=4, gpus_per_node=4, compiled=False)["ranks"]
    assert [r["tp_dispatch_s"] for r in ranks] == pytest.approx([4 * per_block * r["layers"] for r in ranks])
    recipe = load_recipe("tiny", ["parallel.engine=ddp"])
    pred = predict_step(recipe, cal, world_size=2)
    assert pred["step_s"] > 0 and pred["terms"]["comm/dp.all_reduce_total_s"] > 0
    assert pred["calibration"] == cal.source


def test_gemm_curve_fit_recovers_a_saturating_rate():
    pts = [{"m": s, "n": s, "k": s, "tflops": {"median": 800 * s / (s + 300)}} for s in (256, 1024, 4096)]
    fit = fit_gemm_curve(pts)
    assert fit["max_tflops"] == pytest.approx(800, rel=1e-6) and fit["half_dim"] == pytest.approx(300, rel=1e-6)
    flat = [{"m": s, "n": s, "k": s, "tflops": {"median": 5.0 - s / 1e4}} for s in (64, 128)]  # no saturation
    assert fit_gemm_curve(flat)["half_dim"] == 1.0


def test_gemm_curve_fit_leaves_out_launch_bound_points():
    """A 1024³ GEMM timed at 117 TFLOP/s (18 µs: the launch, not the rate) does not drag the curve down."""
    pts = [{"m": s, "n": s, "k": s, "tflops": {"median": 800 * s / (s + 300)}} for s in (2048, 4096, 8192)]
    fast = {"m": 1024, "n": 1024, "k": 1024, "tflops": {"median": 117.0}}
    fit = fit_gemm_curve([*pts, fast])
    assert fit["max_tflops"] == pytest.approx(800, rel=1e-6) and fit["half_dim"] == pytest.approx(300, rel=1e-6)
    kept = fit_gemm_curve([pts[0], fast])  # one timed point left: all are kept, the fast one pulls the curve
    assert kept["max_tflops"] < 0.9 * fit["max_tflops"]


@pytest.mark.parametrize("args, says", [
    (["--device", "cpu", "--out", "{tmp}"], "is a directory"),
    (["--device", "cpu", "--set", "train.micro_batch_size=2"], "--set needs --recipe"),
    (["--device", "cpu", "--recipe", "no-such-recipe"], "no-such-recipe"),
    (["--calibration", "h200"], "go with --validate"),
    (["--validate", "--calibration", "b200"], "known ones are"),
])
def test_bad_input_is_one_error_line(tmp_path, args, says):
    res = run_cli("calibrate", *[a.replace("{tmp}", str(tmp_path)) for a in args], cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], res.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_validate_prints_predicted_against_measured_for_given_results(tmp_path):
    from scaletool.predict.validation import committed_paths
    from scaletool.records import read_record

    committed = next(p for p in committed_paths() if p.name == "mha-1b-single.json")
    path = tmp_path / committed.name  # as unpack writes it from its run folder's bundle
    path.write_text(read_record(committed))
    res = run_cli("calibrate", "--validate", str(path), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    (run,) = out["runs"]
    assert run["calibration"] == "H100 SXM" and abs(run["rel_error"]) < 0.1
    assert out["summary"]["all"]["n"] == 1
    text = run_cli("calibrate", "--validate", str(path))
    assert "mha-1b-single " in text.stdout and "median |error|" in text.stdout  # a result file by its name
    # piped (1000 columns available): the run column is as wide as its names, not padded to the width
    table = text.stdout.split("meas., pred.")[0].splitlines()
    assert table and max(len(line) for line in table) <= 100, max(table, key=len)


def test_validate_with_no_training_run_says_where_runs_come_from(tmp_path):
    other = tmp_path / "decode.json"
    other.write_text(json.dumps({"kind": "decode", "points": []}))
    text = run_cli("calibrate", "--validate", str(other))
    assert text.returncode == 0, text.stderr
    assert "no GPU training run to re-predict" in text.stdout and "PATHS" in text.stdout


def test_attention_is_timed_with_the_recipes_key_value_heads(monkeypatch):
    """GQA and MQA recipes attend with fewer key/value heads (``enable_gqa``); the calibration times that
    kernel, not an MHA-shaped one, and records the heads it used. On the CPU the query heads are cut to 4 and
    the group size kept where it fits."""
    import torch

    from scaletool.predict import calibrate as cal_mod

    with pytest.raises(ValueError, match="do not divide"):
        cal_mod.measure_attention(4, 16, 16, 16, 1, torch.device("cpu"), torch.float32, kv_heads=3)
    r = cal_mod.measure_attention(4, 16, 16, 16, 1, torch.device("cpu"), torch.float32, kv_heads=2)
    assert r["kv_heads"] == 2 and r["heads"] == 4 and r["tflops"]["n"] > 0
    assert cal_mod.measure_attention(4, 16, 16, 16, 1, torch.device("cpu"), torch.float32)["kv_heads"] == 4

    llama, mha = load_recipe("llama3-8b").model, load_recipe("mha-1b").model
    assert cal_mod.kv_heads_of(llama, 32) == 8 and cal_mod.kv_heads_of(llama, 4) == 1
    assert cal_mod.kv_heads_of(mha, 16) == 16 and cal_mod.kv_heads_of(load_recipe("mla-1b").model, 16) == 16
    assert cal_mod.kv_heads_of(None, 16) == 16

    seen = []
    real = cal_mod.measure_attention
    monkeypatch.setattr(cal_mod, "measure_attention", lambda *a, **k: seen.append(k) or real(*a, **k))
    monkeypatch.setattr(cal_mod, "measure_block_dispatch", lambda *a, **k: None)  # another test's subject
    out = cal_mod.calibrate(torch.device("cpu"), recipe=load_recipe("tiny", ["model.attention=gqa", "model.n_kv_heads=2"]))
    assert seen and all(k.get("kv_heads") == 2 for k in seen)
    assert [a["kv_heads"] for a in out["measured"]["attention"]] == [2] * len(seen)


def test_alibi_attention_is_timed_with_the_dense_bias_training_passes(monkeypatch):
    """``alibi=True`` times SDPA as ALiBi training calls it: the (1, H, T, T) score bias with the causal mask folded
    in as ``attn_mask`` and no causal flag (no kernel can skip the masked half); the rate keeps the causal FLOPs."""
    import torch
    import torch.nn.functional as F

    from scaletool.model.positions import alibi_bias, alibi_slopes
    from scaletool.predict import calibrate as cal_mod

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(kw)
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    plain = cal_mod.measure_attention(4, 16, 16, 32, 1, torch.device("cpu"), torch.float32)
    assert calls and all(c["attn_mask"] is None and c["is_causal"] for c in calls) and "alibi" not in plain
    calls.clear()
    r = cal_mod.measure_attention(4, 16, 16, 32, 1, torch.device("cpu"), torch.float32, kv_heads=2, alibi=True)
    assert r["alibi"] is True and r["kv_heads"] == 2 and r["tflops"]["n"] > 0
    mask = calls[0]["attn_mask"]
    want = alibi_bias(alibi_slopes(4), torch.arange(32), 32, causal=True)
    assert all(c["is_causal"] is False and c["enable_gqa"] for c in calls)
    assert mask.shape == (1, 4, 32, 32) and torch.equal(mask, want)
    assert torch.isinf(mask[0, :, 0, 1:]).all() and mask[0, 1, 5, 2].item() == -3 * alibi_slopes(4)[1].item()


def test_an_alibi_recipe_is_calibrated_and_predicted_on_its_bias_path(monkeypatch, tmp_path):
    """An ALiBi recipe's calibration also times the dense-bias path (``attention_tflops.alibi``); the step model
    charges ALiBi's attention at that rate (the causal rate over ALIBI_OVER_CAUSAL_TIME where a calibration has
    none), RoPE's at the causal one; a table of only ``alibi`` is refused."""
    import dataclasses

    import torch
    import yaml

    from scaletool.analytic.calibration import ALIBI_OVER_CAUSAL_TIME, load_calibration
    from scaletool.analytic.step import predict_step
    from scaletool.errors import RecipeError
    from scaletool.predict import calibrate as cal_mod

    monkeypatch.setattr(cal_mod, "measure_block_dispatch", lambda *a, **k: None)  # another test's subject
    alibi = load_recipe("tiny", ["model.attention=mha", "model.position_encoding=alibi"])
    out = cal_mod.calibrate(torch.device("cpu"), recipe=alibi)
    assert out["attention_tflops"]["alibi"] > 0 and [a.get("alibi", False) for a in out["measured"]["attention"]] == [
        False, True]
    assert "alibi" not in cal_mod.calibrate(torch.device("cpu"), recipe=load_recipe("tiny"))["attention_tflops"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(out))
    cal = load_calibration(str(path))
    assert cal.attention_rate(64, 64, 128, bias=True) == pytest.approx(out["attention_tflops"]["alibi"] * 1e12)

    rope = load_recipe("tiny", ["model.attention=mha"])
    plain = dataclasses.replace(cal, attention_tflops={"default": 100.0})
    biased = dataclasses.replace(cal, attention_tflops={"default": 100.0, "alibi": 20.0})
    att = {name: predict_step(r, c)["terms"]["attention_s"]
           for name, r, c in (("rope", rope, plain), ("derived", alibi, plain), ("measured", alibi, biased))}
    assert att["derived"] == pytest.approx(ALIBI_OVER_CAUSAL_TIME * att["rope"])
    assert att["measured"] == pytest.approx(5 * att["rope"])
    path.write_text(yaml.safe_dump(out | {"attention_tflops": {"alibi": 20.0}}))
    with pytest.raises(RecipeError, match="attention_tflops"):
        load_calibration(str(path))


def test_the_tp_probe_says_why_it_did_not_run_and_the_calibration_goes_on(monkeypatch):
    """No process is started for a model whose three blocks would not fit the probe's share of memory, or that TP 2
    cannot split (one head); a probe whose processes fail is started again, and one that fails every time leaves
    a reason, not a failed calibration."""
    import torch
    from torch.multiprocessing.spawn import ProcessExitedException

    from scaletool.predict import calibrate as cal_mod
    from scaletool.predict import calibrate_tp

    def never(*a, **k):
        raise AssertionError("no probe process for this recipe")

    monkeypatch.setattr(calibrate_tp, "measure_tp_dispatch", never)
    cpu = torch.device("cpu")
    assert "over the" in cal_mod._tp_dispatch(load_recipe("deepseek-v3"), cpu)["skipped"]
    assert "heads do not split" in cal_mod._tp_dispatch(load_recipe("tiny", ["model.n_heads=1"]), cpu)["skipped"]

    calls = []

    def dies(*a, **k):
        calls.append(1)
        raise ProcessExitedException(f"process 1 terminated with exit code {len(calls)}", 1, 1, 1)

    monkeypatch.setattr(calibrate_tp, "measure_tp_dispatch", dies)
    said = cal_mod._tp_dispatch(load_recipe("tiny"), cpu)
    assert len(calls) == SPAWN_ATTEMPTS == 3
    assert said["skipped"] == "not measured: the probe failed 3 times (last: process 1 terminated with exit code 3)"
    assert said["failed_attempts"] == [f"process 1 terminated with exit code {i}" for i in (1, 2, 3)]

    def dies_once(*a, **k):  # a process that dies once: the next start measures, and the failure is kept
        calls.append(1)
        if len(calls) == 4:
            raise ProcessExitedException("process 0 terminated with signal SIGSEGV", 0, -11, 11)
        return {"tensor_parallel": 2}

    monkeypatch.setattr(calibrate_tp, "measure_tp_dispatch", dies_once)
    assert cal_mod._tp_dispatch(load_recipe("tiny"), cpu) == {
        "tensor_parallel": 2, "failed_attempts": ["process 0 terminated with signal SIGSEGV"]}


@pytest.mark.distributed
def test_collectives_whose_processes_die_once_are_measured_on_the_next_start(monkeypatch):
    """Two real gloo processes measure all-reduce after a start that failed; the failure is kept. Processes
    that fail every start raise the last failure (calibrate then says it in one error line)."""
    from torch.multiprocessing.spawn import ProcessExitedException

    from scaletool.predict import calibrate_comm

    real, starts = calibrate_comm.mp.start_processes, []

    def dies_first(*a, **k):
        starts.append(1)
        if len(starts) == 1:
            raise ProcessExitedException("process 1 terminated with signal SIGKILL", 1, -9, 9)
        return real(*a, **k)

    monkeypatch.setattr(calibrate_comm.mp, "start_processes", dies_first)
    out = calibrate_comm.measure_collectives(2, (1 << 16,), ("all_reduce",))
    assert len(starts) == 2 and out["failed_attempts"] == ["process 1 terminated with signal SIGKILL"]
    assert out["ops"]["all_reduce"]["2"]["bus_gb_s"]["n"] == REPS

    def always(*a, **k):
        starts.append(1)
        raise ProcessExitedException(f"process 0 terminated with exit code {len(starts)}", 0, 1, 1)

    monkeypatch.setattr(calibrate_comm.mp, "start_processes", always)
    with pytest.raises(ProcessExitedException, match="exit code 5"):
        calibrate_comm.measure_collectives(2, (1 << 16,), ("all_reduce",))
    assert len(starts) == 2 + SPAWN_ATTEMPTS


def test_collectives_that_fail_every_start_are_one_error_line_and_nothing_written(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from torch.multiprocessing.spawn import ProcessExitedException

    from scaletool.cli import main
    from scaletool.predict import calibrate_comm

    def always(*a, **k):
        raise ProcessExitedException("process 1 terminated with signal SIGKILL", 1, -9, 9)

    monkeypatch.setattr(calibrate_comm.mp, "start_processes", always)
    out = tmp_path / "cal.yaml"
    res = CliRunner().invoke(main, ["calibrate", "--device", "cpu", "--gpus", "2", "--out", str(out)])
    assert res.exit_code == 1, res.output
    assert res.output.splitlines() == [
        "error: --gpus 2: the collectives' processes failed 3 times (last: process 1 terminated with signal SIGKILL); "
        "nothing written"]
    assert not out.exists() and list(tmp_path.iterdir()) == []
