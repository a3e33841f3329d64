"""`scaletool decode` through the command line, on CPU with the tiny recipe."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import RECIPES, run_cli

from scaletool.cli import main
from scaletool.config import load_recipe
from scaletool.results import load_result
from scaletool.results.decode import DecodeResult
from scaletool.stats import Spread

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

TINY = str(RECIPES / "tiny.yaml")
FAST = ["--device", "cpu", "--warmup-steps", "1", "--prefill-repeats", "1"]


def _decode(*args, env=None):
    return CliRunner().invoke(main, ["decode", *args], env=env)


def test_json_points_carry_the_contract_and_cache_bytes_match_the_analytic_model():
    res = _decode(TINY, *FAST, "--batch", "2", "--context", "16,80", "--new-tokens", "4", "--prefill-chunk", "32",
                  "--memory-budget", "0.01", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["kind"] == "decode" and out["schema_version"] == 2 and out["threads"] >= 1 and not out["cuda_graph"]
    assert [p["context"] for p in out["points"]] == [16, 80]
    for p in out["points"]:
        assert p["attention"] == "mla" and p["batch"] == 2 and p["cuda_graph"] is False
        # on CPU the steps run synchronously: issuing one takes about the time it runs (the mean over every step,
        # warm-up included, against the median of the timed ones: not less than half of it)
        assert p["decode_host_issue_s_per_step"] >= 0.5 * p["decode_step_s"]["median"]
        # the cache holds the prompt, the warm-up step and the 4 timed steps
        assert p["max_len"] == p["context"] + 1 + 4
        assert p["kv_cache_bytes_measured"] == p["kv_cache_bytes_analytic"] == 2 * p["max_len"] * 320
        steps, pre = Spread(**p["decode_step_s"]), Spread(**p["prefill_s"])
        assert 1 <= steps.n <= 4 and p["warmup_steps_excluded"] == 5 - steps.n
        assert pre.n == 1 and p["prefill_runs_excluded"] == 1
        assert p["decode_tokens_per_s"] == pytest.approx(2 / steps.median)  # rates from the median step
        assert p["prefill_tokens_per_s"] == pytest.approx(p["context"] / pre.median)
        assert p["decode_tokens_per_s_spread"] == pytest.approx(steps.p90 / steps.p10 - 1)
        assert p["decode_bandwidth_bytes_per_s"] == pytest.approx(p["decode_bytes_per_step"] / steps.median, rel=1e-6)
        assert p["decode_bandwidth_fraction_of_peak"] is None  # no bandwidth peak is invented for CPUs
        assert "cuDNN" not in p["attention_kernel"]
    # tiny's max_seq_len is 64: the 80-token context ran on extended RoPE tables
    assert out["points"][0]["rope_extended_to"] is None and out["points"][1]["rope_extended_to"] == 85
    fit = {(r["attention"], r["context"]): r["max_batch"] for r in out["memory_fit"]["rows"]}
    assert fit[("mla", 16)] // 4 == fit[("mla-naive", 16)]  # the naive cache is 4× the latent one here
    assert fit[("mla", 16)] > fit[("mla", 80)] > 0
    assert isinstance(load_result(out), DecodeResult)


def test_two_new_tokens_fit_the_cache_and_the_rope_table():
    """Warm-up steps once ran past a cache sized for context + new tokens (RoPE crash)."""
    res = _decode(TINY, "--device", "cpu", "--context", "64", "--batch", "1", "--new-tokens", "2", "--json")
    assert res.exit_code == 0, res.output
    (p,) = json.loads(res.stdout)["points"]
    assert p["max_len"] == 64 + 3 + 2 and p["rope_extended_to"] == 69


def test_batch_list_and_max_measure_both_and_the_table_names_the_kernel():
    res = _decode(TINY, *FAST, "--batch", "1,max", "--context", "8", "--new-tokens", "2", "--memory-budget", "0.002",
                  "--mla-mode", "naive")
    assert res.exit_code == 0, res.output
    assert "mla-naive" in res.stdout and "Largest batch" in res.stdout and "sdpa" in res.stdout
    assert "cuDNN" not in res.output  # a CPU run once claimed cuDNN
    # stderr is not a terminal here: one plain progress line per point, no frozen progress bar
    lines = res.stderr.splitlines()
    assert lines[0].startswith("decode: building the model on cpu")
    assert lines[1] == "[1/2] decode mla-naive: batch 1 × context 8"
    assert lines[2].startswith("[2/2] decode mla-naive: batch ") and lines[2].endswith(" × context 8")


def test_the_tables_fit_80_columns_without_truncation():
    res = _decode(TINY, *FAST, "--batch", "1,max", "--context", "8,1k", "--new-tokens", "1", "--memory-budget",
                  "0.004", env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    assert "…" not in res.stdout
    for value in ("1,024", "KiB"):  # numbers and units are never split across lines
        assert value in res.stdout


def test_result_file_gets_the_typed_result(tmp_path):
    out = tmp_path / "decode.json"
    res = CliRunner().invoke(main, ["--result-file", str(out), "decode", TINY, *FAST, "--context", "8",
                                    "--new-tokens", "1"])
    assert res.exit_code == 0, res.output
    doc = load_result(json.loads(out.read_text()))
    assert isinstance(doc, DecodeResult) and doc.points[0].ok and doc.recipe == TINY


def test_mha_recipe_decodes_and_naive_mode_is_refused_for_it():
    args = [TINY, *FAST, "--context", "8", "--new-tokens", "2", "--set", "model.attention=mha",
            "--set", "model.kv_lora_rank=0", "--set", "model.qk_nope_head_dim=null",
            "--set", "model.v_head_dim=null", "--set", "model.qk_rope_head_dim=null"]
    res = _decode(*args, "--json")
    assert res.exit_code == 0, res.output
    p = json.loads(res.stdout)["points"][0]
    assert p["attention"] == "mha" and p["attention_kernel"] == "sdpa over the cached K/V"
    res = _decode(*args, "--mla-mode", "naive")
    assert res.exit_code == 2 and "naive is for attention=mla" in res.output


@pytest.mark.parametrize("args, expected", [
    (["--device", "cpu", "--batch", "max"], "--memory-budget"),
    (["--device", "cpu", "--context", "4k,x"], "'x' is not a positive token count"),
    (["--device", "cpu", "--batch", "0"], "neither a positive integer nor 'max'"),
    (["--device", "cpu", "--batch", "2,,y"], "'y' is neither a positive integer nor 'max'"),
    (["--device", "cpu", "--mla-kernel", "triton"], "fused kernel cannot run here"),
    (["--device", "cpu", "--cuda-graph"], "CUDA graphs need a CUDA device"),
    (["--device", "cpu", "--compile", "--split-batch", "2"], "the compiled step does not take"),
    (["--device", "cpu", "--split-batch", "0"], "0 is not in the range x>=1"),
    (["--device", "tpu"], "'tpu' is not one of 'cuda', 'cpu'"),
    (["--device", "cuda"], "no CUDA device is available"),
    (["--device", "cpu", "--set", "model.d_model=1048576", "--set", "model.n_layers=1000"], "decode needs about"),
])
def test_bad_input_gets_one_clear_line(args, expected):

    if args[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = _decode(TINY, *args)
    assert res.exit_code == 2, res.output
    assert expected in res.output and "Traceback" not in res.output


def test_regression_recipes_are_refused():
    res = _decode(str(RECIPES / "price-transformer.yaml"), "--device", "cpu")
    assert res.exit_code == 2 and "decode is for task=lm" in res.output and "Traceback" not in res.output


def test_a_model_too_large_for_memory_is_refused_with_the_figure_before_allocating():
    """`decode` of a huge model on CPU was once killed by the OOM killer; now it is refused."""
    res = run_cli("decode", TINY, "--device", "cpu", "--set", "model.d_model=1000000", "--set", "model.n_heads=4",
                  "--set", "model.intermediate_size=1000000", timeout=120)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: decode needs about ") and "GiB" in line and "available on cpu" in line


def test_the_command_module_does_not_import_torch():
    """`--help` must stay fast: cli/decode.py imports torch only when the command runs."""
    code = ("import sys, types, pathlib, scaletool\n"
            "cli = types.ModuleType('scaletool.cli')\n"  # skip the group's __init__, which loads every command
            "cli.__path__ = [str(pathlib.Path(scaletool.__file__).parent / 'cli')]\n"
            "sys.modules['scaletool.cli'] = cli\n"
            "import scaletool.cli.decode\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_checkpoint_from_scaletool_train_is_decoded(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", TINY, "--out", str(out), "--no-measure", "--set", "train.steps=2",
                                    "--set", "train.checkpoint_every=2", "--set", "train.seq_len=16"])
    assert res.exit_code == 0, res.output
    ckpt = out / "checkpoints" / "step_2"
    args = [*FAST, "--context", "8", "--new-tokens", "2", "--json"]
    res = _decode(TINY, "--checkpoint", str(ckpt), *args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["checkpoint"] == str(ckpt)
    res = _decode(TINY, "--checkpoint", str(tmp_path), *args)
    assert res.exit_code == 2 and "not a scaletool checkpoint" in res.output
    # a checkpoint of another shape is one line naming the tensor and both shapes (the check
    # lives in load_model_weights, which gains it with trust_checkpoint in the train branch)
    import inspect

    from scaletool.train.checkpoint import load_model_weights

    if "trust_checkpoint" not in inspect.signature(load_model_weights).parameters:
        pytest.skip("load_model_weights has no shape check yet (it arrives with the train branch)")
    res = _decode(TINY, "--checkpoint", str(ckpt), *args, "--set", "model.d_model=32")
    assert res.exit_code == 2, res.output
    (line,) = res.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: ") and "has shape [256, 64] in the checkpoint but [256, 32]" in line
    assert "Traceback" not in res.output


def test_piped_progress_is_plain_lines_on_stderr_and_stdout_stays_one_json_document():
    """stderr is a pipe here: no bar, no carriage returns or escapes; a line for building the model, one per
    point, and the end; stdout holds the JSON document alone."""
    res = run_cli("decode", TINY, "--device", "cpu", "--context", "8,16", "--batch", "1", "--new-tokens", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["kind"] == "decode"
    assert "\r" not in res.stderr and "\x1b" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("decode: building the model on cpu (") and "parameters" in lines[0]
    assert lines[1:] == ["[1/2] decode mla: batch 1 × context 8", "[2/2] decode mla: batch 1 × context 16",
                         "decode mla: 2 points done"]


def test_progress_hears_of_every_part_of_a_point_with_the_time_left(capsys):
    """With no interval, the plain form prints every detail: the cache allocation, each prefill run and each
    decode step (a CPU run), with the time elapsed and, past the first, the time left; done only grows."""
    from scaletool import api
    from scaletool.cli.feedback import PlainLines

    seen = []
    plain = PlainLines(interval_s=0)

    def progress(done, total, description, detail=None):
        seen.append((done, total))
        plain(done, total, description, detail)

    api.decode(TINY, device="cpu", contexts=[8], batch=[1, 2], new_tokens=2, warmup_steps=1, prefill_repeats=2,
               progress=progress)
    err = capsys.readouterr().err
    assert seen[0] == (0, None) and seen[-1] == (2, 2)
    dones = [d for d, _ in seen[1:]]
    assert dones == sorted(dones) and any(0 < d < 1 for d in dones)
    for part in ("allocating the KV cache", "prefill 1/3 (warm-up)", "prefill 3/3", "decode steps (3, 1 of them warm-up)",
                 "decode step 3/3"):
        assert f"[2/2] decode mla: batch 2 × context 8: {part}" in err, part
    assert "s elapsed, about " in err and " s left)" in err


def test_compile_is_recorded_with_each_point_and_every_point_names_its_bound():
    res = _decode(TINY, *FAST, "--context", "16", "--new-tokens", "3", "--compile", "--compile-tuning", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["settings"]["compile"] is True and out["compiled"] is True and out["settings"]["compile_tuning"] is True
    (p,) = out["points"]
    assert p["compiled"] is True and p["compile_graph_breaks"] == 0 and p["compile_s"] > 0 and p["compile_tuning"] is True
    assert p["spin_up_replays"] == 0  # CUDA only: a CPU's clock needs no spin-up
    assert "first replayed untimed for 0.5 s" in out["timing"]["rule"]
    assert out["device"]["copy_bandwidth_bytes_per_s"] > 0
    assert out["device"]["versions"]["torch"] == torch.__version__  # what ran, with the result
    assert out["device"]["versions"]["cuda"] == torch.version.cuda
    # on a CPU only the memory floor is known: the bound is memory, its fraction the bytes over the median step
    assert p["decode_bound"] == "memory" and p["decode_floor_launch_s"] is None
    assert p["decode_hbm_fraction_of_copy"] == pytest.approx(
        p["decode_bytes_per_step"] / p["decode_step_s"]["median"] / out["device"]["copy_bandwidth_bytes_per_s"])
    plain = json.loads(_decode(TINY, *FAST, "--context", "16", "--new-tokens", "3", "--json").stdout)
    assert plain["settings"]["compile"] is False and plain["points"][0]["compiled"] is False
    assert plain["settings"]["compile_tuning"] is False and plain["points"][0]["compile_tuning"] is None


def test_a_split_batch_is_recorded_and_decodes_as_the_whole_one():
    args = [TINY, *FAST, "--context", "8", "--batch", "3", "--new-tokens", "3", "--json"]
    whole = json.loads(_decode(*args).stdout)
    split = _decode(*args, "--split-batch", "2")
    assert split.exit_code == 0, split.output
    out = json.loads(split.stdout)
    assert out["settings"]["split"] == 2 and out["points"][0]["split_streams"] == 2
    assert whole["points"][0]["split_streams"] == 1 and out["points"][0]["cuda_graph"] is False


def test_projections_are_joined_unless_asked_not_to_and_the_result_says_how_many():
    args = [TINY, *FAST, "--context", "8", "--new-tokens", "2"]
    joined = _decode(*args)
    assert joined.exit_code == 0, joined.output
    assert "groups reading one input joined into one GEMM each" in joined.output
    counts = []
    for flag in ("--join-projections", "--no-join-projections"):
        res = _decode(*args, flag, "--json")
        assert res.exit_code == 0, res.output
        counts.append(json.loads(res.stdout)["settings"]["join_projections"])
    layers = load_recipe(RECIPES / "tiny.yaml").model.n_layers
    assert counts == [2 * layers, 0]  # attention's and the SwiGLU's per layer


def test_pdl_is_recorded_and_said_not_to_run_without_a_hopper_gpu():
    args = [TINY, *FAST, "--context", "8", "--new-tokens", "2"]
    res = _decode(*args, "--pdl", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["settings"]["pdl"] is True and out["points"][0]["pdl"] is False
    text = _decode(*args, "--pdl")
    assert text.exit_code == 0 and "--pdl asked for, not run" in text.output
    assert "dependent launch" not in _decode(*args).output


def test_pdl_defaults_to_the_gpu_having_it_and_the_gemv_to_pdl_under_compile(monkeypatch):
    from scaletool import api
    from scaletool.kernels import pdl

    kw = dict(device="cpu", contexts=[8], new_tokens=2, warmup_steps=1, prefill_repeats=1)
    assert api.decode(TINY, **kw).settings["pdl"] is False  # a CPU has no PDL
    monkeypatch.setattr(pdl, "supported", lambda device: True)  # as on a Hopper GPU
    res = api.decode(TINY, **kw)
    assert res.settings["pdl"] is True and res.settings["gemv"] is False  # no compile: ATen's kernels around it
    assert api.decode(TINY, **kw, pdl=False).settings["pdl"] is False
    assert api.decode(TINY, **kw, gemv=True).settings["gemv"] is True
