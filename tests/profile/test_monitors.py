"""Training-dynamics monitors: hand-computed values on small tensors, then the monitor on the tiny model."""
from __future__ import annotations

import math
import types
from contextlib import nullcontext

import pytest
import torch
from conftest import RECIPES

from scaletool.config import load_recipe
from scaletool.engines import init_distributed, make_engine
from scaletool.profile.monitors import DynamicsMonitor, attention_entropy, effective_rank, update_ratio
from scaletool.results.train import TrainResult
from scaletool.train.metrics import MetricsWriter


def test_attention_entropy_of_known_distributions():
    # head 0 uniform over 4 keys (ln 4), head 1 uniform over 2 of them (ln 2); B=1, T=3 rows each
    p = torch.zeros(1, 2, 3, 4)
    p[0, 0] = 0.25
    p[0, 1, :, :2] = 0.5
    mean, low = attention_entropy(p)
    assert mean == pytest.approx((math.log(4) + math.log(2)) / 2, rel=1e-6)
    assert low == pytest.approx(math.log(2), rel=1e-6)
    one_hot = torch.eye(5).expand(2, 3, 5, 5)  # (B, H, T, T): each query on one key
    assert attention_entropy(one_hot) == (pytest.approx(0.0, abs=1e-6), pytest.approx(0.0, abs=1e-6))


def test_effective_rank_of_known_spectra():
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))

    def with_singular_values(s):
        return u[:, :len(s)] @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ v[:, :len(s)].T  # (8, 6)

    assert effective_rank(with_singular_values([2.0, 2.0, 2.0])) == pytest.approx(3.0, rel=1e-5)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))  # p = (3, 1) / 4
    assert effective_rank(with_singular_values([3.0, 1.0, 0.0])) == pytest.approx(math.exp(h), rel=1e-5)
    identical_rows = torch.ones(8, 6)
    assert effective_rank(identical_rows) == pytest.approx(1.0, rel=1e-4)
    batch = torch.stack([with_singular_values([1.0] * 6), identical_rows.double()])  # mean over leading dims
    assert effective_rank(batch) == pytest.approx(3.5, rel=1e-4)


def test_update_ratio():
    before = [torch.full((2, 2), 2.0), torch.full((3,), 2.0)]
    after = [b * 1.1 for b in before]
    assert update_ratio(before, after) == pytest.approx(0.1, rel=1e-6)
    assert update_ratio(before, before) == 0.0


@pytest.fixture
def monitored(tmp_path):
    r = load_recipe(RECIPES / "tiny.yaml", ["profile.monitors.enabled=true", "profile.monitors.every=5"])
    env = init_distributed("single")
    engine = make_engine(r, env)
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False, quiet=True)
    info = types.SimpleNamespace(recipe=r, out_dir=tmp_path, env=env, engine=engine, writer=writer,
                                 unmeasured=nullcontext)
    mon = DynamicsMonitor(r.profile.monitors)
    mon.on_train_start(info)
    yield mon, engine.model, tmp_path
    writer.close()


def test_monitor_values_match_the_model_and_leave_training_state_alone(monitored):
    mon, model, _ = monitored
    assert mon.on_step_end(2, None) is None  # not due (every 5), no snapshot due either
    assert mon.on_step_end(3, None) is None and mon._prev[0] == 3  # step 4 is due: weights kept for its ratio
    with torch.no_grad():  # stand-in for an optimizer step that moves block 0 by 10%
        for p in model.layers[0].parameters():
            p.mul_(1.1)
    v = mon.on_step_end(4, None)
    assert all(p.grad is None for p in model.parameters())  # autograd.grad: training grads untouched
    assert v["dynamics/update_to_weight_ratio/block_00"] == pytest.approx(0.1, rel=1e-5)
    assert v["dynamics/update_to_weight_ratio/block_01"] == 0.0

    inputs, targets = mon.probe
    assert inputs.shape == (2, 64)  # profile.monitors.batch_size
    model.zero_grad(set_to_none=True)
    model(inputs, targets).backward()
    for i, layer in enumerate(model.layers):
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in layer.parameters()))
        assert v[f"dynamics/grad_norm/block_{i:02d}"] == pytest.approx(norm, rel=1e-4)
    with torch.no_grad():
        h = model.hidden_states(inputs)
        positions = model.positions(0, inputs.shape[1], inputs.shape[1], h[1].dtype)
        mean, low = attention_entropy(model.layers[1].attn.probs(model.layers[1].attn_norm(h[1]), positions))
        assert v["dynamics/attention_entropy_nats/layer_01"] == pytest.approx(mean, rel=1e-5)
        assert v["dynamics/attention_entropy_min_head_nats/layer_01"] == pytest.approx(low, rel=1e-5)
        assert v["dynamics/effective_rank/layer_00"] == pytest.approx(effective_rank(h[1]), rel=1e-5)
    assert v["dynamics/effective_rank_ratio/layer_00"] == pytest.approx(v["dynamics/effective_rank/layer_00"] / 64)
    assert mon.warnings == []


def test_collapse_warnings(monitored):
    mon, model, out = monitored
    with torch.no_grad():
        model.layers[0].attn.wq.weight.mul_(1e3)  # sharp scores in layer 0: attention on one key per query
        model.tok_embeddings.weight[:] = model.tok_embeddings.weight[0]  # every token the same vector
    v = mon.on_step_end(9, None)
    # identical tokens: every state is one row repeated (rank 1), and attention over equal keys is uniform
    assert v["dynamics/effective_rank/layer_01"] == pytest.approx(1.0, rel=1e-3)
    assert any("rank collapse at step 9, layer 1" in w for w in mon.warnings)
    with torch.no_grad():
        model.tok_embeddings.weight.normal_(generator=torch.Generator().manual_seed(1))
    v = mon.on_step_end(9, None)
    assert v["dynamics/attention_entropy_nats/layer_00"] < 0.5
    assert any("entropy collapse at step 9, layer 0" in w for w in mon.warnings)
    assert "entropy collapse" in (out / "train.log").read_text()
    result = TrainResult(status="completed")
    mon.on_train_end(result)
    assert result.dynamics["steps"] == [9, 9] and result.dynamics["warnings"] == mon.warnings
