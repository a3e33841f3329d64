"""The SM clock a card sustains under its power limit: GEMMs on n of its SMs, an attention kernel, and a training run.

Usage (GPU machine, repo root; about 3 minutes on one H200):
    python benchmarks/scripts/power_clock.py OUT
    python benchmarks/scripts/power_clock.py OUT --dtypes bf16,fp8 --zeroed '' --no-train

The question it answers: what a card's power limit does to its sustained clock, and so to the rate of the
compute-bound work, on the card's own die. A bf16 GEMM (random operands, 8,192 cubed) runs on a green context of
n SMs for each n: the work per SM is the same, so while the card is under its limit the board power grows in
proportion to n at the highest clock (the line's intercept is what does not scale with the SMs), and once the
limit binds the clock drops until the power is the limit's. Each n gives (clock, power, TFLOP/s), and from them
the dynamic power's curve against the clock, ``r(f) = (P_limit - P0) / (n * c)`` where ``c`` is one SM's share
at the highest clock: what a lower limit would leave of the clock is read off that curve, with no limit
changed (the card's settings stay as they are). FP8 operands (``--dtypes fp8``) draw more power a SM and so
reach lower clocks under the same limit: the same curve further down. Also measured: the GEMM at all SMs with
a share of its operands zeroed (less switching, less power: the clock against the switching at the limit), causal SDPA (flash) at
T = 8,192, and a ``scaletool train`` run of torchtitan's Llama-3.1-8B shape cut to ``--train-layers`` blocks
(the clock and power training draws), each sampled by NVML every ``--interval`` seconds.

Per point: ``--warmup`` seconds excluded (power and clock settle), then ``--seconds`` measured; clock and power
median with p10/p90 and n samples; TFLOP/s from CUDA events over the measured window. Writes
``OUT/power-clock.jsonl`` (one JSON object a line; the first describes the card).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_args import checked, positive_ints  # noqa: E402  (beside this script)
from sm_partition import green_stream  # noqa: E402  (a green context's stream, beside this script)

_POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT (not every binding names it)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(xs: list[float]) -> dict | None:
    from scaletool.stats import spread as _spread

    return _spread(xs).model_dump() if xs else None


class Sampler:
    """NVML every ``interval`` seconds: (t, SM MHz, W, temperature C, throttle-reason bits, utilisation %)."""

    def __init__(self, index: int, interval: float):
        import pynvml

        pynvml.nvmlInit()
        self.n, self.h, self.interval = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index), interval
        self.rows: list[tuple] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def power_w(self) -> float:
        n, h = self.n, self.h
        try:
            v = n.nvmlDeviceGetFieldValues(h, [_POWER_INSTANT])[0]
            if v.nvmlReturn == 0:
                return v.value.uiVal / 1000.0
        except Exception:  # older driver or binding: the averaged reading
            pass
        return n.nvmlDeviceGetPowerUsage(h) / 1000.0

    def _run(self):
        n, h = self.n, self.h
        while not self._stop.wait(self.interval):
            try:
                self.rows.append((time.perf_counter(), n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM), self.power_w(),
                                  n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                                  n.nvmlDeviceGetCurrentClocksThrottleReasons(h),
                                  n.nvmlDeviceGetUtilizationRates(h).gpu))
            except Exception as e:  # a failed read ends sampling, never the study
                log(f"NVML read failed: {e}")
                return

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()

    def window(self, t0: float, t1: float) -> dict:
        rows = [r for r in self.rows if t0 <= r[0] <= t1]
        return {"clock_mhz": spread([r[1] for r in rows]), "power_w": spread([r[2] for r in rows]),
                "temperature_c": spread([r[3] for r in rows]),
                "power_capped_share": sum(1 for r in rows if r[4] & 0x4) / len(rows) if rows else None,
                "thermal_share": sum(1 for r in rows if r[4] & (0x20 | 0x40 | 0x8)) / len(rows) if rows else None,
                "samples": len(rows)}


def card(sampler: Sampler, dev) -> dict:
    import torch

    n, h = sampler.n, sampler.h

    def q(fn, *a):
        try:
            return getattr(n, fn)(h, *a)
        except Exception:
            return None
    limit = q("nvmlDeviceGetPowerManagementLimit")
    return {"name": torch.cuda.get_device_name(dev), "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
            "power_limit_w": limit / 1000 if limit else None,
            "max_sm_clock_mhz": q("nvmlDeviceGetMaxClockInfo", n.NVML_CLOCK_SM),
            "default_app_sm_clock_mhz": q("nvmlDeviceGetDefaultApplicationsClock", n.NVML_CLOCK_SM),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.date.today().isoformat(), "command": "python benchmarks/scripts/power_clock.py "
            + " ".join(sys.argv[1:])}


def hold(fn, flops: float, stream, sampler: Sampler, warmup: float, seconds: float) -> dict:
    """Run ``fn`` back to back on ``stream`` for ``warmup`` + ``seconds``; the measured window's rate and NVML."""
    import torch

    with torch.cuda.stream(stream):
        end = time.perf_counter() + warmup
        while time.perf_counter() < end:
            for _ in range(4):
                fn()
            torch.cuda.current_stream().synchronize()
        t0, calls = time.perf_counter(), 0
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(4):
                fn()
            calls += 4
            # keep at most a few calls queued: the host's clock then follows the device's
            torch.cuda.current_stream().synchronize()
        e1.record()
        e1.synchronize()
        t1 = time.perf_counter()
    s = e0.elapsed_time(e1) / 1e3
    return {"calls": calls, "seconds": s, "tflops": flops * calls / s / 1e12, **sampler.window(t0 + 0.2, t1)}


