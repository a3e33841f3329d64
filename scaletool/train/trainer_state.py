"""The trainer state a checkpoint's ``trainer.json`` must hold before a run resumes from it.

A resume reads the step, the loss curve (``history``: one list per key, one entry per step), the
engine that wrote the checkpoint and the earlier segments; a file lacking one of them, or holding
another type, is refused when the checkpoint is verified instead of failing mid-run with a KeyError.
"""
from __future__ import annotations

from scaletool.errors import echo

HISTORY_KEYS = ("step", "loss", "grad_norm", "lr", "step_time_s")
OPTIONAL_HISTORY_KEYS = ("contended",)
_MAX = 2**63 - 1


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX


def _number_or_none(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _history_problem(history) -> str | None:
    if not isinstance(history, dict):
        return f"has history {echo(history)}, not a mapping of lists"
    missing = [k for k in HISTORY_KEYS if k not in history]
    if missing:
        return f"has no history of {', '.join(missing)}"
    keys = [k for k in (*HISTORY_KEYS, *OPTIONAL_HISTORY_KEYS) if k in history]
    for k in keys:
        if not isinstance(history[k], list):
            return f"has history {k} = {echo(history[k])}, not a list"
    lengths = {len(history[k]) for k in keys}
    if len(lengths) > 1:
        return f"has history lists of different lengths ({', '.join(f'{k}: {len(history[k])}' for k in keys)})"
    if not all(_int(s) for s in history["step"]):
        return "has a history step that is not a step number"
    for k in keys[1:]:
        ok = (lambda v: v is None or isinstance(v, bool)) if k == "contended" else _number_or_none
        bad = next((v for v in history[k] if not ok(v)), None)
        if bad is not None:
            return f"has history {k} entry {echo(bad)}, not a number"
    return None


def trainer_state_problem(state, step: int | None) -> str | None:
    """Why ``state`` (a parsed trainer.json) cannot start a resume at ``step`` (None: any), or None."""
    if not isinstance(state, dict):
        return f"holds {type(state).__name__}, not a trainer state"
    if not _int(state.get("step")):
        return f"has step {echo(state.get('step'))}, not a step number"
    if step is not None and state["step"] != step:
        return f"does not describe step {step} (it says {state['step']})"
    problem = _history_problem(state.get("history"))
    if problem is not None:
        return problem
    if not isinstance(state.get("engine"), str):
        return f"has engine {echo(state.get('engine'))}, not an engine name"
    segments = state.get("segments")
    if segments is not None and not (isinstance(segments, list) and all(
            isinstance(s, dict) and _int(s.get("start_step")) and _int(s.get("end_step")) for s in segments)):
        return "has segments that are not a list of start and end steps"
    return None
