"""Count the collectives a piece of training issues, with their process groups and message sizes.

:class:`CollectiveLog` is a ``TorchDispatchMode``: every collective that reaches the dispatcher while
it is active is recorded, whether DTensor issued it (functional collectives: tensor parallelism's
all-gathers and reduce-scatters, loss parallelism's all-reduces) or a ``ProcessGroup`` call did (c10d
ops: FSDP2's parameter all-gathers and gradient reduce-scatters, DDP's all-reduces). It sees the
collectives of the backward too (autograd runs them through the dispatcher). Works on any device,
so the analytic communication model (:mod:`scaletool.analytic`, "Communication") can be checked on
CPU with gloo; on a GPU the profiler's kernel times say what they cost.

A message is the full tensor a collective works on: an all-gather's output, a reduce-scatter's
input, an all-reduce's tensor (the convention of the analytic model).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# op -> (canonical name, where the full message is: "out" = return value, or an argument index)
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "all_reduce": ("all_reduce", 0),
    "all_to_all_single": ("all_to_all", 0),
}
_C10D = {
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "alltoall_base_": ("all_to_all", 1),
}


@dataclass(frozen=True)
class Collective:
    op: str  # all_gather | reduce_scatter | all_reduce | broadcast | all_to_all
    ranks: tuple[int, ...]  # the group's global ranks (a DeviceMesh dimension's: mesh[dim].mesh.tolist())
    message_bytes: int


def _nbytes(x) -> int:
    tensors = x if isinstance(x, (list, tuple)) else [x]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class CollectiveLog(TorchDispatchMode):
    """``with CollectiveLog() as log: ...`` then ``log.records`` (in issue order) or :meth:`totals`."""

    def __init__(self):
        super().__init__()
        self.records: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives, then see those
        out = func(*args, **(kwargs or {}))
        table = {"_c10d_functional": _FUNCTIONAL, "c10d": _C10D}.get(func.namespace)
        name = func._overloadpacket.__name__
        if table is not None and name in table:
            op, where = table[name]
            if func.namespace == "c10d":  # the ProcessGroup argument arrives boxed as a ScriptObject
                group = ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject)))
            else:  # functional collectives name their group last
                group = _resolve_process_group(args[-1])
            self.records.append(Collective(op, tuple(get_process_group_ranks(group)),
                                           _nbytes(out if where == "out" else args[where])))
        return out

    def totals(self) -> dict[tuple[tuple[int, ...], str], dict[str, int]]:
        """(group's ranks, op) -> {"count", "message_bytes"} summed over the records."""
        out: dict = defaultdict(lambda: {"count": 0, "message_bytes": 0})
        for r in self.records:
            out[r.ranks, r.op]["count"] += 1
            out[r.ranks, r.op]["message_bytes"] += r.message_bytes
        return dict(out)
