"""``scaletool calibrate``: measure this machine's rates for the step-time model, or check the model
against recorded training results (``--validate``)."""
from __future__ import annotations

import os
import shlex
import sys
import textwrap
from pathlib import Path

import click

from scaletool.cli.options import PositiveFloat, console, deliver, json_option, set_option
from scaletool.fmt import printable


def _short_engine(engine: str) -> str:
    return (engine.replace("deepspeed ZeRO-", "zero").replace(" TP", " tp").replace(" PP", " pp")
            .replace(" interleaved-1f1b", "i").replace(" 1f1b", "").replace(" gpipe", "g"))


#: the step's bound in a word (scaletool.analytic.step's bounds)
BOUND_WORD = {"compute": "compute", "memory bandwidth": "memory", "exposed communication": "comm"}


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

    groups: dict[tuple[str, str], list[tuple[str, dict]]] = {}
    for r in res["runs"]:
        head, name = _where(printable(r["run"]))
        groups.setdefault((head, printable(r.get("calibration") or r["card"])), []).append((name, r))
    # as wide as the longest run name needs, at most what the width leaves (piped output is 1000 columns wide)
    longest = max((len(name.removesuffix(".json")) for rows in groups.values() for name, _ in rows), default=0)
    run_w = max(16, min(width - 52, longest + 2))
    lines = [f"{'run':<{run_w}} {'engine':<10} {'GPUs':>4} {'mode':<5} {'meas.':>6} {'pred.':>6} {'error':>7} bound"]
    for (head, card), rows in groups.items():
        # a long folder wraps (its path stays whole to copy)
        lines += textwrap.wrap(f"{head or 'results'} ({card})", width, break_long_words=True, break_on_hyphens=False)
        for name, r in rows:
            parts = textwrap.wrap(name.removesuffix(".json"), run_w - 2, break_long_words=True, break_on_hyphens=False) or [""]
            bound = str(r["bound"])
            word = "stage " + bound.split()[-1] if bound.startswith("pipeline rank") else BOUND_WORD.get(bound, bound.split()[0])
            figures = (f"{_short_engine(r['engine'])[:10]:<10} {r['world_size']:>4} {'comp' if r['compiled'] else 'eager':<5} "
                       f"{si(r['measured_tokens_per_s_per_gpu']):>6} {si(r['predicted_tokens_per_s_per_gpu']):>6} "
                       f"{r['rel_error']:>+7.1%} {word}")
            lines.append(f"  {parts[0]:<{run_w - 2}} {figures}")
            lines += [f"  {p}" for p in parts[1:]]
    return lines


def summary_lines(res: dict) -> list[str]:
    """The error distribution in README's words: the dense runs and the dropless MoE runs the model claims,
    both together, by engine, and the runs outside the model with the reason."""
    import statistics

    from scaletool.predict.claims import OUTSIDE

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
    """The by-engine key of scaletool.predict.validation.summarize."""
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
        con.print(f"skipped: {escape(printable(line))}", highlight=False)
    if res.get("duplicates"):
        con.print(f"counted once: {len(res['duplicates'])} runs given twice", highlight=False)


