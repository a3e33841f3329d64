"""``scaletool estimate`` on a Hugging Face config.json: imported on the fly with its notes, shapes from
options, and a model too large for one card told how many GPUs each engine needs."""
from __future__ import annotations

import json
import re
import shutil

from click.testing import CliRunner
from conftest import ROOT

from scaletool.analytic.memory import recipe_memory
from scaletool.analytic.step import fits
from scaletool.cli import main
from scaletool.hf import load_recipe
from scaletool.measure.hardware import profile_named

LLAMA = ROOT / "tests" / "hf_configs" / "llama-3.1-8b.json"


def _estimate(*args: str):
    return CliRunner(env={"COLUMNS": "80"}).invoke(main, ["estimate", *args])


def test_a_config_json_or_its_folder_is_imported_with_its_notes_at_4096_tokens(tmp_path):
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    shutil.copy(LLAMA, folder / "config.json")
    for arg in (str(LLAMA), str(folder)):
        res = _estimate(arg, "--json")
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert doc["params"]["total"] == 8_030_261_248  # Llama-3.1-8B, exactly
        assert doc["seq_len"] == 4096  # not max_position_embeddings 131072
        assert "a Hugging Face config, imported as `scaletool recipe from-hf` does" in res.stderr
        assert "note: rope_scaling llama3" in res.stderr
        assert "sequence length 4,096 (the model takes up to 131,072)" in res.stderr
    res = _estimate(str(LLAMA), "--seq-len", "8192", "--micro-batch", "2", "--gpus", "8", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["seq_len"] == 8192 and doc["memory"]["world_size"] == 8
    assert "sequence length 8,192" in res.stderr


def test_too_large_for_one_card_says_how_many_gpus_each_engine_needs():
    res = _estimate(str(LLAMA), "--micro-batch", "1")
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())
    assert "Does not fit one H100 SXM" in out
    m = re.search(r"No checkpointing: needs at least (\d+) GPUs under fsdp / zero3", out)
    assert m, out
    n = int(m.group(1))
    # the same count from the memory the estimate reports, engine by engine
    card = profile_named("H100 SXM").memory_bytes
    r = load_recipe(str(LLAMA), ["train.micro_batch_size=1", "parallel.engine=fsdp"])
    assert fits(recipe_memory(r, n)["total_bytes"], card)[0]
    assert not fits(recipe_memory(r, n - 1)["total_bytes"], card)[0]
    assert "does not fit ddp on up to 65,536 GPUs" in out  # DDP replicates: more GPUs never help


def test_a_model_that_fits_gets_no_gpu_count():
    res = _estimate("tiny")
    assert res.exit_code == 0, res.output
    assert "Does not fit" not in res.output and "needs at least" not in res.output


def test_a_config_needing_a_drop_is_one_error_line_naming_the_way():
    res = _estimate(str(ROOT / "tests" / "hf_configs" / "deepseek-v3.json"))
    assert res.exit_code == 2
    assert len(res.output.splitlines()) == 1, res.output
    assert res.output.startswith("error: ") and "--drop FEATURE -o recipe.yaml` imports it anyway" in res.output
