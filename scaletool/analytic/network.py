"""Collectives across nodes: NCCL's ring and hierarchical (tree) algorithms over a node's NVLink and its NICs.

A group of ``ranks`` ranks, ``per_node`` of them on each node, moves a collective's bytes over NVLink inside a node
(``B_intra``, the calibration's intra-node bus bandwidth by op and group size) and the network between nodes
(``B_inter``: what one GPU's NIC carries in a collective, ``collectives.inter_node_gb_s``, measured by
``scaletool calibrate`` over one rank per node, or ``--inter-node-gb-s``). Bus bandwidth is nccl-tests'
convention (PERFORMANCE.md): bytes each rank sends in the bandwidth-optimal algorithm over the time. NCCL (docs,
"Collective Operations", ``NCCL_ALGO``; Jeaugey, "Massively Scale Your Deep Learning Training with NCCL 2.4",
NVIDIA blog 2019) chooses between:

- **ring**: one ring per NIC, crossing each node boundary once: ``wire_bytes / min(B_intra, per_node · B_inter)``;
- **hierarchical / tree**: inside the node, across nodes between GPUs of one local rank (each on its NIC), inside
  again: all-reduce = reduce-scatter and all-gather over the node plus an all-reduce of the ``S / per_node`` shard
  across nodes; all-gather and reduce-scatter: the node's part on ``S``, the rails' part on ``S / per_node``;
  ``time = intra part / B_intra + inter part / B_inter``.

The faster is taken (NCCL's tuner weighs the same two terms), each with its fixed cost per collective as NCCL's
tuner estimates it (:func:`latency_seconds`). All-to-all is point-to-point: the bytes bound for
other nodes at ``B_inter``, concurrent with the rest at ``B_intra``. A group inside one node is NVLink only, a group
of one rank per node (HSDP's replicas) the network only. docs/prediction.md ("Across nodes") works examples.
"""
from __future__ import annotations

import math
from dataclasses import replace

from scaletool.analytic.calibration import Calibration
from scaletool.analytic.collectives import wire_bytes


def _check(ranks: int, per_node: int) -> int:
    if ranks < 1 or per_node < 1 or ranks % per_node:
        raise ValueError(f"a group of {ranks} ranks is not a whole number of nodes of {per_node} of its ranks")
    return ranks // per_node


#: NCCL's tuning model (src/graph/tuning.cc, ``baseLat`` and ``hwLat``, the Simple protocol its large messages use),
#: microseconds: a ring collective's launch, a ring step over NVLink, a ring step across the network; the tree's
#: step (all-reduce's hierarchical algorithm) inside a node and across nodes.
NCCL_LATENCY_US = {"ring_base": 8.4, "ring_nvlink": 3.4, "ring_net": 14.0, "tree_nvlink": 28.0, "tree_net": 28.0}


def latency_seconds(op: str, ranks: int, per_node: int, algorithm: str) -> float:
    """Seconds of one collective's fixed cost as NCCL's tuner estimates it (:data:`NCCL_LATENCY_US`): a ring's n-1
    steps (all-reduce 2(n-1)), nodes-1 of them across nodes (all-reduce 2·nodes); the all-reduce tree's
    2·(g-1 + log2 nodes) levels; the hierarchical all-gather/reduce-scatter a ring in the node and one across;
    all-to-all one step (its sends are concurrent)."""
    if ranks <= 1:
        return 0.0
    us, nodes = NCCL_LATENCY_US, ranks // per_node
    if op == "all_to_all":
        return (us["ring_base"] + (us["ring_net"] if nodes > 1 else us["ring_nvlink"])) * 1e-6
    if algorithm == "hierarchical" and op == "all_reduce":
        steps = 2 * ((per_node - 1) * us["tree_nvlink"] + math.log2(nodes) * us["tree_net"])
        return steps * 1e-6
    factor = 2 if op == "all_reduce" else 1
    if algorithm == "hierarchical":
        intra, inter = factor * (per_node - 1), factor * (nodes - 1)
    else:
        inter = (2 * nodes if op == "all_reduce" else nodes - 1) if nodes > 1 else 0
        intra = factor * (ranks - 1) - inter
    return (us["ring_base"] + intra * us["ring_nvlink"] + inter * us["ring_net"]) * 1e-6