def _print_published(res: dict) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    con = console()
    t = Table(title="Published runs predicted (tokens/s per GPU)", title_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    for col in ("id", "card", "GPUs", "ckpt", "mode", "published", "predicted", "error"):
        t.add_column(col, justify="left" if col in ("id", "card", "ckpt", "mode") else "right", no_wrap=True)
    for r in res["rows"]:
        mode = ("comp" if r["compiled"] else "eager") + (" fp8" if r["float8"] != "none" else "")
        t.add_row(escape(printable(r["id"])), escape(printable(r["card"])), str(r["gpus"]), r["activation_checkpointing"], mode,
                  f"{r['measured_tokens_per_s_per_gpu']:,.0f}", f"{r['predicted_tokens_per_s_per_gpu']:,.0f}",
                  f"{r['rel_error']:+.1%}")
    con.print(t)
    for key, title in (("all", "every row predicted"), ("one_node", "one node"), ("multi_node", "several nodes")):
        s = res["summary"][key]
        if s["n"]:
            con.print(f"{title}: median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}, "
                      f"n={s['n']}", highlight=False)
    from scaletool.predict.claims import OUTSIDE

    said: dict[str, list[str]] = {}  # what the prediction took each run to be, and what it does not charge
    for r in res["rows"]:
        for note in [*r["notes"], *([f"outside what the model claims: {OUTSIDE[r['outside']]}"] if r["outside"] else [])]:
            said.setdefault(note, []).append(r["id"])
    for note, ids in said.items():
        which = ", ".join(ids) if len(ids) <= 12 else f"{', '.join(ids[:3])}, ... {ids[-1]} ({len(ids)} rows)"
        text = textwrap.fill(printable(f"{which}: {note}"), max(40, con.width), subsequent_indent="  ")
        con.print(escape(text), highlight=False)
    _print_published_memory(res)
    for r in res["not_expressible"]:
        con.print(f"not expressible: {escape(printable(r['id']))} ({escape(printable(r['model'][:20]))}): "
                  f"{escape(printable(r['reason']))}", highlight=False)
    con.print("sources: the table's source column (--json lists each row's)", highlight=False)


def _print_published_memory(res: dict) -> None:
    """The rows that state their peak memory: published (the allocator's reserved peak, as torchtitan logs it)
    against the estimated (allocated) peak, and whether the plan would call the run fitting its card."""
    from rich.markup import escape

    rows = [r for r in res["rows"] if "memory_rel_error" in r]
    if not rows:
        return
    con = console()
    con.print("peak memory per GPU, published (reserved) vs estimated (allocated):", highlight=False)
    for r in rows:
        fit = {True: "fits", False: "said not to fit", None: "card size unknown"}[r["memory_fits"]]
        con.print(f"  {escape(printable(r['id']))}: {r['published_memory_gib']:.1f} vs {r['estimated_memory_gib']:.1f} "
                  f"GiB ({r['memory_rel_error']:+.1%}), {fit}", highlight=False)
    m = res["summary"]["memory"]
    con.print(f"memory: median |error| {m['median_abs_error']:.1%}, worst {m['worst_abs_error']:.1%}, n={m['n']}"
              + (f"; said not to fit but ran: {', '.join(m['called_not_fitting'])}" if m["called_not_fitting"] else ""),
              highlight=False)


def _print_calibration(cal: dict, out: Path) -> None:
    from rich.markup import escape

    from scaletool.analytic.calibration import ALIBI_KEY
    from scaletool.analytic.host import TP_STEP_PARTS

    con = console()
    g = cal["gemm_tflops"]
    con.print(f"{cal['source']}", highlight=False)
    con.print(f"GEMM: {g['max_tflops']:.4g} TFLOP/s x s/(s+{g['half_dim']:.0f}) over {len(g['points'])} shapes",
              highlight=False)
    for k, v in cal["attention_tflops"].items():
        rates = ", ".join(f"{r:.4g} at T={t}" for t, r in sorted(v.items())) if isinstance(v, dict) else f"{v:.4g}"
        what = "ALiBi's dense score bias path, causal convention" if k == ALIBI_KEY else "causal"
        con.print(f"attention {k}: {rates} TFLOP/s ({what}, forward + backward)", highlight=False)
    con.print(f"HBM copy: {cal['hbm_gb_s']:.4g} GB/s", highlight=False)
    c = cal["collectives"]
    con.print(f"collectives ({c['source']}):", highlight=False)
    for op, t in c["intra_node_gb_s"].items():
        con.print(f"  {op}: " + ", ".join(f"{r} ranks {v:.4g} GB/s" for r, v in sorted(t.items())), highlight=False)
    con.print(f"across nodes: {c['inter_node_gb_s']:.4g} GB/s per GPU ({c.get('inter_node_source', 'assumed')})",
              highlight=False)
    m = cal["measured"]
    tp_failed = [] if "skipped" in m.get("tp_dispatch", {}) else m.get("tp_dispatch", {}).get("failed_attempts", [])
    for what, failed in (("the collectives' processes", m.get("collectives_failed_attempts", [])),
                         ("the tensor-parallel probe's processes", tp_failed)):
        if failed:  # measured on a later start: the figures stand, the failures are said
            con.print(f"note: {what} were started again after {len(failed)} failure(s) "
                      f"(last: {escape(printable(failed[-1]))})", highlight=False)
    host = m.get("host_dispatch")
    if host and "skipped" in host:
        con.print(f"eager block issue time: {host['skipped']}", highlight=False)
    elif host:
        per = ", ".join(f"{mode} {host[mode]['block_s'] * 1e3:.3g} ms" for mode in ("autocast", "bf16") if mode in host)
        con.print(f"eager block issue time ({host['processes']} process(es) at once): {per} per block", highlight=False)
    tp = m.get("tp_dispatch")
    if tp and "skipped" in tp:
        con.print(f"tensor-parallel block issue time: {tp['skipped']}", highlight=False)
    elif tp:
        per = ", ".join(f"{mode} {tp[mode]['block_s']['median'] * 1e3:.3g} ms" for mode in ("eager", "compiled")
                        if mode in tp)
        con.print(f"tensor-parallel block issue time (TP {tp['tensor_parallel']}, per micro-batch): {per} per block",
                  highlight=False)
        for mode in ("eager", "compiled"):
            step = tp.get(mode, {}).get("step")
            if step:  # g·(L·block + head) + L·update_block + update, TP over both ranks
                con.print(f"tensor-parallel step ({mode}): " + ", ".join(
                    f"{part} {step[part]['value'] * 1e3:.3g} ms" for part in TP_STEP_PARTS)
                    + (f"; not written, {step['unresolved']}: the fitted figures stand" if "unresolved" in step else ""),
                    highlight=False)
    odd = m.get("gemm_unaligned")
    if odd:
        con.print(f"GEMMs off 16-byte alignment: {cal['gemm_unaligned']['eager']:.3g} of the curve eager "
                  f"({len(odd)} shape(s))", highlight=False)
    con.print(f"wrote {out}", highlight=False)


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), metavar="PATH",
              help="Calibration YAML to write (default: calibration-<card>.yaml here).")
