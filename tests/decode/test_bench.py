"""The decode benchmark's procedure: warm-up per point, timing samples, sizing and the memory refusal."""
from __future__ import annotations

import pytest
import torch
from conftest import RECIPES
from tiny_variants import tiny_cfg, tiny_model

from scaletool import api
from scaletool.config import load_recipe
from scaletool.decode.bench import DecodeSettings, plan_points, run_decode
from scaletool.decode.setup import decode_model
from scaletool.decode.sizing import check_memory, memory_fit
from scaletool.errors import RecipeError
from scaletool.model.attention import DecodeMode

COLD_S = 1000.0  # what a cold first call costs on the fake clock below
WARM_S = 0.001  # and every other call


def _cold_per_shape(model, clock, calls):
    """Make the first call of every input shape cost COLD_S on ``clock`` (first kernel launches, autotuning and
    lazy allocations do that), every other call WARM_S; ``calls`` logs (shape, cold) in order."""
    seen, step = set(), model.step

    def slow_first(tokens, *args, **kwargs):
        cold = tokens.shape not in seen
        seen.add(tokens.shape)
        calls.append((tuple(tokens.shape), cold))
        clock.advance(COLD_S if cold else WARM_S)
        return step(tokens, *args, **kwargs)

    model.step = slow_first
    return model


def test_every_point_is_warmed_before_it_is_timed_so_no_point_is_cold(fake_clock):
    """Contexts 64,32,64 once gave prefill 151 tokens/s at the first point and 49.5k at the third.

    The mechanism: every point runs its excluded warm-up (one prefill, ``warmup_steps`` decode steps) before
    its timed samples, so a cold call lands in a warm-up and never in a timed sample. The step timer reads a
    fake clock that only the model's calls move: the samples say exactly which calls fell into them.
    """
    cfg, model, _ = tiny_model("mla")
    calls = []
    s = DecodeSettings(batches=(1,), contexts=(64, 32, 64), new_tokens=4, warmup_steps=1, prefill_repeats=3)
    res = run_decode(cfg, _cold_per_shape(model, fake_clock, calls), s, budget_bytes=None)
    assert [p.context for p in res.points] == [64, 32, 64]
    # per point, in order: 1 warm-up + 3 timed prefills, then 1 warm-up + 4 timed decode steps
    assert [shape for shape, _ in calls] == [shape for n in (64, 32, 64) for shape in [(1, n)] * 4 + [(1, 1)] * 5]
    # the cold calls: the first prefill of contexts 64 and 32 and the first decode step: each a warm-up call
    cold_at = [i for i, (_, cold) in enumerate(calls) if cold]
    assert cold_at == [0, 4, 9]
    for p in res.points:
        assert p.prefill_runs_excluded == 1 and p.warmup_steps_excluded == 1
        # the timed samples hold warm calls only: exactly one each
        assert p.prefill_s.n == 3 and p.prefill_s.p90 == pytest.approx(WARM_S), p.prefill_s
        assert p.decode_step_s.n == 4 and p.decode_step_s.p90 == pytest.approx(WARM_S), p.decode_step_s


def test_a_slow_start_beyond_the_minimum_warm_up_is_excluded_by_rule(fake_clock):
    cfg, model, _ = tiny_model("mqa")
    calls = {"n": 0}
    step = model.step

    def slow_start(tokens, *args, **kwargs):  # the first 3 decode steps are slow, the minimum excludes 1
        if tokens.shape[1] == 1:
            calls["n"] += 1
        fake_clock.advance(0.5 if tokens.shape[1] == 1 and calls["n"] <= 3 else WARM_S)
        return step(tokens, *args, **kwargs)

    model.step = slow_start
    s = DecodeSettings(batches=(2,), contexts=(16,), new_tokens=12, warmup_steps=1, prefill_repeats=1)
    (p,) = run_decode(cfg, model, s, budget_bytes=None).points
    assert calls["n"] == 13
    # the minimum (1) and the two slow steps after it are out by the settled-level rule; the rest are timed
    assert p.warmup_steps_excluded == 3 and p.decode_step_s.n == 10
    assert p.decode_step_s.p90 == pytest.approx(WARM_S)


def test_batches_and_max_resolve_per_context_and_max_needs_a_budget():
    cfg = tiny_cfg("mla")
    s = DecodeSettings(batches=(1, None, 1), contexts=(16, 64), new_tokens=4)
    fit = memory_fit(cfg, 2**22, s.contexts, s.extra_positions)
    plan = plan_points(cfg, s, fit)
    biggest = {r["context"]: r["max_batch"] for r in fit["rows"] if r["attention"] == "mla"}
    assert plan == [(16, 1), (16, biggest[16]), (64, 1), (64, biggest[64])]  # duplicates measured once
    assert biggest[16] > biggest[64] > 1
    with pytest.raises(RecipeError, match="needs a memory budget"):
        plan_points(cfg, s, None)


