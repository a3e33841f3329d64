"""Tensor parallelism on CPU (gloo): TP=2 (two ranks) and FSDP2 × TP 2×2 (four ranks) against ``single``.

One torchrun job per layout (tests/engines/tp_worker.py) trains every attention kind of the tiny recipe
through ``scaletool.api.train``: with the same seed and the same global batch (8 sequences per step:
one data-parallel rank × 8, or two × 4) the loss and gradient-norm curves equal the one-process run's to
float32 summation-order noise, which any mistake in a plan (a head split the wrong way, a replicated
gradient not summed or summed twice, a data-parallel rank reading another's batch) would exceed by orders
of magnitude. The MLA job saves at step 2; a copy without its step-3 checkpoint resumes from step 2 and
must reproduce the curve, and the checkpoint loads into a plain model with the one-process run's weights.
The recipe rules for ``parallel.tensor_parallel`` are checked in this process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from scaletool import api
from scaletool.analytic.comm import communication, tensor_parallel_config, tensor_parallel_replicated
from scaletool.analytic.params import param_counts
from scaletool.cli import main
from scaletool.config import load_recipe, recipe_from_dict
from scaletool.errors import RecipeError
from scaletool.model import build_model
from scaletool.train.checkpoint import load_model_weights

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
WORKER = str(Path(__file__).with_name("tp_worker.py"))
COMMON = ["train.steps=3", "train.measure_warmup_steps=1"]
KINDS = {"mha": ["model.attention=mha"], "gqa": ["model.attention=gqa", "model.n_kv_heads=2"],
         "mqa": ["model.attention=mqa"], "mla": ["train.checkpoint_every=2"],
         "post": ["model.attention=mha", "model.norm_placement=post", "model.position_encoding=none"]}
#: compiled jobs (per-block torch.compile after the split, aot_eager backend: dynamo and AOT autograd trace the
#: DTensor blocks as on GPUs, without inductor's C++ build) -> the one-process run they must match
COMPILED = {"mha-compiled": ("mha", ["model.attention=mha", "train.compile=true"]),
            "mla-compiled": ("mla", ["train.compile=true"])}
#: layout -> (ranks, tensor_parallel, the kinds it trains, further overrides); "-local": parallel.tp_local_ops, the
#: same split with the blocks on local tensors, must match the one-process runs (and the collectives) the same way;
#: TP=2 on two ranks trains without FSDP2 (pure tensor parallelism), "tp2-fsdp" with it (parallel.fsdp_on_one_rank)
LOCAL = ["parallel.tp_local_ops=true"]
LAYOUTS = {"tp2": (2, 2, ("mha", "gqa", "mqa", "mla", "post", *COMPILED), []),
           "fsdp2x2": (4, 2, ("mha", "gqa", "mla"), []),
           "tp2-local": (2, 2, ("mha", "mqa", "mla", "post", *COMPILED), LOCAL),
           "tp2-fsdp": (2, 2, ("mha", "mla"), ["parallel.fsdp_on_one_rank=true"]),
           "fsdp2x2-local": (4, 2, ("gqa", "mla"), LOCAL)}


def summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process runs, in this process: 8 sequences per step."""
    root = tmp_path_factory.mktemp("single")
    return {kind: api.train(TINY, overrides=COMMON + sets + ["train.micro_batch_size=8"], out=root / kind,
                            quiet=True, measure=False).model_dump(mode="json") | {"out": root / kind}
            for kind, sets in KINDS.items()}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tmp_path_factory):
    name = request.param
    ranks, tp, kinds, extra = LAYOUTS[name]
    root = tmp_path_factory.mktemp(name)
    parallel = ["parallel.engine=fsdp", f"parallel.tensor_parallel={tp}", f"train.micro_batch_size={8 * tp // ranks}",
                *extra]
    jobs = {kind: COMMON + (COMPILED[kind][1] if kind in COMPILED else KINDS[kind]) + parallel for kind in kinds}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), WORKER, TINY,
                        str(root), json.dumps(jobs), json.dumps(parallel)], capture_output=True, text=True,
                       timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1", "TP_WORKER_COMPILE_BACKEND": "aot_eager"})
    assert p.returncode == 0, p.stderr[-4000:]
    return name, ranks, root, kinds, parallel