@click.option("--gpus", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="Local processes for the collectives (group sizes 2..N); NCCL on GPUs, gloo on the CPU. With "
                   "--recipe and N >= 2 also the recipe's tensor-parallel block issue time over 2 of them.")
@click.option("--message-mib", type=PositiveFloat(), multiple=True, metavar="MIB", help="Collective message size "
              "(repeat for several; the largest sets the bus bandwidth) [default: 1, 16, 64, 256 on GPUs; 1 on a CPU].")
@click.option("--recipe", "recipe", metavar="RECIPE", help="Also time this recipe's GEMM and attention shapes.")
@set_option
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="Where to measure GEMMs, attention and HBM.")
@click.option("--validate", "validate", is_flag=True,
              help="Instead of measuring: re-predict recorded training results (PATHS, default the committed "
                   "ones; a run folder's records.jsonl.xz stands for the results it holds) and print predicted "
                   "against measured tokens/s per GPU.")
@click.option("--published", is_flag=True, help="With --validate: predict other projects' published training "
              "runs instead (the shipped table, or PATHS: tables of the same tab-separated columns) at their model, "
              "card, GPU count and layout, set a row's stated peak memory ('mem 82.4 GiB' in its notes) beside "
              "the estimate, and list the rows scaletool cannot express with the reason.")
@click.option("--calibration", metavar="NAME|PATH", help="With --validate: use this calibration for every run "
              "(default: the one of each run's card). A PATH has a '/' or ends in .yaml; a NAME is a shipped one.")
