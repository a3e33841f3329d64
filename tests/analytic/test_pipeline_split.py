"""The stage split is the bottleneck partition: among every way to cut the blocks into the p·v chunks, the one whose
largest chunk (time first, then memory) is least. Checked against brute force over every cut on small models,
with uneven in-flight counts, a MoE model's dense first blocks and the first and last chunks' extras."""
from __future__ import annotations

import itertools
import random

import pytest

from scaletool.analytic.pipeline import _chunk_costs, _solve
from scaletool.config import load_recipe


def _bottleneck(cfg, seq_len, S, tokens, act, flight, dp, ep, bounds):
    t, ms, ma, first, last = _chunk_costs(cfg, seq_len, S, tokens, act, 2, list(flight), dp, ep)
    worst = (float("-inf"), float("-inf"))
    for c, (i, j) in enumerate(bounds):
        time = sum(t[i:j]) + (first[0] if c == 0 else 0.0) + (last[0] if c == S - 1 else 0.0)
        mem = sum(ms[i:j]) + flight[c] * sum(ma[i:j]) + (first[1] if c == 0 else 0.0) + (last[1] if c == S - 1 else 0.0)
        worst = max(worst, (time, mem))
    return worst


@pytest.mark.parametrize("name, sets", [("tiny", ["model.n_layers=7"]), ("mha-1b", ["model.n_layers=9"]),
                                        ("deepseek-v2-lite", ["model.n_layers=8"])])
def test_the_split_is_the_least_bottleneck_of_every_partition(name, sets):
    cfg = load_recipe(name, sets).model
    L, rng = cfg.n_layers, random.Random(0)
    for S in range(1, L + 1):
        flight = tuple(float(rng.choice([1, 2, 3, 1.5])) for _ in range(S))
        args = (cfg, 2048, S, rng.choice([1, 4096]), rng.choice(["none", "full"]), flight, rng.choice([1, 8]),
                8 if cfg.ffn == "moe" else 1)
        got = _solve(*args[:5], 2, *args[5:])
        assert [b[0] for b in got][1:] == [b[1] for b in got][:-1] and got[0][0] == 0 and got[-1][1] == L
        assert all(i < j for i, j in got) and len(got) == S
        best = min(_bottleneck(*args, list(zip((0, *cuts), (*cuts, L))))
                   for cuts in itertools.combinations(range(1, L), S - 1))
        assert _bottleneck(*args, got) == pytest.approx(best, rel=1e-12)
