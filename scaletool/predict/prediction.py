"""The step-time model's calibration for a device, and its prediction for a recipe there.

A shipped calibration of the card (``profiles/calibrations/``) is used when one exists, else the
datasheet default derived from the card's hardware profile. The CPU has neither: its calibration is
a placeholder (:func:`cpu_calibration`) so that a CPU run records a prediction and exercises the
whole path; its error there is not meaningful and says nothing about the model.
"""
from __future__ import annotations

from scaletool.analytic.calibration import (
    Calibration,
    calibration_for,
    default_calibration,
    load_calibration,
    shipped_calibration,
)
from scaletool.analytic.pipeline import peak_bytes
from scaletool.analytic.step import predict_step
from scaletool.config import Recipe
from scaletool.errors import RecipeError

#: the CPU placeholder's rates: a few-core CPU's order of magnitude, not a measurement
CPU_PLACEHOLDER = {"gemm_tflops": 0.1, "half_dim": 64, "attention_tflops": 0.02, "memory_gb_s": 10.0, "gloo_gb_s": 1.0}
CPU_NOTE = "CPU placeholder (not measured): the prediction's error on a CPU is not meaningful"


def cpu_calibration() -> Calibration:
    """The shipped calibration named ``cpu`` when there is one (``profiles/calibrations/`` only: a file called
    ``cpu`` in the working directory is not a calibration), else the placeholder."""
    try:
        return shipped_calibration("cpu")
    except RecipeError:
        pass
    c = CPU_PLACEHOLDER
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    return Calibration(
        name="CPU (placeholder)", source=CPU_NOTE, hardware="CPU", peak_tflops=c["gemm_tflops"],
        gemm_tflops={"max_tflops": c["gemm_tflops"], "half_dim": c["half_dim"]},
        attention_tflops={"default": c["attention_tflops"]}, hbm_gb_s=c["memory_gb_s"],
        collectives={"intra_node_gb_s": {op: {2: c["gloo_gb_s"]} for op in ops}, "inter_node_gb_s": c["gloo_gb_s"],
                     "source": "placeholder: gloo over shared memory"},
        overheads={"step_s": 0.01, "micro_batch_s": 0.005})


def calibration_for_device(device_type: str, profile=None) -> Calibration:
    """The calibration for a device: the CPU placeholder, the card's shipped calibration, or the
    datasheet default of its hardware ``profile`` (a RecipeError when there is no profile to derive from)."""
    if device_type == "cpu":
        return cpu_calibration()
    if profile is None:
        raise RecipeError("no hardware profile matches this GPU, so there is no calibration to predict with "
                          "(`scaletool hardware` says how to add a profile)")
    return calibration_for(profile.name) or default_calibration(profile)


def predict(recipe: Recipe, calibration: Calibration, world_size: int, gpus_per_node: int | None = None,
            designed_bubble: bool = False) -> dict:
    """The step-time model's prediction for the recipe as configured (its compile setting included); a pipeline's
    bubble as torch realises its schedule, or as designed (``designed_bubble``: another project's runs)."""
    if recipe.parallel.pipeline_parallel > 1:  # pipeline stages: analytic.pipeline's per-rank model
        from scaletool.analytic.pipeline_time import pipeline_step
        return pipeline_step(recipe, calibration, world_size=world_size, gpus_per_node=gpus_per_node,
                             compiled=recipe.train.compile, designed_bubble=designed_bubble)
    return predict_step(recipe, calibration, world_size=world_size, gpus_per_node=gpus_per_node,
                        compiled=recipe.train.compile)


#: activation checkpointing from the lightest (fastest) to the heaviest (least memory)
CHECKPOINTING = ("none", "selective", "full")


def fitting_checkpointing(recipe: Recipe, world_size: int, card_bytes: float | None) -> str | None:
    """The recipe's activation checkpointing where its estimated peak fits ``card_bytes`` (the allocator's
    reserve kept, as ``plan`` keeps it), else the lightest heavier setting that fits; None when none does.
    No card size known: the recipe's own."""
    from scaletool.analytic.step import fits

    own = recipe.train.activation_checkpointing
    if not card_bytes:
        return own
    for ac in CHECKPOINTING[CHECKPOINTING.index(own):]:
        candidate = recipe.model_copy(update={"train": recipe.train.model_copy(update={"activation_checkpointing": ac})})
        if fits(peak_bytes(candidate, world_size), card_bytes)[0]:
            return ac
    return None


