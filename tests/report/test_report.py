"""The report from fixture results directories (real CPU sweeps, see fixtures/make_fixtures.py)."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from scaletool.cli import main
from scaletool.report import data, tables
from scaletool.report.render import md_escape

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY, PRICE = FIXTURES / "tiny", FIXTURES / "price"
HOSTILE = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    res = CliRunner().invoke(main, ["report", str(TINY), str(PRICE), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return out, json.loads(res.output)


def _records(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines()]


def _section(md: str, title: str) -> str:
    return md.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _md_row(md: str, *cells: str) -> list[str]:
    """The cells of the markdown table line that starts with ``cells`` (escaped as the report does)."""
    head = "| " + " | ".join(md_escape(c) for c in cells) + " |"
    lines = [ln for ln in md.splitlines() if ln.startswith(head)]
    assert len(lines) == 1, (head, lines)
    return [c.strip() for c in re.split(r"(?<!\\)\|", lines[0])[1:-1]]


def test_hostile_strings_are_escaped_everywhere(report):
    out, _ = report
    page = (out / "report.html").read_text()
    assert HOSTILE not in page and "<script" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # shown, as text
    md = (out / "report.md").read_text()
    assert HOSTILE not in md and "&lt;script&gt;" in md
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
    for rec in _records(TINY):
        if rec["status"] != "ok":
            continue
        r = rec["result"]
        title = {"estimate": "Analytic estimate", "count": "Measured parameters and FLOPs", "train": "Training",
                 "decode": "Decoding"}[rec["mode"]]
        sec = _section(md, title)
        cells = _md_row(sec, tiny, rec["label"]) if rec["mode"] != "decode" else None
        if rec["mode"] == "count":
            n["count"] += 1
            assert cells[2] == f"{r['params']['measured']:,}" and cells[3] == f"{r['params']['analytic']:,}"
            assert cells[6] == tables.fmt(r["flops"]["flop_counter"]["train"], "flops")
        elif rec["mode"] == "estimate":
            n["estimate"] += 1
            assert cells[5] == f"{r['params']['total']:,}"
            assert cells[9] == f"{r['kv_cache']['bytes_per_token']:,}"
            assert cells[10] == f"{r['kv_cache']['compression_ratio']:.2f}×"
        elif rec["mode"] == "train":
            n["train"] += 1
            assert cells[5] == "single"  # the fixture trains on one process
            assert cells[6] == "-"  # and its trimmed summaries carry no environment
            assert cells[7] == tables.fmt(r["tokens_per_s"], "rate")
            assert cells[12] == f"{r['loss_first']:.4g}" and cells[13] == f"{r['loss_last']:.4g}"
        else:
            for p in r["points"]:
                row = _md_row(sec, tiny, rec["label"], p["attention"], str(p["batch"]), str(p["context"]))
                assert row[-1] == tables.fmt(p["decode_tokens_per_s"], "rate")
                n["decode"] += 1
    ok = {m: sum(1 for rec in _records(TINY) if rec["status"] == "ok" and rec["mode"] == m) for m in n}
    assert n["count"] == ok["count"] == 8 and n["estimate"] == ok["estimate"] == 8 and n["train"] == ok["train"] == 6
    assert n["decode"] == 2 * ok["decode"]
    # results.csv: one row per record (a decode run: one per context), the same numbers
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == res["csv_rows"] == sum(len(rec["result"]["points"]) if rec["mode"] == "decode"
                                               and rec["status"] == "ok" else 1
                                               for d in (TINY, PRICE) for rec in _records(d))
    count_rows = {(r["point"], r["mode"]): r for r in rows if r["mode"] == "count"}
    for rec in _records(TINY):
        if rec["mode"] == "count":
            assert int(count_rows[(rec["label"], "count")]["result.params.measured"]) == rec["result"]["params"]["measured"]


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
    # SEEDS.md's claim, checked against the real figures of the price transformer (kv_lora_rank 256)
    assert "663,552,000" in text and "16,588,800" in text and "46,592" in text
    assert "4.44× saving" in text
    assert "Training throughput, MLA against MHA" in text
    assert "12·d²·L against the exact non-embedding parameter count" in text
    md = (out / "report.md").read_text()
    assert "## Profiler time breakdown" in md and "ffn\\_matmul" not in md and "ffn_matmul" in md and "46.0%" in md
    assert "## Skipped and failed runs" in md and "only used by engine=deepspeed" in md


def test_single_dir_plots_only_what_it_has(tmp_path):
    res = CliRunner().invoke(main, ["report", str(PRICE), "-o", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert {Path(p).stem for p in got["plots"]} == {"kv_vs_compression", "params_vs_compression"}
    assert got["tables"] == ["estimate", "claim"]
    md = (tmp_path / "report.md").read_text()
    assert "| source |" not in md  # one results dir: no source column


def test_not_a_results_dir_is_one_line_and_exit_2(tmp_path):
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 2
    assert res.output.strip() == f"error: {tmp_path}: no results.jsonl here; is it a results directory of `scaletool sweep`?"


def test_csv_cells_cannot_become_formulas(tmp_path):
    from scaletool.report.render import _csv_safe

    assert _csv_safe("=HYPERLINK(\"http://x\")") == "'=HYPERLINK(\"http://x\")"
    assert _csv_safe("attention=mla") == "attention=mla" and _csv_safe(-0.5) == -0.5
