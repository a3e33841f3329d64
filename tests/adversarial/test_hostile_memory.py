"""A training run that cannot fit in memory is refused before any model is built, with the estimate
and the budget (on CPU: every local rank shares this machine's memory; on CUDA: each rank's GPU)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hostile import invoke

from scaletool.measure import available, count


@pytest.fixture
def small_cpu(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1048576 kB\nMemAvailable: 1024 kB\n")  # 1 MiB available
    monkeypatch.setattr(available, "MEMINFO", str(meminfo))
    monkeypatch.setattr(available, "CGROUP_DIR", str(tmp_path / "no-cgroup"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("extra, where", [
    ([], "this CPU process"),
    (["--nproc-per-node", "2", "--set", "parallel.engine=ddp"], "2 CPU ranks"),
    (["--set", "train.micro_batch_size=4096"], "this CPU process"),
])
def test_a_cpu_run_that_cannot_fit_is_one_line_with_the_estimate_and_the_budget(tmp_path, small_cpu, extra, where):
    out = tmp_path / "run"
    lines, _ = invoke(["train", "tiny", "--out", str(out), *extra], within=tmp_path)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: training needs about ") and f" for {where} (analytic estimate" in lines[0]
    assert "but 1.0 MiB is available (MemAvailable in /proc/meminfo)" in lines[0]
    assert not out.exists()


def test_a_gpu_run_checks_each_ranks_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (2**20 if i == 1 else 2**40, 2**40))
    lines, _ = invoke(["train", "tiny", "--out", str(tmp_path / "run"), "--nproc-per-node", "2", "--set",
                       "parallel.engine=ddp"], within=tmp_path)
    assert len(lines) == 1 and " for each GPU rank " in lines[0] and "but 1.0 MiB is available (free memory of the " \
        "GPU" in lines[0], lines


def test_a_run_that_fits_is_not_refused(tmp_path):
    from scaletool.config import load_recipe

    checked = count.train_memory_check(load_recipe("tiny"), 1)
    assert checked is None or 0 < checked["required_bytes"] < checked["available_bytes"]


def test_a_compiled_run_is_checked_against_the_compiled_estimate(monkeypatch):
    """mha-1b at micro-batch 24 on an 80 GB card: the compiled estimate (~65 GiB) fits, the eager one (~87) not."""
    from scaletool.config import load_recipe
    from scaletool.errors import RecipeError

    MHA_1B = str(Path(__file__).resolve().parents[2] / "recipes" / "mha-1b.yaml")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (int(78.66 * 2**30), 80 * 2**30))
    compiled = load_recipe(MHA_1B, ["train.micro_batch_size=24"])
    assert compiled.train.compile
    checked = count.train_memory_check(compiled, 1)
    assert 60 * 2**30 < checked["required_bytes"] < 70 * 2**30
    eager = load_recipe(MHA_1B, ["train.micro_batch_size=24", "train.compile=false"])
    with pytest.raises(RecipeError) as err:
        count.train_memory_check(eager, 1)
    assert "training needs about 87." in str(err.value) and "engine=single, micro_batch_size 24" in str(err.value)


def test_a_pipeline_run_is_checked_against_its_largest_stage(monkeypatch):
    """The layout `plan` ranked third for Llama-3-8B on 4 H200s (FSDP2, PP 2 interleaved, 8 micro-batches of one
    8,192-token sequence, compiled): its largest stage is 84.8 GiB (measured 91.1), and train once refused it at
    391.6 GiB, the count of micro-batch 8 through the whole model. The check is now the figure estimate and plan give."""
    from scaletool.analytic.pipeline import peak_bytes
    from scaletool.config import load_recipe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (int(139.28 * 2**30), 140 * 2**30))
    llama = str(Path(__file__).resolve().parents[2] / "recipes" / "llama3-8b.yaml")
    r = load_recipe(llama, ["parallel.engine=fsdp", "parallel.pipeline_parallel=2", "train.compile=true",
                            "parallel.pipeline_schedule=interleaved-1f1b", "parallel.pipeline_virtual_stages=2",
                            "parallel.pipeline_microbatches=8", "train.micro_batch_size=8",
                            "train.activation_checkpointing=none"])
    checked = count.train_memory_check(r, 4)
    assert checked["required_bytes"] == int(peak_bytes(r, 4))
    assert 80 * 2**30 < checked["required_bytes"] < 95 * 2**30
