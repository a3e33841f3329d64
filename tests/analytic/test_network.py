"""Collectives across nodes (analytic.network): NCCL's ring and hierarchical algorithms against hand-worked
figures, the step-time model reading them, and the inter-node bandwidth option's bad values."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scaletool.analytic.calibration import load_calibration
from scaletool.analytic.collectives import wire_bytes
from scaletool.analytic.comm import collective_group, communication
from scaletool.analytic.network import (
    NCCL_LATENCY_US,
    collective_seconds,
    latency_seconds,
    per_node_of,
    send_seconds,
    with_inter_node,
)
from scaletool.analytic.step import predict_step
from scaletool.config import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
GB = 1e9


def test_one_node_is_nvlink_only_and_one_rank_per_node_the_network_only():
    S = 1e9
    inside = collective_seconds("all_reduce", S, 8, 8, 300 * GB, 40 * GB)
    assert inside["algorithm"] == "nvlink"
    assert inside["seconds"] == pytest.approx(2 * 7 / 8 * S / (300 * GB))
    rails = collective_seconds("all_reduce", S, 4, 1, 300 * GB, 40 * GB)
    assert rails["algorithm"] == "network"
    assert rails["seconds"] == pytest.approx(2 * 3 / 4 * S / (40 * GB))
    assert collective_seconds("all_gather", S, 1, 1, 1.0, 1.0)["seconds"] == 0.0


def test_all_reduce_across_nodes_hand_worked():
    """2 nodes x 8 GPUs, 1 GB, NVLink 300 GB/s, NIC 25 GB/s per GPU.
    ring: 2*15/16 GB over min(300, 8*25 = 200) GB/s = 9.375 ms;
    hierarchical: reduce-scatter + all-gather inside (2 * 7/8 GB at 300: 5.833 ms) + all-reduce of 1/8 GB across
    2 nodes (2 * 1/2 * 0.125 GB at 25: 5 ms) = 10.833 ms: NCCL's ring wins here."""
    out = collective_seconds("all_reduce", 1e9, 16, 8, 300 * GB, 25 * GB)
    assert out["ring_s"] == pytest.approx(2 * 15 / 16 / 200)
    assert out["hierarchical_s"] == pytest.approx(2 * 7 / 8 / 300 + 2 * 0.5 * 0.125 / 25)
    assert out["algorithm"] == "ring" and out["seconds"] == out["ring_s"]
    # a fast network per GPU: the node's NICs outrun NVLink, the ring is NVLink-bound and still the faster
    fast = collective_seconds("all_reduce", 1e9, 16, 8, 300 * GB, 100 * GB)
    assert fast["ring_s"] == pytest.approx(2 * 15 / 16 / 300)
    # many nodes: the hierarchical form's inter-node term shrinks by the node's width
    many = collective_seconds("all_reduce", 1e9, 128, 8, 300 * GB, 25 * GB)
    assert many["hierarchical_s"] == pytest.approx(2 * 7 / 8 / 300 + 2 * 15 / 16 * 0.125 / 25)


def test_gather_scatter_and_all_to_all_across_nodes():
    S = 8e9
    ag = collective_seconds("all_gather", S, 32, 8, 300 * GB, 40 * GB)
    assert ag["hierarchical_s"] == pytest.approx(wire_bytes("all_gather", S, 8) / (300 * GB)
                                                 + wire_bytes("all_gather", S / 8, 4) / (40 * GB))
    assert ag["ring_s"] == pytest.approx(wire_bytes("all_gather", S, 32) / (300 * GB))  # 8 x 40 > 300
    rs = collective_seconds("reduce_scatter", S, 32, 8, 300 * GB, 40 * GB)
    assert rs["seconds"] == pytest.approx(ag["seconds"])
    a2a = collective_seconds("all_to_all", S, 32, 8, 300 * GB, 40 * GB)
    assert a2a["seconds"] == pytest.approx(max(3 / 4 * S / (40 * GB), 7 / 32 * S / (300 * GB)))
    with pytest.raises(ValueError, match="whole number of nodes"):
        collective_seconds("all_gather", S, 12, 8, 1.0, 1.0)


