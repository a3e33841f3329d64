"""Hugging Face ``config.json`` -> recipe ``model`` section.

Llama, Mistral, Qwen2/Qwen3-style dense models, GPT-2 (learned positions, LayerNorm, GELU, tied
embeddings, biased q/k/v) and DeepSeek-V2/V3, the latter with their mixture-of-experts FFNs (routing:
V2's softmax with greedy or group-limited top-k, V3's sigmoid with the selection bias and
group-limited ``noaux_tc``).

What the model family does not implement is handled by what it costs:

- settings that change no parameter, FLOP or KV-cache figure import with a note in ``model.notes``
  (RoPE scaling of the llama3, yarn, linear and dynamic kinds, which only rescale rotation
  frequencies), and so does V3's multi-token-prediction module, which the figures leave out;
- settings that would change the figures (sliding windows, extra biases, FP8 weights, other RoPE
  scalings...) are errors naming them; ``drop`` lists those the user accepts to lose, recorded in
  the notes. ``--drop moe`` on a DeepSeek config imports its dense twin (every layer the dense FFN).

The file is untrusted input: every key is type-checked (an error line names the key and what it
holds), and the file is refused past :data:`MAX_CONFIG_BYTES`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from scaletool.config import Recipe, RecipeError, recipe_from_dict
from scaletool.config import load_recipe as load_yaml_recipe
from scaletool.errors import echo, shorten
from scaletool.resources import read_bounded
from scaletool.yaml_input import check_tree

DENSE_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"}
GPT2_TYPES = {"gpt2"}
DEEPSEEK_TYPES = {"deepseek_v2", "deepseek_v3"}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu": "gelu", "gelu_new": "gelu", "relu": "relu"}
MAX_CONFIG_BYTES = 4 * 2**20  # a config.json is a few KiB

# RoPE scalings that only rescale the rotation frequencies (Llama 3.1's llama3, YaRN, linear position
# interpolation, dynamic NTK): no weight, no FLOP and no cached number changes.
FREE_ROPE_SCALINGS = ("llama3", "yarn", "linear", "dynamic")

# feature name -> (predicate on the config, what it is); each is an error unless dropped
_UNSUPPORTED = {
    "moe": (lambda c: bool(c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts")),
            "mixture-of-experts FFN layers"),  # supported for DeepSeek types (_MOE_KEYS)
    "rope_scaling": (lambda c: _rope_kind(c) not in (None, "default", *FREE_ROPE_SCALINGS),
                     "RoPE scaling of this kind (llama3, yarn, linear and dynamic import with a note)"),
    "sliding_window": (lambda c: bool(c.get("sliding_window")) and c.get("use_sliding_window", True),
                       "sliding-window attention"),
    "attention_bias": (lambda c: bool(c.get("attention_bias")) and c.get("model_type") not in ("qwen2",),
                       "biases on every attention projection (o_proj included)"),
    "output_bias": (lambda c: c.get("model_type") in GPT2_TYPES,
                    "a bias on the attention output projection (GPT-2's attn.c_proj; its q/k/v biases import)"),
    "mlp_bias": (lambda c: bool(c.get("mlp_bias")) or c.get("model_type") in GPT2_TYPES, "biases in the MLP"),
    "cross_attention": (lambda c: bool(c.get("add_cross_attention")), "cross-attention layers (an encoder-decoder)"),
    "quantization": (lambda c: bool(c.get("quantization_config")),
                     "quantized weights (e.g. V3's FP8 blocks); the recipe models its dtype's weights"),
    "batch_aux_loss": (lambda c: c.get("seq_aux") is False and bool(c.get("aux_loss_alpha")),
                       "batch-wise balance loss (seq_aux: false); scaletool's is sequence-wise"),
}
# DeepSeek config key -> (recipe key, type)
_MOE_KEYS = {"n_routed_experts": int, "n_shared_experts": int, "num_experts_per_tok": int,
             "moe_intermediate_size": int, "first_k_dense_replace": int, "norm_topk_prob": bool,
             "routed_scaling_factor": float, "aux_loss_alpha": float}
# topk_method -> the router scoring its group scores assume (see scaletool.model.moe)
_TOPK_METHODS = {"greedy": None, "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}


def _rope_kind(cfg: dict) -> Any:
    """``rope_scaling``'s type (``rope_type``, or ``type`` in older configs); None without scaling."""
    rs = cfg.get("rope_scaling")
    if not rs:
        return None
    return rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else "(not an object)"


