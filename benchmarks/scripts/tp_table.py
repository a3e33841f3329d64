"""Tensor parallelism against FSDP2 alone: the analytic table before the runs, the measured table after.

    python benchmarks/scripts/tp_table.py analytic mha-1b mla-1b   # peak memory and bytes on the wire per GPU
    python benchmarks/scripts/tp_table.py table OUT                 # OUT: a tp, tp-2gpu or tp-4gpu study's output

Layouts: fsdp-x2 (2 GPUs), tp2, fsdp-x4, tp4, 2x2 (FSDP2 x TP=2). Regimes: rank8, 8 sequences per
data-parallel rank (the default where a name has none); global8, the same global batch of 8 sequences for
every layout. Modes (read from each result's recipe): eager, compiled, compiled with train.compile_mode.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LAYOUTS = {"fsdp-x2": (2, 1), "tp2": (2, 2), "fsdp-x4": (4, 1), "tp4": (4, 4), "2x2": (4, 2)}


def analytic(recipes: list[str]) -> None:
    from scaletool.analytic.comm import communication
    from scaletool.analytic.memory import tensor_parallel_memory
    from scaletool.config import load_recipe
    from scaletool.fmt import gib
    for recipe in recipes:
        for regime in ("rank8", "global8"):
            for name, (world, tp) in LAYOUTS.items():
                mb = 8 if regime == "rank8" else 8 * tp // world
                r = load_recipe(f"recipes/{recipe}.yaml", ["parallel.engine=fsdp", f"parallel.tensor_parallel={tp}",
                                                            f"train.micro_batch_size={mb}", "train.compile=false"])
                mem = tensor_parallel_memory(r, world, tp)
                c = communication(r, world, tp)
                print(f"{recipe:7} {regime:7} {name:7} mb={mb} peak={gib(mem['total_bytes'])} "
                      f"act={gib(mem['activations_bytes'])} wire/GPU/step tp={gib(c['tp_wire_bytes'])} "
                      f"dp={gib(c['dp_wire_bytes'])}")


def _load(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


_STEM = re.compile(r"^(?P<recipe>.+?)-(?:(?P<regime>rank8|global8)-)?(?P<layout>fsdp-x\d+|tp\d+|\d+x\d+)(?:-|$)")


def _mode(d: dict) -> str:
    """eager, compiled or compiled with its mode, async TP and activation checkpointing where set."""
    t, p = d["recipe"]["train"], d["recipe"]["parallel"]
    m = "eager" if not t["compile"] else "compiled" + ("" if t.get("compile_mode", "default") == "default"
                                                       else f" {t['compile_mode']}")
    one_rank = p.get("tensor_parallel", 1) > 1 and p.get("fsdp_on_one_rank", True) and d["environment"]["world_size"] == \
        p["tensor_parallel"]  # FSDP2 over one rank: set, or recorded before the key existed
    return m + (" local" if p.get("tp_local_ops") else "") + (" async" if p.get("async_tp") else "") + \
        (" fsdp1" if one_rank else "") + \
        (f" ac={t['activation_checkpointing']}" if t["activation_checkpointing"] != "none" else "")


def _per_gpu(d: dict) -> tuple[float, float | None, float | None, int]:
    """Median, p10, p90 and n of the per-step rates; a run without per-step timing (``--no-measure``): the
    measured window's rate, no spread, n 0."""
    t, w = d["timing"]["tokens_per_s"], d["environment"]["world_size"]
    if t is None:
        return d["tokens_per_s"] / w, None, None, 0
    return t["median"] / w, t["p10"] / w, t["p90"] / w, t["n"]


def _rate(med: float, p10: float | None, p90: float | None, n: int) -> str:
    return f"{med:,.0f} [{p10:,.0f}-{p90:,.0f}] {n}" if n else f"{med:,.0f} [window]"


def _failures(out: Path) -> list[str]:
    """The study's commands whose last record is not ok, each with the first error line of its log."""
    runs = out / "runs.jsonl"
    last = {}
    for line in (runs.read_text().splitlines() if runs.exists() else []):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        last[r.get("command")] = r
    rows = []
    for name, r in last.items():
        if r.get("status") == "ok":
            continue
        log = out / "logs" / f"{name}.stderr"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        why = next((x for x in lines if x.startswith("error: ") and not x.startswith("error: rank")),
                   next((x for x in reversed(lines) if "Error" in x), ""))
        rows.append(f"{name:34} {r.get('status')}: {why[:110]}")
    return rows


def _results(out: Path, pattern: str) -> list[Path]:
    """The study's result files under OUT, not the runs' own directories (runs/, logs/)."""
    return sorted(p for p in out.rglob(pattern) if p.relative_to(out).parts[0] not in ("runs", "logs"))


