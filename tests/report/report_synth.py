"""Small synthetic sweep results for the report's tests: records as the sweep writes them, with typed
results (``kind``, timing spreads, repeats) whose step times are chosen, so that a test can put two
points on either side of the noise line. Estimates are the real analytic model's. Train results of the
training-dynamics study carry chosen loss curves and monitor records (:class:`DynamicsStudy`)."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import yaml

from scaletool import api
from scaletool.config import SECTIONS, ModelConfig, recipe_from_dict
from scaletool.report import data
from scaletool.report.dynamics import ENTROPY, RANK
from scaletool.stats import settled_start, spread
from scaletool.yaml_input import set_dotted

ROOT = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
AS_MHA = {"model.attention": "mha", "model.kv_lora_rank": 0, "model.qk_nope_head_dim": None,
          "model.qk_rope_head_dim": None, "model.v_head_dim": None}
#: a repeating pattern of relative deviations: p10/p90 of base·(1 + JITTER) sit about ±2% around base
JITTER = (-0.02, 0.01, 0.0, 0.02, -0.01, 0.005, -0.005, 0.015, -0.015, 0.0)


def recipe(**dotted) -> dict:
    """tiny.yaml as written, with dotted overrides (``recipe(**{"model.kv_lora_rank": 8})``)."""
    raw = json.loads(json.dumps(TINY))
    for k, v in dotted.items():
        set_dotted(raw, k, v, SECTIONS)
    return raw


def mha(**dotted) -> dict:
    return recipe(**AS_MHA, **dotted)


def mla(rank: int, **dotted) -> dict:
    return recipe(**{"model.kv_lora_rank": rank}, **dotted)


def steps(base_s: float, n: int = 20, jitter: float = 1.0, warmup: tuple[float, ...] = (0.5, 0.2)) -> list[float]:
    """Step times: slow warm-up steps, then ``base_s`` with the JITTER pattern scaled by ``jitter``."""
    return list(warmup) + [base_s * (1 + jitter * JITTER[i % len(JITTER)]) for i in range(n)]


def train_result(step_times: list[float], *, tokens_per_step: int = 256, warmup: int = 2, device: str = "cpu",
                 mfu_at_1s: float | None = None) -> dict:
    """A schema-2 train summary as COMMON.md's contract describes it. ``mfu_at_1s``: MFU a 1 s step would
    have (MFU scales with tokens/s); None for a device without a known peak."""
    start = settled_start(step_times, warmup)
    step = spread(step_times[start:])
    rate = step.inverse(tokens_per_step)
    mfu = mfu_at_1s / step.median if mfu_at_1s else None
    return {
        "kind": "train", "schema_version": 2, "status": "completed", "message": None,
        "tokens_per_s": rate.median, "tokens_per_step": tokens_per_step, "mfu": mfu,
        "mfu_full_attention": mfu * 1.07 if mfu else None, "peak_memory_bytes": None if device == "cpu" else 5_100_000,
        "loss_first": 5.55, "loss_last": 5.09, "measured_steps": len(step_times) - start, "measure_warmup_steps": warmup,
        "steps_completed": len(step_times), "start_step": 0, "threads": 1 if device == "cpu" else None,
        "timing": {"step_s": step.model_dump(), "tokens_per_s": rate.model_dump(), "warmup_steps_excluded": start,
                   "rule": f"at least {warmup} warm-up steps, then until the step time settles"},
        "tokens_per_s_spread": rate.ratio_spread,
        "metrics": {"throughput/tokens_per_s": rate.median, "flops/mfu": mfu, "memory/analytic_bytes": 4862976},
        "environment": {"world_size": 1, "device_type": device},
        "hardware": {"profile": "CPU" if device == "cpu" else "H100", "peak_tflops": None if device == "cpu" else 989.0},
        "history": {"step": list(range(len(step_times))), "step_time_s": step_times},
    }


def decode_point(attention: str, context: int, step_times: list[float], prefill_times: list[float], *,
                 batch: int = 1, kv_bytes_per_token: int = 1024, new_tokens: int = 8) -> dict:
    step, prefill = spread(step_times), spread(prefill_times)
    kv = batch * (context + new_tokens) * kv_bytes_per_token
    return {"attention": attention, "batch": batch, "context": context, "max_len": context + new_tokens,
            "new_tokens": new_tokens, "kv_cache_bytes_measured": kv, "kv_cache_bytes_analytic": kv,
            "decode_step_s": step.model_dump(), "prefill_s": prefill.model_dump(),
            "decode_tokens_per_s": batch / step.median, "prefill_tokens_per_s": context / prefill.median,
            "decode_tokens_per_s_spread": step.inverse(batch).ratio_spread}


def decode_result(points: list[dict], device: str = "cpu") -> dict:
    return {"kind": "decode", "schema_version": 1, "points": points, "device": {"type": device, "name": device}}


def estimate_result(raw: dict) -> dict:
    res = api.estimate(recipe_from_dict(raw, "synthetic"))
    return res.model_dump(mode="json") if hasattr(res, "model_dump") else res  # typed once the estimate model lands


class Sweep:
    """A results directory being written record by record, in the sweep's record format."""

    def __init__(self, path: Path, name: str = "synthetic", label: str | None = None):
        self.path, self.name, self.lines = Path(path), name, []
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "sweep.json").write_text(json.dumps({"name": name, "label": label, "description": None}))

    def add(self, label: str, values: dict, raw: dict, mode: str, result, *, status: str = "ok", index: int = 0,
            repeat: int | None = None, repeats: int | None = None, **extra) -> Sweep:
        point_id = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]
        rec = {"key": f"{point_id}-{mode}" + (f"-{repeat}" if repeat is not None else ""), "point_id": point_id,
               "mode": mode, "sweep": self.name, "index": index, "label": label, "values": values,
               "match_params": None, "recipe": raw, "result": result, "status": status, "run_dir": None, **extra}
        if repeat is not None:
            rec.update(repeat=repeat, repeats=repeats)
        self.lines.append(json.dumps(rec, sort_keys=True))
        (self.path / "results.jsonl").write_text("\n".join(self.lines) + "\n")
        return self