def test_each_collective_pays_nccls_fixed_cost_hand_worked():
    """NCCL's tuner (src/graph/tuning.cc, Simple protocol): a ring's launch 8.4 us, its steps 3.4 us over NVLink and
    14 us across nodes; the all-reduce's tree 28 us a level."""
    us = 1e-6
    assert latency_seconds("all_reduce", 4, 4, "ring") == pytest.approx((8.4 + 6 * 3.4) * us)  # 2(n-1) steps
    assert latency_seconds("all_gather", 8, 8, "ring") == pytest.approx((8.4 + 7 * 3.4) * us)
    # 512 ranks on 64 nodes: 63 of the ring's 511 steps cross a node boundary
    assert latency_seconds("all_gather", 512, 8, "ring") == pytest.approx((8.4 + 448 * 3.4 + 63 * 14) * us)
    assert latency_seconds("reduce_scatter", 512, 8, "hierarchical") == pytest.approx((8.4 + 7 * 3.4 + 63 * 14) * us)
    assert latency_seconds("all_reduce", 512, 8, "hierarchical") == pytest.approx(2 * (7 + 6) * 28 * us)  # log2 64
    assert latency_seconds("all_reduce", 16, 8, "ring") == pytest.approx((8.4 + 26 * 3.4 + 4 * 14) * us)
    assert latency_seconds("all_to_all", 16, 8, "ring") == pytest.approx((8.4 + 14) * us)
    assert latency_seconds("all_gather", 1, 1, "ring") == 0.0
    bandwidth = collective_seconds("all_gather", 1e9, 8, 8, 300 * GB, 40 * GB)["seconds"]
    ten = collective_seconds("all_gather", 1e9, 8, 8, 300 * GB, 40 * GB, count=10)["seconds"]
    assert ten == pytest.approx(bandwidth + 10 * latency_seconds("all_gather", 8, 8, "ring"))
    # many small collectives across nodes: the hierarchical form's fewer network steps win
    small = collective_seconds("all_gather", 1e6, 512, 8, 300 * GB, 40 * GB, count=100)
    assert small["algorithm"] == "hierarchical" and small["ring_s"] > small["hierarchical_s"]


def test_a_small_models_rate_per_gpu_falls_with_the_nodes(monkeypatch):
    """FSDP2 on 128 and 512 GPUs: the same bytes per GPU, so flat without the fixed cost; NCCL's ring steps grow with
    the ranks (llm-foundry's large-scale MPT runs fall 3-10% from 128 to 512 H100s)."""
    h100 = load_calibration("h100-sxm")
    r = load_recipe(str(RECIPES / "mha-1b.yaml"), ["parallel.engine=fsdp", "train.micro_batch_size=8"])
    rate = {n: predict_step(r, h100, world_size=n, gpus_per_node=8)["tokens_per_s_per_gpu"] for n in (128, 512)}
    assert rate[512] < 0.97 * rate[128]
    monkeypatch.setitem(NCCL_LATENCY_US, "ring_base", 0.0)
    for k in ("ring_nvlink", "ring_net", "tree_nvlink", "tree_net"):
        monkeypatch.setitem(NCCL_LATENCY_US, k, 0.0)
    flat = {n: predict_step(r, h100, world_size=n, gpus_per_node=8)["tokens_per_s_per_gpu"] for n in (128, 512)}
    assert flat[512] == pytest.approx(flat[128], rel=0.005) and flat[128] > rate[128]


def test_groups_in_the_row_major_layout():
    assert collective_group("tp", 64, 8) == (8, 1)
    assert collective_group("dp", 64, 8) == (8, 8)
    assert collective_group("dp", 64, 1, replicate=8) == (8, 1)
    assert collective_group("dp_replicate", 64, 1, replicate=8) == (8, 8)
    assert per_node_of(8, 1, 8) == 8  # a shard group is one node
    assert per_node_of(8, 8, 8) == 1  # replicas: one per node
    assert per_node_of(16, 2, 8) == 4  # data parallelism beside TP=2: four of its ranks on each node
    assert per_node_of(12, 1, 8) == 6  # 12 ranks over nodes of 8: the largest even split


