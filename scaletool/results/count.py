"""``scaletool count``'s result (kind "count"): parameters and FLOPs measured on the built model, beside
the closed forms, under the same key names as ``scaletool estimate`` (``params.total`` is the exact
count in both; ``params.measured`` the sum over the built module).

Schema versions: 1 (before results were typed) named the exact count ``params.analytic`` and had no
``model``, ``flops.per_token`` or ``memory``; 2 names it ``params.total`` like estimate, adds the rest of
estimate's parameter breakdown, ``model``, ``flops.per_token`` (estimate's per-token figures for this
dispatch) and ``memory`` (what counting on a real device needs, checked before building).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from scaletool.results.base import Result, register
from scaletool.results.estimate import ModelSummary, Part


class CountParams(Part):
    total: int  # the exact count (estimate's params.total)
    measured: int  # sum(p.numel()) of the built model
    rel_error: float | None
    active: int
    non_embedding: int
    rule_of_thumb_12d2L: int
    rule_of_thumb_rel_error: float
    by_module: dict[str, int]
    # the rest of estimate's breakdown (absent from version-1 documents)
    embedding: int | None = None
    head: int | None = None
    final_norm: int | None = None
    attention: int | None = None
    ffn: int | None = None
    norms: int | None = None
    matmul: int | None = None
    per_layer: dict[str, Any] | None = None
    moe: dict[str, Any] | None = None


class CounterFlops(Part):
    forward: float
    train: float
    forward_rel_error: float | None
    train_rel_error: float | None


class FvcoreFlops(Part):
    forward: float
    forward_rel_error: float | None
    by_operator: dict[str, float]


class CountFlops(Part):
    tokens: int
    analytic: dict[str, float]  # totals for this batch: forward/train in both conventions, 6·N·T
    flop_counter: CounterFlops
    fvcore: FvcoreFlops | None = None
    notes: list[str]
    per_token: dict[str, Any] | None = None  # estimate's flops.per_token for this dispatch (null in version 1)


class CountMemory(Part):
    """What counting on a real device needs (checked against what is available before building)."""

    required_bytes: int
    components: dict[str, int]
    available_bytes: int | None
    available_source: str | None


class ModuleNode(Part):
    """One module of ``count --by module``: parameters (each counted once, under the first module holding
    it) and forward FLOPs (FlopCounterMode) of it and all below; ``own_*`` what its children do not hold
    or compute (all of it where the tree is cut); ``analytic`` the closed form where one exists."""

    name: str
    type: str
    params: int
    own_params: int
    forward_flops: float
    own_flops: float
    analytic: dict[str, float] | None = None
    children: list[ModuleNode] = []
    train_flops: float | None = None  # the root: forward and backward, all modules
    tokens: int | None = None  # the root: tokens in the counted batch


@register
class CountResult(Result):
    """Measured parameters and FLOPs of a recipe's model, against the closed forms."""

    SCHEMA_VERSION: ClassVar[int] = 2
    kind: Literal["count"] = "count"
    schema_version: int = 2
    device: str
    batch: int
    seq_len: int
    params: CountParams
    flops: CountFlops
    model: ModelSummary | None = None  # null in version-1 documents
    memory: CountMemory | None = None  # null on meta (nothing allocated) and in version 1
    modules: ModuleNode | None = None  # count --by module only

    @classmethod
    def migrate(cls, data: Any) -> Any:
        """Version 1 called the exact count ``params.analytic``."""
        if not isinstance(data, dict):
            return data
        params = dict(data.get("params") or {})
        if "total" not in params and "analytic" in params:
            params["total"] = params.pop("analytic")
        return {**data, "params": params}
