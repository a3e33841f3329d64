"""``plan --verify K``: plan again for this machine, run the best K layouts for a few steps, and set the
measurement beside the prediction.

This machine is its CUDA devices (one rank each, their memory as torch reports it) or, without CUDA,
up to two CPU ranks over gloo (eager only, engines single, DDP and FSDP2, micro-batches up to the
recipe's: a CPU step of a large micro-batch takes minutes, and on the CPU the prediction's calibration
is a placeholder, so its error says nothing about the model). Each layout runs as its own
``python -m scaletool train`` process into a temporary run directory, removed afterwards.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from scaletool.config import Recipe
from scaletool.errors import RecipeError, shorten
from scaletool.kinds.engines import engine_kind, table_engines
from scaletool.plan.build import make_plan, make_request
from scaletool.plan.commands import command_line, describe, layout_sets
from scaletool.predict.prediction import calibration_for_device
from scaletool.stats import rel_error

#: steps of a verification run, and how many of them are warm-up (not measured)
VERIFY_STEPS, VERIFY_WARMUP = 10, 3
#: seconds one verification run may take before it is stopped
VERIFY_TIMEOUT_S = 1800


def local_machine() -> dict:
    """Ranks, device kind and name, memory per rank, and the matching profile of this machine."""
    import torch

    from scaletool.measure.hardware import profile_for

    if torch.cuda.is_available() and torch.cuda.device_count():
        name = torch.cuda.get_device_name(0)
        return {"device": "cuda", "name": name, "ranks": torch.cuda.device_count(), "profile": profile_for("cuda", name),
                "memory_bytes": torch.cuda.get_device_properties(0).total_memory}
    ranks = min(2, os.cpu_count() or 1)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"device": "cpu", "name": "CPU", "ranks": ranks, "profile": None, "memory_bytes": ram // ranks}


def carried_batch(asked, ranks: int) -> tuple[int | None, str | None]:
    """The global batch a verification on ``ranks`` ranks plans for, from the plan's request ``asked``: the
    same tokens per GPU (``--global-batch-tokens`` over ``--gpus``, times this machine's ranks), and a note."""
    if asked is None or asked.global_batch_tokens is None:
        return None, None
    per_gpu, rest = divmod(asked.global_batch_tokens, asked.gpus)
    if rest:
        return None, (f"global batch not kept: {asked.global_batch_tokens:,} tokens over {asked.gpus} GPUs is not a "
                      "whole number per GPU; verified with accumulation 1")
    return per_gpu * ranks, (f"global batch {per_gpu * ranks:,} tokens here: the plan's {per_gpu:,} per GPU on "
                             f"{ranks} rank{'s' if ranks > 1 else ''}")


def local_plan(recipe: Recipe, name: str, overrides: tuple[str, ...], k: int, machine: dict, asked=None) -> dict:
    """The plan for this machine: its ranks, its memory, its calibration, and the asked plan's global batch
    per GPU and attention variants (``asked``, its request); on the CPU narrowed as above."""
    cpu = machine["device"] == "cpu"
    narrow = {"labels": tuple(label for label, engine, _ in table_engines() if engine_kind(engine).quick_on_cpu),
              "compiled": (False,),
              "max_micro_batch": recipe.train.micro_batch_size} if cpu else {}
    batch, _ = carried_batch(asked, machine["ranks"])
    req = make_request(machine["ranks"], machine["ranks"], machine["name"], top=k, card_bytes=machine["memory_bytes"],
                       calibration=calibration_for_device(machine["device"], machine["profile"]),
                       global_batch_tokens=batch, attention_variants=bool(asked and asked.attention_variants), **narrow)
    return make_plan(recipe, name, overrides, req)


def train_argv(name: str, overrides: tuple[str, ...], recipe: Recipe, row: dict, ranks: int, out: Path) -> list[str]:
    """``python -m scaletool train`` of one layout for a few steps (the layout's keys after the user's)."""
    sets = {**layout_sets(recipe, row), "train.steps": VERIFY_STEPS, "train.measure_warmup_steps": VERIFY_WARMUP,
            "train.checkpoint_every": 0}
    argv = [sys.executable, "-m", "scaletool", "train", name, "--out", str(out), "--json"]
    if ranks > 1 or engine_kind(row["engine"]).distributed:
        argv += ["--nproc-per-node", str(ranks)]
    for item in overrides:
        argv += ["--set", item]
    for key, value in sets.items():
        argv += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    return argv


class Interrupted(Exception):
    """SIGINT or SIGTERM while layouts were being verified."""


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first, then the parent's pid), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc's parent links; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        fields = _stat(entry) if entry.isdigit() else None
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """Stop a verification run and everything it started: SIGTERM to its process group (its torchrun agent
    passes it on to the ranks, which may run in sessions of their own), SIGKILL to the run after ``grace_s``,
    then the same two steps for whatever of its process tree outlived it; returns once all are gone, so the
    next layout finds the GPUs free."""
    tree = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    try:  # wait, not communicate: a rank that outlives the run holds the pipes open
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        tree |= _descendants(proc.pid)
        _signal_all([proc.pid], signal.SIGKILL)
        proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = {pid for pid in tree if _alive(pid)}
        _signal_all(alive, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 10)
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = {pid for pid in alive if _alive(pid)}
        if not alive:
            return


def _run(argv: list[str]) -> tuple[dict | None, str | None]:
    """(the train result, None) or (None, why it failed in one line); on an interruption the run (its whole
    process group) is stopped and ``Interrupted`` raised."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=VERIFY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return None, f"did not finish within {VERIFY_TIMEOUT_S} s"
    except (KeyboardInterrupt, Interrupted):
        _stop(proc)
        raise Interrupted from None
    try:
        doc = json.loads(stdout) if stdout.strip() else None
    except json.JSONDecodeError:
        doc = None
    if proc.returncode != 0 or doc is None:
        return doc, failure_line(stderr, proc.returncode)
    return doc, None


def _raise_interrupted(signum, frame):
    raise Interrupted


def outcome_line(v: dict) -> str:
    """One verified layout in a line: measured beside predicted, or why it did not run."""
    head = f"verify {v['rank']}: {v['layout']}: "
    m = v["measured_tokens_per_s"]
    if not m:
        return head + f"{v['status']}: {v['message'] or 'no measurement'}"
    line = head + f"{m['median']:,.0f} tok/s (p10-p90 {m['p10']:,.0f}-{m['p90']:,.0f}, n={m['n']}), predicted " \
                  f"{v['rel_error_tokens_per_s']:+.1%}"
    if v["measured_peak_memory_bytes"]:
        line += f"; {v['measured_peak_memory_bytes'] / 2**30:.2f} GiB, estimate {v['rel_error_memory']:+.1%}"
    if v.get("alloc_retries"):  # the card was full: the allocator freed its cache and retried, each time a sync
        line += f"; the allocator retried {v['alloc_retries']:,} times (the card full: slower than predicted)"
    return line


#: the last line of a Python traceback: ``module.Name: message`` (or the bare name)
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)|[A-Za-z_][\w.]*Warning)(: .*)?$")


def failure_line(stderr: str, returncode: int) -> str:
    """Why a verification run failed, in one line: train's first ``error:`` line; else the exception a
    traceback ended with (a crash before train could report it); else the exit status (a signal as its name)."""
    lines = stderr.splitlines()
    errors = [ln for ln in lines if ln.startswith("error:")]
    if errors:
        return errors[0].removeprefix("error: ").strip()
    raised = [ln.strip() for ln in lines if _EXCEPTION.match(ln.strip())]
    if raised:
        return raised[-1][:300]
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"exit status {returncode}"


def _verified(row: dict, ranks: int, doc: dict | None, why: str | None, command: str, status: str | None = None) -> dict:
    timing = (doc or {}).get("timing") or {}
    rate = timing.get("tokens_per_s")
    peak = (doc or {}).get("peak_memory_bytes")
    predicted = row["prediction"]["tokens_per_s"]
    return {"rank": row["rank"], "layout": describe(row), "world_size": ranks, "predicted_tokens_per_s": predicted,
            "measured_tokens_per_s": rate, "rel_error_tokens_per_s": rel_error(predicted, rate["median"]) if rate else None,
            "predicted_memory_bytes": row["memory_bytes"], "measured_peak_memory_bytes": peak,
            "rel_error_memory": rel_error(row["memory_bytes"], peak) if peak else None,
            "alloc_retries": ((doc or {}).get("memory") or {}).get("alloc_retries"),
            "status": status or (doc or {}).get("status") or "failed", "message": why, "command": command}


def prepare_keep_dir(path: Path) -> Path:
    """``--verify-out``: a new or empty directory for the verified runs, created; a RecipeError (one line) for
    a file, a directory with something in it, or one that cannot be made."""
    shown = shorten(str(path))
    if path.exists() and not path.is_dir():
        raise RecipeError(f"--verify-out {shown}: not a directory")
    try:
        if path.is_dir() and any(path.iterdir()):
            raise RecipeError(f"--verify-out {shown}: not empty; each layout's run goes to {shown}/layoutN, so "
                              "name a new or empty directory")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"--verify-out {shown}: {e.strerror or e}") from None
    return path


def verify_locally(recipe: Recipe, name: str, overrides: tuple[str, ...], k: int, progress=None,
                   asked=None, keep: Path | None = None) -> tuple[list, list]:
    """Run the best ``k`` layouts that fit this machine (``asked``: the plan's request, whose global batch per
    GPU and attention variants carry over); (the verified rows, notes on what was assumed). ``keep``: a
    directory (:func:`prepare_keep_dir`) the runs stay in, ``keep/layout<rank>``; else a temporary one."""
    machine = local_machine()
    try:
        plan = local_plan(recipe, name, overrides, k, machine, asked)
    except RecipeError as e:
        raise RecipeError(f"verify: {e.problems[0]}") from None
    notes = [f"this machine: {machine['ranks']} × {machine['name']} ({machine['memory_bytes'] / 2**30:.1f} GiB each); "
             f"{VERIFY_STEPS} steps per layout, the first {VERIFY_WARMUP} not measured; calibration "
             f"{plan['calibration']}"]
    batch_note = carried_batch(asked, machine["ranks"])[1]
    if batch_note:
        notes.append(batch_note)
    if machine["device"] == "cpu":
        notes.append("CPU: eager single/DDP/FSDP2 over gloo, micro-batches up to the recipe's; the CPU calibration is "
                     "a placeholder, so the prediction's error is not meaningful here; memory is measured on CUDA only "
                     "(the allocator's peak)")
    out = []
    try:  # SIGTERM as SIGINT: the layouts verified so far are kept, the rest marked not run
        previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    except ValueError:  # not the main thread
        previous = None
    try:
        if keep is not None:
            notes.append(f"each layout's run kept in {keep}/layout<rank> (its summary.json is what "
                         "`scaletool calibrate --validate` re-predicts)")
        with nullcontext(str(keep)) if keep is not None else tempfile.TemporaryDirectory(prefix="scaletool-verify-") as tmp:
            layouts = plan["layouts"]

            def argv_of(row: dict) -> list[str]:
                return train_argv(name, overrides, recipe, row, machine["ranks"], Path(tmp) / f"layout{row['rank']}")

            try:  # wherever the signal lands (a run, a progress line, between layouts), what finished is kept
                for row in layouts:
                    argv = argv_of(row)
                    if progress is not None:
                        progress(f"verify {row['rank']}/{len(layouts)}: {describe(row)}")
                    doc, why = _run(argv)
                    out.append(_verified(row, machine["ranks"], doc, why, command_line(["scaletool", *argv[3:]])))
                    if progress is not None:
                        progress(outcome_line(out[-1]))
            except (KeyboardInterrupt, Interrupted):
                done = len(out)
                for rest in layouts[done:]:
                    out.append(_verified(rest, machine["ranks"], None, "interrupted before it finished",
                                         command_line(["scaletool", *argv_of(rest)[3:]]), status="not run"))
                if done < len(layouts):
                    notes.append(f"interrupted during layout {layouts[done]['rank']}: {len(layouts) - done} of "
                                 f"{len(layouts)} not run")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return out, notes
