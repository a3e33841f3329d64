"""FP8 training against bf16 on one GPU: the float8-1gpu study's table and loss overlay.

    python benchmarks/scripts/float8_table.py OUT    # OUT holds the study's {shape}-{mode}.json results

Reads each run's result (``scaletool train --json``): ``llama8l-*`` (Llama-3-8B with 8 layers, T=8192,
micro-batch 1; ``llama4l-*`` the same with 4 layers; ``llama{4,8}lt2k-*`` both at T=2048, micro-batch 4: the
same tokens per step with a quarter of the attention FLOPs per token), ``mha1b-*`` (mha-1b at its recipe micro-batch) and
``loss-*`` (a small decoder trained 300 steps from one seed on one text, bf16 against tensorwise). Writes
OUT/float8.json (per run: tokens/s median with p10/p90 and n over the measured steps, warm-up excluded;
MFU against the bf16 and the FP8 dense peaks; peak memory; the speed-up over bf16 of the same shape; card,
date, torch and CUDA of the runs; the per-layer gain from the 4- and 8-layer runs, below), OUT/float8.md
(the table) and OUT/float8-loss.json + .png (the loss curves, step by step).

Per layer: a step of L layers takes a + L·b (the embedding, output head, loss and their optimizer work
in a; one block's forward, backward and optimizer step in b). Two depths give both, per mode, from the
median step times; b(bf16) / b(FP8) is the gain of one Llama-3-8B block, and (a + 32·b) projects the
whole 32-layer model. The range beside each is the extreme one of the runs' p10/p90 step times gives.
"""
from __future__ import annotations

import datetime as dt
import json
import re
import sys
from pathlib import Path

MODES = ("none", "tensorwise", "rowwise")
SHAPES = {"llama4l": "Llama-3-8B, 4 layers, T=8192, micro-batch 1 (single, compiled per block)",
          "llama8l": "Llama-3-8B, 8 layers, T=8192, micro-batch 1 (single, compiled per block)",
          "llama4lt2k": "Llama-3-8B, 4 layers, T=2048, micro-batch 4 (single, compiled per block)",
          "llama8lt2k": "Llama-3-8B, 8 layers, T=2048, micro-batch 4 (single, compiled per block)",
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


def _step_s(d: dict, which: str) -> float | None:
    """Seconds per token of one run's step at the tokens/s quantile ``which`` (median, p10, p90)."""
    rate = ((d.get("timing") or {}).get("tokens_per_s") or {}).get(which)
    return 1.0 / rate if rate else None


def per_layer(found: dict, shallow: str = "llama4l", deep: str = "llama8l", depths: tuple[int, int] = (4, 8),
              full: int = 32) -> list[dict]:
    """Per FP8 mode with both depths and bf16 at both: one block's gain, and the whole ``full``-layer model's
    projected gain (see the module docstring), median with the range the p10/p90 steps give."""
    (l1, l2), out = depths, []

    def fit(mode: str, q1: str, q2: str) -> tuple[float, float] | None:
        t1, t2 = _step_s(found[(shallow, mode)], q1), _step_s(found[(deep, mode)], q2)
        if t1 is None or t2 is None:
            return None
        b = (t2 - t1) / (l2 - l1)
        return t1 - l1 * b, b  # a, b: seconds per token outside the blocks, and per block

    if (shallow, "none") not in found or (deep, "none") not in found:
        return out
    for mode in MODES[1:]:
        if (shallow, mode) not in found or (deep, mode) not in found:
            continue
        base, f8 = fit("none", "median", "median"), fit(mode, "median", "median")
        if base is None or f8 is None or base[1] <= 0 or f8[1] <= 0:
            continue
        # the extremes: bf16 blocks at their fastest/slowest against FP8 blocks at their slowest/fastest
        qs = [("p90", "p10"), ("p10", "p90")]  # tokens/s p90 is the shorter step
        gains, projected = [], []
        for (bq1, bq2), (fq1, fq2) in ((qs[0], qs[1]), (qs[1], qs[0])):
            b0, f0 = fit("none", bq1, bq2), fit(mode, fq1, fq2)
            if b0 and f0 and b0[1] > 0 and f0[1] > 0:
                gains.append(b0[1] / f0[1])
                projected.append((b0[0] + full * b0[1]) / (f0[0] + full * f0[1]))
        out.append({"float8": mode, "shapes": [shallow, deep], "depths": [l1, l2],
                    "block_s_per_token": {"none": base[1], mode: f8[1]},
                    "outside_blocks_s_per_token": {"none": base[0], mode: f8[0]},
                    "gain/per_block": base[1] / f8[1],
                    "gain/per_block_range": [min(gains), max(gains)] if gains else None,
                    "gain/projected_layers": full,
                    "gain/projected": (base[0] + full * base[1]) / (f8[0] + full * f8[1]),
                    "gain/projected_range": [min(projected), max(projected)] if projected else None,
                    "blocks_share_of_bf16_step": {str(l2): l2 * base[1] / (base[0] + l2 * base[1]),
                                                  str(full): full * base[1] / (base[0] + full * base[1])}})
    return out


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(rows: list[dict], env: dict, layers: list[dict] | None = None) -> str:
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
    if layers:
        lines += ["", "## Per Llama-3-8B block (from the 4- and 8-layer runs)", "",
                  "| runs | float8 | gain per block | range | blocks' share of the bf16 step (8 / 32 layers) | "
                  "projected gain, 32 layers | range |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in layers:
            lo, hi = r["gain/per_block_range"] or (None, None)
            plo, phi = r["gain/projected_range"] or (None, None)
            share = r["blocks_share_of_bf16_step"]
            lines.append(f"| {' / '.join(r.get('shapes', []))} | {r['float8']} | {r['gain/per_block']:.2f}x | "
                         + ("-" if lo is None else f"{lo:.2f}-{hi:.2f}x") + f" | {_pct(share['8'])} / {_pct(share['32'])} | "
                         f"{r['gain/projected']:.2f}x | " + ("-" if plo is None else f"{plo:.2f}-{phi:.2f}x") + " |")
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
    layers = per_layer(found) + per_layer(found, "llama4lt2k", "llama8lt2k")
    doc = {"kind": "float8-1gpu", "environment": env, "rows": rows, "per_block": layers}
    (out / "float8.json").write_text(json.dumps(doc, indent=1))
    (out / "float8.md").write_text(markdown(rows, env, layers))
    loss_overlay(found, out)
    return doc


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print((Path(sys.argv[1]) / "float8.md").read_text() if table(Path(sys.argv[1])) else "")
