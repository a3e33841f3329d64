"""The report from fixture results directories (real CPU sweeps written before results had a kind, see
fixtures/make_fixtures.py): they still load, and the tables, CSV, plots and findings match their data."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import unpacked_fixture
from report_md import md_row, md_section

from scaletool.cli import main
from scaletool.report import data, tables

TINY, PRICE = unpacked_fixture("tiny"), unpacked_fixture("price")
HOSTILE = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    res = CliRunner().invoke(main, ["report", str(TINY), str(PRICE), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return out, json.loads(res.output)


def _records(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines()]


def test_hostile_strings_are_escaped_everywhere(report):
    out, _ = report
    page = (out / "report.html").read_text()
    assert HOSTILE not in page and "<script" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # shown, as text
    md = (out / "report.md").read_text()
    assert HOSTILE not in md and "&lt;script>" in md
    # escaping is for what a renderer would read as HTML: a '>' in prose stays as written
    assert "&gt;" not in md and "(runs > 1)" in md
    # self-contained: every image is inline data, nothing is fetched
    assert re.findall(r'src="([^"]*)"', page) and all(s.startswith("data:image/png;base64,")
                                                      for s in re.findall(r'src="([^"]*)"', page))
    assert "http://" not in page and "https://" not in page


def test_tables_match_the_data(report):
    out, res = report
    md = (out / "report.md").read_text()
    tiny = data.load([TINY, PRICE]).sources[0]["label"]
    assert tiny == f"{HOSTILE} cpu"
    n = {"count": 0, "estimate": 0, "train": 0, "decode": 0}
    sections = {"estimate": "Analytic estimate", "count": "Measured parameters and FLOPs", "train": "Training",
                "decode": "Decoding"}
    for rec in _records(TINY):
        if rec["status"] != "ok":
            continue
        r, sec = rec["result"], md_section(md, sections[rec["mode"]])
        n[rec["mode"]] += 1 if rec["mode"] != "decode" else len(r["points"])
        if rec["mode"] == "decode":
            for p in r["points"]:
                row = md_row(sec, point=rec["label"], source=tiny, batch=str(p["batch"]), context=str(p["context"]))
                assert row["decode tokens/s median"] == tables.fmt(p["decode_tokens_per_s"], "rate")
                assert row["decode tokens/s n"] == "1" and row["decode tokens/s p10–p90"] == "-"  # no spread recorded
                assert row["KV cache measured"] == tables.fmt(p["kv_cache_bytes_measured"], "bytes")
            continue
        row = md_row(sec, point=rec["label"], source=tiny)
        if rec["mode"] == "count":
            assert row["parameters measured"] == f"{r['params']['measured']:,}"
            assert row["parameters exact"] == f"{r['params']['analytic']:,}"
            assert row["FLOPs fwd+bwd FlopCounterMode"] == tables.fmt(r["flops"]["flop_counter"]["train"], "flops")
        elif rec["mode"] == "estimate":
            assert row["parameters exact"] == f"{r['params']['total']:,}"
            assert row["KV cache bytes/token"] == f"{r['kv_cache']['bytes_per_token']:,}"
            assert row["KV cache vs same-dims MHA"] == f"{r['kv_cache']['compression_ratio']:.2f}×"
            # the MHA point of these results caches 1,024 bytes/token
            assert row["KV cache vs MHA point"] == f"{1024 / r['kv_cache']['bytes_per_token']:.2f}×"
        else:
            assert row["engine"] == "single"  # the fixture trains on one process
            assert row["GPUs"] == "-"  # and its trimmed summaries carry no environment
            # a schema-1 summary without its step history: the recorded figure, one sample, no range
            assert row["tokens/s median"] == tables.fmt(r["tokens_per_s"], "rate")
            assert row["tokens/s p10–p90"] == "-" and row["tokens/s n"] == "1" and row["runs"] == "1"
            assert row["MFU causal (Megatron)"] == row["MFU full attention (torchtitan)"] == "-"  # CPU: no peak
            assert row["loss first"] == f"{r['loss_first']:.4g}" and row["loss last"] == f"{r['loss_last']:.4g}"
    ok = {m: sum(1 for rec in _records(TINY) if rec["status"] == "ok" and rec["mode"] == m) for m in n}
    assert n["count"] == ok["count"] == 8 and n["estimate"] == ok["estimate"] == 8 and n["train"] == ok["train"] == 6
    assert n["decode"] == 2 * ok["decode"]
    # every identity column the point labels already give is left out; the price points do not name
    # their attention or width, so those columns stay in a report that includes them
    assert "| point | source | attention | intermediate_size | parameters exact |" in md
    assert "| point | source | parameters measured |" in md_section(md, "Measured parameters and FLOPs")


def test_csv_has_the_typed_figures(report):
    out, res = report
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == res["csv_rows"] == sum(len(rec["result"]["points"]) if rec["mode"] == "decode"
                                               and rec["status"] == "ok" else 1
                                               for d in (TINY, PRICE) for rec in _records(d))
    by = {(r["point"], r["mode"], r["decode/context"]): r for r in rows}
    for rec in _records(TINY):
        r = rec["result"]
        if rec["mode"] == "count":
            row = by[(rec["label"], "count", "")]
            assert int(row["params/measured"]) == r["params"]["measured"] and int(row["params/exact"]) == r["params"]["analytic"]
        elif rec["mode"] == "train" and rec["status"] == "ok":
            row = by[(rec["label"], "train", "")]
            assert float(row["throughput/tokens_per_s"]) == pytest.approx(r["tokens_per_s"])
            assert row["throughput/tokens_per_s_n"] == "1" and row["runs"] == "1"
            assert {"flops/mfu_causal", "flops/mfu_full_attention"} <= set(row)
        elif rec["mode"] == "estimate":
            row = by[(rec["label"], "estimate", "")]
            assert float(row["kv_cache/compression_vs_same_dims_mha"]) == pytest.approx(r["kv_cache"]["compression_ratio"])
            assert float(row["kv_cache/compression_vs_mha_point"]) == pytest.approx(1024 / r["kv_cache"]["bytes_per_token"])
        elif rec["mode"] == "train":
            row = by[(rec["label"], "train", "")]
            assert row["status"] == "skipped" and "only used by engine=deepspeed" in row["reason"]
    # the varied keys are columns of their own; a dict value stays one JSON cell
    assert {"values.model.attention", "values.model.kv_lora_rank", "values.parallel.deepspeed"} <= set(rows[0])
    assert any(json.loads(r["values.parallel.deepspeed"] or "null") == {"comment": HOSTILE} for r in rows)


def test_findings_plots_and_hooks(report):
    out, res = report
    assert set(res["tables"]) == {"estimate", "count", "train", "decode", "claim", "breakdown", "failures"}
    plots = {Path(p).stem for p in res["plots"]}
    assert {"kv_vs_compression", "params_vs_compression", "tokens_per_s_vs_compression", "tokens_per_s_vs_ffn",
            "decode_vs_context"} <= plots
    # the CPU has no MFU peak and no allocator peak: those plots have no data, so they are left out
    assert not plots & {"mfu_vs_compression", "mfu_vs_ffn", "memory_vs_ffn"}
    assert all((out / "plots" / f"{p}.png").read_bytes()[:4] == b"\x89PNG" for p in plots)
    text = "\n".join(res["findings"])
    # the price transformer's stated claim, checked against the real figures of the price transformer (kv_lora_rank 256)
    assert "663,552,000" in text and "16,588,800" in text and "46,592" in text
    assert "4.44× saving" in text
    # old CPU results have no spread: the throughput findings say so, state no difference, and warn about CPUs
    tput = [f for f in res["findings"] if f.startswith(("Training throughput", "Decode throughput"))]
    assert len(tput) == 4 and all("not judged" in f and "do not predict GPU behaviour" in f for f in tput)
    assert not any(re.search(r"[+-]\d+\.\d%", f) for f in tput)
    # the KV saving, labelled against both references
    kv = next(f for f in res["findings"] if f.startswith(f"{HOSTILE} cpu: MLA's KV cache"))
    assert "4.00× to 10.00× smaller than the MHA with the same heads and head dims" in kv
    assert "3.20× to 8.00× smaller than the MHA point of these results (1,024 bytes/token)" in kv
    assert "12·d²·L against the exact non-embedding parameter count" in text
    md = (out / "report.md").read_text()
    assert "## Profiler time breakdown" in md and "ffn\\_matmul" not in md and "ffn_matmul" in md and "46.0%" in md
    assert "## Skipped and failed runs" in md and "only used by engine=deepspeed" in md


def test_single_dir_plots_only_what_it_has(tmp_path):
    res = CliRunner().invoke(main, ["report", str(PRICE), "-o", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["kind"] == "report"
    assert {Path(p).stem for p in got["plots"]} == {"kv_vs_compression", "params_vs_compression"}
    assert got["tables"] == ["estimate", "claim"]
    md = (tmp_path / "report.md").read_text()
    assert "| source |" not in md  # one results dir: no source column
    assert "no MHA point" in "\n".join(got["findings"])


def test_the_claim_check_appears_only_with_the_price_transformer(tmp_path):
    res = CliRunner().invoke(main, ["report", str(TINY), "-o", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert "claim" not in got["tables"] and "663,552,000" not in "\n".join(got["findings"])


def test_not_a_results_dir_is_one_line_and_exit_2(tmp_path):
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 2
    assert res.output.strip() == f"error: {tmp_path}: no results.jsonl here; is it a results directory of `scaletool sweep`?"


def test_csv_cells_cannot_become_formulas():
    from scaletool.report.results_csv import _csv_safe

    assert _csv_safe("=HYPERLINK(\"http://x\")") == "'=HYPERLINK(\"http://x\")"
    assert _csv_safe("attention=mla") == "attention=mla" and _csv_safe(-0.5) == -0.5


def test_human_output_names_the_files_and_the_api_refuses_no_dirs(tmp_path):
    res = CliRunner().invoke(main, ["report", str(PRICE), "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert f"report: {tmp_path / 'report.html'}" in res.output and str(tmp_path / "results.csv") in res.output
    assert "tables: estimate, claim; 2 plot(s)" in res.output
    from scaletool import api
    from scaletool.errors import RecipeError

    with pytest.raises(RecipeError, match="no results directory given"):
        api.report([])
