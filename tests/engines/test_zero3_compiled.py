"""DeepSpeed ZeRO-3 under ``torch.compile``: the LM head's weight is gathered where it is used.

ZeRO-3 partitions every parameter and gathers it in the hooks of the module whose forward uses it. A
head that reads ``output.weight`` (or, tied, the embedding's weight) outside that module's forward met
the empty partition (size (0,)) under ``torch.compile`` and every rank failed with ``TorchRuntimeError``
in fake-tensor tracing. The untied head is now called as a module; the tied weight is registered as an
external parameter of the root (:func:`scaletool.engines.deepspeed.register_tied_head`). FSDP2 gathers its
root's parameters (the embedding with them) for the whole root forward, so its tied head needs nothing more.

Real jobs: ``scaletool train --nproc-per-node 2`` (gloo, CPU, inductor), the tiny recipe tied and untied,
each against a one-process eager run of the same global batch (8 sequences) and seed: the loss curves
agree to float32 summation-order noise.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
COMMON = ["train.steps=3", "train.measure_warmup_steps=1"]
ZERO3 = ["parallel.engine=deepspeed", "parallel.zero_stage=3", "train.compile=true", "train.micro_batch_size=4"]


def train(out: Path, sets: list[str], *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(out), "--json", *extra]
    for s in COMMON + sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


FSDP2 = ["parallel.engine=fsdp", "train.compile=true", "train.micro_batch_size=4"]


@pytest.mark.parametrize("engine, tied", [("zero3", False), ("zero3", True), ("fsdp", True)],
                         ids=["zero3-untied", "zero3-tied", "fsdp-tied"])
def test_partitioned_engines_compiled_train_and_match_one_process(tmp_path, engine, tied):
    """ZeRO-3 tied and untied; FSDP2 with a tied head (its root keeps the embedding gathered through the
    forward, so the head reads the whole weight; its blocks are compiled, the head eager)."""
    tie = [f"model.tie_embeddings={str(tied).lower()}"]
    one = train(tmp_path / "single", tie + ["train.micro_batch_size=8"])
    assert one.returncode == 0, one.stderr[-3000:]
    p = train(tmp_path / engine, tie + (ZERO3 if engine == "zero3" else FSDP2), "--nproc-per-node", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    ref, run = json.loads(one.stdout), json.loads(p.stdout)
    assert run["status"] == "completed" and run["environment"]["world_size"] == 2
    assert run["recipe"]["train"]["compile"] is True
    assert run["recipe"]["parallel"]["engine"] == ("deepspeed" if engine == "zero3" else "fsdp")
    assert run["recipe"]["model"]["tie_embeddings"] is tied
    assert run["tokens_per_step"] == ref["tokens_per_step"]
    assert run["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-4)


def test_the_tied_weight_is_registered_with_the_root_only_when_tied():
    """The registration itself, on real models: the tied embedding weight becomes an external parameter of
    the root, an untied model registers nothing (its head is a module with its own hooks)."""
    pytest.importorskip("deepspeed")
    from scaletool.config import load_recipe
    from scaletool.engines.deepspeed import register_tied_head
    from scaletool.model import build_model

    tied = build_model(load_recipe(TINY, ["model.tie_embeddings=true"]).model)
    assert register_tied_head(tied)
    assert [p for p in tied._external_params.values()] == [tied.tok_embeddings.weight]
    untied = build_model(load_recipe(TINY, []).model)
    assert not register_tied_head(untied)
    assert not getattr(untied, "_external_params", {})
