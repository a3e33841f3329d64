"""`scaletool estimate` and `scaletool count` through the real command line."""
from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import RECIPES, run_cli

from scaletool.cli import main


def test_estimate_json_has_the_contract_keys():
    res = CliRunner().invoke(main, ["estimate", str(RECIPES / "mla-1b.yaml"), "--json"])
    assert res.exit_code == 0, res.output
    est = json.loads(res.output)
    assert est["params"]["total"] == 904_996_864
    assert est["kv_cache"]["bytes_per_token"] == (512 + 64) * 16 * 2
    assert est["flops"]["per_token"]["train"] > 6 * est["params"]["matmul"]
    assert {row["label"] for row in est["memory"]["engines"]} >= {"ddp", "fsdp", "zero1", "zero2", "zero3"}


def test_estimate_table_and_overrides():
    res = CliRunner().invoke(main, ["estimate", str(RECIPES / "mha-1b.yaml"), "--set", "model.attention=gqa",
                                    "--set", "model.n_kv_heads=4", "--world-size", "8"])
    assert res.exit_code == 0, res.output
    for text in ("Parameters", "12·d²·L", "FLOPs per token", "KV cache", "zero3", "world size 8"):
        assert text in res.output


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
    assert out["params"]["measured"] == out["params"]["analytic"] > 400e9
    assert abs(out["flops"]["flop_counter"]["train_rel_error"]) < 0.01
    assert res["maxrss_kb"] < 4 * 2**20  # under 4 GiB resident: nothing was materialised


def test_bad_device_is_one_line():
    res = run_cli("count", str(RECIPES / "tiny.yaml"), "--device", "tpu9")
    assert res.returncode == 2 and "Traceback" not in res.stderr and "--device" in res.stderr


def test_help_teaches():
    res = run_cli("--help")
    assert res.returncode == 0
    for cmd in ("estimate", "count", "recipe"):
        assert cmd in res.stdout