class _Fields:
    """Typed reads of a config's keys; each wrong type or missing key becomes one problem line."""

    _MISSING = object()

    def __init__(self, cfg: dict):
        self.cfg, self.problems = cfg, []

    def _raw(self, keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
        for k in keys:
            if self.cfg.get(k) is not None:
                return k, self.cfg[k]
        if default is self._MISSING:
            self.problems.append(f"{keys[0]}: missing")
        return keys[0], None if default is self._MISSING else default

    def _bad(self, key: str, value: Any, expected: str) -> None:
        self.problems.append(f"{key}: expected {expected}, got {type(value).__name__} {echo(value)}")

    def integer(self, *keys: str, default: Any = _MISSING, minimum: int = 1) -> int | None:
        key, v = self._raw(keys, default)
        if v is None or v is default:
            return v
        if isinstance(v, float) and v.is_integer():  # 4096.0, as some exporters write
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            return self._bad(key, v, "an integer")
        if v < minimum:
            self.problems.append(f"{key}: must be at least {minimum}, got {echo(v)}")
            return None
        return v

    def number(self, *keys: str, default: Any = _MISSING) -> float | None:
        key, v = self._raw(keys, default)
        if v is None or v is default:
            return v
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return self._bad(key, v, "a finite number")
        return float(v)

    def string(self, *keys: str, default: Any = _MISSING) -> str | None:
        key, v = self._raw(keys, default)
        if v is not None and not isinstance(v, str):
            return self._bad(key, v, "a string")
        return v

    def flag(self, *keys: str, default: Any = _MISSING) -> bool | None:
        key, v = self._raw(keys, default)
        if v is not None and not isinstance(v, bool):
            return self._bad(key, v, "true or false")
        return v

    def check(self) -> None:
        if self.problems:
            raise RecipeError(self.problems)


def model_section(cfg: dict, drop: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """Translate one HF config; returns (model section, features dropped). Notes on what was imported
    without being modelled are in the section's ``notes``."""
    f = _Fields(cfg)
    mtype = f.string("model_type")
    f.check()
    if mtype not in DENSE_TYPES | DEEPSEEK_TYPES | GPT2_TYPES:
        known = ", ".join(sorted(DENSE_TYPES | DEEPSEEK_TYPES | GPT2_TYPES))
        raise RecipeError(f"model_type {echo(mtype)} is not supported (known: {known})")
    if "mtp" in drop:
        raise RecipeError("--drop mtp: nothing to drop: multi-token-prediction modules import with a note "
                          "(the figures leave them out)")
    unknown_drop = set(drop) - set(_UNSUPPORTED)
    if unknown_drop:
        raise RecipeError(f"--drop {echo(', '.join(sorted(unknown_drop)))[1:-1]}: unknown feature "
                          f"(droppable: {', '.join(_UNSUPPORTED)})")
    present = [name for name, (pred, _) in _UNSUPPORTED.items() if pred(cfg)]
    supported = {"moe"} if mtype in DEEPSEEK_TYPES else set()
    missing = [n for n in present if n not in drop and n not in supported]
    if missing:
        raise RecipeError([f"{n}: {_UNSUPPORTED[n][1]} not supported by scaletool's model family "
                           f"(pass --drop {n} to import without it)" for n in missing])
    if mtype in GPT2_TYPES:
        m, notes = _gpt2(f, cfg)
    else:
        m, notes = _common(f), _rope_notes(cfg, f)
        f.check()
        if mtype in DEEPSEEK_TYPES:
            m.update(_deepseek(f, cfg, moe="moe" in present and "moe" not in drop, notes=notes))
        else:
            m.update(_dense_attention(f, m, mtype))
    f.check()
    dropped = [n for n in present if n in drop]
    notes += [f"--drop {n}: imported without {_UNSUPPORTED[n][1]}" for n in dropped]
    if notes:
        m["notes"] = notes
    return m, dropped


def _common(f: _Fields) -> dict[str, Any]:
    m = {
        "d_model": f.integer("hidden_size"),
        "n_layers": f.integer("num_hidden_layers"),
        "n_heads": f.integer("num_attention_heads"),
        "intermediate_size": f.integer("intermediate_size"),
        "vocab_size": f.integer("vocab_size"),
        "max_seq_len": f.integer("max_position_embeddings", default=2048),
        "rope_theta": f.number("rope_theta", default=10000.0),
        "norm_eps": f.number("rms_norm_eps", "layer_norm_eps", default=1e-6),
        "tie_embeddings": f.flag("tie_word_embeddings", default=False),
    }
    act = f.string("hidden_act", default="silu")
    dtype = f.string("torch_dtype", "dtype", default="bfloat16")
    if act is not None and act not in _ACTS:
        f.problems.append(f"hidden_act {echo(act)} not supported (known: {', '.join(_ACTS)})")
    elif act is not None:
        m["ffn"] = _ACTS[act]
    if dtype is not None and dtype not in _DTYPES:
        f.problems.append(f"torch_dtype {echo(dtype)} not supported (known: {', '.join(_DTYPES)})")
    elif dtype is not None:
        m["dtype"] = _DTYPES[dtype]
    return m


# GPT-2 settings that change how attention computes but no parameter, FLOP or KV-cache figure (default -> note)
_GPT2_NOTES = {
    "scale_attn_weights": (True, "attention scores are not divided by sqrt(head_dim); scaletool's are"),
    "scale_attn_by_inverse_layer_idx": (False, "scores are also divided by the layer index + 1; scaletool's are not"),
    "reorder_and_upcast_attn": (False, "keys are scaled before the product and scores computed in fp32; numerics "
                                       "only"),
}


def _gpt2(f: _Fields, cfg: dict) -> tuple[dict[str, Any], list[str]]:
    """GPT-2 (Radford et al. 2019; transformers' GPT2Config names): pre-LayerNorm blocks with a final
    LayerNorm, a learned n_positions × n_embd position table, GELU MLP of n_inner (default 4·n_embd),
    fused c_attn with biases (q/k/v biases: ``qkv_bias``), LM head tied to the token embedding."""
    d = f.integer("n_embd", "hidden_size")
    m = {
        "attention": "mha", "position_encoding": "learned", "norm": "layernorm", "qkv_bias": True,
        "d_model": d, "n_layers": f.integer("n_layer", "num_hidden_layers"),
        "n_heads": f.integer("n_head", "num_attention_heads"),
        "intermediate_size": f.integer("n_inner", default=None) or (4 * d if d else None),
        "vocab_size": f.integer("vocab_size"), "max_seq_len": f.integer("n_positions", "n_ctx", default=1024),
        "norm_eps": f.number("layer_norm_epsilon", default=1e-5),
        "tie_embeddings": f.flag("tie_word_embeddings", default=True),  # transformers' default, which GPT-2 keeps
    }
    act = f.string("activation_function", default="gelu_new")
    if act is not None and act not in _ACTS:
        f.problems.append(f"activation_function {echo(act)} not supported (known: {', '.join(_ACTS)})")
    elif act is not None:
        m["ffn"] = _ACTS[act]
    dtype = f.string("torch_dtype", "dtype", default="bfloat16")
    if dtype is not None and dtype in _DTYPES:
        m["dtype"] = _DTYPES[dtype]
    elif dtype is not None:
        f.problems.append(f"torch_dtype {echo(dtype)} not supported (known: {', '.join(_DTYPES)})")
    notes = [f"{key} {echo(cfg[key])}: {what}" for key, (default, what) in _GPT2_NOTES.items()
             if key in cfg and cfg[key] != default]
    return m, notes


def _rope_notes(cfg: dict, f: _Fields) -> list[str]:
    """The note on a frequency-only RoPE scaling, after checking its numbers as transformers reads them
    (a factor of at least 1; the original context, llama3's frequency factors and yarn's betas when given): nonsense is a problem
    of ``f``, never copied into the notes."""
    kind = _rope_kind(cfg)
    if kind not in FREE_ROPE_SCALINGS:
        return []
    rs = cfg["rope_scaling"]
    scaling = _Fields(rs)
    factor = scaling.number("factor")
    if factor is not None and factor < 1:
        scaling.problems.append(f"factor: must be at least 1, got {echo(factor)}")
    scaling.integer("original_max_position_embeddings", default=None)
    if kind == "llama3":
        low, high = scaling.number("low_freq_factor", default=None), scaling.number("high_freq_factor", default=None)
        if low is not None and high is not None and not 0 < low < high:
            scaling.problems.append(f"low_freq_factor {echo(low)}, high_freq_factor {echo(high)}: expected "
                                    "0 < low_freq_factor < high_freq_factor")
    if kind == "yarn":
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            scaling.number(key, default=None)
    f.problems += [f"rope_scaling.{p}" for p in scaling.problems]
    if scaling.problems:
        return []
    detail = ", ".join(f"{k} {echo(rs[k])}" for k in ("factor", "original_max_position_embeddings") if k in rs)
    return [f"rope_scaling {kind} ({detail}): rescales RoPE frequencies for long contexts; it changes no "
            "parameter, FLOP or KV-cache figure, and the model here uses plain RoPE"]


def _dense_attention(f: _Fields, m: dict, mtype: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kv = f.integer("num_key_value_heads", default=m["n_heads"])
    hd = f.integer("head_dim", default=None)
    partial = f.number("partial_rotary_factor", default=None)
    if kv is None or m["n_heads"] is None:
        return out
    out["attention"] = "mha" if kv == m["n_heads"] else ("mqa" if kv == 1 else "gqa")
    if out["attention"] == "gqa":
        out["n_kv_heads"] = kv
    if hd and m["d_model"] and hd != m["d_model"] // m["n_heads"]:
        out["head_dim"] = hd
    if partial is not None and partial != 1.0:
        out["partial_rotary_factor"] = partial
    if mtype == "qwen2":
        out["qkv_bias"] = True
    return out


def _deepseek(f: _Fields, cfg: dict, *, moe: bool, notes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "attention": "mla", "kv_lora_rank": f.integer("kv_lora_rank"),
        "q_lora_rank": f.integer("q_lora_rank", default=0, minimum=0),
        "qk_nope_head_dim": f.integer("qk_nope_head_dim"), "qk_rope_head_dim": f.integer("qk_rope_head_dim"),
        "v_head_dim": f.integer("v_head_dim")}
    mtp = f.integer("num_nextn_predict_layers", default=0, minimum=0)
    if mtp:
        notes.append(f"num_nextn_predict_layers {mtp}: multi-token prediction is not modelled (each module adds one "
                     "MoE block and a 2*d_model x d_model projection, sharing the embedding and LM head; used in "
                     "training and for speculative decoding); the figures are the main model's")
    if not moe:
        experts = f.integer("n_routed_experts", default=None, minimum=0)
        if experts == 0 and "n_routed_experts" in cfg:
            notes.append("n_routed_experts 0: no routed experts, so every layer is the dense FFN (intermediate_size); "
                         "imported as a dense model")
        return out
    layers, dense = f.integer("num_hidden_layers"), f.integer("first_k_dense_replace", default=0, minimum=0)
    if layers is not None and dense is not None and dense >= layers:
        notes.append(f"first_k_dense_replace {dense} >= num_hidden_layers {layers}: every layer is dense (transformers "
                     "builds no MoE layer), imported as the dense FFN")
        return out
    out.update(_deepseek_moe(f, cfg))
    return out


def _deepseek_moe(f: _Fields, cfg: dict) -> dict:
    """The MoE keys of a DeepSeek-V2/V3 config as recipe keys; routing it cannot express is an error."""
    freq = f.integer("moe_layer_freq", default=1)
    method = f.string("topk_method", default="greedy")
    scoring = f.string("scoring_func", default="softmax")
    readers = {int: lambda k: f.integer(k, default=None, minimum=0), bool: lambda k: f.flag(k, default=None),
               float: lambda k: f.number(k, default=None)}
    m = {key: readers[kind](key) for key, kind in _MOE_KEYS.items()}
    m = {k: v for k, v in m.items() if v is not None}
    f.check()
    if freq != 1:
        raise RecipeError(f"moe_layer_freq {freq}: MoE in every n-th layer is not supported "
                          "(scaletool: every layer after first_k_dense_replace)")
    if method not in _TOPK_METHODS:
        raise RecipeError(f"topk_method {echo(method)} not supported (known: {', '.join(_TOPK_METHODS)})")
    if scoring not in ("softmax", "sigmoid"):
        raise RecipeError(f"scoring_func {echo(scoring)} not supported (known: softmax, sigmoid)")
    if _TOPK_METHODS[method] not in (None, scoring):
        raise RecipeError(f"topk_method {method} with scoring_func {scoring}: scaletool scores groups as "
                          f"{method} does only with scoring_func {_TOPK_METHODS[method]}")
    m.update(ffn="moe", scoring_func=scoring)
    if method != "greedy":  # greedy ignores n_group / topk_group
        m.update(n_group=f.integer("n_group", default=1), topk_group=f.integer("topk_group", default=1))
    return m


def read_config(path: str | Path) -> dict:
    """A config.json as a dict; a missing, special, huge, non-UTF-8 or malformed file is one error line."""
    p = Path(path)
    shown = shorten(p)
    blob = read_bounded(p, MAX_CONFIG_BYTES, "a config.json")
    try:
        cfg = json.loads(blob.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise RecipeError(f"{shown}: not UTF-8 text (byte {e.start}); a config.json is UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise RecipeError(f"{shown}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit; nesting past the stack
        raise RecipeError(f"{shown}: malformed JSON: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(cfg, dict):
        raise RecipeError(f"{shown}: expected a JSON object, got {type(cfg).__name__}")
    check_tree(cfg, shown)
    return cfg


def recipe_from_hf(path: str | Path, drop: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """Read a config.json and return a validated recipe dict (``model`` section filled) and the drops."""
    cfg = read_config(path)
    shown = shorten(path)
    try:
        model, dropped = model_section(cfg, drop)
    except RecipeError as e:
        raise RecipeError([f"{shown}: {p}" for p in e.problems]) from None
    recipe = recipe_from_dict({"model": model}, shown)  # validate now: a bad config fails here, not later
    out = {"model": {k: v for k, v in recipe.model.model_dump().items() if k in model}}
    return out, dropped


#: the training sequence length of a config.json used as a recipe (``estimate config.json``), unless
#: given: its max_position_embeddings (131,072 for Llama-3.1) is the longest context, not a training shape
IMPORT_SEQ_LEN = 4096
_announced: set[tuple[str, int]] = set()


def hf_config_path(arg: str | Path) -> Path | None:
    """The config.json ``arg`` names where a recipe is expected: a ``.json`` file, or a directory holding a
    ``config.json`` (a downloaded model's folder); None for anything else (a recipe, a shipped name)."""
    p = Path(arg)
    try:
        if p.is_dir():
            return p / "config.json" if (p / "config.json").is_file() else None
        return p if p.suffix == ".json" and p.exists() else None
    except OSError:  # a name too long for the filesystem: find_recipe says so
        return None


def imported_recipe(path: Path) -> dict:
    """A config.json as recipe input (``recipe from-hf``'s conversion, nothing dropped), its training
    sequence length :data:`IMPORT_SEQ_LEN` or the model's maximum where that is shorter."""
    try:
        raw, _ = recipe_from_hf(path)
    except RecipeError as e:  # --drop belongs to `recipe from-hf`: say how to get there
        how = f"`scaletool recipe from-hf {shorten(path)} --drop FEATURE -o recipe.yaml` imports it anyway"
        raise RecipeError([*e.problems[:-1], f"{e.problems[-1]}; {how}"] if "--drop" in e.problems[-1]
                          else e.problems) from None
    raw["train"] = {"seq_len": min(IMPORT_SEQ_LEN, raw["model"].get("max_seq_len", IMPORT_SEQ_LEN))}
    return raw


def announce_import(path: Path, recipe) -> None:
    """Say on stderr, once per file and sequence length in a process, that ``path`` was imported, with its notes and the
    sequence length chosen when it is shorter than the model's maximum."""
    import sys

    key = (str(path), recipe.seq_len)
    if key in _announced:
        return
    _announced.add(key)
    lines = [f"note: {shorten(path)}: a Hugging Face config, imported as `scaletool recipe from-hf` does"]
    lines += [f"note: {n}" for n in recipe.model.notes or ()]
    m = recipe.model
    if recipe.seq_len < m.max_seq_len:
        lines.append(f"note: sequence length {recipe.seq_len:,} (the model takes up to {m.max_seq_len:,}); "
                     "estimate --seq-len N, or --set train.seq_len=N, sets it")
    print("\n".join(lines), file=sys.stderr)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), *,
                extra: dict | None = None) -> Recipe:
    """A recipe from any input the commands take: a recipe file or shipped name
    (:func:`scaletool.config.load_recipe`), or a Hugging Face config.json or the folder holding one, imported
    on the fly (:func:`imported_recipe`, announced once); then ``--set`` overrides, validated."""
    config_json = hf_config_path(path)
    if not config_json:
        return load_yaml_recipe(path, overrides, extra=extra)
    recipe = load_yaml_recipe(path, overrides, extra=extra, raw=imported_recipe(config_json))
    announce_import(config_json, recipe)
    return recipe
