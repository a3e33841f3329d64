"""DecodeResult: documents written before typed results still load (schema 1 -> 2)."""
from __future__ import annotations

import json

import pytest
from conftest import ROOT, unpacked_fixture

from scaletool import records
from scaletool.results import ResultLoadError, load_result
from scaletool.results.decode import DecodeResult

RESULTS = ROOT / "benchmarks" / "results"
OLD = [RESULTS / "decode" / "h200-2026-11-26" / f"{name}.json" for name in ("mha-1b", "mla-1b", "mla-1b-torch", "mla-1b-naive")]
NEW = [p for p in records.glob(RESULTS, "decode/h[12]00-*/m[hl]a-1b-*.json") if p not in OLD]  # loose or bundled


def _fixture_decode_results():
    lines = (unpacked_fixture("tiny") / "results.jsonl").read_text().splitlines()
    return [r["result"] for r in map(json.loads, lines) if r.get("mode") == "decode" and r.get("result")]


@pytest.mark.parametrize("path", OLD, ids=[p.name for p in OLD])
def test_the_committed_h200_benchmark_results_load(path):
    old = json.loads(records.read_record(path))
    assert "kind" not in old  # written by the untyped decode
    res = load_result({**old, "kind": "decode"}, str(path))
    assert isinstance(res, DecodeResult) and res.schema_version == 2
    assert res.device.name.startswith("NVIDIA H200") and res.timing.rule.startswith("schema 1")
    for p, raw in zip(res.points, old["points"]):
        assert p.decode_tokens_per_s == raw.get("decode_tokens_per_s") and p.decode_step_s is None


@pytest.mark.parametrize("path", NEW, ids=[p.name for p in NEW])
def test_the_committed_typed_results_load_as_they_are(path):
    res = load_result(json.loads(records.read_record(path)), str(path))
    assert isinstance(res, DecodeResult) and res.points and all(p.decode_step_s.n >= 3 for p in res.points)


def test_sweep_fixture_results_load_and_round_trip():
    docs = _fixture_decode_results()
    assert docs
    for old in docs:
        res = load_result({**old, "kind": "decode"})
        again = load_result(json.loads(res.to_json()))
        assert again == res and again.points[0].prefill_tokens_per_s == old["points"][0]["prefill_tokens_per_s"]


def test_a_partial_document_loads_for_its_points():
    doc = {"kind": "decode", "device": {"type": "cuda", "name": "x"},
           "points": [{"attention": "mla", "batch": 8, "context": 1024,
                       "decode_step_s": {"median": 0.002, "p10": 0.0019, "p90": 0.0022, "n": 12}}]}
    res = load_result(doc)
    assert res.points[0].decode_step_s.n == 12 and res.attention is None and res.timing.rule.startswith("schema 1")


def test_a_newer_or_broken_document_is_refused_with_a_line():
    with pytest.raises(ResultLoadError, match="newer scaletool"):
        load_result({"kind": "decode", "schema_version": 99})
    with pytest.raises(ResultLoadError, match="points"):
        load_result({"kind": "decode", "schema_version": 2, "attention": "mla", "device": {"type": "cpu", "name": "cpu"},
                     "dtype": "fp32", "settings": {}, "weights_bytes": 1, "weights_bytes_read_per_step": 1,
                     "kv_cache": {}, "points": "not a list", "timing": {"clock": "", "rule": ""}})