def test_the_memory_check_names_the_figures_and_passes_what_fits():
    cfg = tiny_cfg("mla")
    check_memory(cfg, 10 * 2**20, "cpu")  # 10 MiB of cache fits any machine running the tests
    with pytest.raises(RecipeError) as e:
        check_memory(cfg, 2**60, "cpu")
    (line,) = e.value.problems
    assert line.startswith("decode needs about ") and "KV cache 1073741824.00 GiB" in line and "available on cpu" in line


def test_api_decode_returns_the_typed_result_for_a_recipe_object():
    r = load_recipe(RECIPES / "tiny.yaml")
    res = api.decode(r, contexts=[8], batch=[1, 2], new_tokens=2, device="cpu", warmup_steps=1, prefill_repeats=1,
                     mla_kernel="torch")
    assert res.kind == "decode" and [p.batch for p in res.points] == [1, 2] and res.recipe is None
    assert res.settings["kernel"] == "torch" and res.threads >= 1
    with pytest.raises(RecipeError, match="batch"):
        api.decode(r, batch=[0], device="cpu")
    with pytest.raises(RecipeError, match="mla_mode"):
        api.decode(r, mla_mode="latent", device="cpu")


def test_mode_not_the_cache_picks_the_algorithm():
    """The decode algorithm once came from the cache object's attributes; now the caller's mode
    picks it, and a cache of the wrong kind for the mode is refused instead of silently followed."""
    from scaletool.model.cache import make_caches

    cfg, model, _ = tiny_model("mla")
    latent = make_caches(cfg, 1, 8, dtype=torch.float32, device="cpu", mla_mode="absorbed")
    tokens = torch.randint(cfg.vocab_size, (1, 4))
    with pytest.raises(ValueError, match="mode 'naive' needs a 'kv' cache holding k, v, got a 'latent' one"):
        model.step(tokens, 0, latent, DecodeMode("naive"))
    with pytest.raises(ValueError, match="kernel must be one of"):
        DecodeMode("absorbed", "cuda")


def test_trust_checkpoint_reaches_a_loader_that_takes_it(monkeypatch):
    import scaletool.train.checkpoint as ckpt

    seen = {}

    def loader(path, model, trust_checkpoint=False):
        seen.update(path=path, trust=trust_checkpoint)
        return model

    monkeypatch.setattr(ckpt, "load_model_weights", loader)
    r = load_recipe(RECIPES / "tiny.yaml")
    model = decode_model(r, torch.device("cpu"), 0, api.checkpoint_weights("some/dir", True))
    assert seen == {"path": "some/dir", "trust": True} and not model.training


def test_api_decode_takes_the_kinds_default_mode_and_refuses_what_the_kind_cannot_do():
    """Per-head-RoPE MLA decodes in expand (its latent cache, re-expanded every step) unless told naive;
    absorbed is refused with the reason; a learned position table refuses contexts past it."""
    r = load_recipe(RECIPES / "tiny.yaml", ["model.mla_rope=per_head"])
    res = api.decode(r, contexts=[8], new_tokens=2, device="cpu", warmup_steps=1, prefill_repeats=1)
    (p,) = res.points
    assert res.mla_mode == "expand" and p.attention == "mla-per_head" and "up-projected from every cached latent" \
        in p.attention_kernel
    assert p.kv_cache_bytes_measured == p.kv_cache_bytes_analytic == p.max_len * r.model.kv_lora_rank * 4 * 2
    with pytest.raises(RecipeError, match="mla_mode absorbed: mla_rope=per_head cannot absorb W_UK"):
        api.decode(r, mla_mode="absorbed", device="cpu")
    with pytest.raises(RecipeError, match="mla_mode naive is for attention=mla recipes; this one is gqa"):
        api.decode(r, overrides=["model.attention=gqa", "model.n_kv_heads=2"], mla_mode="naive", device="cpu")
    learned = ["model.attention=mha", "model.position_encoding=learned"]
    with pytest.raises(RecipeError, match=r"learned has a table of model.max_seq_len=64 positions, and the longest point "
                                          r"needs 69 \(context 64 \+ 3 warm-up \+ 2 new tokens\)"):
        api.decode(r, overrides=learned, contexts=[64], new_tokens=2, device="cpu")
