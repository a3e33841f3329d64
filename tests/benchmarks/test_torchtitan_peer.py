"""The torchtitan peer script's CPU paths: recipe mapping, argument errors, the measured loop and its
JSON (scaletool side), and, where torchtitan imports, parameter counts equal to scaletool's exactly.

torchtitan itself only trains on an accelerator (its device helpers assume one); its GPU run is
benchmarks/scripts/peers/README.md's. Tests that need torchtitan skip where it is not installed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import RECIPES, ROOT

from scaletool.config import RecipeError, load_recipe, recipe_from_dict

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

SCRIPT = ROOT / "benchmarks" / "scripts" / "peers" / "torchtitan_train.py"
spec = importlib.util.spec_from_file_location("torchtitan_train", SCRIPT)
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)


def has_torchtitan() -> bool:
    try:
        peer.ensure_torch_api(allow_compat=False)
        import torchtitan.models.llama3  # noqa: F401
    except (ImportError, RecipeError):
        return False
    return True


needs_torchtitan = pytest.mark.skipif(not has_torchtitan(), reason="torchtitan 0.3.0 is not importable here")


def test_mha_and_mla_map_to_llama3_and_dense_deepseek_v3():
    mha = peer.torchtitan_shapes(load_recipe(RECIPES / "mha-1b.yaml").model)
    assert mha["family"] == "llama3" and (mha["dim"], mha["n_layers"], mha["n_heads"], mha["n_kv_heads"]) == \
        (2048, 16, 16, 16)
    assert (mha["hidden_dim"], mha["head_dim"], mha["vocab_size"], mha["rope_theta"]) == (5632, 128, 32000, 10000.0)
    mla = peer.torchtitan_shapes(load_recipe(RECIPES / "mla-1b.yaml").model)
    assert mla["family"] == "deepseek_v3"
    assert {k: mla[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")} \
        == {"q_lora_rank": 0, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    gqa = peer.torchtitan_shapes(load_recipe(RECIPES / "mha-1b.yaml", ["model.attention=gqa", "model.n_kv_heads=4"]).model)
    assert gqa["n_kv_heads"] == 4


def test_features_the_peers_cannot_express_are_one_line_each():
    cfg = recipe_from_dict({"model": {"ffn": "gelu", "norm": "layernorm", "qkv_bias": True, "dropout": 0.1}}).model
    with pytest.raises(RecipeError) as e:
        peer.torchtitan_shapes(cfg)
    assert [p.split(":")[0] for p in e.value.problems] == ["model.ffn", "model.norm", "model.qkv_bias", "model.dropout"]


@pytest.mark.parametrize("argv, message", [
    (["nope.yaml", "--dry-run"], "error: "),
    ([str(RECIPES / "mha-1b.yaml"), "--set", "model.ffn=gelu", "--dry-run"], "error: model.ffn: gelu"),
    ([str(RECIPES / "mha-1b.yaml"), "--steps", "0"], "--steps: 0 is too small"),
    ([str(RECIPES / "mha-1b.yaml"), "--tp", "0"], "--tp: 0 is too small"),
    ([str(RECIPES / "mha-1b.yaml"), "--async-tp"], "--async-tp: needs --tp > 1"),
    ([str(RECIPES / "mha-1b.yaml"), "--tp", "2", "--also-recipe"], "--also-recipe: not with --tp"),
    ([str(RECIPES / "mha-1b.yaml"), "--tp", "2", "--only", "scaletool"], "error: --tp 2: does not divide the world size 1"),
    ([str(RECIPES / "mha-1b.yaml"), "--tp", "3", "--dry-run"], "model.n_heads: 16 heads do not split"),
])
def test_bad_input_exits_2_with_one_line_per_problem(argv, message, capsys):
    try:
        rc = peer.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr()
    assert rc == 2 and message in err.err, err.err
    assert "Traceback" not in err.err and err.out == ""


def test_scaletool_side_measures_on_cpu_and_writes_the_document(tmp_path, capsys):
    """The timed loop, the warm-up rule and the JSON, through scaletool's engines (torchtitan not needed);
    in-process, on a one-rank gloo group that main() tears down."""
    out = tmp_path / "peer.json"
    rc = peer.main([str(RECIPES / "tiny.yaml"), "--only", "scaletool", "--also-recipe", "--set", "train.micro_batch_size=2",
                    "--set", "train.seq_len=32", "--steps", "5", "--warmup", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == doc
    assert doc["world_size"] == 1 and doc["settings"]["seq_len"] == 32 and doc["versions"]["torch"]
    for name in ("scaletool", "scaletool_recipe"):  # FSDP2 with torchtitan's settings, then the recipe's engine
        r = doc["results"][name]
        assert r["step_s"]["n"] == 5 - r["warmup_steps_excluded"] and r["warmup_steps_excluded"] >= 1
        assert r["tokens_per_s_per_gpu"]["median"] == pytest.approx(2 * 32 / r["step_s"]["median"])
        assert r["loss_last"] < r["loss_first"]
    # same seed, same batches, same maths: the two engines take the same steps
    assert doc["results"]["scaletool"]["loss_last"] == pytest.approx(doc["results"]["scaletool_recipe"]["loss_last"],
                                                                     rel=1e-4)
    assert not torch.distributed.is_initialized()


@needs_torchtitan
@pytest.mark.parametrize("recipe", ["mha-1b.yaml", "mla-1b.yaml"])
def test_torchtitan_model_has_exactly_scaletools_parameters(recipe):
    r = load_recipe(RECIPES / recipe)
    _, doc = peer.plan(peer.parse_args([str(RECIPES / recipe), "--dry-run"]))
    assert doc["params"]["torchtitan_model"] == doc["params"]["scaletool_analytic"]
    # torchtitan counts full attention and 6 FLOPs for every non-embedding parameter, norm weights too:
    # our full convention (matmul weights only) plus 6 per weight outside a matmul
    from scaletool.analytic.params import param_counts
    c = param_counts(r.model)
    outside_matmul = c["total"] - c["embedding"] - c["matmul"]
    assert doc["flops_per_token"]["torchtitan"] == doc["flops_per_token"]["scaletool_full"] + 6 * outside_matmul


@pytest.mark.parametrize("local", [[], ["--set", "parallel.tp_local_ops=true"]], ids=["dtensor", "local"])
def test_scaletool_side_with_tp_matches_one_rank(tmp_path, local):
    """--tp 2 under torchrun (two gloo ranks, one tensor-parallel group): both ranks read the one batch
    stream a one-rank run reads, so scaletool's TP=2 step takes the one-rank FSDP2 step's losses; tokens/s per
    GPU counts each batch once over the two GPUs. An override of the split's own keys (the local-ops form)
    applies to the split."""
    args = [str(RECIPES / "tiny.yaml"), "--only", "scaletool", "--set", "train.micro_batch_size=2", "--set",
            "train.seq_len=32", "--steps", "4", "--warmup", "1"]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT), *args,
                        "--tp", "2", *local, "--out", str(tmp_path / "tp2.json")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    tp2 = json.loads((tmp_path / "tp2.json").read_text())
    assert peer.main([*args, "--out", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())
    s = tp2["settings"]
    assert ("parallel.tp_local_ops=true" in tp2["overrides"]) == bool(local)
    assert (tp2["world_size"], s["tensor_parallel"], s["data_parallel"], s["global_batch_sequences"]) == (2, 2, 1, 2)
    r = tp2["results"]["scaletool"]
    assert r["tokens_per_s_per_gpu"]["median"] == pytest.approx(2 * 32 / 2 / r["step_s"]["median"])
    for key in ("loss_first", "loss_last"):
        assert r[key] == pytest.approx(one["results"]["scaletool"][key], rel=1e-4)


@needs_torchtitan
@pytest.mark.parametrize("recipe", ["mha-1b.yaml", "mla-1b.yaml"])
def test_both_tensor_parallel_plans_leave_a_rank_the_same_share(recipe):
    """--tp 2 --dry-run: torchtitan's sharding plan and scaletool's, each on the meta device over a fake
    two-rank group, keep the same parameters per rank and replicate the same ones, the analytic figures."""
    _, doc = peer.plan(peer.parse_args([str(RECIPES / recipe), "--tp", "2", "--dry-run"]))
    shares = doc["tp_shares"]
    assert shares["torchtitan"] == shares["scaletool"] == {"local": shares["analytic_local"],
                                                           "replicated": shares["analytic_replicated"]}
    assert shares["analytic_local"] < doc["params"]["scaletool_analytic"]


@needs_torchtitan
def test_unequal_shapes_are_refused(monkeypatch):
    monkeypatch.setattr(peer, "torchtitan_counts", lambda cfg, T, backend: {"params": 1, "flops_per_token": 1.0,
                                                                            "model_class": "Llama3Model"})
    with pytest.raises(RecipeError, match="the shapes differ"):
        peer.plan(peer.parse_args([str(RECIPES / "mha-1b.yaml"), "--dry-run"]))


def test_torch_compat_shims_refuse_without_the_flag_and_raise_on_unsupported_use(monkeypatch):
    """On a torch without the two APIs (simulated here), no flag: one error line each; --torch-compat:
    a placeholder that raises if built, and a create_block_mask that takes True and raises on False."""
    import torch.distributed.fsdp as fsdp
    from torch.nn.attention import flex_attention

    calls = []
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    monkeypatch.setattr(flex_attention, "create_block_mask", lambda *a, **kw: calls.append((a, kw)) or "mask")
    with pytest.raises(RecipeError) as e:
        peer.ensure_torch_api(allow_compat=False)
    assert len(e.value.problems) == 2 and all("--torch-compat" in p for p in e.value.problems)
    notes = peer.ensure_torch_api(allow_compat=True)
    assert [n.split(" ")[0] for n in notes] == ["torch.distributed.fsdp.DataParallelMeshDims", "create_block_mask(...,"]
    with pytest.raises(RuntimeError, match="placeholder"):
        fsdp.DataParallelMeshDims(shard=("fsdp",))
    assert flex_attention.create_block_mask("mod", 1, separate_full_blocks=True) == "mask"
    assert calls == [(("mod", 1), {})]  # the keyword older torch lacks is not passed on
    with pytest.raises(RuntimeError, match="separate_full_blocks=False"):
        flex_attention.create_block_mask("mod", separate_full_blocks=False)


@pytest.mark.skipif(has_torchtitan(), reason="torchtitan is installed here")
def test_without_torchtitan_the_torchtitan_side_is_one_error_line(capsys):
    assert peer.main([str(RECIPES / "mha-1b.yaml"), "--tp", "2", "--dry-run"]) == 2
    err = capsys.readouterr()
    assert err.err.startswith("error: torchtitan 0.3.0 is not importable") and len(err.err.splitlines()) == 1
    assert err.out == ""
