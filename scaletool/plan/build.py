"""A plan from a recipe and a cluster: the checked request, the search, the commands and the assumptions."""
from __future__ import annotations

import math

from scaletool.analytic.step import ALLOCATOR_RESERVE_FRACTION, ALLOCATOR_RESERVE_MIN_BYTES, MEDIAN_ABS_ERROR
from scaletool.config import Recipe, RecipeError
from scaletool.measure.hardware import profile_named
from scaletool.plan.commands import command_line, launch_argv
from scaletool.plan.search import Request, search
from scaletool.predict.prediction import calibration_for_device

#: GPUs per node assumed when --gpus-per-node is not given (the HGX/DGX node)
DEFAULT_GPUS_PER_NODE = 8
#: the most GPUs a plan is made for: far past any cluster (the largest published runs use tens of thousands),
#: and a bound on the search, whose divisor walks grow with the count (10^11 GPUs ran for minutes)
MAX_GPUS = 1 << 20


def hardware_profile(name: str):
    """The card's profile (see :func:`~scaletool.measure.hardware.profile_named`)."""
    return profile_named(name)


def check_cluster(gpus: int, gpus_per_node: int | None) -> int:
    """GPUs per node, checked against the GPU count (one line per problem, before any search)."""
    if gpus < 1:
        raise RecipeError(f"gpus: {gpus}: need at least 1 GPU to plan for")
    if gpus > MAX_GPUS or (gpus_per_node is not None and gpus_per_node > MAX_GPUS):
        n = max(gpus, gpus_per_node or 0)
        shown = f"{n:,}" if n < 10**15 else f"a {len(str(n))}-digit count"
        raise RecipeError(f"gpus: {shown}: scaletool plans for at most {MAX_GPUS:,} GPUs")
    g = gpus_per_node if gpus_per_node is not None else min(gpus, DEFAULT_GPUS_PER_NODE)
    if g < 1:
        raise RecipeError(f"gpus per node: {g}: need at least 1")
    if gpus % g:
        raise RecipeError(f"gpus: {gpus} GPUs are not a whole number of nodes of {g} GPUs (give a multiple of {g}, "
                          "or the GPUs per node that divides it)")
    return g


def make_request(gpus: int, gpus_per_node: int | None, hardware: str, *, global_batch_tokens: int | None = None,
                 price_per_gpu_hour: float | None = None, attention_variants: bool = False, top: int = 5,
                 card_bytes: int | None = None, calibration=None, inter_node_gb_s: float | None = None,
                 **narrow) -> Request:
    """The checked :class:`Request` (``narrow``: the Request fields that restrict the search); ``inter_node_gb_s``
    replaces the calibration's bus bandwidth per GPU across nodes."""
    from scaletool.analytic.network import with_inter_node

    g = check_cluster(gpus, gpus_per_node)
    if global_batch_tokens is not None and global_batch_tokens < 1:
        raise RecipeError(f"global batch tokens: {global_batch_tokens}: must be at least 1")
    if price_per_gpu_hour is not None and not (math.isfinite(price_per_gpu_hour) and price_per_gpu_hour > 0):
        raise RecipeError(f"price per GPU hour: {price_per_gpu_hour}: must be a positive number")
    if top < 1:
        raise RecipeError(f"top: {top}: list at least 1 layout")
    if card_bytes is None:
        prof = hardware_profile(hardware)
        if not prof.memory_bytes:
            raise RecipeError(f"hardware {prof.name!r}: its profile ({prof.source}) has no memory_gib, so nothing can "
                              "be fitted to it; add memory_gib to a user profile of that name")
        hardware, card_bytes = prof.name, prof.memory_bytes
        calibration = calibration if calibration is not None else calibration_for_device(prof.device, prof)
    if inter_node_gb_s is not None:
        try:
            calibration = with_inter_node(calibration, inter_node_gb_s)
        except ValueError as e:
            raise RecipeError(f"inter-node bandwidth: {e}") from None
    return Request(gpus=gpus, gpus_per_node=g, hardware=hardware, card_bytes=card_bytes, calibration=calibration,
                   global_batch_tokens=global_batch_tokens, price_per_gpu_hour=price_per_gpu_hour,
                   attention_variants=attention_variants, top=top, **narrow)