def table(out: Path) -> None:
    """Every training result under OUT (the tp, tp-2gpu and tp-4gpu studies' layouts): tokens/s per GPU
    (median [p10-p90] n), the ratio to the best FSDP2 run of the same recipe, GPUs and compile (eager or
    compiled), peak memory against the estimate; then best TP against best FSDP2, the profiles, failures."""
    runs = {}
    for p in _results(out, "*.json"):
        d = _load(p)
        if not isinstance(d, dict) or d.get("kind") != "train" or p.stem.startswith("profile-"):
            continue
        m = _STEM.match(p.stem)
        recipe = "win" if p.stem.startswith("win") else (m["recipe"] if m else p.stem)
        runs[p.stem] = (recipe, (m and m["regime"]) or "rank8", d)
    ok = {k: v for k, v in runs.items() if v[2].get("status") == "completed"}
    env = next(iter(ok.values()), (None, None, {}))[2].get("environment", {})
    print(f"card {(env.get('gpu_names') or ['cpu'])[0]}, torch {env.get('torch')}, CUDA {env.get('cuda')}")

    def group(k):  # FSDP2's runs this one is compared with
        recipe, regime, d = runs[k]
        return recipe, regime, d["environment"]["world_size"], d["recipe"]["train"]["compile"]
    best_fsdp = {}
    for k, (_, _, d) in ok.items():
        if d["recipe"]["parallel"]["tensor_parallel"] == 1:
            g = group(k)
            if g not in best_fsdp or _per_gpu(d)[0] > _per_gpu(ok[best_fsdp[g]][2])[0]:
                best_fsdp[g] = k
    print(f"{'run':34} {'GPUs':>4} {'TP':>3} {'mb':>3} {'mode':30} {'tok/s/GPU median [p10-p90] n':>32} "
          f"{'vs fsdp':>8} {'peak GiB':>9} {'est GiB':>8} {'rel':>7}")
    for k, (_, _, d) in runs.items():
        if k not in ok:
            print(f"{k:34} {d.get('status')}: {str(d.get('message', ''))[:100]}")
            continue
        m, world = d["metrics"], d["environment"]["world_size"]
        med, p10, p90, n = _per_gpu(d)
        ref = best_fsdp.get(group(k))
        ratio = f"{med / _per_gpu(ok[ref][2])[0]:.2f}" if ref else "-"
        rel, peak = m.get("memory/analytic_rel_error"), d.get("peak_memory_bytes")
        print(f"{k:34} {world:>4} {d['recipe']['parallel']['tensor_parallel']:>3} "
              f"{d['recipe']['train']['micro_batch_size']:>3} {_mode(d):30} "
              f"{_rate(med, p10, p90, n):>32} {ratio:>8} "
              f"{(f'{peak / 2**30:.2f}' if peak else '-'):>9} {m['memory/analytic_bytes'] / 2**30:>8.2f} "
              f"{(f'{rel:+.1%}' if rel is not None else '-'):>7}")
    print("\nbest TP against best FSDP2, per GPU (same recipe, batch regime and GPU count; any mode)")
    keys = sorted({(r, g, d["environment"]["world_size"]) for r, g, d in ok.values()})
    for recipe, regime, world in keys:
        same = {k: _per_gpu(d)[0] for k, (r, g, d) in ok.items()
                if (r, g, d["environment"]["world_size"]) == (recipe, regime, world)}
        tp = {k: v for k, v in same.items() if ok[k][2]["recipe"]["parallel"]["tensor_parallel"] > 1}
        fs = {k: v for k, v in same.items() if k not in tp}
        if tp and fs:
            bt, bf = max(tp, key=tp.get), max(fs, key=fs.get)
            print(f"{recipe} {regime} {world} GPUs: {bt} {tp[bt]:,.0f} / {bf} {fs[bf]:,.0f} = {tp[bt] / fs[bf]:.2f}")
    print("\nprofiler, rank 0 (share of the step; exposed = not overlapped by compute)")
    for p in _results(out, "profile-*.json"):
        d = _load(p)
        if not d or not d.get("step_time_s"):
            print(f"{p.stem}: no breakdown")
            continue
        co, step = d["communication_overlap"], d["step_time_s"]
        print(f"{p.stem:26} step {1e3 * step:7.1f} ms  communication {1e3 * co['communication_s']:6.1f} ms "
              f"({co['communication_s'] / step:.1%}), exposed {co['exposed_s'] / step:.1%}, "
              f"overlap ratio {co['overlap_ratio']}")
    peers = [(p, d) for p in _results(out, "peer-*.json") if isinstance(d := _load(p), dict) and d.get("results")]
    if peers:
        print("\npeers: tokens/s per GPU, median [p10-p90] n, each side in the same process group")
    for p, d in peers:
        sides = "  ".join(f"{k} {r['tokens_per_s_per_gpu']['median']:,.0f} [{r['tokens_per_s_per_gpu']['p10']:,.0f}-"
                          f"{r['tokens_per_s_per_gpu']['p90']:,.0f}] {r['tokens_per_s_per_gpu']['n']}"
                          for k, r in d["results"].items())
        ratio = d.get("scaletool_over_torchtitan", {}).get("tokens_per_s_ratio")
        print(f"{p.stem:34} TP {d.get('settings', {}).get('tensor_parallel', '-')}  {sides}"
              + (f"  scaletool/torchtitan {ratio:.2f}" if ratio else ""))
    failures = _failures(out)
    if failures:
        print("\nfailed or stopped (the first error line of logs/NAME.stderr)")
        print("\n".join(failures))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "analytic":
        analytic(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "table":
        table(Path(sys.argv[2]))
    else:
        sys.exit("usage: tp_table.py analytic RECIPE... | tp_table.py table OUT")
