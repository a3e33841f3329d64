"""FP8 training against bf16 on one GPU: the float8-1gpu study's table and loss overlay.

    python recipes/benchmarks/float8_table.py OUT    # OUT holds the study's {shape}-{mode}.json results

Reads each run's result (``scaletool train --json``): ``llama8l-*`` (Llama-3-8B with 8 layers, T=8192,
micro-batch 1), ``mha1b-*`` (mha-1b at its recipe micro-batch) and ``loss-*`` (a small decoder trained
300 steps from one seed on one text, bf16 against tensorwise). Writes OUT/float8.json (per run: tokens/s
median with p10/p90 and n over the measured steps, warm-up excluded; MFU against the bf16 and the FP8
dense peaks; peak memory; the speed-up over bf16 of the same shape; card, date, torch and CUDA of the
runs), OUT/float8.md (the table) and OUT/float8-loss.json + .png (the loss curves, step by step).
"""
from __future__ import annotations

import datetime as dt
import json
import re
import sys
from pathlib import Path

MODES = ("none", "tensorwise", "rowwise")
SHAPES = {"llama8l": "Llama-3-8B, 8 layers, T=8192, micro-batch 1 (single, compiled per block)",
          "mha1b": "mha-1b, its recipe's micro-batch 8 x 2048 (single, compiled per block)",
          "loss": "small decoder, 300 steps on one text (eager; loss curves)"}


def _load(p: Path) -> dict | None:
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("kind") == "train" else None


def runs(out: Path) -> dict[tuple[str, str], dict]:
    """(shape, mode) -> the run's result, for every ``{shape}-{mode}.json`` in ``out``."""
    found = {}
    for p in sorted(out.glob("*.json")):
        m = re.fullmatch(r"([a-z0-9]+)-(none|tensorwise|rowwise)", p.stem)
        if m and m.group(1) in SHAPES and (d := _load(p)) is not None:
            found[(m.group(1), m.group(2))] = d
    return found


def row(shape: str, mode: str, d: dict, base: dict | None) -> dict:
    t = (d.get("timing") or {}).get("tokens_per_s") or {}
    m = d.get("metrics") or {}
    rate, ref = t.get("median"), ((base or {}).get("timing") or {}).get("tokens_per_s", {}).get("median")
    return {"shape": shape, "float8": mode, "status": d.get("status"),
            "throughput/tokens_per_s_median": rate, "throughput/tokens_per_s_p10": t.get("p10"),
            "throughput/tokens_per_s_p90": t.get("p90"), "throughput/n_steps": t.get("n"),
            "flops/mfu_bf16_peak": m.get("flops/mfu"), "flops/mfu_fp8_peak": m.get("flops/mfu_fp8_peak"),
            "memory/peak_allocated_bytes": d.get("peak_memory_bytes"),
            "speedup/over_bf16": rate / ref if rate and ref and mode != "none" else None,
            "loss/first": d.get("loss_first"), "loss/last": d.get("loss_last")}


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(rows: list[dict], env: dict) -> str:
    lines = [f"# FP8 training against bf16, one GPU ({env.get('card')}, torch {env.get('torch')}, CUDA {env.get('cuda')})",
             "", "tokens/s: median over the measured steps (warm-up excluded), p10-p90, n steps. MFU: model FLOPs "
             "(causal) over the dense bf16 peak and over the dense FP8 peak.", "",
             "| shape | float8 | tokens/s | p10-p90 | n | vs bf16 | MFU (bf16 peak) | MFU (FP8 peak) | peak memory GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rate = r["throughput/tokens_per_s_median"]
        spread = (f"{r['throughput/tokens_per_s_p10']:,.0f}-{r['throughput/tokens_per_s_p90']:,.0f}"
                  if r["throughput/tokens_per_s_p10"] is not None else "-")
        mem, up = r["memory/peak_allocated_bytes"], r["speedup/over_bf16"]
        cells = [r["shape"], r["float8"], "-" if rate is None else f"{rate:,.0f}", spread,
                 str(r["throughput/n_steps"] or "-"), "-" if up is None else f"{up:.2f}x",
                 _pct(r["flops/mfu_bf16_peak"]), _pct(r["flops/mfu_fp8_peak"]),
                 "-" if mem is None else f"{mem / 2**30:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {k}: {v}" for k, v in SHAPES.items())]
    return "\n".join(lines) + "\n"


def loss_overlay(found: dict, out: Path) -> dict:
    """The loss runs' curves, step by step, as JSON and (matplotlib there) one plot."""
    curves = {mode: {"step": d["history"]["step"], "loss": d["history"]["loss"]}
              for (shape, mode), d in found.items() if shape == "loss"}
    (out / "float8-loss.json").write_text(json.dumps(curves, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return curves
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, c in curves.items():
        ax.plot(c["step"], c["loss"], label="bf16" if mode == "none" else f"float8 {mode}", linewidth=1)
    ax.set_xlabel("step"), ax.set_ylabel("training loss"), ax.legend(), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "float8-loss.png", dpi=120)
    plt.close(fig)
    return curves


def table(out: Path) -> dict:
    found = runs(out)
    if not found:
        raise SystemExit(f"error: no {{shape}}-{{mode}}.json train results in {out}")
    rows = [row(s, m, found[(s, m)], found.get((s, "none"))) for s in SHAPES for m in MODES if (s, m) in found]
    any_env = next(iter(found.values())).get("environment") or {}
    env = {"card": (any_env.get("gpu_names") or ["cpu"])[0], "torch": any_env.get("torch"),
           "cuda": any_env.get("cuda"), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv)}
    doc = {"kind": "float8-1gpu", "environment": env, "rows": rows}
    (out / "float8.json").write_text(json.dumps(doc, indent=1))
    (out / "float8.md").write_text(markdown(rows, env))
    loss_overlay(found, out)
    return doc


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print((Path(sys.argv[1]) / "float8.md").read_text() if table(Path(sys.argv[1])) else "")
