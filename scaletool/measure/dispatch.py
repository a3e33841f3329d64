"""Count the host-side work of a piece of training: DTensor op dispatches, plain aten ops, collectives.

Tensor parallelism on DTensor pays, for every op whose arguments are DTensors, a Python-side
sharding propagation and unwrap/rewrap on the host, besides the local op itself; at 1B parameters
that host time, not communication, bounds a TP step. :class:`DispatchCount` is a
``TorchDispatchMode``: it sees each op with DTensor arguments once (then lets DTensor run it, and
sees the local ops and collectives it turns into), forward and backward alike, and counts the
``DTensor.from_local`` / ``to_local`` / ``redistribute`` calls made while it is active. The counts
are the same on any device, so a plan's host cost can be compared on CPU with gloo.
"""
from __future__ import annotations

from collections import Counter

from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from scaletool.measure.collectives import _C10D, _FUNCTIONAL

_WRAPPERS = ("from_local", "to_local", "redistribute")
_COLLECTIVES = {"_c10d_functional": set(_FUNCTIONAL), "c10d": set(_C10D)}


class DispatchCount(TorchDispatchMode):
    """``with DispatchCount() as c: ...`` then ``c.summary()``; ``c.dtensor_ops`` counts by op name."""

    def __init__(self):
        super().__init__()
        self.dtensor_ops: Counter[str] = Counter()
        self.local_ops: Counter[str] = Counter()
        self.collectives: Counter[str] = Counter()
        self.wrappers: Counter[str] = Counter()
        self._saved: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if any(issubclass(t, DTensor) for t in types):
            self.dtensor_ops[name] += 1
            return NotImplemented  # DTensor turns it into local ops (and collectives), which come back here
        if name in _COLLECTIVES.get(func.namespace, ()):
            self.collectives[name] += 1
        else:
            self.local_ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in _WRAPPERS:  # counted where a plan calls them (parallel styles, autograd Functions)
            self._saved[name] = original = DTensor.__dict__[name]
            self._wrap(name, original)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(DTensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)

    def _wrap(self, name: str, original) -> None:
        counts = self.wrappers
        if isinstance(original, staticmethod):
            fn = original.__func__

            def counted_static(*a, **k):
                counts[name] += 1
                return fn(*a, **k)
            setattr(DTensor, name, staticmethod(counted_static))
        else:
            def counted(*a, **k):
                counts[name] += 1
                return original(*a, **k)
            setattr(DTensor, name, counted)

    def summary(self) -> dict:
        """Totals and the per-op breakdown (most frequent first), JSON-ready."""
        return {"dtensor_ops": sum(self.dtensor_ops.values()), "local_ops": sum(self.local_ops.values()),
                "collectives": sum(self.collectives.values()), **{f"{k}_calls": self.wrappers[k] for k in _WRAPPERS},
                "collectives_by_name": dict(self.collectives), "dtensor_ops_by_name": dict(self.dtensor_ops.most_common())}