@pytest.mark.distributed
def test_tensor_parallel_runs_match_single_and_resume(layout, single):
    name, ranks, root, kinds, _ = layout
    for kind in kinds:
        s, ref = summary(root / kind), single[COMPILED[kind][0] if kind in COMPILED else kind]
        assert s["recipe"]["train"]["compile"] == (kind in COMPILED)
        assert s["status"] == "completed" and s["environment"]["world_size"] == ranks, kind
        assert s["recipe"]["parallel"]["tensor_parallel"] == 2
        assert s["tokens_per_step"] == ref["tokens_per_step"], kind  # data-parallel ranks, not all ranks
        assert s["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-5), f"{name} {kind}"
        assert s["history"]["grad_norm"] == pytest.approx(ref["history"]["grad_norm"], rel=1e-4), f"{name} {kind}"
    assert f"fsdp ({ranks // 2} data × 2 tensor parallel) on {ranks}× cpu" in (root / "mla" / "train.log").read_text()
    resumed = summary(root / "mla-resumed")
    assert resumed["start_step"] == 2 and resumed["resumed_from"].endswith("step_2")
    assert resumed["history"]["loss"] == pytest.approx(summary(root / "mla")["history"]["loss"], rel=1e-6)
    cfg = load_recipe(TINY).model
    sharded, plain = build_model(cfg, "cpu", seed=99), build_model(cfg, "cpu", seed=99)
    load_model_weights(root / "mla" / "checkpoints" / "step_2", sharded)
    load_model_weights(single["mla"]["out"] / "checkpoints" / "step_2", plain)
    for key, value in plain.state_dict().items():
        # atol: AdamW's first steps move an element whose gradient is near zero by up to lr, so summation-order
        # noise in that gradient reaches ~1e-5 in the weight (one element in 12288 did); a wrong plan moves many by lr
        torch.testing.assert_close(sharded.state_dict()[key], value, rtol=1e-4, atol=2e-5, msg=key)


@pytest.mark.distributed
def test_the_engines_issue_the_collectives_the_analytic_model_counts(layout):
    """One step's forward and backward, as issued (scaletool.measure.collectives) against
    analytic.communication: every collective of both mesh dimensions, count and bytes, exactly."""
    name, ranks, root, _, parallel = layout
    measured = json.loads((root / "collectives.json").read_text())
    expected: dict[str, dict[str, int]] = {}
    for row in communication(load_recipe(TINY, parallel), world_size=ranks)["collectives"]:
        e = expected.setdefault(f"{row['group']}:{row['op']}", {"count": 0, "message_bytes": 0})
        e["count"] += row["count"]
        e["message_bytes"] += row["message_bytes"]
    assert measured == expected, name


@pytest.fixture
def fake_group():
    """A 4-rank process group in this process (torch's fake backend: shapes and placements without
    communication), for what the plans do to the model."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sets", [["model.attention=mha"], ["model.attention=mqa", "model.qkv_bias=true"],
                                  ["model.attention=gqa", "model.n_heads=8", "model.n_kv_heads=4", "model.qkv_bias=true"],
                                  [], ["model.q_lora_rank=16", "model.tie_embeddings=true", "model.norm=layernorm"]])
@pytest.mark.parametrize("tp", [2, 4])
def test_plans_leave_each_rank_its_analytic_share(fake_group, sets, tp):
    """Every kind's plan: the parameters a rank keeps are analytic.tensor_parallel_config's model (its
    count), the replicated ones are exactly analytic.tensor_parallel_replicated's, and the attention
    modules hold per-rank head counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from scaletool.engines.tp import apply_tensor_parallel

    cfg = load_recipe(TINY, sets + ["parallel.engine=fsdp", f"parallel.tensor_parallel={tp}"]).model
    m = build_model(cfg, "cpu")
    apply_tensor_parallel(m, init_device_mesh("cpu", (tp,)), cfg)
    params = list(m.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    local = tensor_parallel_config(cfg, tp)
    assert sum(p.to_local().numel() for p in params) == param_counts(local)["total"]
    replicated = sorted(p.numel() for p in params if p.placements == (Replicate(),))
    assert replicated == sorted(tensor_parallel_replicated(cfg))
    attn = m.layers[0].attn
    assert attn.n_heads == cfg.n_heads // tp == local.n_heads
    assert getattr(attn, "n_kv_heads", local.n_kv_heads) == local.n_kv_heads


MODEL = {"attention": "gqa", "d_model": 64, "n_layers": 1, "n_heads": 8, "n_kv_heads": 4, "intermediate_size": 128,
         "vocab_size": 256, "max_seq_len": 64}
MOE = {"ffn": "moe", "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def recipe(tp: int, engine: str = "fsdp", **model) -> dict:
    return {"model": {**MODEL, **model}, "parallel": {"engine": engine, "tensor_parallel": tp}}


@pytest.mark.parametrize("raw, lines", [
    (recipe(2, "ddp"), ["parallel.tensor_parallel: 2 needs parallel.engine=fsdp (FSDP2 over the data-parallel ranks, "
                        "tensor parallelism within each group of 2), not engine=ddp"]),
    (recipe(2, "deepspeed"), ["not engine=deepspeed"]),
    (recipe(4, "single"), ["parallel.tensor_parallel: 4 needs parallel.engine=fsdp"]),
    (recipe(3), ["model.n_heads: 8 heads do not split over parallel.tensor_parallel=3 ranks",
                 "model.n_kv_heads: 4 K/V heads do not split over parallel.tensor_parallel=3 ranks",
                 "model.intermediate_size: 128 columns do not split evenly",
                 "model.vocab_size: 256 columns do not split evenly",
                 "train.seq_len: 64 positions (sequence parallelism) do not split evenly"]),
    (recipe(8), ["model.n_kv_heads: 4 K/V heads do not split over parallel.tensor_parallel=8 ranks (attention=mqa "
                 "replicates its single K/V head instead)"]),
    (recipe(8, attention="mqa", n_kv_heads=None), []),  # MQA replicates its K/V head
    (recipe(2, **MOE), ["parallel.tensor_parallel: not supported with model.ffn=moe; parallel.expert_parallel "
                        "splits the experts instead"]),
    (recipe(2, task="regression"), ["parallel.tensor_parallel: supported for task=lm"]),
    (recipe(0), ["parallel.tensor_parallel: Input should be greater than 0"]),
    (recipe(2) | {"parallel": {"engine": "fsdp", "tensor_parallel": 2, "async_tp": True}},
     ["parallel.async_tp: needs parallel.tensor_parallel > 1 and train.compile=true"]),
    (recipe(1) | {"parallel": {"engine": "fsdp", "async_tp": True}, "train": {"compile": True}},
     ["parallel.async_tp: needs parallel.tensor_parallel > 1 and train.compile=true"]),
    (recipe(1) | {"parallel": {"engine": "fsdp", "tp_local_ops": True}},
     ["parallel.tp_local_ops: needs parallel.tensor_parallel > 1"]),
    (recipe(1) | {"parallel": {"engine": "fsdp", "fsdp_on_one_rank": True}},
     ["parallel.fsdp_on_one_rank: needs parallel.tensor_parallel > 1"]),
    (recipe(2, position_encoding="learned"), ["model.position_encoding: learned is not split by tensor parallelism"]),
    (recipe(2, position_encoding="alibi"), ["model.position_encoding: alibi is not split by tensor parallelism"]),
])
def test_tensor_parallel_recipe_rules_are_one_line_each(raw, lines):
    if not lines:
        assert recipe_from_dict(raw).parallel.tensor_parallel == 8
        return
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(raw)
    assert len(err.value.problems) == len(lines)
    for problem, expected in zip(err.value.problems, lines):
        assert expected in problem


def test_a_world_size_tensor_parallel_does_not_divide_is_refused_before_any_rank_starts(tmp_path):
    sets = ["--set", "parallel.engine=fsdp", "--set", "parallel.tensor_parallel=2"]
    r = CliRunner().invoke(main, ["train", TINY, "--out", str(tmp_path / "run"), *sets, "--nproc-per-node", "3"])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [
        "error: parallel.tensor_parallel: 2 does not divide the world size 3 (data-parallel ranks × tensor-parallel ranks)"]
    assert not (tmp_path / "run").exists()
    assert load_recipe(TINY, sets[1::2]).engine_problems(4) == []
