"""Operator breakdown of a profiler trace: where a training step's time goes.

Reads the Chrome-trace JSON ``torch.profiler`` writes; per profiled step, the time of each category,
which with ``idle`` adds up to the step. Our own parser, because Holistic Trace Analysis reads GPU
streams only (CPU runs would get nothing) and has heavy dependencies.

The device is the GPU when the trace has kernels, else the CPU. Each work event contributes its self
time, classified by its name, its callers' names and the ``scaletool::<region>`` module range it ran
in (backward ops inherit their forward op's region through ``fwdbwd`` flows; kernels their launching
op's). Where categories overlap, compute wins: ``communication`` is the exposed part. Everything
inside ``scaletool::unmeasured`` (the monitors) is left out.
"""
from __future__ import annotations

import gzip
import json
import re
from bisect import bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1

#: Categories in priority order (a segment where several are active goes to the first); ``idle`` is
#: the rest of the step.
CATEGORIES = ("optimizer", "attention", "norm", "ffn_matmul", "other_matmul", "other", "communication")
ALL_CATEGORIES = CATEGORIES + ("idle",)
#: The module view: which module's code ran (attention includes its projections and RoPE).
MODULES = ("optimizer", "attention", "ffn", "norm", "other", "communication")
ALL_MODULES = MODULES + ("idle",)
COMPUTE = frozenset(CATEGORIES) - {"communication"}

# Name patterns (ops, annotations, kernels), matched case-insensitively anywhere in the name.
_PATTERNS = {
    "communication": re.compile(
        r"nccl|gloo:|c10d::|c10d_functional::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all"
        r"|fsdp::(split_with_sizes_copy|chunk_cat)|FSDP::post_backward_reduce", re.I),
    "optimizer": re.compile(r"^Optimizer\.|_foreach_|adamw?\b|_fused_adam|multi_tensor|clip_grad", re.I),
    "attention": re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|sdpa|cudnn.*attn", re.I),
    "norm": re.compile(r"rms_?norm|layer_?norm|batch_?norm|group_?norm", re.I),
    "matmul": re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|einsum)$|gemm|cutlass|xmma|nvjet"
                         r"|cublas|wgmma|s16816|tensorop", re.I),
}
_PRIORITY = ("communication", "optimizer", "attention", "norm", "matmul")
REGION_PREFIX = "scaletool::"
UNMEASURED = "scaletool::unmeasured"
_REGION_CATEGORY = {"norm": "norm", "optimizer": "optimizer"}
_HOST_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_EVALUATE = "autograd::engine::evaluate_function"


@dataclass(eq=False)
class Event:
    name: str
    cat: str
    ts: float  # µs
    end: float
    thread: tuple
    args: dict
    parent: Event | None = None
    children: list = field(default_factory=list)
    region: str | None = None
    matches: frozenset = frozenset()


def load_trace(path: str | Path) -> dict:
    """A Chrome trace as JSON (``.json`` or ``.json.gz``)."""
    p = Path(path)
    raw = p.read_bytes()
    if p.suffix == ".gz":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def _name_matches(name: str) -> frozenset:
    return frozenset(c for c, rx in _PATTERNS.items() if rx.search(name))


def _region_of_annotation(name: str) -> str | None:
    if name.startswith(REGION_PREFIX):
        return name[len(REGION_PREFIX):]
    if name.startswith("Optimizer."):
        return "optimizer"
    return None


def _category(matches: frozenset, region: str | None) -> str:
    m = set(matches)
    if region in _REGION_CATEGORY:
        m.add(_REGION_CATEGORY[region])
    for c in _PRIORITY:
        if c in m:
            if c == "matmul":
                return "ffn_matmul" if region == "ffn" else "other_matmul"
            return c
    return "other"


def _module(category: str, region: str | None) -> str:
    if category in ("communication", "optimizer"):
        return category
    return region if region in ("attention", "ffn", "norm") else "other"


def _build_trees(events: list[Event]) -> None:
    """Parent/children by time containment on each thread (the profiler nests ranges strictly)."""
    by_thread = defaultdict(list)
    for e in events:
        by_thread[e.thread].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.ts, -e.end))
        stack: list[Event] = []
        for e in evs:
            while stack and e.ts >= stack[-1].end - 1e-3:
                stack.pop()
            while stack and e.end > stack[-1].end + 1e-3:  # overlaps without nesting: treat as sibling
                stack.pop()
            if stack:
                e.parent = stack[-1]
                stack[-1].children.append(e)
            stack.append(e)


