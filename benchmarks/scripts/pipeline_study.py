"""Pipeline stages against FSDP2 alone on 4 (or 2) GPUs: measured beside predicted, and the measured bubble.

    python benchmarks/scripts/pipeline_study.py OUT [--models mla-1b,mha-1b,llama3-8b] [--gpus 4|2]
        [--seqs-per-microbatch S] [--only NAME,...] [--set KEY=VALUE ...] [--suffix TEXT] [--dry-run]

For each model (llama3-8b cut to 8 blocks so that FSDP2 × 4 fits an 80 GB card at its own sequence length), the layouts
FSDP2 × 4, PP = 4, PP = 2 × FSDP2 = 2 and PP = 2 × TP = 2, under 1F1B and interleaved 1F1B (2 chunks per rank), at 4 and 8
pipeline micro-batches of S sequences each (FSDP2 alone: the same 8·S sequences per step), 12 steps with 4
of warm-up; on 2 GPUs FSDP2 × 2 against PP = 2. Each run is a ``scaletool train --nproc-per-node N`` launch
into OUT/<name>; OUT/results.jsonl gets
one JSON record per run: tokens/s per GPU (median, p10, p90, n of the measured steps), peak memory, the
prediction (analytic.pipeline: step, tokens/s per GPU, peak memory per stage, bubble), and per pipeline layout
the measured bubble fraction from the two micro-batch counts: with t(m) = m·s + b (s one micro-batch's work on
the slowest rank, b the time that does not grow with m), s = (t(8) − t(4))/4, b = t(4) − 4·s, bubble(m) = b / t(m);
the predicted bubble derived the same way from the two predicted step times, beside the pipeline's idle share.
``--only`` keeps the runs whose names contain one of the given parts (``pp2x2-interleaved``); ``--set`` adds
overrides to every run (a variant, for example ``parallel.reshard_after_forward=false``) and ``--suffix`` marks
their names, so a variant and its baseline sit side by side in one OUT from one call.
Expected wall time on 4 H100: about 4 minutes per model (--models picks).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MODELS = {"mla-1b": [], "mha-1b": [], "llama3-8b": ["model.n_layers=8"]}
COMMON = ["train.steps=12", "train.measure_warmup_steps=4", "train.compile=false"]
def layouts(gpus: int) -> dict[str, list[str]]:
    """name -> overrides on ``gpus`` GPUs; {m}: pipeline micro-batches, {b}: m x sequences in each, {f}: FSDP2's
    micro-batch (the sequences per step of 8 pipeline micro-batches)."""
    staged = {f"pp{gpus}": (gpus, 1), **({"pp2x2": (2, 1), "pp2tp2": (2, 2)} if gpus == 4 else {})}
    out = {f"fsdp{gpus}": ["parallel.engine=fsdp", "train.micro_batch_size={f}"]}
    for name, (P, tp) in staged.items():
        base = ["parallel.engine=fsdp", f"parallel.pipeline_parallel={P}", "train.micro_batch_size={b}",
                "parallel.pipeline_microbatches={m}", *([f"parallel.tensor_parallel={tp}"] if tp > 1 else [])]
        out[f"{name}-1f1b-m{{m}}"] = base
        out[f"{name}-interleaved-m{{m}}"] = [*base, "parallel.pipeline_schedule=interleaved-1f1b",
                                             "parallel.pipeline_virtual_stages=2"]
    return out


def runs(models: list[str], seqs: int = 1, gpus: int = 4, only: tuple[str, ...] = (), extra: tuple[str, ...] = (),
         suffix: str = ""):
    """(name, model, overrides) of every run; ``seqs`` sequences per pipeline micro-batch (FSDP2 alone: the same
    8 x ``seqs`` sequences per step over its ranks); ``only``: the names holding one of these parts; ``extra``:
    overrides added to each run, whose name is marked ``-suffix``."""
    for model in models:
        for layout, sets in layouts(gpus).items():
            for m in ((4, 8) if "{m}" in layout else (None,)):
                name = f"{model}-{layout.format(m=m)}"
                if only and not any(part in name for part in only):
                    continue
                sets_m = [s.format(m=m, b=(m or 1) * seqs, f=8 // gpus * seqs) for s in MODELS[model] + COMMON + sets]
                # the suffix goes before the micro-batch count, so that -m4/-m8 still pair for the bubble
                tag = f"-{suffix}" if suffix else ""
                yield (name.replace(f"-m{m}", f"{tag}-m{m}") if m else name + tag), model, [*sets_m, *extra]


def predicted(model: str, sets: list[str], gpus: int = 4) -> dict:
    from scaletool.analytic.pipeline import stage_memory
    from scaletool.analytic.pipeline_time import pipeline_step
    from scaletool.config import load_recipe
    from scaletool.predict.prediction import calibration_for_device, predict

    r = load_recipe(f"recipes/{model}.yaml", sets)
    prof = card_profile()
    calib = calibration_for_device(prof.device, prof)
    if r.parallel.pipeline_parallel == 1:
        p = predict(r, calib, gpus)
        return {"step_s": p["step_s"], "tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"]}
    p = pipeline_step(r, calib, world_size=gpus)
    return {"step_s": p["step_s"], "tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"], "bubble_fraction": p["bubble_fraction"],
            "bounding_rank": p["bounding_rank"], "split": p["split"],
            "peak_bytes_per_rank": [row["total_bytes"] for row in stage_memory(r, gpus)]}


def card_profile():
    """The hardware profile of the card this study runs on (GPU 0), or the H100 SXM's where no card or no profile
    matches (a dry run on a CPU)."""
    import torch

    from scaletool.measure.hardware import profile_for, profile_named
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return (profile_for("cuda", name) if name else None) or profile_named("H100 SXM")


def spread(values: list[float]) -> dict:
    """Median, p10, p90 (statistics.quantiles, exclusive method) and n."""
    q = statistics.quantiles(values, n=10) if len(values) >= 2 else [values[0]] * 9
    return {"median": statistics.median(values), "p10": q[0], "p90": q[-1], "n": len(values)}


def measured(summary: dict, gpus: int = 4) -> dict:
    h = summary["history"]
    start = summary["measure_warmup_steps"]
    times = h["step_time_s"][start:]
    tps = [summary["tokens_per_step"] / t / gpus for t in times]
    return {"step_s": spread(times), "tokens_per_s_per_gpu": spread(tps),
            "card": (summary.get("hardware") or {}).get("profile"),
            "contended": summary.get("contention", {}).get("contended"),
            "peak_memory_bytes": summary.get("peak_memory_bytes"),
            # each rank's peak beside its own stage's estimate (ranks pipeline-outermost: stage = rank // dp)
            "per_rank": [{k: x.get(k) for k in ("rank", "peak_allocated_bytes", "stage_estimate_bytes")}
                         for x in (summary.get("memory") or {}).get("per_rank", [])]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--gpus", type=int, default=4, choices=(2, 4),
                    help="GPUs of one host (default 4; 2: PP = 2 against FSDP2 x 2)")
    ap.add_argument("--seqs-per-microbatch", type=int, default=1, choices=range(1, 65), metavar="S",
                    help="sequences in each pipeline micro-batch (default 1; larger keeps each stage's work off the host's "
                         "dispatch bound)")
    ap.add_argument("--only", default="", metavar="NAME,...",
                    help="only the runs whose names contain one of these parts (e.g. pp2x2-interleaved,fsdp4)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="an override added to every run (repeatable)")
    ap.add_argument("--suffix", default="", help="marks each run's name (-SUFFIX; a variant beside its baseline)")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    if a.suffix and not all(c.isalnum() or c in "-_." for c in a.suffix):
        sys.exit("error: --suffix: letters, digits, '-', '_' and '.' only (it names run folders)")
    if any("=" not in x for x in a.extra):
        sys.exit("error: --set takes KEY=VALUE")
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        sys.exit(f"error: unknown model {unknown[0]!r}; one of {', '.join(MODELS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    records = {}
    only = tuple(x for x in a.only.split(",") if x)
    for name, model, sets in runs(models, a.seqs_per_microbatch, a.gpus, only, tuple(a.extra), a.suffix):
        cmd = [sys.executable, "-m", "scaletool", "train", f"recipes/{model}.yaml", "--out", str(a.out / name), "--json",
               "--nproc-per-node", str(a.gpus), *[x for s in sets for x in ("--set", s)]]
        if a.dry_run:
            print(" ".join(cmd))
            continue
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        rec = {"name": name, "model": model, "sets": sets, "returncode": p.returncode,
               "predicted": predicted(model, sets, a.gpus)}
        if p.returncode == 0:
            summary = json.loads(p.stdout)
            rec["measured"] = measured(summary, a.gpus)
            rec["train_prediction"] = {k: (summary.get("prediction") or {}).get(k) for k in ("step_s", "tokens_per_s_per_gpu")}
        else:
            rec["error"] = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")][:3]
        records[name] = rec
        with (a.out / "results.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
    for name, rec in records.items():  # the measured bubble from the two micro-batch counts
        if name.endswith("-m4") and name[:-1] + "8" in records and "measured" in rec \
                and "measured" in records[name[:-1] + "8"]:
            t4 = rec["measured"]["step_s"]["median"]
            t8 = records[name[:-1] + "8"]["measured"]["step_s"]["median"]
            s = (t8 - t4) / 4
            b = t4 - 4 * s
            with (a.out / "results.jsonl").open("a") as f:
                # the prediction's bubble derived the same way from its two step times (what does not grow with
                # m: the pipeline's idle time, the optimizer, FSDP2's last reduce-scatter), beside its idle share
                p4, p8 = rec["predicted"]["step_s"], records[name[:-1] + "8"]["predicted"]["step_s"]
                pb = p4 - 4 * (p8 - p4) / 4
                f.write(json.dumps({"name": name[:-3], "bubble_measured": {"m4": b / t4, "m8": b / t8},
                                    "bubble_predicted": {"m4": pb / p4, "m8": pb / p8},
                                    "pipeline_idle_predicted": {"m4": rec["predicted"]["bubble_fraction"],
                                                                "m8": records[name[:-1] + "8"]["predicted"]["bubble_fraction"]}})
                        + "\n")


if __name__ == "__main__":
    main()
