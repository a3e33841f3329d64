"""What bounds a decode step: the bytes it must read, the FLOPs it must do, or the kernels it launches.

Three floors per point, each the least time a step could take if it were all that counted:

- memory: the bytes a step must read (weights once and the cache once) at the device-to-device copy
  bandwidth measured in the same run (bytes read + written over a copy's time);
- compute: the step's FLOPs (``scaletool.analytic.flops.decode_flops_per_token`` × batch) at the
  datasheet dense peak of the dtype;
- launch: the kernels one step runs (counted by the profiler over one uncaptured step) × the time
  one tiny kernel takes inside a replayed CUDA graph, measured here (the per-node cost a replayed
  step cannot go under; eager steps pay more, the host's launch time).

The largest floor names the bound; the HBM fraction is the step's bytes over its median time, as a
share of the measured copy bandwidth. CPUs get the copy bandwidth only (no launch or compute floor).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from scaletool.measure.hardware import profile_for
from scaletool.stats import spread


@dataclass(frozen=True)
class Floors:
    """The device's measured rates a point's floors divide by (None: not known on this device)."""

    copy_bandwidth_bytes_per_s: float | None
    graph_kernel_s: float | None
    peak_flops: float | None
    peak_flops_source: str

    def as_dict(self) -> dict:
        return {"copy_bandwidth_bytes_per_s": self.copy_bandwidth_bytes_per_s, "graph_kernel_s": self.graph_kernel_s,
                "peak_flops": self.peak_flops, "peak_flops_source": self.peak_flops_source,
                "basis": "copy: bytes read + written by a device-to-device copy over its median time; kernel: the "
                         "median replay of a CUDA graph of tiny kernels over their number; FLOPs: datasheet"}


def _median_s(device: torch.device, fn, reps: int) -> float:
    fn()  # warm-up
    if device.type != "cuda":
        import time

        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return spread(times).median
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in pairs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize(device)
    return spread([a.elapsed_time(b) / 1e3 for a, b in pairs]).median


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + written), ``nbytes`` each way (1 GiB on CUDA, 64 MiB on CPU)."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**26)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_s(device, lambda: dst.copy_(src), reps)  # both freed on return


def graph_kernel_seconds(device: torch.device, kernels: int = 256, reps: int = 10) -> float | None:
    """Seconds per tiny kernel inside a replayed CUDA graph of ``kernels`` of them (None off CUDA)."""
    if device.type != "cuda":
        return None
    x = torch.zeros(1, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    return _median_s(device, graph.replay, reps) / kernels


def measure_floors(device: torch.device, dtype: str) -> Floors:
    """The rates of this device: copy bandwidth and graph kernel time measured, the FLOP peak looked up."""
    peak, source = None, "no FLOP peak is assumed for CPUs"
    if device.type == "cuda":
        prof = profile_for("cuda", torch.cuda.get_device_name(device))
        tflops = None if prof is None else prof.peak_tflops.get(dtype)
        peak = None if tflops is None else tflops * 1e12
        source = f"datasheet {dtype} peak for profile {prof.source}" if tflops else "no profile peak for this card"
    return Floors(copy_bandwidth(device), graph_kernel_seconds(device), peak, source)


#: kernel-name fragments -> the group a decode step's GPU time is reported under (first match wins)
KERNEL_GROUPS = (
    ("attention", ("mla_", "_mla", "latent_decode", "_merge_kernel", "_merge_up",
                   "_absorb_q", "flash", "fmha", "cudnn", "attention", "sdpa")),
    ("matmul", ("gemv", "gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm80_", "splitk", "mm_")),
    ("fused element-wise (inductor)", ("triton_",)),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_group(name: str) -> str:
    """The group of a CUDA kernel named ``name`` (:data:`KERNEL_GROUPS`), ``other`` if none matches."""
    low = name.lower()
    for group, fragments in KERNEL_GROUPS:
        if any(f in low for f in fragments):
            return group
    return "other"


def kernel_breakdown(kernels: list[tuple[str, float]], top: int = 8) -> dict:
    """GPU time of one step's kernels ``[(name, seconds)]``: the sum, per group (:func:`kernel_group`)
    and the ``top`` kernels by total time (name, calls, seconds). The sum is busy time only: a step's
    time over it is the gaps between kernels (launch and dependency latency)."""
    groups: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for name, s in kernels:
        g = kernel_group(name)
        groups[g] = groups.get(g, 0.0) + s
        by_name.setdefault(name, []).append(s)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"busy_s": sum(s for _, s in kernels),
            "groups_s": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n[:160], "calls": len(v), "s": sum(v)} for n, v in ranked]}


def step_kernels(steps) -> list[tuple[str, float]] | None:
    """The kernels (and copies) one decode step runs on the GPU, ``[(name, seconds)]`` in launch order,
    from the profiler over one uncaptured step (None off CUDA, or without CUPTI). The stepper's token and
    position are put back, so the next step rewrites the same cache row."""
    device = steps.token.device
    if device.type != "cuda":
        return None
    mark = steps.mark()
    run = getattr(steps, "_run", steps.step)
    from torch.profiler import ProfilerActivity, profile

    try:
        run()  # a step outside the profiler first: its one-time work (autotuning, allocation) stays out
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize(device)
        found = [(e.name, e.time_range.elapsed_us() / 1e6) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
    except Exception:  # noqa: BLE001 - no CUPTI in this build or container: the launch floor stays unknown
        found = None
    finally:
        steps.rewind(mark)
    return found or None


def point_bound(floors: Floors, step_s: float, bytes_per_step: float, flops_per_step: float,
                kernels: int | None) -> dict:
    """A point's floors, its bound (the largest floor), the step over that floor and its HBM fraction."""
    bw = floors.copy_bandwidth_bytes_per_s
    out = {"decode_floor_memory_s": None if bw is None else bytes_per_step / bw,
           "decode_floor_compute_s": None if floors.peak_flops is None else flops_per_step / floors.peak_flops,
           "decode_floor_launch_s": None if kernels is None or floors.graph_kernel_s is None
           else kernels * floors.graph_kernel_s,
           "decode_kernels_per_step": kernels, "decode_flops_per_step": flops_per_step,
           "decode_hbm_fraction_of_copy": None if bw is None else bytes_per_step / step_s / bw}
    named = {k: out[f"decode_floor_{k}_s"] for k in ("memory", "compute", "launch")}
    known = {k: v for k, v in named.items() if v is not None}
    bound = max(known, key=known.get) if known else None
    out["decode_bound"] = bound
    out["decode_step_over_floor"] = None if bound is None else step_s / known[bound]
    return out
