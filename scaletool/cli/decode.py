"""``scaletool decode``: prefill and decode a recipe's model; KV cache, speed and bandwidth, measured.

Parses options and calls :func:`scaletool.api.decode`; torch is imported only when the command runs.
"""
from __future__ import annotations

import click
from rich import box
from rich.console import Console
from rich.table import Table

from scaletool.cli.feedback import feedback
from scaletool.cli.options import PositiveFloat, console, deliver, json_option, recipe_argument, set_option
from scaletool.fmt import CONTENDED_MARK, gib, pct, si, stdout_to_stderr
from scaletool.kinds.attention import MLA_MODES
from scaletool.stats import MIN_SAMPLES


def _token_count(p: str) -> int | None:
    mult = 1024 if p.endswith("k") else 1
    digits = p[:-1] if mult > 1 else p
    return int(digits) * mult if digits.isdigit() and int(digits) > 0 else None


class _Batches(click.ParamType):
    name = "B[,B2,...]|max"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        out = []
        for p in (p.strip().lower() for p in str(value).split(",") if p.strip()):
            if p == "max":
                out.append("max")
            elif p.isdigit() and int(p) > 0:
                out.append(int(p))
            else:
                self.fail(f"{p!r} is neither a positive integer nor 'max'", param, ctx)
        if not out:
            self.fail("give at least one batch size", param, ctx)
        return tuple(out)


class _Contexts(click.ParamType):
    name = "N[,N2,...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        out = []
        for p in (p.strip().lower() for p in str(value).split(",") if p.strip()):
            n = _token_count(p)
            if n is None:
                self.fail(f"{p!r} is not a positive token count (e.g. 4096 or 32k)", param, ctx)
            out.append(n)
        if not out:
            self.fail("give at least one context length", param, ctx)
        return tuple(out)


@click.command()
@recipe_argument
@set_option
@click.option("--batch", "batches", type=_Batches(), default="1", show_default=True, metavar="B[,B2,...]|max",
              help="Sequences decoded together, comma-separated; 'max': the largest batch whose weights + KV cache "
                   "fit --memory-budget at each context (analytic fit). '1,max' measures both.")
@click.option("--context", "contexts", type=_Contexts(), default=None,
              help="Prompt lengths to measure, comma-separated (4096,32k). Default: model.max_seq_len. "
                   "Longer than max_seq_len extends the RoPE tables for decoding (plain extrapolation).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Decode steps timed per point (after the warm-up steps).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Where to run (default: cuda when available).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Weights and cache dtype (default: model.dtype of the recipe).")
@click.option("--mla-mode", type=click.Choice(MLA_MODES), default=None,
              help="MLA only: absorbed caches the latent c_kv + shared RoPE key and decodes with W_UK/W_UV "
                   "absorbed; expand caches the latent and up-projects K and V from all of it every step; naive "
                   "caches up-projected per-head K and V. Default: absorbed (expand for model.mla_rope=per_head, "
                   "which cannot absorb).")
@click.option("--mla-kernel", type=click.Choice(["auto", "triton", "torch"]), default="auto", show_default=True,
              help="Absorbed MLA decode attention: fused Triton kernel (CUDA, 16-bit) or the torch reference.")
@click.option("--cuda-graph/--no-cuda-graph", default=None,
              help="Replay each decode step from a CUDA graph (default: on with CUDA). --no-cuda-graph runs the "
                   "eager reference path.")
@click.option("--compile", "compile_step", is_flag=True,
              help="Run each decode step through torch.compile (static shapes, one compile per point), then "
                   "capture the compiled step in the CUDA graph: fewer, fused kernels per step. The compile "
                   "time is reported, not timed.")
@click.option("--compile-tuning/--no-compile-tuning", default=False, show_default=True,
              help="With --compile: Inductor's coordinate-descent tuning of its kernels. At batch 1 it fuses the "
                   "matrix-vector products into tuned reductions (fewer kernels); each point compiles about 3x longer, "
                   "and on an H100 the step was not faster (docs/decode.md).")
@click.option("--join-projections/--no-join-projections", default=True, show_default=True,
              help="Join the projections that read one input into one GEMM each before decoding (q, k, v; MLA's "
                   "query and latent projections; SwiGLU's gate and up): the same numbers, fewer kernels per step. "
                   "At batch 1 each projection costs a fixed ramp of about 3 us beside its bytes (docs/decode.md).")