def test_point_to_point_send():
    h100 = load_calibration("h100-sxm")
    intra, inter = send_seconds(h100, 1e9, False), send_seconds(h100, 1e9, True)
    assert inter == pytest.approx(1e9 / (h100.collectives["inter_node_gb_s"] * GB))
    assert intra == pytest.approx(1e9 / h100.bus_bandwidth("all_gather", 2))
    assert send_seconds(h100, 0, True) == 0.0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "40"])
def test_with_inter_node_refuses_what_is_not_a_bandwidth(bad):
    with pytest.raises(ValueError, match="not a positive finite number"):
        with_inter_node(load_calibration("h100-sxm"), bad)


def test_the_step_uses_the_inter_node_figure_only_across_nodes():
    h100 = load_calibration("h100-sxm")
    r = load_recipe(str(RECIPES / "llama3-8b.yaml"), ["parallel.engine=fsdp", "train.micro_batch_size=1"])
    one_node = predict_step(r, h100, world_size=8, gpus_per_node=8)
    slow, fast = (predict_step(r, with_inter_node(h100, bw), world_size=64, gpus_per_node=8) for bw in (5, 100))
    assert predict_step(r, with_inter_node(h100, 5), world_size=8, gpus_per_node=8)["step_s"] == one_node["step_s"]
    ag = "comm/dp.all_gather_total_s"
    assert slow["terms"][ag] > fast["terms"][ag]
    assert slow["step_s"] > fast["step_s"]
    assert any("5 GB/s bus bandwidth per GPU (--inter-node-gb-s)" in a for a in slow["assumptions"])


def test_hsdp_communication_and_its_replica_all_reduce():
    base = ["parallel.engine=fsdp", "train.micro_batch_size=1"]
    r = load_recipe(str(RECIPES / "mha-1b.yaml"), base)
    hsdp = load_recipe(str(RECIPES / "mha-1b.yaml"), [*base, "parallel.data_parallel_replicate=4"])
    flat, two_d = communication(r, 32), communication(hsdp, 32)
    assert two_d["data_parallel_shard"] == 8 and two_d["data_parallel_replicate"] == 4
    rows = {(c["group"], c["op"]): c for c in two_d["collectives"]}
    flat_rows = {(c["group"], c["op"]): c for c in flat["collectives"]}
    # the shard group gathers the same messages; the replicas all-reduce a shard of the fp32 gradients
    assert rows["dp", "all_gather"]["message_bytes"] == flat_rows["dp", "all_gather"]["message_bytes"]
    assert rows["dp_replicate", "all_reduce"]["message_bytes"] == pytest.approx(
        rows["dp", "reduce_scatter"]["message_bytes"] / 8, rel=1e-6)
    h100 = with_inter_node(load_calibration("h100-sxm"), 25)
    p_flat = predict_step(r, h100, world_size=32, gpus_per_node=8)
    p_hsdp = predict_step(hsdp, h100, world_size=32, gpus_per_node=8)
    assert p_hsdp["terms"]["comm/dp_replicate.all_reduce_total_s"] > 0
    # HSDP gathers inside a node: its all-gathers cost NVLink time only, below FSDP2's across four nodes
    assert p_hsdp["terms"]["comm/dp.all_gather_total_s"] < p_flat["terms"]["comm/dp.all_gather_total_s"]


