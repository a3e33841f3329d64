"""``scaletool calibrate``: measure this machine's rates for the step-time model, or check the model
against recorded training results (``--validate``)."""
from __future__ import annotations

import shlex
import sys
import textwrap
from pathlib import Path

import click

from scaletool.cli.options import console, deliver, json_option, set_option


def _short_engine(engine: str) -> str:
    return engine.replace("deepspeed ZeRO-", "zero").replace(" TP", " tp")


#: the step's bound in a word (scaletool.analytic.step's bounds)
BOUND_WORD = {"compute": "compute", "memory bandwidth": "memory", "exposed communication": "comm"}


def _printable(text: str) -> str:
    """A run's label as printed: no control characters (a file name may hold escape sequences)."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _where(label: str) -> tuple[str, str]:
    """(results file or folder, run within it) of a run's label: ``sweep.results.jsonl: attention=mha`` or
    ``float8-h100/llama8l-none.json``."""
    if ": " in label:
        head, _, name = label.partition(": ")
        return head, name
    head, _, name = label.rpartition("/")
    return (head + "/" if head else ""), name  # result files: their names, without .json


def validation_lines(res: dict, width: int) -> list[str]:
    """The runs as lines that fit ``width`` columns (80 and up): grouped by results file or folder and card
    (said once, above the group's runs), each run's name folded, never cut, its figures beside it."""
    from scaletool.fmt import si

    run_w = max(16, width - 52)
    lines = [f"{'run':<{run_w}} {'engine':<10} {'GPUs':>4} {'mode':<5} {'meas.':>6} {'pred.':>6} {'error':>7} bound"]
    groups: dict[tuple[str, str], list[tuple[str, dict]]] = {}
    for r in res["runs"]:
        head, name = _where(_printable(r["run"]))
        groups.setdefault((head, _printable(r.get("calibration") or r["card"])), []).append((name, r))
    for (head, card), rows in groups.items():
        lines.append(textwrap.shorten(f"{head or 'results'} ({card})", width, placeholder="…"))
        for name, r in rows:
            parts = textwrap.wrap(name.removesuffix(".json"), run_w - 2, break_long_words=True, break_on_hyphens=False) or [""]
            bound = str(r["bound"])
            figures = (f"{_short_engine(r['engine'])[:10]:<10} {r['world_size']:>4} {'comp' if r['compiled'] else 'eager':<5} "
                       f"{si(r['measured_tokens_per_s_per_gpu']):>6} {si(r['predicted_tokens_per_s_per_gpu']):>6} "
                       f"{r['rel_error']:>+7.1%} {BOUND_WORD.get(bound, bound.split()[0])}")
            lines.append(f"  {parts[0]:<{run_w - 2}} {figures}")
            lines += [f"  {p}" for p in parts[1:]]
    return lines


def summary_lines(res: dict) -> list[str]:
    """The error distribution in README's words: the dense runs and the dropless MoE runs the model claims,
    both together, by engine, and the runs outside the model with the reason."""
    import statistics

    from scaletool.measure.validation import OUTSIDE

    def line(what: str, rows: list[dict]) -> str | None:
        errs = [abs(r["rel_error"]) for r in rows]
        if not errs:
            return None
        return f"{what}: median |error| {statistics.median(errs):.1%}, worst {max(errs):.1%}, n={len(errs)}"
    claimed = [r for r in res["runs"] if not r.get("outside")]
    dense, moe = [r for r in claimed if not r.get("moe")], [r for r in claimed if r.get("moe")]
    lines = [line("dense runs the model claims", dense), line("dropless MoE runs the model claims", moe),
             line("all runs the model claims", claimed) if dense and moe else None]
    lines += [f"  {key}: {text.split(': ', 1)[1]}" for key, s in res["summary"]["by_engine"].items()
              if s["n"] for text in [line(key, [r for r in claimed if _group(r) == key])] if text]
    lines += [line(f"outside the model ({OUTSIDE[key]})", [r for r in res["runs"] if r.get("outside") == key])
              for key in res["summary"].get("outside", {})]
    return [x for x in lines if x]


def _group(r: dict) -> str:
    """The by-engine key of scaletool.measure.validation.summarize."""
    return r["engine"] + (" compiled" if r["compiled"] else "")


def _print_validation(res: dict) -> None:
    from rich.markup import escape

    con = console()
    if res["runs"]:
        for line in validation_lines(res, con.width):
            click.echo(line)
        con.print("meas., pred.: tokens/s per GPU, measured at the median step and predicted; error: (predicted − "
                  "measured) / measured; bound: what sets the predicted step", highlight=False)
    for text in summary_lines(res):
        con.print(text, highlight=False)
    if not res["runs"] and not res["skipped"]:
        con.print("no GPU training run to re-predict: the committed results come with a checkout of the repository "
                  "(not with an installed package); pass result files as PATHS", highlight=False)
    for line in res["skipped"]:
        con.print(f"skipped: {escape(line)}", highlight=False)
    if res.get("duplicates"):
        con.print(f"counted once: {len(res['duplicates'])} runs given twice", highlight=False)


def _print_calibration(cal: dict, out: Path) -> None:
    con = console()
    g = cal["gemm_tflops"]
    con.print(f"{cal['source']}", highlight=False)
    con.print(f"GEMM: {g['max_tflops']:.4g} TFLOP/s x s/(s+{g['half_dim']:.0f}) over {len(g['points'])} shapes",
              highlight=False)
    for k, v in cal["attention_tflops"].items():
        con.print(f"attention {k}: {v:.4g} TFLOP/s (causal, forward + backward)", highlight=False)
    con.print(f"HBM copy: {cal['hbm_gb_s']:.4g} GB/s", highlight=False)
    c = cal["collectives"]
    con.print(f"collectives ({c['source']}):", highlight=False)
    for op, t in c["intra_node_gb_s"].items():
        con.print(f"  {op}: " + ", ".join(f"{r} ranks {v:.4g} GB/s" for r, v in sorted(t.items())), highlight=False)
    con.print(f"wrote {out}", highlight=False)


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), metavar="PATH",
              help="Calibration YAML to write (default: calibration-<card>.yaml here).")
@click.option("--gpus", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="Local processes for the collectives (group sizes 2..N); NCCL on GPUs, gloo on the CPU.")
@click.option("--recipe", "recipe", metavar="RECIPE", help="Also time this recipe's GEMM and attention shapes.")
@set_option
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="Where to measure GEMMs, attention and HBM.")
@click.option("--validate", "validate", is_flag=True,
              help="Instead of measuring: re-predict recorded training results (PATHS, default the committed "
                   "ones) and print predicted against measured tokens/s per GPU.")
@click.option("--calibration", metavar="NAME|PATH", help="With --validate: use this calibration for every run "
              "(default: the one of each run's card).")
@click.argument("paths", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@json_option
def calibrate(out: Path | None, gpus: int, recipe: str | None, overrides: tuple[str, ...], device: str,
              validate: bool, calibration: str | None, paths: tuple[Path, ...], as_json: bool):
    """Measure this machine's rates for the step-time model and write a calibration YAML: GEMM rates
    (the recipe's shapes and square sizes), causal attention forward + backward, HBM copy
    bandwidth, and collective bus bandwidth over 2..N local processes. Each figure is a median
    with p10/p90 and n, warm-up excluded; card, date, torch version and this command are kept
    in the file. On a CPU it measures small sizes with gloo (what CI runs).

    \b
    Examples:
      scaletool calibrate --gpus 8 --recipe mla-1b --out h100.yaml
      scaletool calibrate --device cpu --gpus 2 --out cpu.yaml
      scaletool calibrate --validate
      scaletool calibrate --validate run/result.json --json
    """
    from scaletool.errors import RecipeError

    if validate:
        from scaletool.measure.validation import validate as run_validation

        res = run_validation(list(paths) if paths else None, calibration)
        deliver(res, as_json)
        if not as_json:
            _print_validation(res)
        return res
    if paths or calibration:
        raise RecipeError("PATHS and --calibration go with --validate")
    return _measure(out, gpus, recipe, overrides, device, as_json)


def _measure(out: Path | None, gpus: int, recipe: str | None, overrides: tuple[str, ...], device: str, as_json: bool):
    import json
    import re

    import torch
    import yaml

    from scaletool import api
    from scaletool.analytic.calibration import calibration_from_dict
    from scaletool.errors import RecipeError, shorten
    from scaletool.fmt import write_atomic
    from scaletool.measure.calibrate import calibrate as measure
    from scaletool.measure.calibrate import card_name
    from scaletool.measure.calibrate_comm import measure_collectives

    if device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("--device cuda: no CUDA device here (use --device cpu)")
    dev = torch.device("cuda" if device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    r = api.resolve(recipe, overrides) if recipe else None
    if overrides and not recipe:
        raise RecipeError("--set needs --recipe")
    slug = re.sub(r"[^a-z0-9]+", "-", card_name(dev).lower()).strip("-")
    out = out or Path(f"calibration-{slug}.yaml")
    if out.exists() and out.is_dir():
        raise RecipeError(f"--out {shorten(str(out))}: is a directory")
    command = " ".join(shlex.quote(a) for a in ["scaletool", *sys.argv[1:]])
    comm = measure_collectives(gpus) if gpus > 1 else {}
    cal = json.loads(json.dumps(measure(dev, recipe=r, gpus=gpus, command=command, comm=comm)))  # plain types
    calibration_from_dict(cal, str(out))  # what load_calibration will read back
    try:
        text = "# written by scaletool calibrate\n" + yaml.safe_dump(cal, sort_keys=False)
        write_atomic(out, text, follow_links=True)  # the user named it
    except OSError as e:
        raise RecipeError(f"--out {shorten(str(out))}: cannot write: {e.strerror or e}") from None
    deliver({"path": str(out), "calibration": cal}, as_json)
    if not as_json:
        _print_calibration(cal, out)
    return cal