@click.argument("paths", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@json_option
def calibrate(out: Path | None, gpus: int, message_mib: tuple[float, ...], recipe: str | None,
              overrides: tuple[str, ...], device: str,
              validate: bool, published: bool, calibration: str | None, paths: tuple[Path, ...], as_json: bool):
    """Measure this machine's rates for the step-time model and write a calibration YAML: GEMM rates
    (the recipe's shapes and square sizes), causal attention (on a GPU at T from 1,024 to 16,384 and
    the recipe's), HBM copy, collective bus bandwidth over 2..N local processes, and the recipe's eager
    block issue time (on every GPU at once). Each figure is a median with p10/p90 and n, warm-up
    excluded; card, date, torch version and this command are kept in the file. On a CPU it measures
    small sizes with gloo (what CI runs).

    Under torchrun over several nodes it measures the collectives inside each node and across them (one
    rank per node: the inter-node bus bandwidth per GPU that estimate and plan use); rank 0 writes it.

    \b
    Examples:
      scaletool calibrate --gpus 8 --recipe mla-1b --out h100.yaml
      scaletool calibrate --device cpu --gpus 2 --out cpu.yaml
      torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 \\
          -m scaletool calibrate --out cluster.yaml
      scaletool calibrate --validate
      scaletool calibrate --validate run/result.json --json
      scaletool calibrate --validate --published
    """
    from scaletool.errors import RecipeError

    if published and not validate:
        raise RecipeError("--published goes with --validate")
    if published:
        if calibration:
            raise RecipeError("--calibration does not go with --published: each published row uses its card's")
        from scaletool.predict.published import validate_published

        res = validate_published(list(paths) if paths else None)
        deliver(res, as_json)
        if not as_json:
            _print_published(res)
        return res
    if validate:
        from scaletool.predict.validation import validate as run_validation

        res = run_validation(list(paths) if paths else None, calibration)
        deliver(res, as_json)
        if not as_json:
            _print_validation(res)
        return res
    if paths or calibration:
        raise RecipeError("PATHS and --calibration go with --validate")
    if message_mib and gpus < 2 and not os.environ.get("WORLD_SIZE"):
        raise RecipeError("--message-mib: goes with --gpus N (N >= 2) or a torchrun job: there are no collectives "
                          "on one process")
    return _measure(out, gpus, recipe, overrides, device, as_json, message_mib)


def check_out(out: Path) -> None:
    """``--out`` can take the calibration: a regular file (or a link to one) or a new name, in an existing
    directory this process may write; a FIFO, a device (/dev/full), a directory or a missing folder is one
    line now, not after the measurement."""
    import os
    import stat

    from scaletool.errors import RecipeError, shorten

    where = f"--out {shorten(str(out))}"
    try:
        st = out.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:  # a path through a file, a name too long, a link loop
        raise RecipeError(f"{where}: cannot write: {e.strerror or e}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise RecipeError(f"{where}: is a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise RecipeError(f"{where}: not a regular file (a FIFO or a device); calibrate writes a YAML file there")
    folder = Path(os.path.realpath(out)).parent
    if not folder.is_dir():
        raise RecipeError(f"{where}: no such directory {shorten(str(folder))}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RecipeError(f"{where}: cannot write in {shorten(str(folder))} (permission denied)")


def _measure(out: Path | None, gpus: int, recipe: str | None, overrides: tuple[str, ...], device: str, as_json: bool,
             message_mib: tuple[float, ...] = ()):
    import json
    import re

    import torch
    import yaml
    from torch.multiprocessing.spawn import ProcessException

    from scaletool import api
    from scaletool.analytic.calibration import calibration_from_dict
    from scaletool.cli import ErrorLines
    from scaletool.errors import RecipeError, shorten
    from scaletool.fmt import write_atomic
    from scaletool.predict.calibrate import calibrate as measure
    from scaletool.predict.calibrate import card_name
    from scaletool.predict.calibrate_comm import SPAWN_ATTEMPTS, failure_line, job_layout, measure_collectives, measure_in_job

    if device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("--device cuda: no CUDA device here (use --device cpu)")
    dev = torch.device("cuda" if device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    r = api.resolve(recipe, overrides) if recipe else None
    if overrides and not recipe:
        raise RecipeError("--set needs --recipe")
    slug = re.sub(r"[^a-z0-9]+", "-", card_name(dev).lower()).strip("-")
    out = out or Path(f"calibration-{slug}.yaml")
    check_out(out)  # before minutes of measuring, which a path that cannot take the file would lose
    command = " ".join(shlex.quote(a) for a in ["scaletool", *sys.argv[1:]])
    messages = tuple(int(m * 2**20) for m in message_mib) or None
    if messages and min(messages) < 64:
        raise RecipeError("--message-mib: at least 64 bytes (a few elements per rank)")
    job = job_layout()
    if job and gpus > 1:
        raise RecipeError("--gpus: under torchrun the job's own processes are measured (its nodes and "
                          "--nproc-per-node); leave --gpus out")
    if job:  # a torchrun job over one or several nodes: every rank measures, rank 0 writes
        rank, comm = measure_in_job(messages)
        if rank:
            return None
        command = f"torchrun --nnodes {comm['nodes']} --nproc-per-node {comm['per_node']} -m {command}"
    else:
        try:
            comm = measure_collectives(gpus, messages) if gpus > 1 else {}
        except ProcessException as e:  # every start failed: a measurement that did not happen, not a bad input
            raise ErrorLines([f"error: --gpus {gpus}: the collectives' processes failed {SPAWN_ATTEMPTS} times "
                              f"(last: {printable(failure_line(e))}); nothing written"], exit_code=1) from None
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
