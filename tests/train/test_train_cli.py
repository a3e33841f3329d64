"""`scaletool train` in one process (engine single) through click's CliRunner: outputs, errors, resume,
callbacks, data sources and the summary's contract."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from scaletool import api
from scaletool.cli import main
from scaletool.config import load_recipe
from scaletool.train.callbacks import Callback

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = str(RECIPES / "tiny.yaml")
FAST = ["train.steps=6", "train.measure_warmup_steps=1"]


def train(tmp_path, *sets, args=(), recipe=TINY, out="run"):
    cmd = ["train", recipe, "--out", str(tmp_path / out), "--json", *args]
    for s in (*FAST, *sets):
        cmd += ["--set", s]
    return CliRunner().invoke(main, cmd)


def summary_of(result) -> dict:
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_summary_has_the_contracted_keys_and_files(tmp_path):
    s = summary_of(train(tmp_path, args=("--peak-tflops", "0.5")))
    for key in ("tokens_per_s", "mfu", "peak_memory_bytes", "loss_first", "loss_last", "recipe", "environment"):
        assert key in s
    assert s["kind"] == "train" and s["schema_version"] == 2
    timing = s["timing"]
    assert s["status"] == "completed" and s["steps_completed"] == 6 and timing["warmup_steps_excluded"] >= 1
    assert s["measured_steps"] == timing["step_s"]["n"] == 6 - timing["warmup_steps_excluded"]
    # throughput and MFU from the median step, with the per-step spread beside it
    assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / timing["step_s"]["median"])
    assert timing["tokens_per_s"]["p10"] <= s["tokens_per_s"] <= timing["tokens_per_s"]["p90"]
    assert s["tokens_per_s_spread"] == pytest.approx(timing["tokens_per_s"]["p90"] / timing["tokens_per_s"]["p10"] - 1)
    assert s["peak_memory_bytes"] is None and s["threads"] >= 1  # CPU: allocator peaks are CUDA's
    m = s["metrics"]
    assert s["mfu"] == m["flops/mfu"] == pytest.approx(m["flops/achieved_tflops_per_gpu"] / 0.5)
    assert s["mfu_full_attention"] == m["flops/mfu_full_attention"] > s["mfu"]  # full attention: twice the scores
    tpg = m["throughput/tokens_per_s_per_gpu"]
    assert m["flops/achieved_tflops_per_gpu"] == pytest.approx(tpg * s["flops_per_token"]["train"] / 1e12)
    assert s["flops_per_token"]["convention"] == "causal"
    assert s["memory"]["analytic"]["total_bytes"] > 0 and s["environment"]["world_size"] == 1
    assert s["recipe"]["train"]["steps"] == 6 and s["hardware"]["source"] == "--peak-tflops"
    out = tmp_path / "run"
    assert json.loads((out / "summary.json").read_text())["loss_last"] == s["loss_last"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6)) and all("loss/train" in r and "time/step_s" in r for r in rows)
    assert any((out / "tensorboard").iterdir()) and "done: 6 steps" in (out / "train.log").read_text()


def test_cpu_without_peak_gives_null_mfu_and_a_warning(tmp_path):
    r = train(tmp_path)
    s = summary_of(r)
    assert s["mfu"] is None and s["metrics"]["flops/mfu_full_attention"] is None
    assert "no CPU peak is assumed" in s["hardware"]["warning"]
    assert "warning: no CPU peak" in (tmp_path / "run" / "train.log").read_text()


def test_accumulation_and_no_measure_keep_the_loss_curve(tmp_path):
    ref = summary_of(train(tmp_path, "train.micro_batch_size=8", out="a"))
    acc = summary_of(train(tmp_path, "train.micro_batch_size=2", "train.grad_accum_steps=4", out="b"))
    bare = summary_of(train(tmp_path, "train.micro_batch_size=8", args=("--no-measure",), out="c"))
    assert acc["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-5)
    assert bare["history"]["loss"] == ref["history"]["loss"]
    assert bare["tokens_per_s"] > 0 and bare["history"]["step_time_s"] == [None] * 6
    assert not (tmp_path / "c" / "tensorboard").exists()


def test_same_seed_reproduces_and_another_seed_differs(tmp_path):
    a = summary_of(train(tmp_path, "model.dropout=0.1", out="a"))
    b = summary_of(train(tmp_path, "model.dropout=0.1", out="b"))
    c = summary_of(train(tmp_path, "model.dropout=0.1", "train.seed=7", out="c"))
    assert a["history"]["loss"] == b["history"]["loss"]
    assert a["history"]["loss"] != c["history"]["loss"]


def test_resume_single_and_fp16_bf16_and_activation_checkpointing(tmp_path):
    sets = ("train.checkpoint_every=2", "model.dtype=bf16", "train.activation_checkpointing=selective",
            "train.selective_every=1")
    full = summary_of(train(tmp_path, *sets, out="full"))
    assert full["loss_last"] < full["loss_first"]
    (tmp_path / "full" / "checkpoints" / "step_6" / "trainer.json").unlink()  # damaged after it was written
    (tmp_path / "full" / "summary.json").unlink()  # as if the run had been killed there
    r = train(tmp_path, *sets, args=("--resume",), out="full")
    res = summary_of(r)
    assert f"warning: skipping checkpoint {tmp_path / 'full' / 'checkpoints' / 'step_6'}: trainer.json is missing" \
        in (tmp_path / "full" / "train.log").read_text()
    assert res["resumed_from"].endswith("step_4") and res["start_step"] == 4
    assert res["history"]["loss"] == pytest.approx(full["history"]["loss"], rel=1e-6)
    fp16 = summary_of(train(tmp_path, "model.dtype=fp16", "train.activation_checkpointing=full", out="fp16"))
    assert fp16["loss_last"] < fp16["loss_first"]


def test_nan_loss_stops_with_the_step_and_keeps_the_summary(tmp_path):
    r = train(tmp_path, "train.lr=1.0e+12", "train.grad_clip=0", "train.warmup_steps=0")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(("error: loss is nan at step ", "error: loss is inf at step "))
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"] == "diverged" and f"at step {s['steps_completed'] - 1}" in s["message"]


@pytest.mark.parametrize("sets, expected", [
    (("parallel.zero_stage=2",), "parallel.zero_stage: only used by engine=deepspeed, but parallel.engine=single"),
    (("parallel.engine=deepspeed", "parallel.deepspeed={gradient_clipping: 0.5}"),
     "parallel.deepspeed.gradient_clipping=0.5 conflicts with train.grad_clip (= 1.0); set it in one place"),
    (("parallel.engine=deepspeed", "parallel.deepspeed={scheduler: {type: WarmupLR}}"),
     "parallel.deepspeed.scheduler: the learning-rate schedule comes from train.lr"),
    (("parallel.cpu_offload=true",), "parallel.cpu_offload: only used by engine=fsdp"),
    (("data.source=tokens", "data.path=/nonexistent/tokens.bin"), "data.path: /nonexistent/tokens.bin: no such file"),
    (("data.source=text", "data.path=" + TINY), "model.vocab_size: 256 is too small for the byte-level tokenizer"),
])
def test_bad_configs_fail_with_one_clear_line(tmp_path, sets, expected):
    r = train(tmp_path, *sets)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


def test_resume_without_checkpoint_is_one_line_and_creates_nothing(tmp_path):
    r = train(tmp_path, args=("--resume",), out="empty")
    assert r.exit_code == 2 and r.stderr.strip().count("\n") == 0 and "no complete checkpoint" in r.stderr
    assert not (tmp_path / "empty").exists()


def test_text_tokens_and_regression_sources_train(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    s = summary_of(train(tmp_path, "data.source=text", f"data.path={text}", "model.vocab_size=257", out="text"))
    assert s["loss_last"] < s["loss_first"] - 0.5
    for dtype in ("uint16", "uint32"):
        tok = tmp_path / f"tokens.{dtype}"
        np.tile(np.arange(40, dtype=dtype), 200).tofile(tok)
        s = summary_of(train(tmp_path, "data.source=tokens", f"data.path={tok}", f"data.token_dtype={dtype}",
                             out=dtype))
        assert s["loss_last"] < s["loss_first"] - 0.5
    bad = tmp_path / "big.uint16"
    np.array([300] * 100, dtype=np.uint16).tofile(bad)
    r = train(tmp_path, "data.source=tokens", f"data.path={bad}", out="bad")
    assert r.exit_code == 2 and "token id 300" in r.stderr and "model.vocab_size=256" in r.stderr
    small = ("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.kv_lora_rank=16",
             "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
             "model.intermediate_size=64", "model.dropout=0", "train.seq_len=24", "train.micro_batch_size=16",
             "train.lr=3.0e-3", "train.steps=16")
    s = summary_of(train(tmp_path, *small, recipe=str(RECIPES / "price-transformer.yaml"), out="reg"))
    assert s["loss_last"] < 0.8 * s["loss_first"]
    csv = tmp_path / "series.csv"
    rng = np.random.default_rng(0)
    walk = np.cumsum(rng.normal(size=(200, 20)), axis=0)
    np.savetxt(csv, walk, delimiter=",", header=",".join(f"f{i}" for i in range(20)), comments="")
    s = summary_of(train(tmp_path, *small, "data.source=csv", f"data.path={csv}",
                         recipe=str(RECIPES / "price-transformer.yaml"), out="csv"))
    assert s["status"] == "completed" and s["loss_last"] < s["loss_first"]


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_train_start(self, info):
        self.calls.append(("start", info.env.world_size))

    def on_step_start(self, step):
        self.calls.append(("step_start", step))

    def on_step_end(self, step, state):
        self.calls.append(("step_end", step))
        return {"probe/loss_copy_nats": float(state.loss)} if step == 2 else None

    def on_train_end(self, result):
        result.probe = {"steps_seen": sum(1 for c in self.calls if c[0] == "step_end")}


class OnlyEnd(Callback):
    def on_train_end(self, result):
        result.metrics["probe/x"] = 1.0


def test_callbacks_plug_in_without_touching_the_trainer(tmp_path):
    rec = Recorder()
    s = api.train(load_recipe(TINY, FAST), out=tmp_path, quiet=True, callbacks=[rec, OnlyEnd()])
    assert rec.calls[0] == ("start", 1) and rec.calls[1:3] == [("step_start", 0), ("step_end", 0)]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["probe"] == {"steps_seen": 6} and saved["metrics"]["probe/x"] == 1.0 and s.probe == saved["probe"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    probe = [row for row in rows if "probe/loss_copy_nats" in row]
    assert probe and probe[0]["step"] == 2 and probe[0]["probe/loss_copy_nats"] == pytest.approx(s.history.loss[2])


def test_help_teaches():
    r = CliRunner().invoke(main, ["train", "--help"])
    assert r.exit_code == 0
    for word in ("--nproc-per-node", "--resume", "--peak-tflops", "fsdp", "deepspeed", "summary.json"):
        assert word in r.output


def _step_lines(out: Path) -> list[str]:
    return [line for line in (out / "train.log").read_text().splitlines() if line.startswith("step ")]


def test_step_lines_carry_peak_memory_and_mfu_where_a_peak_is_known(tmp_path):
    """Every log interval, a line as torchtitan prints it: loss, peak memory, tokens/s, MFU (from the card's
    peak; a CPU has none, so the line says nothing of MFU rather than invent one)."""
    summary_of(train(tmp_path, "train.log_every=3", args=("--peak-tflops", "0.5"), out="peak"))
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "peak" / "metrics.jsonl").read_text().splitlines())}
    lines = _step_lines(tmp_path / "peak")
    assert [int(line.split()[1]) for line in lines] == [2, 5]
    for line in lines:
        row = rows[int(line.split()[1])]
        assert row["flops/mfu"] > 0
        assert f"loss {row['loss/train']:.4f}" in line and f"mfu {100 * row['flops/mfu']:.1f}%" in line
        assert f"tok/s {row['throughput/tokens_per_s']:,.0f}" in line
        assert row["memory/max_rss_bytes"] > 2**20 and f"rss {row['memory/max_rss_bytes'] / 2**30:.2f} GiB" in line
    s = json.loads((tmp_path / "peak" / "summary.json").read_text())
    for row in rows.values():  # MFU of a step: its tokens/s per GPU × training FLOPs per token over the peak
        assert row["flops/mfu"] == pytest.approx(row["throughput/tokens_per_s"] * s["flops_per_token"]["train"]
                                                 / 1e12 / 0.5)
    summary_of(train(tmp_path, "train.log_every=3", out="cpu"))
    lines = _step_lines(tmp_path / "cpu")
    assert len(lines) == 2 and all("mfu" not in line and "TFLOP" not in line and "tok/s" in line for line in lines)
    assert all("flops/mfu" not in json.loads(r) for r in (tmp_path / "cpu" / "metrics.jsonl").read_text().splitlines())