def collective_seconds(op: str, message_bytes: float, ranks: int, per_node: int, intra_bytes_s: float,
                       inter_bytes_s: float, count: int | None = 0) -> dict:
    """Seconds of one collective (``op``, a ``message_bytes`` message as :mod:`scaletool.analytic.comm` counts
    it) over ``ranks`` ranks, ``per_node`` of them on each node, with bus bandwidths ``intra_bytes_s``
    (NVLink) and ``inter_bytes_s`` (the network, per GPU): ``{"seconds", "algorithm", "ring_s",
    "hierarchical_s"}`` (the module docstring gives the formulas and their sources)."""
    nodes = _check(ranks, per_node)
    if ranks == 1 or message_bytes <= 0:
        return {"seconds": 0.0, "algorithm": "none", "ring_s": 0.0, "hierarchical_s": 0.0}
    S, g, Bi, Bn = float(message_bytes), per_node, intra_bytes_s, inter_bytes_s
    n = 1 if count is None else max(0, int(count))  # None: a library's size buckets, one fixed cost charged
    fixed = n * latency_seconds(op, ranks, g, "ring")
    if nodes == 1:
        t = wire_bytes(op, S, ranks) / Bi + fixed
        return {"seconds": t, "algorithm": "nvlink", "ring_s": t, "hierarchical_s": t}
    if g == 1:
        t = wire_bytes(op, S, ranks) / Bn + fixed
        return {"seconds": t, "algorithm": "network", "ring_s": t, "hierarchical_s": t}
    if op == "all_to_all":
        inter = (nodes - 1) / nodes * S
        intra = (g - 1) / ranks * S
        t = max(inter / Bn, intra / Bi) + fixed
        return {"seconds": t, "algorithm": "point-to-point", "ring_s": t, "hierarchical_s": t}
    ring = wire_bytes(op, S, ranks) / min(Bi, g * Bn) + fixed
    if op == "all_reduce":  # reduce-scatter + all-gather inside, all-reduce of the shard across
        hier = 2 * wire_bytes("reduce_scatter", S, g) / Bi + wire_bytes("all_reduce", S / g, nodes) / Bn
    else:  # all-gather / reduce-scatter: the rails' part on S/g, the node's part on S
        hier = wire_bytes(op, S, g) / Bi + wire_bytes(op, S / g, nodes) / Bn
    hier += n * latency_seconds(op, ranks, g, "hierarchical")
    best = "ring" if ring <= hier else "hierarchical"
    return {"seconds": min(ring, hier), "algorithm": best, "ring_s": ring, "hierarchical_s": hier}


def group_seconds(calib: Calibration, op: str, message_bytes: float, ranks: int, per_node: int,
                  count: int | None = 0) -> dict:
    """:func:`collective_seconds` at ``calib``'s rates: the intra-node bus bandwidth measured for ``op`` at the
    group's ranks on one node (``min(ranks, per_node)``), the inter-node figure per GPU."""
    intra = calib.bus_bandwidth(op, max(2, min(ranks, per_node)))
    inter = calib.bus_bandwidth(op, ranks, inter_node=True)
    return collective_seconds(op, message_bytes, ranks, per_node, intra, inter, count)


def per_node_of(ranks: int, stride: int, gpus_per_node: int) -> int:
    """How many of a group's ``ranks`` share a node when the group's members are ``stride`` ranks apart in a
    row-major layout of nodes of ``gpus_per_node`` GPUs (a tensor-parallel group: stride 1; FSDP2's data-parallel
    group beside TP: stride TP; HSDP's replicas: stride = the shard group's size times TP)."""
    if stride >= gpus_per_node:
        return 1
    k = max(1, min(ranks, gpus_per_node // stride))
    while ranks % k:  # nodes that do not hold whole groups: the largest even split below (an approximation)
        k -= 1
    return k


def send_seconds(calib: Calibration, nbytes: float, inter_node: bool) -> float:
    """Seconds of one point-to-point send of ``nbytes`` (a pipeline stage's activations or gradients): across
    nodes at the inter-node bandwidth per GPU, inside a node at NVLink's two-rank bus bandwidth (a two-rank
    all-gather sends each rank's half once: the bus bandwidth is the link's one-way rate)."""
    if nbytes <= 0:
        return 0.0
    rate = calib.bus_bandwidth("all_gather", 2, inter_node=True) if inter_node else calib.bus_bandwidth("all_gather", 2)
    return float(nbytes) / rate


def with_inter_node(calib: Calibration, gb_s: float | None, source: str = "--inter-node-gb-s") -> Calibration:
    """``calib`` with its inter-node bus bandwidth per GPU replaced by ``gb_s`` (GB/s; None: unchanged); a
    ValueError unless it is a finite positive number."""
    if gb_s is None:
        return calib
    if isinstance(gb_s, bool) or not isinstance(gb_s, (int, float)) or not math.isfinite(gb_s) or gb_s <= 0:
        raise ValueError(f"inter-node bandwidth: {gb_s!r} GB/s is not a positive finite number")
    c = {**calib.collectives, "inter_node_gb_s": float(gb_s), "inter_node_source": source}
    return replace(calib, collectives=c, name=f"{calib.name}, inter-node {gb_s:g} GB/s")
