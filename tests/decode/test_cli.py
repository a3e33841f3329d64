"""`scaletool decode` through the command line, on CPU with the tiny recipe."""
from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import RECIPES

from scaletool.cli import main

TINY = str(RECIPES / "tiny.yaml")


def _decode(*args):
    return CliRunner().invoke(main, ["decode", *args])


def test_json_points_carry_the_contract_and_cache_bytes_match_the_analytic_model():
    res = _decode(TINY, "--device", "cpu", "--batch", "2", "--context", "16,80", "--new-tokens", "4",
                  "--prefill-chunk", "32", "--warmup-steps", "1", "--memory-budget", "0.01", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [p["context"] for p in out["points"]] == [16, 80]
    for p in out["points"]:
        assert {"attention", "batch", "context", "kv_cache_bytes_measured", "kv_cache_bytes_analytic",
                "decode_tokens_per_s"} <= set(p)
        assert p["attention"] == "mla" and p["batch"] == 2
        assert p["kv_cache_bytes_measured"] == p["kv_cache_bytes_analytic"] == 2 * (p["context"] + 4) * 320
        assert p["decode_tokens_per_s"] > 0 and p["prefill_tokens_per_s"] > 0
        assert p["decode_bandwidth_fraction_of_peak"] is None  # no bandwidth peak is invented for CPUs
    # tiny's max_seq_len is 64: the 80-token context ran on extended RoPE tables
    assert out["points"][0]["rope_extended_to"] is None and out["points"][1]["rope_extended_to"] == 84
    fit = {(r["attention"], r["context"]): r["max_batch"] for r in out["memory_fit"]["rows"]}
    assert fit[("mla", 16)] // 4 == fit[("mla-naive", 16)]  # the naive cache is 4× the latent one here
    assert fit[("mla", 16)] > fit[("mla", 80)] > 0


def test_batch_max_takes_the_largest_fitting_batch_and_the_table_names_the_kernel():
    res = _decode(TINY, "--device", "cpu", "--batch", "max", "--context", "8", "--new-tokens", "2",
                  "--memory-budget", "0.002", "--warmup-steps", "1", "--mla-mode", "naive")
    assert res.exit_code == 0, res.output
    assert "mla-naive" in res.output and "Largest batch" in res.output and "sdpa" in res.output


def test_mha_recipe_decodes_and_naive_mode_is_refused_for_it():
    args = [TINY, "--device", "cpu", "--context", "8", "--new-tokens", "2", "--warmup-steps", "1",
            "--set", "model.attention=mha", "--set", "model.kv_lora_rank=0", "--set", "model.qk_nope_head_dim=null",
            "--set", "model.v_head_dim=null", "--set", "model.qk_rope_head_dim=null"]
    res = _decode(*args, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["points"][0]["attention"] == "mha"
    res = _decode(*args, "--mla-mode", "naive")
    assert res.exit_code == 2 and "naive is for attention=mla" in res.output


def test_bad_input_gets_one_clear_line():
    res = _decode(str(RECIPES / "price-transformer.yaml"), "--device", "cpu")
    assert res.exit_code == 2 and "decode is for task=lm" in res.output and "Traceback" not in res.output
    res = _decode(TINY, "--device", "cpu", "--batch", "max")
    assert res.exit_code == 2 and "--memory-budget" in res.output
    res = _decode(TINY, "--device", "cpu", "--context", "4k,x")
    assert res.exit_code == 2 and "'x' is not a positive token count" in res.output
    res = _decode(TINY, "--device", "cpu", "--batch", "0")
    assert res.exit_code == 2 and "neither a positive integer nor 'max'" in res.output
    res = _decode(TINY, "--device", "cpu", "--mla-kernel", "triton")
    assert res.exit_code == 2 and "fused kernel cannot run here" in res.output


def test_checkpoint_from_scaletool_train_is_decoded(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", TINY, "--out", str(out), "--no-measure", "--set", "train.steps=2",
                                    "--set", "train.checkpoint_every=2", "--set", "train.seq_len=16"])
    assert res.exit_code == 0, res.output
    ckpt = out / "checkpoints" / "step_2"
    args = ["--device", "cpu", "--context", "8", "--new-tokens", "2", "--warmup-steps", "1", "--json"]
    res = _decode(TINY, "--checkpoint", str(ckpt), *args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["checkpoint"] == str(ckpt)
    res = _decode(TINY, "--checkpoint", str(tmp_path), *args)
    assert res.exit_code == 2 and "not a scaletool checkpoint" in res.output