@click.option("--gemv/--no-gemv", default=None,
              help="Run the graphed step's projections (bias-free linear layers) through scaletool's Triton GEMV, "
                   "which streams each weight once for the step's few rows (at most 8), where it can run: CUDA, "
                   "16-bit. Default: on with --pdl and --compile (the GEMV loads its weights before it waits for its "
                   "input while the kernel before it, Inductor's, finishes; otherwise cuBLAS, as fast on an H100).")
@click.option("--pdl/--no-pdl", default=None,
              help="Launch the step's Triton kernels (scaletool's attention, merges and GEMV, and Inductor's with "
                   "--compile) with programmatic dependent launch, so each is scheduled while the one before it "
                   "finishes and loads its weights before it waits for its input. Default: on for Hopper and "
                   "newer GPUs, which alone have it. Each point records whether it ran.")
@click.option("--split-batch", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Decode each step's batch as N parts, each on its own CUDA stream inside the one graphed step, "
                   "so one part's projections can run beside another's attention. Not with --compile.")
@click.option("--memory-budget", type=PositiveFloat(), default=None, metavar="GiB",
              help="Memory for the largest-batch fit (default: the GPU's total memory; none on CPU).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), default=None,
              help="Weights from a `scaletool train` checkpoint directory (default: random, seeded).")
@click.option("--trust-checkpoint", is_flag=True,
              help="Allow checkpoint formats that can only be read by unpickling (DeepSpeed ZeRO-3 partitions): "
                   "unpickling runs code, so only for checkpoints you made.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for random weights and the prompt.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Prompt tokens per prefill forward pass (bounds activation memory).")
@click.option("--warmup-steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Decode steps always excluded from timing (more are, while slower than the settled level).")
@click.option("--prefill-repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed prefills per point, after one warm-up prefill.")
@json_option
def decode(recipe: str, overrides: tuple[str, ...], batches: tuple, contexts: tuple[int, ...] | None,
           new_tokens: int, device: str | None, dtype: str | None, mla_mode: str | None, mla_kernel: str,
           cuda_graph: bool | None, compile_step: bool, compile_tuning: bool, join_projections: bool,
           gemv: bool | None, pdl: bool | None, split_batch: int,
           memory_budget: float | None,
           checkpoint: str | None, trust_checkpoint: bool, seed: int, prefill_chunk: int, warmup_steps: int,
           prefill_repeats: int, as_json: bool):
    """Prefill and decode RECIPE's model; measure the KV cache, speed and memory bandwidth.

    For each context length N and batch B: the KV-cache bytes allocated (cache tensors and CUDA
    allocator) next to the analytic bytes per token of `scaletool estimate`; prefill tokens/s and
    decode tokens/s with their spread (median of per-step times, p10-p90, warm-up excluded by
    rule); the bandwidth a decode step achieves (weights + cache read per step over the median
    step) against the card's peak HBM bandwidth and a copy measured in the run, with the step's
    bound and where one step's GPU time goes; and the largest batch per context that fits
    --memory-budget, per attention type (analytic).

    \b
    Examples:
      scaletool decode tiny --context 32,64 --new-tokens 8 --device cpu
      scaletool decode mla-1b --batch 1,max --context 4k,32k --dtype bf16 --json
      scaletool decode mla-1b --mla-mode naive --batch 4 --no-cuda-graph
      scaletool decode mla-1b --batch 1 --context 4k --compile
      scaletool decode mha-1b --context 4k --compile --no-join-projections
      # per-head RoPE: the cache is re-expanded every step
      scaletool decode mla-1b --set model.mla_rope=per_head --context 4k
    """
    from scaletool import api

    if "max" in batches and memory_budget is None and device != "cuda":
        import torch

        if device == "cpu" or not torch.cuda.is_available():
            raise click.BadParameter("'max' needs --memory-budget GiB on CPU (the default budget is the GPU's "
                                     "memory)", param_hint="--batch")
    with feedback() as progress, stdout_to_stderr(as_json):  # libraries' prints (DeepSpeed's); stdout keeps the JSON
        res = api.decode(recipe, overrides=overrides, contexts=contexts, batch=batches, new_tokens=new_tokens,
                         device=device, dtype=dtype, mla_mode=mla_mode, mla_kernel=mla_kernel, cuda_graph=cuda_graph,
                         memory_budget_gib=memory_budget, checkpoint=checkpoint, trust_checkpoint=trust_checkpoint,
                         seed=seed, prefill_chunk=prefill_chunk, warmup_steps=warmup_steps,
                         prefill_repeats=prefill_repeats, compile=compile_step,
                         compile_tuning=compile_tuning, gemv=gemv, pdl=pdl, split_batch=split_batch,
                         join_projections=join_projections, progress=progress)
    deliver(res, as_json)
    if not as_json:
        print_decode(res, console(), max_seq_len=api.resolve(recipe, overrides).model.max_seq_len)
    return res


