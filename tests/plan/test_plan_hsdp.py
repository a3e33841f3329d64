"""HSDP in the plan: across nodes FSDP2 may shard within a node and replicate across nodes; the layout's command
sets ``parallel.data_parallel_replicate`` to the nodes, and the memory the plan fitted is what ``estimate`` says of
that recipe (states sharded over one node's GPUs). On one node there is no HSDP layout."""
from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner

from scaletool.analytic.memory import recipe_memory
from scaletool.cli import main
from scaletool.config import load_recipe


def _plan(*argv: str) -> dict:
    res = CliRunner().invoke(main, ["plan", *argv, "--json"], prog_name="scaletool")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_hsdp_layouts_across_nodes_are_the_recipes_their_commands_set():
    plan = _plan("mha-1b", "--gpus", "16", "--gpus-per-node", "8", "--top", "500", "--inter-node-gb-s", "25")
    hsdp = [r for r in plan["layouts"] if r["label"] == "hsdp"]
    assert hsdp and all(r["engine"] == "fsdp" and r["data_parallel_replicate"] == 2 for r in hsdp)
    for r in hsdp[:3]:
        argv = shlex.split(r["command"])
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        assert "parallel.data_parallel_replicate=2" in sets
        rec = load_recipe("mha-1b", sets)
        assert rec.parallel.data_parallel_replicate == 2 and r["command_problems"] == []
        assert recipe_memory(rec, 16)["total_bytes"] == r["memory_bytes"]
        assert r["prediction"]["terms"]["comm/dp_replicate.all_reduce_total_s"] > 0
    # FSDP2 over every rank shards the states 16 ways, HSDP 8 ways: more memory at the same micro-batch
    flat = {(r["micro_batch_size"], r["activation_checkpointing"], r["compiled"]): r["memory_bytes"]
            for r in plan["layouts"] if r["label"] == "fsdp" and r["tensor_parallel"] == 1}
    same = [(r["memory_bytes"], flat[k]) for r in hsdp if r["tensor_parallel"] == 1
            and (k := (r["micro_batch_size"], r["activation_checkpointing"], r["compiled"])) in flat]
    assert same and all(h > f for h, f in same)


def test_hsdp_by_tensor_parallel_layouts_are_offered_and_estimated_alike():
    """Across nodes HSDP composes with tensor parallelism inside the node (a (replicate, shard, tp) mesh): the plan
    lists such layouts, their commands set both, and the memory and prediction are estimate's for that recipe."""
    from scaletool import api

    plan = _plan("mha-1b", "--gpus", "16", "--gpus-per-node", "8", "--hardware", "h200", "--top", "500")
    rows = [r for r in plan["layouts"] if r["label"] == "hsdp" and r["tensor_parallel"] > 1]
    assert rows and {r["tensor_parallel"] for r in rows} >= {2}
    for r in rows[:3]:
        argv = shlex.split(r["command"])
        rec = load_recipe("mha-1b", [argv[i + 1] for i, a in enumerate(argv) if a == "--set"])
        p = rec.parallel
        assert (p.data_parallel_replicate, p.tensor_parallel) == (2, r["tensor_parallel"])
        mem = recipe_memory(rec, 16)
        assert mem["total_bytes"] == r["memory_bytes"] and mem["data_parallel_shard"] == 8 // r["tensor_parallel"]
        est = api.estimate(rec, world_size=16, hardware="h200", gpus_per_node=8)
        hsdp = next(x for x in est.prediction.rows if x["label"].startswith("hsdp"))
        assert hsdp["label"] == f"hsdp 2x{8 // r['tensor_parallel']} tp{r['tensor_parallel']}"
        assert hsdp["tokens_per_s"] == pytest.approx(r["prediction"]["tokens_per_s"])
        assert r["prediction"]["terms"]["comm/dp_replicate.all_reduce_total_s"] > 0


def test_no_hsdp_on_one_node():
    plan = _plan("tiny", "--gpus", "8", "--top", "500")
    assert not [r for r in plan["layouts"] if r["label"] == "hsdp"]


def test_a_recipe_that_states_hsdp():
    """The plan decides the replicas itself; each command sets what its layout runs over the user's own --set, and
    replicas that do not divide the GPUs planned for are one error line."""
    sets = ["--set", "parallel.engine=fsdp", "--set", "parallel.data_parallel_replicate=2"]
    plan = _plan("tiny", "--gpus", "16", *sets, "--top", "500")
    labels = {r["label"] for r in plan["layouts"]}
    assert {"hsdp", "fsdp", "zero3"} <= labels and any(r["tensor_parallel"] > 1 for r in plan["layouts"])
    for r in plan["layouts"][:20]:
        rec = load_recipe("tiny", [a for a in (shlex.split(r["command"])) if "=" in a and not a.startswith("-")])
        assert rec.parallel.data_parallel_replicate == r["data_parallel_replicate"] and r["command_problems"] == []
    res = CliRunner().invoke(main, ["plan", "tiny", "--gpus", "16", "--set", "parallel.engine=fsdp", "--set",
                                    "parallel.data_parallel_replicate=3"], prog_name="scaletool")
    assert res.exit_code == 2
    assert res.output.strip() == "error: parallel.data_parallel_replicate: 3 replicas do not divide the 16 GPUs planned for"