def engine_predictions(recipe: Recipe, world_size: int, hardware: str, inter_node_gb_s: float | None = None,
                       gpus_per_node: int | None = None, calibration: str | None = None) -> dict:
    """The predicted step of the recipe under each engine at ``world_size`` GPUs on ``hardware`` (the
    recipe's micro-batch, accumulation and compile setting; with tensor parallelism the recipe's FSDP2 × TP
    layout only, with pipeline stages the recipe's; under HSDP a row ``hsdp RxS`` follows the engines'): what
    ``estimate`` prints beside the memory table. Each engine at the recipe's checkpointing where that fits the
    card, else at the lightest that does (``activation_checkpointing`` says which; None, and no figures, where
    none fits): one answer per engine, of a run that can start. ``inter_node_gb_s`` replaces the calibration's
    inter-node bus bandwidth per GPU, ``gpus_per_node`` the default of all on one node up to 8; ``calibration`` (a
    shipped name or a file's path, what ``scaletool calibrate`` wrote) replaces the card's own."""
    from scaletool.analytic.network import with_inter_node
    from scaletool.kinds.engines import engine_kind, engines_for, tensor_parallel_engine
    from scaletool.measure.hardware import profile_named
    from scaletool.predict.claims import outside_layout

    prof = profile_named(hardware)
    base = load_calibration(calibration) if calibration else calibration_for_device(prof.device, prof)
    try:
        calib = with_inter_node(base, inter_node_gb_s)
    except ValueError as e:
        raise RecipeError(f"--inter-node-gb-s: {e}") from None
    if gpus_per_node is not None and world_size > gpus_per_node and world_size % gpus_per_node:
        raise RecipeError(f"--gpus-per-node: {world_size} GPUs are not a whole number of nodes of {gpus_per_node}")
    p = recipe.parallel
    R = p.data_parallel_replicate
    if p.pipeline_parallel > 1:  # stages over the engine that composes with them (kinds.pipeline)
        tp = f" tp{p.tensor_parallel}" if p.tensor_parallel > 1 else ""
        layouts = [(f"{p.engine} pp{p.pipeline_parallel}{tp} {p.pipeline_schedule}", p.engine, p.zero_stage)]
    elif p.tensor_parallel > 1:
        engine = tensor_parallel_engine()
        layouts = [(f"{engine} tp{p.tensor_parallel}", engine, p.zero_stage)]
    else:
        layouts = engines_for(world_size)
    rows = []
    for label, engine, stage in layouts:
        par = p.model_copy(update={"engine": engine, "zero_stage": stage or p.zero_stage, "data_parallel_replicate": 1})
        # train.float8 where the engine takes it; the others' rows are bf16 (the recipe rules refuse them)
        t = recipe.train if engine_kind(engine).float8 else recipe.train.model_copy(update={"float8": "none"})
        layout = recipe.model_copy(update={"parallel": par, "train": t})
        ac = fitting_checkpointing(layout, world_size, prof.memory_bytes)
        if ac is None:  # no checkpointing fits the card: a speed of a run that cannot start answers nothing
            rows.append({"label": label, "activation_checkpointing": None, "outside": None, "step_s": None, "tokens_per_s": None,
                         "tokens_per_s_per_gpu": None, "mfu": None, "hfu": None, "bound": "does not fit"})
            continue
        if ac != t.activation_checkpointing:
            layout = layout.model_copy(update={"train": t.model_copy(update={"activation_checkpointing": ac})})
        pred = predict(layout, calib, world_size, gpus_per_node)
        rows.append({"label": label, "activation_checkpointing": ac, "outside": outside_layout(layout, pred["step_s"]),
                     **{k: pred[k] for k in ("step_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "hfu", "bound")}})
    # the recipe's HSDP beside FSDP2 over every rank: replicas x shard group
    if R > 1 and "data_parallel_replicate" in engine_kind(p.engine).layouts:
        pred = predict(recipe, calib, world_size, gpus_per_node)
        tp = p.tensor_parallel
        rows.append({"label": f"hsdp {R}x{world_size // (R * tp)}" + (f" tp{tp}" if tp > 1 else ""),
                     "activation_checkpointing": recipe.train.activation_checkpointing,
                     "outside": outside_layout(recipe, pred["step_s"]),
                     **{k: pred[k] for k in ("step_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "hfu", "bound")}})
    return {"hardware": prof.name, "calibration": calib.name, "calibration_source": calib.source,
            "calibration_file": calib.file or None, "world_size": world_size, "rows": rows}