def _table(title: str, columns: list[str]) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in columns:  # a narrow terminal folds cells, never a heading's word ("prefil/l") nor a rate ("1.27 k ⚠")
        t.add_column(c, justify="right", overflow="fold", min_width=max(*map(len, c.split()), 8 if "tok/s" in c else 0))
    return t


def _spread_pct(s) -> str:
    """Half the p10-p90 range in percent; '-' below the samples a spread needs (scaletool.stats)."""
    return "-" if s is None or s.n < MIN_SAMPLES else f"±{100 * s.rel_halfwidth:.0f}%"


def _bound(p) -> str:
    """The bound and how far above its floor the step ran ('launch ×1.3'); '-' when no floor is known."""
    if p.decode_bound is None:
        return "-"
    return f"{p.decode_bound} ×{p.decode_step_over_floor:.3g}"


def _print_kernel_time(points, con: Console) -> None:
    """Where one uncaptured step's GPU time went, per point: busy time against the median step (the rest is
    the gaps between kernels) and the kernel groups (scaletool.decode.bounds.kernel_breakdown)."""
    timed = [p for p in points if p.decode_kernel_time]
    if not timed:
        return
    groups = sorted({g for p in timed for g in p.decode_kernel_time["groups_s"]},
                    key=lambda g: -sum(p.decode_kernel_time["groups_s"].get(g, 0.0) for p in timed))
    t = _table("GPU time of one step (profiled, not captured), ms",
               ["ctx", "batch", "kernels", "busy", "of step"] + groups)
    for p in timed:
        k = p.decode_kernel_time
        step = p.decode_step_s.median if p.decode_step_s else None
        t.add_row(f"{p.context:,}", f"{p.batch:,}", str(p.decode_kernels_per_step or "-"), f"{1e3 * k['busy_s']:.3g}",
                  "-" if not step else f"{100 * k['busy_s'] / step:.0f}%",
                  *(f"{1e3 * k['groups_s'].get(g, 0.0):.3g}" for g in groups))
    con.print(t)


def _print_speed(res, ok, peak: bool, con: Console) -> None:
    """Speed per point; a contended point's rates carry the mark, and a line under the table says how many."""
    t = _table("Decode (median; ± is half the p10-p90 range)",
               ["ctx", "batch", "prefill\ntok/s", "±", "decode\ntok/s", "±", "ms/step", "read/s"]
               + (["of peak"] if peak else []) + ["of copy", "bound"])
    for p in res.points:
        if not p.ok:
            t.add_row(f"{p.context:,}", str(p.batch), f"[red]{p.error}")
            continue
        mark = f" {CONTENDED_MARK}" if p.contended else ""  # on the figure itself, as in the report's tables
        t.add_row(f"{p.context:,}", f"{p.batch:,}", si(p.prefill_tokens_per_s) + mark, _spread_pct(p.prefill_s),
                  si(p.decode_tokens_per_s) + mark, _spread_pct(p.decode_step_s), f"{p.decode_ms_per_token:.3g}",
                  si(p.decode_bandwidth_bytes_per_s, "B"),
                  *([f"{100 * p.decode_bandwidth_fraction_of_peak:.0f}%"] if peak else []),
                  "-" if p.decode_hbm_fraction_of_copy is None else f"{100 * p.decode_hbm_fraction_of_copy:.0f}%",
                  _bound(p))
    con.print(t)
    busy = [p for p in ok if p.contended]
    if busy:
        con.print(f"[bold yellow]{CONTENDED_MARK} contended[/]: {len(busy)} of {len(ok)} point(s) timed while another "
                  "process held a CPU (or the GPU) they waited for; their tok/s are not this machine's (compare none; "
                  "--json: contention).", highlight=False)