def _roots_first(events: list[Event]) -> list[Event]:
    order, todo = [], [e for e in events if e.parent is None]
    while todo:
        e = todo.pop()
        order.append(e)
        todo.extend(e.children)
    return order


def _backward_links(host: list[Event], order: list[Event], flows: dict) -> dict[Event, Event]:
    """Backward op -> the forward op that created its autograd node, from the trace's ``fwdbwd`` flows.

    A flow starts at the forward op (``aten::mm``) and ends at the backward node's op
    (``MmBackward0``); the link is put on the enclosing ``evaluate_function`` so its whole subtree
    inherits it. Where several ops start at the flow's timestamp, the deepest is the one meant.
    """
    depth, at = {}, {}
    for e in order:
        depth[e] = depth[e.parent] + 1 if e.parent else 0
    for e in host:
        key = (e.thread, e.ts)
        if key not in at or depth[e] > depth[at[key]]:
            at[key] = e
    links = {}
    for start, end in flows.values():
        if start is None or end is None or start not in at or end not in at:
            continue  # one end outside the profiled window
        bwd = at[end]
        if bwd.parent is not None and bwd.parent.name.startswith(_EVALUATE):
            bwd = bwd.parent
        links[bwd] = at[start]
    return links


def _attribute_host(host: list[Event], flows: dict) -> None:
    """Set ``region`` and ``matches`` on every host event.

    Forward ops get both from their callers (annotations, op names); a backward subtree gets its
    forward op's, so the backward of a matmul in the FFN is an FFN matmul, and the backward of the
    softmax inside SDPA's math path is attention.
    """
    order = _roots_first(host)

    def inherits(e: Event) -> bool:
        # a module's range starts afresh: under activation checkpointing the forward is recomputed
        # inside a backward op, and those forward ops are not that backward op's kind
        return e.parent is not None and not (e.cat == "user_annotation" and e.name.startswith(REGION_PREFIX))

    annotated, base = {}, {}  # from callers only
    for e in order:
        own = _region_of_annotation(e.name) if e.cat == "user_annotation" else None
        annotated[e] = own or (annotated[e.parent] if e.parent else None)
        base[e] = _name_matches(e.name) | (base[e.parent] if inherits(e) else frozenset())
    links = _backward_links(host, order, flows)
    for e in order:
        own = _region_of_annotation(e.name) if e.cat == "user_annotation" else None
        fwd = links.get(e)
        if own is None and fwd is not None:
            own = annotated[fwd]
        e.region = own or (e.parent.region if e.parent else None)
        e.matches = (_name_matches(e.name) | (e.parent.matches if inherits(e) else frozenset())
                     | (base[fwd] if fwd is not None else frozenset()))


def _unmeasured(e: Event) -> bool:
    while e is not None:
        if e.name == UNMEASURED:
            return True
        e = e.parent
    return False


def _is_host_work(e: Event) -> bool:
    return e.cat == "cpu_op" or (e.cat == "user_annotation" and e.name.startswith("gloo:"))


def _work_children(e: Event):
    for c in e.children:
        if _is_host_work(c):
            yield c
        else:
            yield from _work_children(c)


