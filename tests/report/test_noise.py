"""Findings respect the noise; repeats aggregate; spreads reach tables, CSV and plots; typed reading
refuses what it cannot read. Synthetic results (tests/report/report_synth.py) put points on both sides of the line."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import report_synth as synth
from conftest import unpacked_fixture
from report_md import md_row, md_section

from scaletool import api
from scaletool.records import read_record
from scaletool.report import data, findings, tables
from scaletool.report.plots import line_plot
from scaletool.report.render import all_tables
from scaletool.results import ResultLoadError
from scaletool.results.decode import DecodeResult
from scaletool.results.train import TrainResult
from scaletool.stats import compare, settled_start, spread

ROOT = Path(__file__).resolve().parents[2]


def _train_pair(path: Path, mla_step_s: float, *, device: str = "cuda", n: int = 20, ranks=(8,), mha_step_s=0.010,
                jitter: float = 1.0) -> Path:
    """MHA and MLA points trained once each, MHA at 10 ms per step, MLA at ``mla_step_s``."""
    s = synth.Sweep(path)
    s.add("attention=mha", {"model.attention": "mha"}, synth.mha(), "train",
          synth.train_result(synth.steps(mha_step_s, n, jitter), device=device), index=0)
    for i, r in enumerate(ranks, 1):
        step = mla_step_s[r] if isinstance(mla_step_s, dict) else mla_step_s
        s.add(f"attention=mla kv_lora_rank={r}", {"model.attention": "mla", "model.kv_lora_rank": r}, synth.mla(r),
              "train", synth.train_result(synth.steps(step, n, jitter), device=device), index=i)
    return path


def _throughput(path: Path) -> str:
    got = [f for f in findings.throughput_crossover(data.load([path])) if f.startswith("Training throughput")]
    assert len(got) == 1, got
    return got[0]


def test_a_difference_beyond_the_noise_is_stated(tmp_path):
    text = _throughput(_train_pair(tmp_path, 0.0125))
    assert "MLA is slower than MHA beyond the noise at every compression ratio measured" in text
    assert "kv_lora_rank 8 (10.00× vs same-dims MHA, 8.00× vs the MHA point): -20.0% (slower)" in text
    assert "25,600 tokens/s, p10–p90" in text and "n=20" in text  # MHA's median with its spread
    assert "CPU" not in text  # GPU timings carry no CPU caveat


def test_a_difference_inside_the_noise_is_not(tmp_path):
    text = _throughput(_train_pair(tmp_path, 0.0101))
    rs = data.load([tmp_path])
    mha, mla = sorted(rs.ok("train"), key=lambda r: r.attention)[::-1]
    c = compare(mla.across(lambda t: t.rate), mha.across(lambda t: t.rate))
    assert not c.significant and abs(c.rel_diff) > 0.005  # the medians differ, by less than the noise
    assert "no difference beyond the noise at any compression ratio measured" in text
    assert f"within noise (±{100 * c.noise:.1f}%)" in text
    assert "slower" not in text and "faster" not in text


def test_cpu_timings_carry_the_caveat(tmp_path):
    text = _throughput(_train_pair(tmp_path, 0.0125, device="cpu"))
    assert "-20.0% (slower)" in text and text.endswith("These are CPU timings: they do not predict GPU behaviour.")


def test_too_few_samples_state_no_difference(tmp_path):
    # two measured steps a side: a 25% gap, but no spread to judge it by
    text = _throughput(_train_pair(tmp_path, 0.0125, n=2))
    assert "not judged" in text and "%" not in text.split("):", 1)[1]


def test_a_crossover_is_located_among_ranks(tmp_path):
    _train_pair(tmp_path, {8: 0.0100, 16: 0.0101, 64: 0.0125}, ranks=(8, 16, 64))
    text = _throughput(tmp_path)
    # kv_lora_rank 64 has the lowest compression ratio (2.22×) and is the only one slower than MHA
    assert ("MLA falls below MHA beyond the noise at compression ratios ≤ 2.22× (kv_lora_rank ≥ 64); "
            "within noise elsewhere") in text


def _repeats(path: Path) -> tuple[Path, list[float]]:
    """MHA trained three times at medians 10, 11 and 12.5 ms; MLA three times, its second run failed."""
    s = synth.Sweep(path)
    bases = [0.010, 0.011, 0.0125]
    for k, base in enumerate(bases):
        s.add("attention=mha", {"model.attention": "mha"}, synth.mha(), "train",
              synth.train_result(synth.steps(base), device="cuda"), repeat=k, repeats=3)
    for k in range(3):
        ok = k != 1
        s.add("attention=mla kv_lora_rank=8", {"model.kv_lora_rank": 8}, synth.mla(8), "train",
              synth.train_result(synth.steps(0.010)) if ok else None, status="ok" if ok else "error",
              error=None if ok else "RuntimeError: boom", repeat=k, repeats=3, index=1)
    return path, [256 / b for b in bases]


def test_repeats_are_one_row_with_the_spread_of_their_medians(tmp_path):
    path, rates = _repeats(tmp_path)
    rs = data.load([path])
    mha = next(r for r in rs.ok("train") if r.attention == "mha")
    assert mha.repeats == 3
    got = mha.across(lambda t: t.rate)
    assert got == spread(rates) and got.n == 3  # p10/p90 over the repeats' medians, n = repeats
    res = api.report([path], tmp_path / "out")
    md = Path(res.report_md).read_text()
    row = md_row(md_section(md, "Training"), point="attention=mha")
    assert row["runs"] == "3" and row["tokens/s n"] == "3"
    assert row["tokens/s median"] == tables.fmt(got.median, "rate")
    assert row["tokens/s p10–p90"] == tables.fmt(got, "range")
    # the failed repeat is listed on its own; the point's two good runs are its row
    failed = md_row(md_section(md, "Skipped and failed runs"), point="attention=mla kv_lora_rank=8")
    assert failed["repeat"] == "2/3" and failed["status"] == "error" and failed["reason"] == "RuntimeError: boom"
    assert md_row(md_section(md, "Training"), point="attention=mla kv_lora_rank=8")["runs"] == "2"
    rows = {r["point"] + r["status"]: r for r in csv.DictReader(open(res.results_csv))}
    assert float(rows["attention=mhaok"]["throughput/tokens_per_s_p90"]) == pytest.approx(got.p90)
    assert rows["attention=mhaok"]["throughput/tokens_per_s_n"] == "3"
    assert rows["attention=mla kv_lora_rank=8error"]["repeat"] == "1"


def test_a_retried_repeat_replaces_the_failed_one(tmp_path):
    path, _ = _repeats(tmp_path)
    # one more line in the same file: repeat 1 of MLA, retried with --retry-failed, ok this time
    lines = (path / "results.jsonl").read_text().splitlines()
    retry = json.loads(lines[4])
    retry.update(status="ok", error=None, result=synth.train_result(synth.steps(0.010)))
    (path / "results.jsonl").write_text("\n".join(lines + [json.dumps(retry)]) + "\n")
    rs = data.load([path])
    assert [r.repeats for r in rs.ok("train")] == [3, 3] and all(r.status == "ok" for r in rs.rows)


def test_decode_spreads_in_table_and_findings(tmp_path):
    s = synth.Sweep(tmp_path)
    fast, slow = synth.steps(0.002, 12, warmup=()), synth.steps(0.003, 12, warmup=())
    noisy = synth.steps(0.0021, 12, jitter=5, warmup=())
    prefill = synth.steps(0.05, 5, warmup=())
    s.add("attention=mha", {"model.attention": "mha"}, synth.mha(), "decode", synth.decode_result(
        [synth.decode_point("mha", 1024, slow, prefill, batch=4), synth.decode_point("mha", 4096, fast, prefill, batch=4)],
        device="cuda"))
    s.add("attention=mla kv_lora_rank=8", {"model.kv_lora_rank": 8}, synth.mla(8), "decode", synth.decode_result(
        [synth.decode_point("mla", 1024, fast, prefill, batch=4, kv_bytes_per_token=128),
         synth.decode_point("mla", 4096, noisy, prefill, batch=4, kv_bytes_per_token=128)], device="cuda"), index=1)
    rs = data.load([tmp_path])
    [text] = findings.decode_speed(rs)
    assert "context 1,024 (MHA batch 4: 1,333 tokens/s, p10–p90" in text and "kv_lora_rank 8: +50.0% (faster)" in text
    assert "context 4,096" in text and "kv_lora_rank 8: within noise" in text and "CPU" not in text
    t = next(t for t in all_tables(rs) if t.key == "decode")
    mla_rows = [row for row in t.rows if row[0] == "attention=mla kv_lora_rank=8"]
    decode = t.column("decode tokens/s p10–p90")[t.rows.index(mla_rows[0])]
    assert decode == spread(fast).inverse(4) and t.column("decode tokens/s n")[t.rows.index(mla_rows[0])] == 12
    assert t.column("prefill tokens/s median")[0] == pytest.approx(1024 / spread(prefill).median)  # one prompt
    assert t.column("KV cache vs MHA point")[t.rows.index(mla_rows[0])] == pytest.approx(8.0)


def test_old_gpu_results_get_their_spread_from_the_step_history(tmp_path):
    """benchmarks/results (schema-1 summaries) kept every step time: the report rebuilds
    the timing by the warm-up rule new runs use, and tokens/s from the median step."""
    src = ROOT / "benchmarks" / "results" / "mla-compression" / "h200-2026-11-26" / "mla-compression.results.jsonl"
    (tmp_path / "mla").mkdir()
    (tmp_path / "mla" / "results.jsonl").write_text(read_record(src))  # from its run folder's bundle
    rs = data.load([tmp_path / "mla"])
    assert not rs.warnings
    raw = {(r["label"], r["mode"]): r for r in map(json.loads, read_record(src).splitlines())}
    for row in rs.ok("train"):
        s = raw[(row.label, "train")]["result"]
        times = s["history"]["step_time_s"]
        start = settled_start(times, s["measure_warmup_steps"])
        rate = row.across(lambda t: t.rate)
        assert rate == spread(times[start:]).inverse(s["tokens_per_step"]) and rate.n == len(times) - start
        # MFU scales with the median-based rate, both conventions
        assert row.result.mfu == pytest.approx(s["mfu"] * rate.median / s["tokens_per_s"])
        assert row.result.mfu_full_attention == pytest.approx(s["metrics"]["flops/mfu_full_attention"] * rate.median
                                                              / s["tokens_per_s"])
    assert len(rs.ok("train")) == 6 and len(rs.ok("decode")) == 6


def test_foreign_lines_are_skipped_with_one_warning_each(tmp_path):
    s = _train_pair(tmp_path, 0.0125)
    good = (s / "results.jsonl").read_text()
    bad = [{"key": "x", "status": "ok", "mode": "train", "label": ["not", "a", "string"]},
           {"key": "y", "status": "ok", "label": "no mode"},
           {"key": "z", "status": "ok", "mode": "count", "label": "params as text", "recipe": synth.mha(),
            "result": {"params": "many"}}]
    (s / "results.jsonl").write_text(good + "".join(json.dumps(b) + "\n" for b in bad))
    rs = data.load([s])
    assert len(rs.ok("train")) == 2
    assert len(rs.warnings) == 3, rs.warnings
    assert "not a sweep record" in rs.warnings[0] and "ignored" in rs.warnings[0]
    assert "results.jsonl:4: not a sweep record" in rs.warnings[1]
    assert "results.jsonl:5: not a sweep record" in rs.warnings[2]


def test_a_result_its_kind_refuses_is_left_out_with_a_warning(tmp_path):
    """A document with a registered kind goes through that kind's model (load_result): one from a
    newer scaletool is refused, saying so, and the rest of the report is made."""
    s = _train_pair(tmp_path, 0.0125)
    lines = (s / "results.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    rec["result"] = {"kind": "train", "schema_version": 99}
    (s / "results.jsonl").write_text("\n".join([lines[0], json.dumps(rec)]) + "\n")
    res = api.report([s], tmp_path / "out")
    assert len(res.warnings) == 1 and "written by a newer scaletool" in res.warnings[0]
    assert "results.jsonl:2: not a sweep record" in res.warnings[0] and res.tables == ["train"]


def test_no_mha_point_means_one_ratio_only(tmp_path):
    s = synth.Sweep(tmp_path)
    for i, r in enumerate((8, 32)):
        raw = synth.mla(r)
        s.add(f"kv_lora_rank={r}", {"model.kv_lora_rank": r}, raw, "estimate", synth.estimate_result(raw), index=i)
    deeper = synth.mha(**{"model.n_layers": 4})  # an MHA point, but not the same model: no reference
    s.add("mha 4 layers", {"model.attention": "mha"}, deeper, "estimate", synth.estimate_result(deeper), index=2)
    rs = data.load([tmp_path])
    [text] = findings.kv_savings(rs)
    assert "4.00× to 10.00× smaller than the MHA with the same heads and head dims" in text
    assert "no MHA point with the same layers, width and heads" in text
    assert tables.estimate_table(rs).column("KV cache vs MHA point")[:2] == [None, None]


def test_moe_shows_useful_and_computed_mfu(tmp_path):
    moe = synth.recipe(**{"model.ffn": "moe", "model.n_routed_experts": 8, "model.num_experts_per_tok": 2,
                          "model.n_shared_experts": 1, "model.moe_intermediate_size": 48,
                          "model.first_k_dense_replace": 1, "model.moe_dispatch": "capacity",
                          "model.capacity_factor": 2.0})
    synth.Sweep(tmp_path).add("experts=8", {"model.n_routed_experts": 8}, moe, "train",
                              synth.train_result(synth.steps(0.010), device="cuda", mfu_at_1s=0.004))
    t = tables.moe_table(data.load([tmp_path]))
    useful, computed = t.column("MFU useful")[0], t.column("MFU computed")[0]
    flops_useful, flops_computed = t.column("train FLOPs/token useful")[0], t.column("train FLOPs/token computed")[0]
    assert useful == pytest.approx(0.4) and flops_computed > flops_useful
    assert computed == pytest.approx(useful * flops_computed / flops_useful)


def test_one_outlier_turns_the_axis_logarithmic_and_the_caption_says_so():
    spreads = [spread([100.0, 110.0, 120.0]), spread([105.0, 115.0, 118.0])]
    narrow = line_plot("k", "t", "x", "y", [("a", 1, spreads[0]), ("a", 2, spreads[1])], autolog=True, caption="Bars.")
    assert narrow.caption == "Bars." and narrow.png[:4] == b"\x89PNG"
    wide = line_plot("k", "t", "x", "y", [("a", 1, spreads[0]), ("a", 2, spreads[1]), ("b", 3, 5000.0)], autolog=True)
    assert wide.caption == "Log y axis: the values span 49×."  # 5,000 over the lowest p10 (102)
    assert line_plot("k", "t", "x", "y", [("a", 1, 1.0), ("b", 1, 2.0)]) is None  # one x value: no plot


def test_results_read_through_the_results_models_legacy_ones_migrated():
    """The report reads each result as its scaletool.results model: a document from before results had a
    kind is migrated there (a bare list of decode points, the device a name), and a document of another
    kind than the record's mode is refused."""
    t = data.read_result("train", {"status": "completed", "environment": None, "tokens_per_s": 500.0,
                                   "history": {"step": [0], "loss": [1.0]}}, "x")
    assert isinstance(t, TrainResult) and t.world_size is None and t.metrics == {} and t.rate == data.one(500.0)
    d = data.read_result("decode", [{"attention": "mla", "batch": 2, "context": 8, "decode_tokens_per_s": 9.0}], "x")
    assert isinstance(d, DecodeResult) and d.device.type == "unknown" and d.points[0].decode_rate == data.one(9.0)
    assert data.read_result("decode", {"device": "cuda", "points": []}, "x").device.type == "cuda"
    with pytest.raises(ResultLoadError, match="a some-future-kind result where a train result belongs"):
        data.read_result("train", {"kind": "some-future-kind", "tokens_per_s": 500.0}, "x")
    with pytest.raises(ResultLoadError, match="points"):
        data.read_result("decode", {"points": "many", "device": "cpu"}, "x")


def test_figures_the_report_computes_are_listed_and_recorded_ones_are_not(tmp_path):
    """Train points without an estimate: their KV figures come from the closed form, and the report says so;
    the fixture whose points have estimates reads every KV figure from them and lists nothing."""
    res = api.report([_train_pair(tmp_path / "s", 0.0125)], tmp_path / "out")
    assert any(line.startswith("KV cache figures (no estimate of the point recorded)") and "attention=mla" in line
               for line in res.recomputed), res.recomputed
    md = Path(res.report_md).read_text()
    assert "## Computed, not recorded" in md and "## Computed, not recorded" not in Path(res.report_html).read_text()
    assert "Computed, not recorded</h2>" in Path(res.report_html).read_text()
    rs = data.load([unpacked_fixture("tiny")])
    est = {r.label: r for r in rs.ok("estimate")}
    trained = [r for r in rs.ok("train") if r.label in est]
    assert trained and all(r.kv == est[r.label].result.kv_cache.model_dump() for r in trained) and not rs.recomputed