def showcase(path: Path) -> Path:
    """A results dir with every timed feature: MHA and four MLA ranks at two FFN widths, trained three
    times each (repeats), one rank clearly slower than MHA and the rest within noise, and decode points
    with spreads at three contexts."""
    s = Sweep(path, name="showcase", label="synthetic GPU")
    points = [("attention=mha", {"model.attention": "mha"}, mha, None, 0.010)]
    points += [(f"attention=mla kv_lora_rank={r}", {"model.attention": "mla", "model.kv_lora_rank": r}, mla, r, t)
               for r, t in ((8, 0.0101), (16, 0.0099), (32, 0.0100), (64, 0.0125))]
    index = 0
    for label, values, make, rank, base in points:
        for width in (128, 256):
            raw = make(rank, **{"model.intermediate_size": width}) if rank else make(**{"model.intermediate_size": width})
            vals = {**values, "model.intermediate_size": width}
            name = f"{label} intermediate_size={width}"
            s.add(name, vals, raw, "estimate", estimate_result(raw), index=index)
            for k in range(3):
                s.add(name, vals, raw, "train", train_result(steps(base * (1 + 0.01 * k) * width / 128), device="cuda",
                                                              mfu_at_1s=0.004), index=index, repeat=k, repeats=3)
            kv = 1024 if rank is None else 4 * (rank + 8) * 2
            pts = [decode_point(values["model.attention"], c, steps(0.002 * (1 + c / 4096) * (kv / 1024) ** 0.3, 12,
                                                                    warmup=()), steps(0.05 * c / 1024, 5, warmup=()),
                                kv_bytes_per_token=kv, batch=8) for c in (1024, 4096, 16384)]
            s.add(name, vals, raw, "decode", decode_result(pts, device="cuda"), index=index)
            index += 1
    return path


# --- the training-dynamics study (scaletool/report/dynamics.py) -------------------------------------

STEPS, EVERY, LAYERS = 40, 4, 2
#: model.norm_placement comes with the model's Post-LN (the arch branch); until the recipe has it, a point
#: names its placement in its sweep values only (which the report reads first)
HAS_NORM = "norm_placement" in ModelConfig.model_fields
#: ±1% batch-to-batch noise of a loss curve
LOSS_NOISE = (0.0, 0.01, -0.01, 0.005, -0.005)


