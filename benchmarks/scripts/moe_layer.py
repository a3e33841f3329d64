"""MoE at dense speed? The dropless MoE layer timed part by part, and training dense against MoE.

Usage (repository root)::

    python benchmarks/scripts/moe_layer.py parts OUT.json [--tiny]   # GPU: about 2 minutes on an H100
    python benchmarks/scripts/moe_layer.py gemms OUT.json [--tiny]   # GPU: seconds
    python benchmarks/scripts/moe_layer.py train OUT_DIR [--tiny]    # GPU: about 4 minutes on an H100
    python benchmarks/scripts/moe_layer.py point PERMUTE -- ARGS...  # `scaletool ARGS` with MoE.permute set
    python benchmarks/scripts/moe_layer.py ep-table OUT/ep            # the moe-ep study's table

``parts``: one MoE layer of mla-1b + 16 experts top-2 (width 1024, one shared expert, 8 x 2048 tokens),
fp32 weights under bf16 autocast as ``scaletool train`` runs it. Each part's forward + backward is timed
with CUDA events (``--iters`` repeats after ``--warmup``): router, balance loss, permutation (``gather``:
index_select both ways | ``indexed``: advanced indexing, scatter-add backward), expert GEMMs (gate/up fused
| three GEMMs; group sizes as routed | rounded up to 16 rows), un-permutation with the gate-weighted sum,
shared expert, and the whole layer eager and compiled (fullgraph) on both paths.

``train``: ``scaletool train --json`` runs of mla-1b dense, MoE e16k2 on the ``indexed`` path and on the
``gather`` path (``--points`` picks some), all compiled (``--compile-scope``), ``--accum`` micro-batches per
step with ``--weight-cast`` (``train.weight_cast``): tokens/s and MFU on active FLOPs per measured step
(median, p10/p90, n; warm-up and compilation excluded), peak memory against scaletool's estimate.

``--tiny`` runs either on CPU at toy sizes (eager training, loop GEMMs, wall-clock timing): a check of this
driver, not a measurement. Writes JSON with the card, date, torch/CUDA versions and the command.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from probe_args import positive_int  # noqa: E402

from scaletool.stats import spread  # noqa: E402

MOE = {"ffn": "moe", "n_routed_experts": 16, "num_experts_per_tok": 2, "n_shared_experts": 1,
       "moe_intermediate_size": 1024, "first_k_dense_replace": 1, "aux_loss_alpha": 0.001}
TINY_MOE = {**MOE, "n_routed_experts": 4, "moe_intermediate_size": 32}


def environment() -> dict:
    import torch
    cuda = torch.cuda.is_available()
    return {"card": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "command": [Path(sys.executable).name, *sys.argv]}


def _spread_dict(xs: list[float], scale: float = 1.0) -> dict | None:
    s = spread([x * scale for x in xs])
    return None if s is None else {"median": s.median, "p10": s.p10, "p90": s.p90, "n": s.n}


# -- gemms ---------------------------------------------------------------------------------------------


def gemms(args) -> int:
    """The routed experts' GEMMs one by one: forward, input gradient (dgrad) and weight gradient (wgrad),
    for both weight layouts ``torch._grouped_mm`` can take, against references of the same FLOPs: one bmm
    over equal groups (what the capacity path runs) and one dense mm of all rows (the ceiling)."""
    import torch

    tiny = args.tiny or not torch.cuda.is_available()
    device = torch.device("cpu" if tiny else "cuda")
    E, d, i, rows = (4, 32, 16, 256) if tiny else (16, 2048, 1024, 32768)
    dtype = torch.float32 if tiny else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    counts = torch.full((E,), rows // E, dtype=torch.long)
    counts += torch.randint(-rows // (8 * E), rows // (8 * E) + 1, (E,), generator=gen)  # routed-like, uneven
    counts[-1] = rows - counts[:-1].sum()
    offs = counts.cumsum(0).to(torch.int32).to(device)
    timed = _timer(device)
    results: dict[str, dict] = {}

    def run(name: str, fn, flops: float) -> None:
        try:
            times = [timed(fn) for _ in range(args.warmup + args.iters)][args.warmup:]
            results[name] = {"ms": _spread_dict(times), "tflops": _spread_dict([flops / (1e9 * t) for t in times])}
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            results[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
        print(f"{name}: {results[name]}", file=sys.stderr)

    def grouped(a, w):
        if tiny:  # no grouped GEMM on the CPU: the per-segment loop, same shapes
            return torch.cat([seg @ w[e] for e, seg in enumerate(a.split(counts.tolist()))])
        return torch._grouped_mm(a, w, offs=offs)

    def time_layout(proj: str, layout: str, x, dy, flops: float) -> None:
        K, N = x.shape[1], dy.shape[1]
        # kn: w stored (E, K, N), as GroupedExperts keeps it; nk: stored (E, N, K) and passed transposed
        store = torch.randn(*((E, K, N) if layout == "kn" else (E, N, K)), device=device, dtype=dtype)

        def view(t):
            return t if layout == "kn" else t.transpose(-2, -1)
        with torch.no_grad():
            run(f"{proj}/{layout}/forward", lambda: grouped(x, view(store)), flops)
        xg = x.detach().requires_grad_()
        out_x = grouped(xg, view(store))
        run(f"{proj}/{layout}/dgrad", lambda: torch.autograd.grad(out_x, xg, dy, retain_graph=True), flops)
        wg = store.detach().requires_grad_()
        out_w = grouped(x, view(wg))
        run(f"{proj}/{layout}/wgrad", lambda: torch.autograd.grad(out_w, wg, dy, retain_graph=True), flops)

    def time_references(proj: str, x, N: int, flops: float) -> None:
        K = x.shape[1]
        xb, wb = x.view(E, rows // E, K), torch.randn(E, K, N, device=device, dtype=dtype)
        wd = torch.randn(K, N, device=device, dtype=dtype)
        with torch.no_grad():
            run(f"{proj}/bmm-equal-groups/forward", lambda: torch.bmm(xb, wb), flops)
            run(f"{proj}/dense-mm/forward", lambda: x @ wd, flops)

    for proj, (K, N) in {"gate_up": (d, 2 * i), "down": (i, d)}.items():
        flops = 2.0 * rows * K * N
        x = torch.randn(rows, K, device=device, dtype=dtype)
        dy = torch.randn(rows, N, device=device, dtype=dtype)
        for layout in ("kn", "nk"):
            time_layout(proj, layout, x, dy, flops)
        time_references(proj, x, N, flops)
    out = {"benchmark": "moe-expert-gemms", **environment(), "tiny": tiny,
           "config": {"experts": E, "d_model": d, "moe_intermediate_size": i, "rows": rows,
                      "rows_per_expert": counts.tolist(), "dtype": str(dtype), "iters": args.iters,
                      "warmup": args.warmup,
                      "layouts": {"kn": "weights (E, K, N), row-major: GroupedExperts' storage",
                                  "nk": "weights (E, N, K) passed as a transposed view (torchtitan's storage)"}},
           "gemms": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all("error" not in r for r in results.values()) else 1


# -- parts ---------------------------------------------------------------------------------------------


def _timer(device):
    """A function timing one call of fn in milliseconds (CUDA events, or the wall clock on CPU)."""
    import torch
    if device.type == "cuda":
        def timed(fn) -> float:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        return timed

    def timed_cpu(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    return timed_cpu


def parts(args) -> int:
    import torch

    from scaletool.config import load_recipe
    from scaletool.model.moe import MoE, _GatherRows, sort_by_expert

    tiny = args.tiny or not torch.cuda.is_available()
    recipe = "recipes/tiny.yaml" if tiny else "recipes/mla-1b.yaml"
    sets = [f"model.{k}={v}" for k, v in (TINY_MOE if tiny else MOE).items()]
    cfg = load_recipe(ROOT / recipe, sets).model
    device = torch.device("cpu" if tiny else "cuda")
    B, T = (2, 64) if tiny else (8, 2048)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    moe = MoE(cfg, 1).to(device)
    torch.nn.init.normal_(moe.gate.weight, 0.0, 0.02)
    moe.init_weights(0.02, 0.02, None)
    for lin in (moe.shared.w1, moe.shared.w2, moe.shared.w3):
        torch.nn.init.normal_(lin.weight, 0.0, 0.02)
    N, d, E, k = B * T, cfg.d_model, cfg.n_routed_experts, cfg.num_experts_per_tok
    autocast = torch.autocast(device.type, dtype=dtype)
    x = torch.randn(N, d, device=device, dtype=dtype)
    impl = None if not tiny else "loop"
    with torch.no_grad(), autocast:
        idx, weights, scores = moe.route(x)
    order, inverse, counts = sort_by_expert(idx, E)
    c16 = (counts + 15) // 16 * 16
    timed = _timer(device)
    results: dict[str, dict] = {}
    leaves: list = []  # inputs whose gradients are dropped between calls

    def leaf(t):
        leaves.append(t.detach().clone().requires_grad_())
        return leaves[-1]

    def run(name: str, fn, flops: float | None = None) -> None:
        """fn() builds its graph and runs backward; gradients are dropped between calls, untimed."""
        try:
            times = []
            for i in range(args.warmup + args.iters):
                moe.zero_grad(set_to_none=True)
                for t in leaves:
                    t.grad = None
                t = timed(fn)
                if i >= args.warmup:
                    times.append(t)
            r = {"ms": _spread_dict(times)}
            if flops:
                r["tflops"] = _spread_dict([flops / (1e9 * t) for t in times])
            results[name] = r
        except Exception as e:  # one failing part must not hide the others
            results[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
        print(f"{name}: {results[name]}", file=sys.stderr)

    xs = leaf(x)

    def router():
        with autocast:
            _, w, s = moe.route(xs)
        (w.sum() + s.sum()).backward()

    run("router", router)
    sc = leaf(scores)
    run("aux_loss", lambda: moe.balance_loss(idx, sc, B).backward())
    gx = torch.randn(N * k, d, device=device, dtype=dtype)
    run("permute/gather", lambda: _GatherRows.apply(xs, order // k, inverse, k).backward(gx))
    run("permute/indexed", lambda: xs[order // k].backward(gx))
    i = cfg.moe_intermediate_size
    for name, cnt in (("routed", counts), ("aligned16", c16)):
        rows = int(cnt.sum())
        xe = leaf(torch.randn(rows, d, device=device, dtype=dtype))
        ge = torch.randn(rows, d, device=device, dtype=dtype)
        for fuse in (True, False):
            def gemm(xe=xe, ge=ge, cnt=cnt, fuse=fuse):
                moe.experts.sorted_forward(xe, cnt, impl, fuse_gate_up=fuse).backward(ge)
            run(f"expert_gemms/{'fused' if fuse else 'three'}/{name}", gemm, flops=3 * 2 * rows * d * i * 3)
    ys = leaf(torch.randn(N * k, d, device=device, dtype=dtype))
    ws = leaf(weights)
    g = torch.randn(N, d, device=device, dtype=dtype)

    def unpermute_gather():
        out = _GatherRows.apply(ys, inverse, order, 1)
        (out.view(N, k, d) * ws.unsqueeze(-1).to(out.dtype)).sum(1).backward(g)

    def unpermute_indexed():
        out = torch.empty_like(ys)
        out[order] = ys
        (out.view(N, k, d) * ws.unsqueeze(-1).to(out.dtype)).sum(1).backward(g)

    run("unpermute/gather", unpermute_gather)
    run("unpermute/indexed", unpermute_indexed)

    def shared():
        with autocast:
            out = moe.shared(xs)
        out.backward(g)

    run("shared_expert", shared, flops=3 * 2 * N * d * i * cfg.n_shared_experts * 3)
    moe.expert_impl = impl
    moe.train()
    x3 = xs.view(B, T, d)
    layer_flops = 3 * 2 * N * d * (E + 3 * i * (k + cfg.n_shared_experts))  # router + active experts
    for compiled in (False, True):
        if compiled and tiny:
            continue  # inductor on a shared CPU takes minutes; the fullgraph capture is a unit test
        for permute in ("gather", "indexed"):
            moe.permute = permute
            torch._dynamo.reset()
            fwd = torch.compile(moe, fullgraph=True) if compiled else moe

            def layer(fwd=fwd):
                with autocast:
                    out = fwd(x3)
                    loss = (out.float() * g.view(B, T, d).float()).sum() + moe.aux_loss
                loss.backward()

            run(f"layer/{'compiled' if compiled else 'eager'}/{permute}", layer, flops=layer_flops)
    result = {"benchmark": "moe-layer-parts", **environment(), "tiny": tiny,
              "config": {"tokens": N, "d_model": d, "experts": E, "top_k": k, "moe_intermediate_size": i,
                         "n_shared_experts": cfg.n_shared_experts, "rows_routed": int(counts.sum()),
                         "rows_aligned16": int(c16.sum()), "tokens_per_expert": counts.tolist(),
                         "iters": args.iters, "warmup": args.warmup},
              "parts": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(parts_table(result))
    return 0 if all("error" not in r for r in results.values()) else 1


def parts_table(result: dict) -> str:
    lines = [f"MoE layer parts, forward + backward, on {result['card']} ({result['config']['tokens']} tokens)", "",
             "| part | ms median | p10 | p90 | n | TFLOP/s |", "|---|---|---|---|---|---|"]
    for name, r in result["parts"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:80]} | | | | |")
            continue
        ms, tf = r["ms"], r.get("tflops")
        lines.append(f"| {name} | {ms['median']:.3f} | {ms['p10']:.3f} | {ms['p90']:.3f} | {ms['n']} | "
                     f"{tf['median']:.1f} |" if tf else f"| {name} | {ms['median']:.3f} | {ms['p10']:.3f} | "
                     f"{ms['p90']:.3f} | {ms['n']} | |")
    return "\n".join(lines) + "\n"


# -- training ------------------------------------------------------------------------------------------


def train_points(tiny: bool) -> list[tuple[str, str, list[str]]]:
    """(name, permute, model overrides) of each training point."""
    moe = [f"model.{k}={v}" for k, v in (TINY_MOE if tiny else MOE).items()]
    return [("dense", "gather", []), ("moe-indexed", "indexed", moe), ("moe-gather", "gather", moe)]


def run_point(args, name: str, permute: str, sets: list[str]) -> dict:
    recipe = "recipes/tiny.yaml" if args.tiny else args.recipe
    sets = [*sets, f"train.steps={args.steps}", "train.log_every=100", f"train.measure_warmup_steps={args.warmup}",
            f"train.compile={'false' if args.tiny else 'true'}", f"train.compile_scope={args.compile_scope}",
            f"train.grad_accum_steps={args.accum}", f"train.weight_cast={args.weight_cast}", *args.overrides]
    cmd = [sys.executable, str(Path(__file__).resolve()), "point", permute, "--", "train", recipe, "--json",
           "--out", str(args.out / "runs" / name)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    try:
        summary = json.loads(p.stdout)
    except json.JSONDecodeError:
        summary = {"status": "failed", "message": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    summary["benchmark"] = {"point": name, "permute": permute, "wall_s": time.perf_counter() - t0,
                            "command": cmd, "returncode": p.returncode}
    (args.out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def point_figures(s: dict) -> dict:
    """tokens/s and MFU (active FLOPs) per measured step, memory against the estimate."""
    if s.get("status") != "completed":
        return {"status": s.get("status"), "message": s.get("message")}
    steps = s["history"]["step_time_s"][s["measure_warmup_steps"]:]
    tps = [s["tokens_per_step"] / t for t in steps if t > 0]
    peak = (s.get("hardware") or {}).get("peak_tflops")
    mem = s.get("memory") or {}
    est = (mem.get("analytic") or {}).get("total_bytes")
    return {"status": "completed", "expert_gemm": (s.get("moe") or {}).get("expert_gemm"),
            "permute": (s.get("moe") or {}).get("permute"),
            "tokens_per_s": _spread_dict(tps),
            "mfu_active": _spread_dict(tps, s["flops_per_token"]["train"] / (peak * 1e12)) if peak else None,
            "peak_allocated_bytes": mem.get("measured_peak_allocated_bytes"), "estimated_bytes": est,
            "memory_rel_error": mem.get("rel_error")}


def train(args) -> int:
    if args.steps <= args.warmup + 2:
        sys.exit(f"error: --steps {args.steps} leaves fewer than 3 measured steps after --warmup {args.warmup}")
    args.out.mkdir(parents=True, exist_ok=True)
    points = {}
    for name, permute, sets in train_points(args.tiny):
        if args.points and name not in args.points:
            continue
        s = run_point(args, name, permute, sets)
        points[name] = point_figures(s)
        print(f"{name}: {points[name].get('status')} in {s['benchmark']['wall_s']:.0f} s", file=sys.stderr)
    result = {"benchmark": "moe-layer-train", **environment(), "tiny": args.tiny,
              "recipe": "recipes/tiny.yaml" if args.tiny else args.recipe,
              "steps": args.steps, "warmup": args.warmup, "compile_scope": args.compile_scope, "accum": args.accum,
              "weight_cast": args.weight_cast, "points": points}
    (args.out / "train.json").write_text(json.dumps(result, indent=2) + "\n")
    text = train_table(result)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0 if all(p["status"] == "completed" for p in points.values()) else 1


def _fmt(sp: dict | None, scale: float = 1.0, spec: str = ",.0f") -> str:
    return "n/a" if not sp else (f"{sp['median'] * scale:{spec}} ({sp['p10'] * scale:{spec}}-"
                                 f"{sp['p90'] * scale:{spec}}, n={sp['n']})")


def _cells(p: dict, per: float = 1.0) -> list[str]:
    """tokens/s and MFU (each divided by ``per``, the GPUs), peak memory, the estimate, its error."""
    gib = [f"{b / 2**30:.1f}" if b else "n/a" for b in (p["peak_allocated_bytes"], p["estimated_bytes"])]
    err = f"{p['memory_rel_error']:+.1%}" if p["memory_rel_error"] is not None else "n/a"
    return [_fmt(p["tokens_per_s"], 1 / per), _fmt(p["mfu_active"], 100 / per, ".1f"), *gib, err]


def train_table(result: dict) -> str:
    lines = [f"Training, {result['recipe']} dense against MoE e16k2, compiled ({result['compile_scope']}), "
             f"{result.get('accum', 1)} micro-batch(es) a step, weight casts per {result.get('weight_cast', 'micro-batch')}, "
             f"on {result['card']}", "", "| point | expert GEMM | permute | tokens/s (p10-p90) | "
             "MFU active % (p10-p90) | peak GiB | estimate GiB | error |", "|---|---|---|---|---|---|---|---|"]
    for name, p in result["points"].items():
        if p["status"] != "completed":
            lines.append(f"| {name} | failed: {str(p.get('message'))[:80]} | | | | | | |")
            continue
        lines.append("| " + " | ".join([name, p["expert_gemm"] or "-", p.get("permute") or "-", *_cells(p)]) + " |")
    return "\n".join(lines) + "\n"


def ep_table(out: Path) -> int:
    """Expert parallelism against FSDP alone (the moe-ep study's results in OUT/ep): tokens/s per GPU and
    MFU per measured step, memory against the estimate; the profiler's communication share of rank 0."""
    runs, profiles = {}, {}
    for p in sorted(out.glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if p.stem.startswith("profile-"):
            profiles[p.stem] = d
        else:
            runs[p.stem] = d
    lines = [f"Expert parallelism against FSDP alone ({out})", "",
             "| run | GPUs | tokens/s per GPU (p10-p90) | MFU active % | peak GiB | estimate GiB | error |",
             "|---|---|---|---|---|---|---|"]
    for name, d in runs.items():
        f = point_figures(d)
        if f["status"] != "completed":
            lines.append(f"| {name} | | failed: {str(f.get('message'))[:80]} | | | | |")
            continue
        world = d["environment"]["world_size"]
        lines.append("| " + " | ".join([name, str(world), *_cells(f, per=world)]) + " |")
    lines += ["", "profiler, rank 0 (share of the step; exposed = not overlapped by compute)", ""]
    for name, d in profiles.items():
        co, step = d.get("communication_overlap"), d.get("step_time_s")
        if not co or not step:
            lines.append(f"{name}: no breakdown ({str(d.get('message') or d.get('status'))[:80]})")
            continue
        lines.append(f"{name}: step {1e3 * step:.1f} ms, communication {1e3 * co['communication_s']:.1f} ms "
                     f"({co['communication_s'] / step:.1%}), exposed {co['exposed_s'] / step:.1%}, "
                     f"overlap ratio {co['overlap_ratio'] if co['overlap_ratio'] is None else round(co['overlap_ratio'], 2)}")
    print("\n".join(lines))
    return 0


def point(argv: list[str]) -> int:
    """``scaletool ARGS`` in this process with every MoE layer on the ``PERMUTE`` path."""
    from scaletool.cli import main as cli
    from scaletool.model.moe import MoE
    if not argv or argv[0] not in ("gather", "indexed"):
        sys.exit("error: point takes PERMUTE (gather | indexed), then -- and the scaletool arguments")
    MoE.permute = argv[0]
    rest = argv[1:]
    return cli.main(args=rest[1:] if rest[:1] == ["--"] else rest, prog_name="scaletool")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["point"]:
        return point(argv[1:])
    if argv[:1] == ["ep-table"]:
        if len(argv) != 2:
            sys.exit("error: ep-table takes one directory (the moe-ep study's OUT/ep)")
        return ep_table(Path(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("parts", help="the MoE layer part by part (forward + backward)")
    a.add_argument("out", type=Path, help="JSON file to write")
    a.add_argument("--iters", type=int, default=20, help="timed repeats per part (default 20)")
    a.add_argument("--warmup", type=int, default=5, help="untimed repeats first (default 5)")
    a.add_argument("--tiny", action="store_true", help="CPU, toy sizes: checks the driver")
    g = sub.add_parser("gemms", help="the routed experts' GEMMs: forward, dgrad, wgrad, both weight layouts")
    g.add_argument("out", type=Path, help="JSON file to write")
    g.add_argument("--iters", type=int, default=20, help="timed repeats per GEMM (default 20)")
    g.add_argument("--warmup", type=int, default=5, help="untimed repeats first (default 5)")
    g.add_argument("--tiny", action="store_true", help="CPU, toy sizes: checks the driver")
    b = sub.add_parser("train", help="dense vs MoE (indexed, gather) training, compiled")
    b.add_argument("out", type=Path, help="directory for the run summaries, train.json and table.md")
    b.add_argument("--recipe", default="recipes/mla-1b.yaml")
    b.add_argument("--steps", type=int, default=14, help="steps per point (default 14)")
    b.add_argument("--warmup", type=int, default=4, help="steps excluded (compilation lands here)")
    b.add_argument("--compile-scope", choices=["model", "block"], default="block")
    b.add_argument("--accum", type=positive_int, default=1, help="micro-batches per optimizer step (default 1)")
    b.add_argument("--weight-cast", choices=["micro-batch", "step"], default="micro-batch",
                   help="train.weight_cast (step: the 16-bit copies once per optimizer step; needs bf16, not --tiny)")
    b.add_argument("--points", type=lambda v: [p for p in v.split(",") if p], default=[],
                   help="comma-separated points to run (dense, moe-indexed, moe-gather; default all)")
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    b.add_argument("--tiny", action="store_true", help="CPU, tiny recipe, eager: checks the driver")
    args = p.parse_args(argv)
    if args.cmd in ("parts", "gemms") and (args.iters < 1 or args.warmup < 0):
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.cmd == "train":
        names = [name for name, _, _ in train_points(args.tiny)]
        unknown = sorted(set(args.points) - set(names))
        if unknown:
            p.error(f"--points: unknown {','.join(unknown)[:200]!r} ({', '.join(names)})")
        if args.tiny and args.weight_cast == "step":
            p.error("--weight-cast step needs the bf16 recipe (--tiny trains recipes/tiny.yaml in fp32)")
    return {"parts": parts, "gemms": gemms, "train": train}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
