"""The typed train result: summaries written before it (schema 1, no ``kind``) still load, with their
recorded figures kept and the timing derived from their step times; today's round-trip exactly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletool import records
from scaletool.results import ResultLoadError, load_result
from scaletool.results.train import TrainResult, load_train_summary, timing_of
from scaletool.stats import settled_start

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
# the schema-1 train summaries of the first single-run studies, and every committed sweep record
OLD_SUMMARIES = [p for study in ("single-gpu", "two-gpu", "moe") for p in records.glob(BENCH / "results" / study, "*/*.json")
                 if "loss_first" in records.read_record(p)]
OLD_RECORDS = [(p.name, i, rec["result"]) for p in records.glob(BENCH / "results", "*/*/*.results.jsonl")
               for i, rec in enumerate(map(json.loads, records.read_record(p).splitlines()))
               if rec.get("mode") == "train" and rec.get("result")]


def test_there_are_old_documents_to_load():
    assert len(OLD_SUMMARIES) >= 10 and len(OLD_RECORDS) >= 20


@pytest.mark.parametrize("path", OLD_SUMMARIES, ids=lambda p: p.name)
def test_schema_1_summaries_load_in_todays_convention(path):
    raw = json.loads(records.read_record(path))
    r = load_train_summary(raw, str(path))
    assert isinstance(r, TrainResult) and r.schema_version == 2 and r.kind == "train" and r.status == raw["status"]
    times = [t for s, t in zip(raw["history"]["step"], raw["history"]["step_time_s"]) if s >= raw["start_step"]]
    if all(t is not None for t in times):  # derived by today's rule from the recorded step times
        assert r.timing.step_s.n == r.measured_steps == len(times) - settled_start(times, raw["measure_warmup_steps"])
        assert r.timing.rule.startswith("derived on load from a schema-1 summary")
        assert r.tokens_per_s == r.timing.tokens_per_s.median  # the median step, like new results
        assert r.tokens_per_s_spread == pytest.approx(r.timing.tokens_per_s.ratio_spread)
        assert r.metrics["throughput/tokens_per_s_window"] == raw["tokens_per_s"]  # what was recorded, kept
        scale = r.tokens_per_s / raw["tokens_per_s"]
        for new, old in ((r.mfu, raw["mfu"]), (r.mfu_full_attention, raw["metrics"]["flops/mfu_full_attention"])):
            assert new == (pytest.approx(old * scale) if old else old)  # MFU is proportional to tokens/s
    else:  # --no-measure: nothing to derive a spread from, the recorded figures stand
        assert r.timing.step_s is None and r.tokens_per_s == raw["tokens_per_s"] and r.mfu == raw["mfu"]


@pytest.mark.parametrize("name, index, result", OLD_RECORDS, ids=[f"{n}:{i}" for n, i, _ in OLD_RECORDS])
def test_old_sweep_records_load(name, index, result):
    assert load_train_summary(result, f"{name}:{index}").status in ("completed", "diverged", "failed")


def test_todays_result_round_trips_and_a_newer_one_is_refused():
    r = TrainResult(status="completed", tokens_per_s=10.0, timing=timing_of([1.0, 0.5, 0.5, 0.5, 0.6], 1, 256),
                    profile={"breakdown": "x"}, probe={"anything": 1})
    again = load_result(json.loads(r.to_json()))
    assert again == r and again.probe == {"anything": 1} and again.timing.step_s.median == 0.5
    with pytest.raises(ResultLoadError, match="schema version 3 was written by a newer scaletool"):
        load_result({**json.loads(r.to_json()), "schema_version": 3})
    with pytest.raises(ResultLoadError, match="a decode result, not a train summary|unknown result kind"):
        load_train_summary({"kind": "decode"})


def test_timing_excludes_warmup_by_rule_and_says_so():
    t = timing_of([5.0, 3.0, 2.0, 1.0, 1.1, 0.9, 1.0, 1.0], 1, 100)
    assert t.warmup_steps_excluded == 3 and t.step_s.n == 5 and t.step_s.median == 1.0
    assert t.tokens_per_s.median == 100.0 and "measure_warmup_steps" in t.rule
    assert timing_of([None, None], 1, 100).step_s is None
