"""``scaletool decode``: prefill and decode a recipe's model; KV cache, speed and bandwidth, measured."""
from __future__ import annotations

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from scaletool.cli.options import deliver, json_option, recipe_argument, set_option
from scaletool.config import load_recipe
from scaletool.fmt import gib, pct, si


class _Batch(click.ParamType):
    name = "B|max"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value is None:
            return value
        if value == "max":
            return None
        if value.isdigit() and int(value) > 0:
            return int(value)
        self.fail(f"{value!r} is neither a positive integer nor 'max'", param, ctx)


class _Contexts(click.ParamType):
    name = "N[,N2,...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = [p.strip().lower() for p in str(value).split(",") if p.strip()]
        out = []
        for p in parts:
            mult = 1024 if p.endswith("k") else 1
            digits = p[:-1] if mult > 1 else p
            if not digits.isdigit() or int(digits) == 0:
                self.fail(f"{p!r} is not a positive token count (e.g. 4096 or 32k)", param, ctx)
            out.append(int(digits) * mult)
        if not out:
            self.fail("give at least one context length", param, ctx)
        return tuple(out)


@click.command()
@recipe_argument
@set_option
@click.option("--batch", type=_Batch(), default="1", show_default=True,
              help="Sequences decoded together; 'max': the largest batch whose weights + KV cache fit "
                   "--memory-budget at each context (analytic fit).")
@click.option("--context", "contexts", type=_Contexts(), default=None,
              help="Prompt lengths to measure, comma-separated (4096,32k). Default: model.max_seq_len. "
                   "Longer than max_seq_len extends the RoPE tables for decoding (plain extrapolation).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Decode steps timed per context (after warm-up steps).")
@click.option("--device", default=None, help="cuda or cpu (default: cuda when available).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Weights and cache dtype (default: model.dtype of the recipe).")
@click.option("--mla-mode", type=click.Choice(["absorbed", "naive"]), default="absorbed", show_default=True,
              help="MLA only: absorbed caches the latent c_kv + shared RoPE key and decodes with W_UK/W_UV "
                   "absorbed; naive caches up-projected per-head K and V.")
@click.option("--mla-kernel", type=click.Choice(["auto", "triton", "torch"]), default="auto", show_default=True,
              help="Absorbed MLA decode attention: fused Triton kernel (CUDA, 16-bit) or the torch reference.")
@click.option("--memory-budget", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GiB",
              help="Memory for the largest-batch fit (default: the GPU's total memory; none on CPU).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), default=None,
              help="Weights from a `scaletool train` checkpoint directory (default: random, seeded).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for random weights and the prompt.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Prompt tokens per prefill forward pass (bounds activation memory).")