def print_decode(res, con: Console, max_seq_len: int | None = None) -> None:
    """The human tables: speed per point, the cache against the analytic bytes, the largest batches.
    ``max_seq_len``: the model's; the RoPE note is printed only where a prompt itself runs past it (the
    default context is max_seq_len, whose decoded tokens always extend the tables a little: no news)."""
    dev, kv = res.device, res.kv_cache
    con.print(f"[bold]{res.attention}[/] on {dev.name}, {res.dtype}; weights {gib(res.weights_bytes)}; analytic "
              f"cache {kv['bytes_per_token']:,} B/token ({kv['compression_ratio']:.2f}× smaller than MHA with the "
              "same heads)")
    ok = [p for p in res.points if p.ok]
    peak = dev.peak_bandwidth_bytes_per_s is not None
    _print_speed(res, ok, peak, con)
    _print_kernel_time(ok, con)
    alloc = any(p.kv_cache_bytes_allocator is not None for p in ok)
    t = _table("KV cache (prompt + warm-up + new tokens)",
               ["ctx", "batch", "measured", "analytic", "Δ"] + (["allocator"] if alloc else []))
    for p in ok:
        t.add_row(f"{p.context:,}", f"{p.batch:,}", gib(p.kv_cache_bytes_measured), gib(p.kv_cache_bytes_analytic),
                  pct(p.kv_cache_rel_error), *([gib(p.kv_cache_bytes_allocator)] if alloc else []))
    if ok:
        con.print(t)
    for k in sorted({p.attention_kernel for p in ok}):
        con.print(f"• attention kernel: {k}")
    joined = (res.settings or {}).get("join_projections") or 0
    if joined:
        con.print(f"• projections: {joined} groups reading one input joined into one GEMM each (--join-projections)")
    gemv = max((p.gemv_linears or 0) for p in ok) if ok else 0
    if gemv:
        con.print(f"• projections: {gemv} linear layers through the Triton GEMV at the step's rows (scaletool.kernels.gemv)")
    if any(p.pdl for p in ok):
        con.print("• kernels under programmatic dependent launch (--pdl)")
    elif (res.settings or {}).get("pdl"):
        con.print("• --pdl asked for, not run: programmatic dependent launch needs a Hopper or newer GPU")
    graphs = {p.cuda_graph for p in ok}
    if graphs:  # none when no point ran (no batch fit the budget)
        con.print("• decode steps: " + ("replayed from a CUDA graph" if graphs == {True} else "eager"
                                        if graphs == {False} else "CUDA graph at some points, eager at others"))
    compiled = [p for p in ok if p.compiled]
    if compiled:
        breaks = sum(p.compile_graph_breaks or 0 for p in compiled)
        tuned = " (coordinate-descent tuned)" if all(p.compile_tuning for p in compiled) else ""
        con.print(f"• compiled with torch.compile{tuned}: {max(p.compile_s for p in compiled):.0f} s at most per point, "
                  f"{breaks} graph break{'s' if breaks != 1 else ''}")
    if dev.copy_bandwidth_bytes_per_s:
        kern = "" if dev.graph_kernel_s is None else f"; a kernel in a replayed graph {1e6 * dev.graph_kernel_s:.1f} µs"
        con.print(f"• bound: the largest of the floors (bytes at the copy's {si(dev.copy_bandwidth_bytes_per_s, 'B')}/s"
                  f", FLOPs at the datasheet peak, kernels per step){kern}; ×: the step over that floor")
    con.print(f"• timing: {res.timing.clock}; warm-up excluded: {res.timing.rule}")
    if dev.versions:
        v = dev.versions
        con.print(f"• ran with torch {v.get('torch')}" + (f" (CUDA {v['cuda']})" if v.get("cuda") else "")
                  + (f", Triton {v['triton']}" if v.get("triton") else ""))
    if res.threads is not None:
        con.print(f"• CPU threads: {res.threads}")
    if not peak:
        con.print(f"• {dev.peak_bandwidth_source}")
    extended = [p.rope_extended_to for p in res.points if p.rope_extended_to
                and (max_seq_len is None or p.context > max_seq_len)]
    if extended:
        con.print(f"• RoPE tables extended to {max(extended):,} positions: a prompt past model.max_seq_len "
                  "(plain extrapolation)")
    fit = res.memory_fit
    if fit:
        t = _table(f"Largest batch in {gib(fit.budget_bytes)} ({fit.basis})",
                   ["attention", "context", "cache/token", "max batch", "batch × context"])
        for row in fit.rows:
            t.add_row(row.attention, f"{row.context:,}", f"{row.kv_cache_bytes_per_token:,} B", f"{row.max_batch:,}",
                      f"{row.max_batch_x_context:,}")
        con.print(t)