def test_hsdp_by_tensor_parallel_shards_over_the_shard_groups_data_parallel_ranks():
    """HSDP × TP over 16 ranks as 2 replicas × 4 shards × 2 TP holds per GPU what FSDP2 × TP over one 8-rank replica
    holds (the same 4-way sharding of the same TP share); the replicas' all-reduce spans nodes, ranks 8 apart."""
    from scaletool.analytic.comm import collective_group
    from scaletool.analytic.memory import recipe_memory

    base = ["parallel.engine=fsdp", "parallel.tensor_parallel=2", "train.micro_batch_size=2"]
    one = load_recipe(str(RECIPES / "mha-1b.yaml"), base)
    hsdp = load_recipe(str(RECIPES / "mha-1b.yaml"), [*base, "parallel.data_parallel_replicate=2"])
    m1, m2 = recipe_memory(one, 8), recipe_memory(hsdp, 16)
    assert m2["data_parallel_shard"] == 4 and m2["data_parallel"] == 8 and "data_parallel_shard" not in m1
    assert m2["total_bytes"] == m1["total_bytes"] and m2["phases"] == m1["phases"]
    assert recipe_memory(hsdp.model_copy(update={"parallel": hsdp.parallel.model_copy(
        update={"data_parallel_replicate": 1})}), 16)["total_bytes"] < m2["total_bytes"]  # FSDP2 over all 8 shards
    c = communication(hsdp, 16)
    assert (c["data_parallel_replicate"], c["data_parallel_shard"], c["tensor_parallel"]) == (2, 4, 2)
    assert collective_group("dp_replicate", 16, 2, 2) == (2, 8) and collective_group("dp", 16, 2, 2) == (4, 2)
    p = predict_step(hsdp, load_calibration("h200"), world_size=16, gpus_per_node=8)
    assert p["terms"]["comm/dp_replicate.all_reduce_total_s"] > 0 and p["terms"]["comm/tp_exposed_s"] > 0


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "scaletool", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value", ["0", "nan", "-5", "inf"])
def test_inter_node_option_bad_values_are_one_error_line(value):
    for cmd in (["estimate", "tiny", "--gpus", "16"], ["plan", "tiny", "--gpus", "16"]):
        res = _cli(*cmd, "--inter-node-gb-s", value)
        assert res.returncode == 2, res.stderr
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and "inter-node-gb-s" in lines[0]
        assert "Traceback" not in res.stderr and not res.stdout


def test_hsdp_shape_that_does_not_divide_is_one_error_line():
    res = _cli("estimate", "tiny", "--gpus", "6", "--set", "parallel.engine=fsdp",
               "--set", "parallel.data_parallel_replicate=4")
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "data_parallel_replicate" in lines[0]
    res = _cli("estimate", "tiny", "--set", "parallel.engine=ddp", "--set", "parallel.data_parallel_replicate=2")
    assert res.returncode == 2 and res.stderr.count("error:") == 1 and "needs parallel.engine=fsdp" in res.stderr


def test_a_calibration_file_carries_the_inter_node_figure_into_estimate_and_plan(tmp_path):
    import json

    import yaml

    from scaletool.resources import data_dir

    raw = yaml.safe_load((data_dir("profiles") / "calibrations" / "h100-sxm.yaml").read_text())
    raw["collectives"]["inter_node_gb_s"] = 5
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(raw))
    args = ["estimate", "mha-1b", "--gpus", "32", "--set", "parallel.engine=fsdp", "--json"]
    default = json.loads(_cli(*args).stdout)["prediction"]
    slow = json.loads(_cli(*args, "--calibration", str(tmp_path / "slow.yaml")).stdout)["prediction"]
    option = json.loads(_cli(*args, "--inter-node-gb-s", "5").stdout)["prediction"]
    fsdp = [next(r["tokens_per_s_per_gpu"] for r in p["rows"] if r["label"] == "fsdp") for p in (default, slow)]
    assert fsdp[1] < fsdp[0]
    assert [r["tokens_per_s_per_gpu"] for r in option["rows"]] == pytest.approx(
        [r["tokens_per_s_per_gpu"] for r in slow["rows"]])
    plan = _cli("plan", "mha-1b", "--gpus", "16", "--calibration", str(tmp_path / "slow.yaml"), "--json")
    assert plan.returncode == 0 and any("5 GB/s bus bandwidth per GPU" in a for a in json.loads(plan.stdout)["assumptions"])
    bad = _cli("estimate", "tiny", "--calibration", str(tmp_path / "none.yaml"))
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: calibration {tmp_path / 'none.yaml'}: no such file"