@click.option("--warmup-steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Untimed decode steps before the timed ones.")
@json_option
def decode(recipe: str, overrides: tuple[str, ...], batch: int | None, contexts: tuple[int, ...] | None,
           new_tokens: int, device: str | None, dtype: str | None, mla_mode: str, mla_kernel: str,
           memory_budget: float | None, checkpoint: str | None, seed: int, prefill_chunk: int, warmup_steps: int,
           as_json: bool) -> None:
    """Prefill and decode RECIPE's model; measure the KV cache, speed and memory bandwidth.

    \b
    For each context length N: the KV-cache bytes allocated (cache tensors and CUDA allocator) next
    to the analytic bytes per token of `scaletool estimate`; prefill tokens/s; decode tokens/s and
    ms/token over --new-tokens steps for --batch sequences; the bandwidth a decode step achieves
    (weights + cache read per step over its time) against the card's peak HBM bandwidth; and the
    largest batch per context that fits --memory-budget, per attention type (analytic).

    \b
    Examples:
      scaletool decode recipes/tiny.yaml --context 32,64 --new-tokens 8 --device cpu
      scaletool decode recipes/mla-1b.yaml --batch max --context 32k --dtype bf16 --json
      scaletool decode recipes/mla-1b.yaml --mla-mode naive --batch 4 --context 4096,32768
    """
    import torch

    from scaletool.decode.bench import DecodeSettings, run_decode
    from scaletool.decode.generate import require_lm
    from scaletool.kernels.mla_decode import triton_supports
    from scaletool.model import build_model

    r = load_recipe(recipe, overrides, extra={"model.dtype": dtype} if dtype else None)
    cfg = r.model
    require_lm(cfg)
    if mla_mode == "naive" and cfg.attention != "mla":
        raise click.BadParameter(f"naive is for attention=mla recipes; this one is {cfg.attention}",
                                 param_hint="--mla-mode")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise click.BadParameter(str(e), param_hint="--device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("cuda requested but no CUDA device is available", param_hint="--device")
    if dev.type not in ("cuda", "cpu"):
        raise click.BadParameter(f"{device}: decode runs on cuda or cpu", param_hint="--device")
    from scaletool.model.layers import TORCH_DTYPES

    torch_dtype = TORCH_DTYPES[cfg.dtype]
    if mla_kernel == "triton" and cfg.attention == "mla" and mla_mode == "absorbed":
        why = triton_supports(dev, torch_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        if why:
            raise click.BadParameter(f"the fused kernel cannot run here: {why}", param_hint="--mla-kernel")
    contexts = contexts or (cfg.max_seq_len,)
    budget = int(memory_budget * 2**30) if memory_budget else (
        torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None)
    settings = DecodeSettings(batch=batch, contexts=contexts, new_tokens=new_tokens, mla_mode=mla_mode,
                              kernel=mla_kernel, prefill_chunk=prefill_chunk, warmup_steps=warmup_steps, seed=seed)

    model = build_model(cfg, dev, seed=seed, sdpa_backend=r.train.sdpa_backend)
    if checkpoint:
        from scaletool.train.checkpoint import load_model_weights
        load_model_weights(checkpoint, model)
    model = model.to(torch_dtype).eval()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    err = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        res = run_decode(cfg, model, settings, budget_bytes=budget, progress=progress)
    res["recipe"] = recipe
    res["checkpoint"] = checkpoint
    deliver(res, as_json)
    if not as_json:
        print_decode(res, Console())
    return res


def print_decode(res: dict, con: Console) -> None:
    dev = res["device"]
    con.print(f"[bold]{res['attention']}[/] on {dev['name']}, {res['dtype']}; "
              f"weights {gib(res['weights_bytes'])}; analytic cache {res['kv_cache']['bytes_per_token']:,} B/token "
              f"({res['kv_cache']['compression_ratio']:.2f}× smaller than MHA with the same heads)")
    t = Table(title=f"Decode ({res['timing']})", title_justify="left")
    ok = [p for p in res["points"] if "error" not in p]
    alloc = any(p["kv_cache_bytes_allocator"] is not None for p in ok)
    peak = dev["peak_bandwidth_bytes_per_s"] is not None
    cols = ["ctx", "batch", "cache", "analytic", "Δ"] + (["alloc"] if alloc else []) + [
        "prefill tok/s", "decode tok/s", "ms/tok", "read/s"] + (["%peak"] if peak else [])
    for c in cols:
        t.add_column(c, justify="right")
    kernels = set()
    for p in res["points"]:
        if "error" in p:
            t.add_row(f"{p['context']:,}", str(p["batch"]), f"[red]{p['error']}", *[""] * (len(cols) - 3))
            continue
        kernels.add(p["attention_kernel"])
        row = [f"{p['context']:,}", str(p["batch"]), gib(p["kv_cache_bytes_measured"]),
               gib(p["kv_cache_bytes_analytic"]), pct(p["kv_cache_rel_error"])]
        row += [gib(p["kv_cache_bytes_allocator"])] if alloc else []
        row += [si(p["prefill_tokens_per_s"]), si(p["decode_tokens_per_s"]), f"{p['decode_ms_per_token']:.3g}",
                si(p["decode_bandwidth_bytes_per_s"], "B")]
        row += [f"{100 * p['decode_bandwidth_fraction_of_peak']:.0f}%"] if peak else []
        t.add_row(*row)
    con.print(t)
    for k in sorted(kernels):
        con.print(f"• attention kernel: {k}")
    if dev["peak_bandwidth_bytes_per_s"] is None:
        con.print(f"• {dev['peak_bandwidth_source']}")
    extended = [p["rope_extended_to"] for p in res["points"] if p.get("rope_extended_to")]
    if extended:
        con.print(f"• RoPE tables extended to {max(extended):,} positions (past model.max_seq_len)")
    fit = res["memory_fit"]
    if fit:
        t = Table(title=f"Largest batch in {gib(fit['budget_bytes'])} ({fit['basis']})", title_justify="left")
        for c in ("attention", "context", "cache/token", "max batch", "batch × context"):
            t.add_column(c, justify="right")
        for row in fit["rows"]:
            t.add_row(row["attention"], f"{row['context']:,}", f"{row['kv_cache_bytes_per_token']:,} B",
                      str(row["max_batch"]), f"{row['max_batch_x_context']:,}")
        con.print(t)
