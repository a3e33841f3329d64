"""The tuned-config table: the sweep's best configs become a table, choose_config's lookup answers the
nearest point of this card and shape, and anything else (no table, another card, another shape, a
damaged file) leaves the heuristic. The sweep script's table-writing and dry-run paths run on CPU."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from scaletool.kernels import mla_decode, mla_tuning

CARD = "NVIDIA H100 80GB HBM3"
SCRIPT = ROOT / "benchmarks" / "scripts" / "decode_tune.py"


def _sweep(points):
    return {"card": {"name": CARD, "versions": {"torch": "2.11"}}, "date": "2026-11-26",
            "shape": {"heads": 16, "kv_lora_rank": 512, "rope": 64, "dtype": "bfloat16"},
            "points": [{"context": s, "batch": b, "best": {"config": {"n_splits": n, "block_s": 64, "num_warps": w,
                                                                       "num_stages": 2, "direct": n == 1},
                                                            "time_s": {"median": 1e-4}, "hbm_fraction_of_copy": 0.9}}
                       for s, b, n, w in points] + [{"context": 4096, "batch": 3, "error": "out of memory"}]}


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(mla_tuning.table_from_sweep(_sweep(
        [(4096, 1, 16, 4), (4096, 1036, 1, 8), (32768, 1, 64, 4), (32768, 130, 2, 8)]))))
    yield str(path)
    mla_tuning.load.cache_clear()


def test_lookup_takes_the_nearest_context_then_the_nearest_batch(table):
    look = lambda b, s: mla_tuning.lookup(CARD, 16, 512, 64, "bfloat16", b, s, path=table)  # noqa: E731
    assert look(1036, 4131)["n_splits"] == 1 and look(1036, 4131)["direct"] is True
    assert look(1, 4131)["n_splits"] == 16
    assert look(700, 2048) == look(1036, 4096)  # 2K is nearer 4K than 32K; 700 nearer 1036 than 1
    assert look(128, 40000) == {"n_splits": 2, "block_s": 64, "num_warps": 8, "num_stages": 2, "direct": False}
    assert mla_decode.KernelConfig(**look(128, 40000)).splits(128, 16, 40000, 132)[0] == 2


@pytest.mark.parametrize("other", [dict(card="NVIDIA H200"), dict(heads=128), dict(kv_lora_rank=256),
                                   dict(dtype="float16")])
def test_another_card_or_shape_finds_nothing(table, other):
    args = {"card": CARD, "heads": 16, "kv_lora_rank": 512, "rope": 64, "dtype": "bfloat16", **other}
    assert mla_tuning.lookup(**args, batch=1, context=4096, path=table) is None


@pytest.mark.parametrize("text", ["", "{", "[]", '{"version": 99, "tables": []}', '{"version": 1, "tables": 3}'])
def test_a_missing_or_damaged_table_is_no_table(tmp_path, text):
    path = tmp_path / "t.json"
    path.write_text(text)
    assert mla_tuning.lookup(CARD, 16, 512, 64, "bfloat16", 1, 4096, path=str(path)) is None
    assert mla_tuning.lookup(CARD, 16, 512, 64, "bfloat16", 1, 4096, path=str(tmp_path / "absent.json")) is None
    mla_tuning.load.cache_clear()


def test_merging_replaces_only_the_same_card_shape_and_point():
    h100 = mla_tuning.table_from_sweep(_sweep([(4096, 1, 16, 4), (4096, 8, 8, 4)]))
    h200 = json.loads(json.dumps(h100))
    h200["tables"][0]["card"] = "NVIDIA H200"
    merged = mla_tuning.merge_tables(mla_tuning.merge_tables(None, h100), h200)
    # a sweep of some points: (4096, 1) re-tuned, (8192, 2) new, (4096, 8) kept from before; the H200's untouched
    again = mla_tuning.merge_tables(merged, mla_tuning.table_from_sweep(_sweep([(8192, 2, 8, 8), (4096, 1, 32, 8)])))
    assert sorted(t["card"] for t in again["tables"]) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    h100_entries = next(t for t in again["tables"] if t["card"] == CARD)["entries"]
    assert [(e["context"], e["batch"], e["config"]["n_splits"]) for e in h100_entries] == \
        [(4096, 1, 32), (4096, 8, 8), (8192, 2, 8)]
    h200_entries = next(t for t in again["tables"] if t["card"] == "NVIDIA H200")["entries"]
    assert [(e["context"], e["batch"], e["config"]["n_splits"]) for e in h200_entries] == [(4096, 1, 16), (4096, 8, 8)]


def test_choose_config_off_cuda_is_the_heuristic():
    assert mla_decode.choose_config(1, 16, 4096, torch.device("cpu")) == mla_decode.KernelConfig()


def _script(*args, cwd):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def test_the_sweep_script_writes_the_table_from_a_result_and_refuses_bad_input(tmp_path):
    (tmp_path / "sweep.json").write_text(json.dumps(_sweep([(4096, 1, 16, 4), (32768, 130, 2, 8)])))
    table = tmp_path / "table.json"
    shipped = mla_tuning.TABLE.read_bytes()
    r = _script("--from", "sweep.json", "--write-table", str(table), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    written = json.loads(table.read_text())
    assert written["version"] == mla_tuning.TABLE_VERSION
    assert mla_tuning.lookup(CARD, 16, 512, 64, "bfloat16", 100, 30000, path=str(table))["n_splits"] == 2
    mla_tuning.load.cache_clear()
    (tmp_path / "bad.json").write_text('{"points": 1}')
    assert mla_tuning.TABLE.read_bytes() == shipped  # the package's table is written only when named
    for args in (["--from", "bad.json", "--write-table", str(tmp_path / "t2.json")],
                 ["--from", "sweep.json", "--write-table", str(tmp_path / "no" / "t3.json")],
                 ["--contexts", "4k"], ["--batches", "0"]):
        r = _script(*args, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("error:") == 1, (args, r.stderr)
    assert not (tmp_path / "t2.json").exists()


def test_the_dry_run_prints_the_pruned_grid_without_a_gpu(tmp_path):
    r = _script("--dry-run", "--contexts", "1024,32768", "--batches", "1,fit", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "4 points"
    assert "splits [1, 2, 4, 8, 16]," in lines[0]  # no split shorter than 64 positions at 1K
    assert "(fit)" in lines[1] and "splits [1, 2]," in lines[1]  # thousands of sequences: one split or two
    assert list(tmp_path.iterdir()) == []  # nothing written