def gemm_points(a, sampler: Sampler, dev, emit) -> None:
    import torch

    M = a.gemm_dim
    x = torch.randn(M, M, device=dev, dtype=torch.bfloat16)
    w = torch.randn(M, M, device=dev, dtype=torch.bfloat16)
    out = torch.empty(M, M, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * M ** 3
    keep = []
    for dtype in a.dtypes:
        fn = functools.partial(torch.mm, x, w, out=out)
        if dtype == "fp8":  # e4m3 operands (the second column-major), unit scales: the tensor cores' FP8 path
            x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t().contiguous().t()
            one = torch.ones((), device=dev, dtype=torch.float32)
            fn = functools.partial(torch._scaled_mm, x8, w8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        for n in a.sms:
            try:
                ctx, s = (None, torch.cuda.Stream()) if n >= torch.cuda.get_device_properties(dev).multi_processor_count \
                    else green_stream(n)[:2]
                keep.append(ctx)
            except Exception as e:
                emit({"part": "sms", "dtype": dtype, "sms": n, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            r = hold(fn, flops, s, sampler, a.warmup, a.seconds)
            emit({"part": "sms", "dtype": dtype, "sms": n, "green": ctx is not None, **r})
    s = torch.cuda.Stream()
    for share in a.zeroed:
        mask = (torch.rand(M, M, device=dev) >= share / 100).to(torch.bfloat16)
        xz, wz = x * mask, w * mask.t()
        r = hold(functools.partial(torch.mm, xz, wz, out=out), flops, s, sampler, a.warmup, a.seconds)
        emit({"part": "zeroed", "zeroed_pct": share, **r})
        del xz, wz, mask


def attention_point(a, sampler: Sampler, dev, emit) -> None:
    import torch
    import torch.nn.functional as F

    T, H, D, B = 8192, 32, 128, 2
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    flops = 4.0 * B * H * T * T * D / 2  # forward, causal convention
    r = hold(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), flops, torch.cuda.Stream(), sampler,
             a.warmup, a.seconds)
    emit({"part": "attention", "what": f"SDPA causal forward, B={B} H={H} T={T} d={D}", **r})


def train_point(a, sampler: Sampler, emit, compiled: bool) -> None:
    recipe = Path(a.out) / "tt2.yaml"
    if not recipe.exists():
        subprocess.run([sys.executable, "-m", "scaletool", "recipe", "from-published", "TT2", "-o", str(recipe)], check=True)
    run = Path(a.out) / ("train-compiled" if compiled else "train-eager")
    cmd = [sys.executable, "-m", "scaletool", "train", str(recipe), "--out", str(run), "--json",
           "--set", "parallel.engine=single", "--set", "parallel.world_size=1", "--set", f"train.compile={str(compiled).lower()}",
           "--set", f"model.n_layers={a.train_layers}", "--set", f"train.steps={a.train_steps}",
           "--set", "train.measure_warmup_steps=5"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    t1 = time.perf_counter()
    rec = {"part": "train", "command": "scaletool " + " ".join(cmd[3:]), "rc": p.returncode}
    try:
        s = json.loads(p.stdout)
        rec.update({k: s.get(k) for k in ("tokens_per_s", "tokens_per_s_spread", "step_time_s", "mfu", "peak_memory_bytes",
                                          "measured_steps", "status", "prediction", "nvml")})
    except ValueError:
        rec["stderr_tail"] = p.stderr[-1500:]
    # the busy samples of the run's second half (compilation and warm-up are in the first)
    mid = t0 + (t1 - t0) / 2
    busy = [r for r in sampler.rows if mid <= r[0] <= t1 and r[5] >= 90]
    if busy:
        rec.update(sampler.window(busy[0][0], busy[-1][0]))
    emit(rec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sms", type=positive_ints, default=[8, 16, 24, 32, 48, 64, 80, 96, 112, 132],
                    help="SMs the GEMM runs on (green contexts; the card's count: all, an ordinary stream)")
    ap.add_argument("--zeroed", type=lambda s: [int(x) for x in s.split(",") if x], default=[0, 25, 50, 75, 90],
                    help="percent of the GEMM's operand elements set to zero, at all SMs")
    ap.add_argument("--dtypes", type=lambda s: [x for x in s.split(",") if x], default=["bf16"],
                    help="GEMM operand types of the SM sweep, comma-separated: bf16, fp8 (e4m3, torch._scaled_mm)")
    ap.add_argument("--gemm-dim", type=int, default=8192)
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds excluded at each point")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds measured at each point")
    ap.add_argument("--interval", type=float, default=0.02, help="NVML sampling interval (s)")
    ap.add_argument("--train-layers", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--no-train", action="store_true")
    a = checked(ap, argv)
    if set(a.dtypes) - {"bf16", "fp8"} or not a.dtypes:
        print("error: --dtypes: bf16 and/or fp8", file=sys.stderr)
        return 2
    import torch  # checked() refused a machine without CUDA

    dev = torch.device("cuda")
    a.out.mkdir(parents=True, exist_ok=True)
    sampler = Sampler(torch.cuda.current_device(), a.interval).start()
    path = a.out / "power-clock.jsonl"
    with path.open("w") as f:
        def emit(rec):
            f.write(json.dumps(rec) + "\n")
            f.flush()
            log(json.dumps({k: (v.get("median") if isinstance(v, dict) else v) for k, v in rec.items()})[:300])
        emit({"part": "card", **card(sampler, dev)})
        time.sleep(1.0)
        t = time.perf_counter()
        time.sleep(2.0)
        emit({"part": "idle", **sampler.window(t, time.perf_counter())})
        gemm_points(a, sampler, dev, emit)
        attention_point(a, sampler, dev, emit)
        torch.cuda.empty_cache()
        for compiled in () if a.no_train else (True, False):
            train_point(a, sampler, emit, compiled)
    sampler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