def loss_curve(final: float, *, spike: int | None = None, diverge: int | None = None, steps: int = STEPS) -> list:
    """5.55 falling to ``final`` with ±1% batch noise; ``spike``: +40% for four steps from there;
    ``diverge``: rising fast for three steps, then NaN at that step and the run stops."""
    out = []
    for s in range(steps if diverge is None else diverge + 1):
        x = final + (5.55 - final) * math.exp(-s / 6)
        x *= 1 + LOSS_NOISE[s % len(LOSS_NOISE)]
        if spike is not None and spike <= s < spike + 4:
            x *= 1.4
        if diverge is not None and s >= diverge - 3:
            x = math.nan if s == diverge else x * 3 ** (s - diverge + 4)
        out.append(x)
    return out


def monitor_history(steps: int, *, collapse: int | None = None, only: str | None = None) -> list[dict]:
    """Monitor records every EVERY steps: entropy ~3 nats and rank ratio ~0.7 per layer; from ``collapse``
    on, layer 1's entropy (``only="entropy"``), rank (``only="rank"``) or both fall below the thresholds."""
    out = []
    for s in range(EVERY - 1, steps, EVERY):
        rec: dict = {"step": s}
        for i in range(LAYERS):
            low = collapse is not None and s >= collapse and i == 1
            rec[f"{ENTROPY}{i:02d}"] = 0.2 if low and only != "rank" else 3.0 - 0.1 * i
            rec[f"dynamics/attention_entropy_min_head_nats/layer_{i:02d}"] = 2.5
            rec[f"{RANK}{i:02d}"] = 0.05 if low and only != "entropy" else 0.7 - 0.05 * i
            rec[f"dynamics/effective_rank/layer_{i:02d}"] = 44.8
            rec[f"dynamics/grad_norm/block_{i:02d}"] = 0.5
        out.append(rec)
    return out


def dynamics_result(loss: list, *, monitored: bool = True, collapse: int | None = None, only: str | None = None,
                    clip: float = 1.0) -> dict:
    """A train result (schema 2) with this loss curve; diverged when it ends on a NaN."""
    r = train_result(steps(0.01))  # the timing is not what the study is about
    diverged = math.isnan(loss[-1])
    r.update(status="diverged" if diverged else "completed", steps_completed=len(loss),
             message=f"loss is nan at step {len(loss) - 1}: training stopped" if diverged else None,
             loss_first=loss[0], loss_last=None if diverged else loss[-1])
    r["history"] = {"step": list(range(len(loss))), "loss": [None if math.isnan(x) else x for x in loss],
                    "grad_norm": [1.5 if clip else None] * len(loss), "lr": [1e-3] * len(loss),
                    "step_time_s": [0.01] * len(loss)}
    if monitored:
        hist = monitor_history(len(loss), collapse=collapse, only=only)
        r["dynamics"] = {"every": EVERY, "batch_size": 2, "entropy_threshold_nats": 0.5, "rank_threshold": 0.1,
                         "steps": [h["step"] for h in hist], "history": hist, "warnings": []}
    return r


class DynamicsStudy:
    """A results dir of the study's points: (norm, warm-up, clipping, lr) -> a train result."""

    def __init__(self, path):
        self.sweep, self.index = Sweep(path, name="training-dynamics"), 0
        self.path = path

    def add(self, res: dict | None, norm: str = "pre", warmup: int = 0, clip: float = 1.0, lr: float = 0.03, **extra):
        values = {"model.norm_placement": norm, "train.warmup_steps": warmup, "train.grad_clip": clip, "train.lr": lr}
        raw = recipe(**{k: v for k, v in values.items() if k != "model.norm_placement" or HAS_NORM})
        label = f"norm_placement={norm} warmup_steps={warmup} grad_clip={clip} lr={lr}"
        if res is not None and res["status"] == "diverged":  # `train` exits 1 on it; the sweep keeps its result
            extra = {"status": "error", "error": f"error: {res['message']}", **extra}
        self.sweep.add(label, values, raw, "train", res, index=self.index, **extra)
        self.index += 1
        return self

    def load(self) -> data.ResultsSet:
        return data.load([self.path])


def dynamics_showcase(path: Path) -> Path:
    """The study in small: Pre-/Post-LN × warm-up × two learning rates, Post-LN without warm-up diverging at
    the higher one after its entropy and rank collapsed."""
    s = DynamicsStudy(path)
    for lr in (0.01, 0.03):
        for norm in ("pre", "post"):
            for warmup in (0, 10):
                diverge = 12 if (norm, warmup, lr) == ("post", 0, 0.03) else None
                s.add(dynamics_result(loss_curve(2.5 + (norm == "post") * 0.3 + lr, diverge=diverge),
                                      collapse=8 if diverge else None), norm, warmup, lr=lr)
    return path