def make_plan(recipe: Recipe, recipe_arg: str, overrides: tuple[str, ...], req: Request, progress=None) -> dict:
    """The plan as the fields of :class:`~scaletool.results.plan.PlanResult` (without verification)."""
    from scaletool.predict.prediction import predict as predict_layout

    def predict(r, lay):  # the one prediction per layout that estimate and train's summary also make
        return predict_layout(r, req.calibration, req.gpus, req.gpus_per_node)

    given, R = recipe, recipe.parallel.data_parallel_replicate
    if R > 1:  # HSDP is the plan's own axis (one replica per node): the recipe's replicas must still fit the GPUs
        if req.gpus % R:
            raise RecipeError(f"parallel.data_parallel_replicate: {R} replicas do not divide the {req.gpus} GPUs planned for")
        recipe = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"data_parallel_replicate": 1})})
    found = search(recipe, req, predict, progress)  # only layouts launch accepts (search.family_problems)
    top = found["layouts"][:req.top]
    for row in top:
        row["argv"] = launch_argv(recipe_arg, overrides, given, row, req.gpus, req.gpus_per_node)
        row["command"] = command_line(row["argv"])
        row["command_problems"] = []
    close = within_error(top)
    return {"recipe": recipe_arg, "gpus": req.gpus, "gpus_per_node": req.gpus_per_node,
            "nodes": req.gpus // req.gpus_per_node, "hardware": req.hardware, "card_bytes": req.card_bytes,
            "seq_len": recipe.seq_len, "global_batch_tokens": req.global_batch_tokens,
            "price_per_gpu_hour": req.price_per_gpu_hour, "calibration": req.calibration.name,
            "layouts": top, "fitting_layouts": len(found["layouts"]), "considered": found["considered"],
            "pipeline_comparison": found["pipeline_comparison"],
            "assumptions": assumptions(req) + found["assumptions"],
            "notes": found["notes"] + order_notes(close, req.gpus == req.gpus_per_node) + outside_notes(top),
            "within_error": close, "left_out": found["left_out"],
            "elapsed_s": found["elapsed_s"]}


def within_error(top: list[dict], error: float = MEDIAN_ABS_ERROR) -> list[int]:
    """The ranks (1-based) of the listed layouts predicted within ``error`` of the best one's tokens/s per GPU,
    the best included, when there are two or more: the prediction does not settle their order."""
    rates = [row["prediction"]["tokens_per_s_per_gpu"] for row in top]
    if not rates or not rates[0] or rates[0] <= 0:
        return []
    close = [i + 1 for i, r in enumerate(rates) if r and r >= rates[0] * (1 - error)]
    return close if len(close) > 1 else []


def order_notes(close: list[int], one_node: bool) -> list[str]:
    """One line saying which listed layouts the prediction does not order, and (on one node, where
    ``--verify`` runs them) how to settle it."""
    if not close:
        return []
    ranks = ", ".join(f"#{r}" for r in close)
    how = f" (--verify {max(close)} measures it on such a node)" if one_node else ""
    return [f"{ranks} are predicted within {100 * MEDIAN_ABS_ERROR:.1f}% of the best, the model's median error on the "
            f"committed runs: the prediction does not settle their order{how}"]


def outside_notes(top: list[dict]) -> list[str]:
    """One line per reason the step model does not stand behind listed layouts' predictions
    (:func:`scaletool.predict.claims.outside_layout`), naming their ranks."""
    from scaletool.predict.claims import OUTSIDE, by_reason

    return [f"{', '.join(r[:8])}{f' and {len(r) - 8} more' if len(r) > 8 else ''}: outside what the model claims "
            f"({OUTSIDE[key]}; their tok/s marked *)" for key, r in by_reason(top, lambda row: f"#{row['rank']}").items()]


def assumptions(req: Request) -> list[str]:
    """What the plan assumes beyond the step-time model's own assumptions."""
    nodes = req.gpus // req.gpus_per_node
    out = [f"{nodes} node{'s' if nodes > 1 else ''} × {req.gpus_per_node} GPUs: tensor parallelism stays within a "
           "node" + ("; data parallelism spans the nodes, so its collectives cross the inter-node network" if nodes > 1
                     else ""),
           f"fits: the phase-resolved memory estimate within the card's {req.card_bytes / 2**30:.1f} GiB less "
           f"{100 * ALLOCATOR_RESERVE_FRACTION:.0f}% (at least {ALLOCATOR_RESERVE_MIN_BYTES / 2**30:.0f} GiB) kept for "
           "the allocator, the CUDA context and NCCL"]
    if req.global_batch_tokens is None:
        out.append("global batch not fixed: gradient accumulation 1, the global batch grows with the micro-batch "
                   "(--global-batch-tokens fixes it)")
    else:
        out.append(f"global batch {req.global_batch_tokens:,} tokens: micro-batch × accumulation × sequence length "
                   "× data-parallel ranks")
    return out