def _subtract(a: float, b: float, holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """[a, b) minus the union of ``holes`` (sorted or not)."""
    out, cur = [], a
    for s, t in sorted(holes):
        if t <= cur:
            continue
        if s >= b:
            break
        if s > cur:
            out.append((cur, s))
        cur = max(cur, t)
    if cur < b:
        out.append((cur, b))
    return out


@dataclass
class Fragment:
    start: float
    end: float
    name: str
    category: str
    module: str
    event_id: int


def _sweep(parts: list[tuple[float, float]], frags: list[Fragment], key: str, order: tuple[str, ...]):
    """Partition ``parts`` (sorted, disjoint spans): each instant goes to the first active label in
    ``order``, else to idle. One pass over the sorted fragment boundaries.

    Returns (µs per label incl. idle, communication µs, communication µs overlapped by compute).
    """
    OPEN, CLOSE = 2, -2  # window edges ride in the same stream as the fragments' +1/-1
    points = [(a, OPEN, None, None) for a, _ in parts] + [(b, CLOSE, None, None) for _, b in parts]
    for f in frags:
        points.append((f.start, 1, getattr(f, key), f.category))
        points.append((f.end, -1, getattr(f, key), f.category))
    points.sort(key=lambda p: p[0])
    times = dict.fromkeys(order + ("idle",), 0.0)
    rank = {lab: i for i, lab in enumerate(order)}
    active, cats = Counter(), Counter()
    comm = overlap = 0.0
    inside, prev = 0, None  # windows open (edges of adjacent windows coincide)
    for t, d, lab, cat in points:
        if inside > 0 and t > prev:
            live = [x for x, n in active.items() if n > 0]
            times[min(live, key=rank.__getitem__) if live else "idle"] += t - prev
            if cats["communication"] > 0:
                comm += t - prev
                if any(n > 0 for c, n in cats.items() if c in COMPUTE):
                    overlap += t - prev
        prev = t
        if d in (OPEN, CLOSE):
            inside += 1 if d == OPEN else -1
        else:
            active[lab] += d
            cats[cat] += d
    return times, comm, overlap


def _clip(f: Fragment, parts: list[tuple[float, float]], starts: list[float]) -> float:
    """µs of ``f`` inside the sorted disjoint ``parts`` (``starts`` = their start times)."""
    total, i = 0.0, max(bisect_right(starts, f.start) - 1, 0)
    while i < len(parts) and parts[i][0] < f.end:
        total += max(0.0, min(f.end, parts[i][1]) - max(f.start, parts[i][0]))
        i += 1
    return total


def _read_events(trace: dict) -> tuple[list[Event], list[Event], dict]:
    """Host and device complete events of a trace, and its forward-backward flows (id -> [start, end])."""
    host, device = [], []
    flows: dict = defaultdict(lambda: [None, None])  # fwdbwd flow id -> [(thread, ts) of start, of end]
    for raw in trace.get("traceEvents", []):
        if raw.get("cat") == "fwdbwd" and raw.get("ph") in ("s", "f"):
            flows[raw.get("id")][raw["ph"] == "f"] = ((raw.get("pid"), raw.get("tid")), float(raw["ts"]))
        if raw.get("ph") != "X" or not isinstance(raw.get("ts"), (int, float)):
            continue
        cat = raw.get("cat", "")
        e = Event(raw.get("name", ""), cat, float(raw["ts"]), float(raw["ts"]) + float(raw.get("dur", 0)),
                  (raw.get("pid"), raw.get("tid")), raw.get("args") or {})
        if cat in _HOST_CATS:
            host.append(e)
        elif cat in _DEVICE_CATS:
            device.append(e)
    return host, device, flows


def _gpu_fragments(host: list[Event], device: list[Event], steps: list) -> tuple[list, list, list]:
    """Kernels as fragments (category and module from the op that launched them), the kernels of
    unmeasured work, and each step's window: from the previous step's last kernel to its own."""
    step_starts = [e.ts for _, e in steps]

    def step_of(ts: float) -> int | None:
        i = bisect_right(step_starts, ts) - 1
        return i if i >= 0 and ts <= steps[i][1].end else None

    launcher_by_corr = {e.args.get("correlation"): e for e in host
                        if e.cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.args}
    op_by_ext = {e.args.get("External id"): e for e in host if e.cat == "cpu_op" and "External id" in e.args}
    frags, excluded, per_step = [], [], defaultdict(list)
    for k, e in enumerate(device):
        launch = launcher_by_corr.get(e.args.get("correlation"))
        op = launch.parent if launch is not None else op_by_ext.get(e.args.get("External id"))
        anchor = launch or op
        if anchor is not None and _unmeasured(anchor):
            excluded.append((e.ts, e.end))
            continue
        region = op.region if op else None
        cat = _category(_name_matches(e.name) | (op.matches if op else frozenset()), region)
        s = step_of(anchor.ts) if anchor is not None else None
        if s is not None:
            per_step[s].append(e)
        frags.append(Fragment(e.ts, e.end, e.name, cat, _module(cat, region), k))
    windows, prev_end = [], None
    for s in range(len(steps)):
        kern = per_step.get(s)
        if not kern:
            continue
        end = max(e.end for e in kern)
        windows.append((steps[s][0], prev_end if prev_end is not None else min(e.ts for e in kern), end))
        prev_end = end
    return frags, excluded, windows


def _cpu_fragments(host: list[Event], steps: list) -> tuple[list, list, list]:
    """Host ops' self time as fragments, unmeasured ranges, and the ProfilerStep ranges as windows."""
    frags, excluded = [], []
    for k, e in enumerate(host):
        if e.name == UNMEASURED:
            excluded.append((e.ts, e.end))
        if not _is_host_work(e) or _unmeasured(e):
            continue
        cat = _category(e.matches, e.region)
        for a, b in _subtract(e.ts, e.end, [(c.ts, c.end) for c in _work_children(e)]):
            frags.append(Fragment(a, b, e.name, cat, _module(cat, e.region), k))
    return frags, excluded, [(num, e.ts, e.end) for num, e in steps]


def _top_ops(frags: list, parts: list, n: int, step_s: float, top: int) -> list[dict]:
    """The ops (CPU) or kernels (GPU) with the most self time inside the steps, per step."""
    clipped = Counter()  # (name, category) -> µs
    calls: dict[tuple, set] = defaultdict(set)
    starts = [a for a, _ in parts]
    for f in frags:
        d = _clip(f, parts, starts)
        if d > 0:
            clipped[f.name, f.category] += d
            calls[f.name, f.category].add(f.event_id)
    return [{"name": name, "category": cat, "calls": len(calls[name, cat]) / n, "time_s": t / n / 1e6,
             "share": (t / n / 1e6) / step_s if step_s else None}
            for (name, cat), t in clipped.most_common(top)]


def analyze(trace: dict, *, top: int = 15) -> dict:
    """Breakdown of one rank's trace (see the module docstring); times are per-step means in seconds."""
    host, device, flows = _read_events(trace)
    _build_trees(host)
    _attribute_host(host, flows)
    steps = sorted(((int(m.group(1)), e) for e in host if e.cat == "user_annotation" and (m := _STEP.match(e.name))),
                   key=lambda x: x[1].ts)
    if not steps:
        raise ValueError("the trace has no ProfilerStep#N ranges: was it written by torch.profiler with a schedule "
                         "and prof.step() once per training step?")
    on_gpu = bool(device)
    frags, excluded, windows = _gpu_fragments(host, device, steps) if on_gpu else _cpu_fragments(host, steps)
    if not windows:
        raise ValueError("no profiled step launched any GPU work")
    step_parts = [_subtract(a, b, excluded) for _, a, b in windows]
    step_times = [sum(t - s for s, t in ps) / 1e6 for ps in step_parts]
    parts = sorted(p for ps in step_parts for p in ps)
    totals, comm_total, comm_overlap = _sweep(parts, frags, "category", CATEGORIES)
    mod_totals, _, _ = _sweep(parts, frags, "module", MODULES)
    n = len(windows)
    step_s = sum(step_times) / n

    def table(tot: dict, labels) -> dict:
        return {c: {"time_s": tot[c] / n / 1e6, "share": (tot[c] / n / 1e6) / step_s if step_s else None}
                for c in labels}

    matmul = totals["ffn_matmul"] + totals["other_matmul"]
    return {
        "device": "cuda" if on_gpu else "cpu",
        "steps": [num for num, _, _ in windows],
        "n_steps": n,
        "step_time_s": step_s,
        "step_times_s": step_times,
        "categories": table(totals, ALL_CATEGORIES),
        "modules": table(mod_totals, ALL_MODULES),
        "communication_overlap": {
            "communication_s": comm_total / n / 1e6,
            "overlapped_s": comm_overlap / n / 1e6,
            "exposed_s": (comm_total - comm_overlap) / n / 1e6,
            "overlap_ratio": comm_overlap / comm_total if comm_total else None,
        },
        "ffn_matmul_fraction_of_matmul": totals["ffn_matmul"] / matmul if matmul else None,
        "top_ops": _top_ops(frags, parts, n, step_s, top),
    }
