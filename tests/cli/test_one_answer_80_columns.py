"""One answer per question, readable at 80 columns: what a newcomer reads in `estimate`, `plan`, `calibrate
--validate`, `decode`, `schema`, `sweep --dry-run` and the top-level help, in-process (CliRunner)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from click.testing import CliRunner

from scaletool.cli import main

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "tests" / "hf_configs" / "llama-3.1-8b.json")


def run(*args: str, columns: int = 80) -> str:
    res = CliRunner(env={"COLUMNS": str(columns)}).invoke(main, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def too_wide(text: str, width: int = 80) -> list[str]:
    return [line for line in text.splitlines() if len(line.rstrip()) > width]


def test_estimate_at_n_gpus_gives_no_second_one_gpu_figure_for_a_one_gpu_recipe():
    out = run("estimate", LLAMA, "--seq-len", "8192", "--gpus", "8")
    assert "This recipe (single" not in out  # the 1-GPU memory beside an 8-GPU table was a second answer
    assert "This recipe's engine (single) runs one process: the rows above are for 8 GPUs" in out
    assert not too_wide(out) or all(line.startswith("note:") for line in too_wide(out))
    detail = run("estimate", LLAMA, "--seq-len", "8192", "--gpus", "8", "--detail")
    assert "This recipe (single" not in detail and "runs one process" in detail
    # a distributed recipe keeps its own line
    fsdp = run("estimate", LLAMA, "--seq-len", "8192", "--gpus", "8", "--set", "parallel.engine=fsdp")
    assert "This recipe (fsdp, 8 GPUs, checkpointing none):" in fsdp and "runs one process" not in fsdp


def test_estimate_tokens_per_s_is_at_the_checkpointing_that_fits_and_none_where_nothing_fits():
    est = json.loads(run("estimate", LLAMA, "--seq-len", "8192", "--gpus", "8", "--json"))
    rows = {row["label"]: row for row in est["prediction"]["rows"]}
    card = 80 * 2**30  # H100 SXM, well above what the estimate keeps as the allocator's reserve
    mem = {(m["label"], m["activation_checkpointing"]): m["total_bytes"] for m in est["memory"]["engines"]}
    # DDP keeps the whole model per GPU: even full checkpointing does not fit, so it has no speed to show
    assert mem[("ddp", "full")] > card and rows["ddp"]["activation_checkpointing"] is None
    assert rows["ddp"]["tokens_per_s_per_gpu"] is None and rows["ddp"]["bound"] == "does not fit"
    # FSDP2 fits only with checkpointing: its speed is the checkpointed run's (the recipe says none)
    assert mem[("fsdp", "none")] > card and rows["fsdp"]["activation_checkpointing"] in ("selective", "full")
    assert rows["fsdp"]["tokens_per_s_per_gpu"] > 0
    out = run("estimate", LLAMA, "--seq-len", "8192", "--gpus", "8")
    line = next(x for x in out.splitlines() if x.startswith("ddp "))
    assert line.split()[-1] == "fit" and "no fit" in line  # ddp ... - - no fit
    assert re.search(r"^fsdp .* (sel|full)\s*$", out, re.M)
    assert "tok/s/GPU, MFU: predicted on H100 SXM, eager, at a ckpt that fits the card" in out


def test_estimate_shows_the_pipeline_and_tensor_parallel_layouts_speed_it_predicts():
    """The layout the recipe asks for is predicted once (--json); the short view shows that figure: a pipeline's
    row in the table (its memory under its own checkpointing only), tensor parallelism's on its own lines."""
    from scaletool.cli.estimate_summary import size
    from scaletool.fmt import si

    pp = ["--gpus", "8", "--set", "parallel.engine=fsdp", "--set", "parallel.pipeline_parallel=4",
          "--set", "parallel.pipeline_microbatches=8", "--set", "train.micro_batch_size=8"]
    est = json.loads(run("estimate", "llama3-8b", *pp, "--json"))
    (row,) = est["prediction"]["rows"]
    assert row["label"] == "fsdp pp4 1f1b" and row["activation_checkpointing"] == "full"
    # the largest stage at the recipe's checkpointing (full) is the recipe's figure; without it, another row
    mem = {m["activation_checkpointing"]: m["total_bytes"] for m in est["memory"]["engines"] if m["label"] == "fsdp pp4"}
    assert mem["full"] == est["memory"]["recipe"]["total_bytes"] < mem["none"]
    line = next(x for x in run("estimate", "llama3-8b", *pp).splitlines() if x.startswith("fsdp pp4"))
    tok, unit = si(row["tokens_per_s_per_gpu"]).split()
    assert line.split() == ["fsdp", "pp4", *size(mem["none"]).split(), "bwd", *size(mem["full"]).split(), "bwd", tok, unit,
                            f"{100 * row['mfu']:.0f}%", "full"]
    tp = ["--gpus", "8", "--set", "parallel.engine=fsdp", "--set", "parallel.tensor_parallel=2"]
    (row,) = json.loads(run("estimate", "llama3-8b", *tp, "--json"))["prediction"]["rows"]
    out = run("estimate", "llama3-8b", *tp)
    assert f"  predicted {si(row['tokens_per_s_per_gpu'])} tok/s per GPU (ckpt full); " in out and not too_wide(out)
    out = run("estimate", "llama3-405b-dense", "--gpus", "8", "--set", "parallel.engine=fsdp",
              "--set", "parallel.tensor_parallel=8")
    assert "  does not fit the card at any checkpointing; " in out
    assert row["outside"] is None and "outside what the model claims" not in out


def test_a_layout_the_model_does_not_stand_behind_is_marked_where_its_speed_is_printed():
    """estimate and plan mark the predictions `calibrate --validate` keeps out of the model's error figures
    (predict.claims): TP inside pipeline stages, async TP, a host-bound step; --json names the reason's key."""
    from scaletool.predict.claims import OUTSIDE

    pp_tp = ["--gpus", "4", "--set", "parallel.engine=fsdp", "--set", "parallel.pipeline_parallel=2", "--set",
             "parallel.tensor_parallel=2", "--set", "train.micro_batch_size=4", "--set", "parallel.pipeline_microbatches=4"]
    (row,) = json.loads(run("estimate", "mla-1b", *pp_tp, "--json"))["prediction"]["rows"]
    assert row["outside"] == "pipeline_tp"
    out = run("estimate", "mla-1b", *pp_tp)
    assert re.search(r"^fsdp pp2 tp2 .* [0-9.]+ k\* ", out, re.M) and not too_wide(out)
    note = " ".join(out.split("note: * fsdp pp2 tp2 1f1b: outside what the model claims (", 1)[1].split())
    assert note.startswith(" ".join(OUTSIDE["pipeline_tp"].split()))
    detail = run("estimate", "mla-1b", *pp_tp, "--detail")  # the predicted-step table says it the same way
    assert re.search(r"^fsdp pp2 tp2 1f1b .* [0-9,]+\* ", detail, re.M) and "note: * fsdp pp2 tp2 1f1b: outside" in detail
    out = run("estimate", "mha-1b", "--gpus", "2", "--set", "parallel.engine=fsdp", "--set", "parallel.tensor_parallel=2",
              "--set", "parallel.async_tp=true", "--set", "train.compile=true")
    assert re.search(r"predicted [0-9.]+ k\* tok/s per GPU", out) and "note: * fsdp tp2: outside" in out
    rows = json.loads(run("estimate", "tiny", "--hardware", "h100-sxm", "--json"))["prediction"]["rows"]
    assert {r["outside"] for r in rows} == {"host"}  # a tiny model's step is the host's launches
    # plan: the layouts it lists say it too (its rows' key, one note per reason naming their ranks)
    plan = json.loads(run("plan", "mla-1b", "--gpus", "4", "--gpus-per-node", "4", "--top", "100", "--json"))
    marked = [r for r in plan["layouts"] if r["outside"]]
    assert marked and all(r["pipeline_parallel"] > 1 and r["tensor_parallel"] > 1 for r in marked)
    assert all(r["outside"] is None for r in plan["layouts"] if not (r["pipeline_parallel"] > 1 and r["tensor_parallel"] > 1))
    assert any(n.startswith("#") and "outside what the model claims (TP inside pipeline stages" in n for n in plan["notes"])


def test_mla_on_a_gqa_model_says_both_savings():
    out = run("estimate", LLAMA, "--set", "model.attention=mla", "--set", "model.kv_lora_rank=512", columns=200)
    (kv,) = [line for line in out.splitlines() if line.startswith("KV cache")]
    # Llama-3.1-8B: 32 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes = 131,072 B/token; MLA 512 + 64 per layer
    assert "36,864 B/token" in kv and "17.78× less than MHA" in kv
    assert f"{131072 / 36864:.2f}× less than the model's own GQA" in kv
    plain = run("estimate", LLAMA, columns=200)
    assert "model's own" not in plain  # no override: one saving, against MHA


def test_calibrate_validate_reads_at_80_columns_and_counts_as_readme_does():
    out = run("calibrate", "--validate")
    assert not too_wide(out) and "…" not in out
    head = out.splitlines()[0].split()
    assert head == ["run", "engine", "GPUs", "mode", "meas.", "pred.", "error", "bound"]
    dense = re.search(r"^dense runs the model claims: median \|error\| ([\d.]+)%, worst ([\d.]+)%, n=(\d+)$", out, re.M)
    moe = re.search(r"^dropless MoE runs the model claims: median \|error\| ([\d.]+)%, worst ([\d.]+)%, n=(\d+)$",
                    out, re.M)
    assert dense and moe
    data = json.loads(run("calibrate", "--validate", "--json"))
    assert int(dense.group(3)) + int(moe.group(3)) == data["summary"]["modelled"]["n"]
    # README states the same counts and figures in the same words
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"On {dense.group(3)} committed dense bf16 GPU runs the prediction is within {dense.group(1)}% (median) "
            f"and {dense.group(2)}% (worst") in readme
    assert f"on {moe.group(3)} dropless MoE runs {moe.group(1)}% and {moe.group(2)}%" in readme
    # plan's note on layouts it does not order reads the same median
    from scaletool.analytic.step import MEDIAN_ABS_ERROR
    assert f"{100 * MEDIAN_ABS_ERROR:.1f}" == dense.group(1)


def test_plan_assumption_lines_fold_at_the_terminal_and_commands_stay_whole():
    out = run("plan", "tiny", "--gpus", "2")
    start = out.splitlines().index("Assumptions:")
    prose = out.splitlines()[start:]
    assert prose[1].startswith("  - ") and not too_wide("\n".join(prose))
    commands = [line for line in out.splitlines() if re.match(r"^ ?\d+\. scaletool launch", line)]
    assert commands  # a command is pasted: never folded, whatever its length


def test_schema_has_no_sphinx_markup_in_any_description():
    kinds = [r["kind"] for r in json.loads(run("schema", "--json"))["kinds"]]
    for kind in kinds:
        text = run("schema", kind)
        descriptions = re.findall(r'"description": "((?:[^"\\]|\\.)*)"', text)
        assert descriptions, kind
        assert not any(m in d for d in descriptions for m in (":class:", ":func:", ":mod:", "``")), kind


def test_top_level_help_shows_plan():
    out = run("--help")
    assert re.search(r"^\s+scaletool plan \S+ --gpus \d+", out, re.M) and not too_wide(out)


def test_sweep_file_takes_a_shipped_recipe_by_name_and_the_dry_run_lists_each_point_once(tmp_path):
    sweep = tmp_path / "mine.yaml"
    sweep.write_text(yaml.safe_dump({"recipe": "tiny", "grid": {"model.intermediate_size": [128, 256]},
                                     "modes": ["estimate", "train"], "repeats": 3}))
    out = run("sweep", str(sweep), "--dry-run", "--out", str(tmp_path / "res"), columns=120)
    rows = [line for line in out.splitlines() if "intermediate_size=" in line]
    trains = [line for line in rows if "train" in line]
    assert len(trains) == 2 and all("train ×3" in line and "3/3" in line for line in trains)
    plan = json.loads(run("sweep", str(sweep), "--dry-run", "--out", str(tmp_path / "res"), "--json"))
    assert plan["base_recipe"].endswith("tiny.yaml") if "base_recipe" in plan else True
    assert sum(r["mode"] == "train" for r in plan["runs"]) == 6  # the three repeats of two points still run


def test_a_sweep_recipe_that_is_neither_a_file_nor_a_shipped_name_is_one_line(tmp_path):
    sweep = tmp_path / "mine.yaml"
    sweep.write_text(yaml.safe_dump({"recipe": "tinyy", "modes": ["estimate"]}))
    res = CliRunner().invoke(main, ["sweep", str(sweep), "--dry-run"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "did you mean 'tiny'?" in lines[0]
    assert "no such file next to the sweep file" in lines[0]


def test_prediction_docs_state_the_h200_calibration_that_ships():
    cal = yaml.safe_load((ROOT / "profiles" / "calibrations" / "h200.yaml").read_text())
    g = cal["gemm_tflops"]
    row = next(line for line in (ROOT / "docs" / "prediction.md").read_text().splitlines() if line.startswith("| GEMM |"))
    h200 = row.split("|")[3]
    assert f"{g['max_tflops']:g} TFLOP/s × s/(s+{g['half_dim']:g})" in h200 and "H100" not in h200.split(":")[0]


def _decode_result(contended: list[bool], context: int = 64):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "report"))
    import report_synth as synth

    from scaletool.results.decode import DecodeResult

    points = []
    for i, flag in enumerate(contended):
        p = synth.decode_point("mla", context, synth.steps(0.01 * (i + 1), 12), synth.steps(0.05, 5), batch=i + 1)
        p["contention"] = {"contended": flag, "contended_steps": 9 if flag else 0, "sampled_steps": 12}
        p["rope_extended_to"] = context + 8  # the decoded tokens run past max_seq_len = context
        p.update(decode_ms_per_token=10.0 / (i + 1), decode_bandwidth_bytes_per_s=1e9)
        points.append(p)
    return DecodeResult.model_validate({**synth.decode_result(points), "weights_bytes": 2**20, "dtype": "fp32",
                                        "timing": {"clock": "perf_counter", "rule": "3 steps"},
                                        "kv_cache": {"bytes_per_token": 1024, "compression_ratio": 4.0}})


def test_decode_marks_a_contended_figure_and_keeps_headers_whole_at_80_columns():
    from rich.console import Console

    from scaletool.cli.decode import print_decode
    from scaletool.fmt import CONTENDED_MARK

    con = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 - closed with the console
    print_decode(_decode_result([False, True]), con, max_seq_len=64)
    text = con.export_text()
    rows = [line for line in text.splitlines() if line.strip().startswith("64 ")][:2]  # the speed table's
    assert len(rows) == 2 and CONTENDED_MARK not in rows[0] and rows[1].count(CONTENDED_MARK) == 2
    assert f"{CONTENDED_MARK} contended: 1 of 2 point(s) timed while another process held a CPU" in " ".join(text.split())
    assert "prefill" in text and "prefil\n" not in text and "decode" in text  # no heading word split
    assert "RoPE tables extended" not in text  # only the decoded tokens ran past max_seq_len: the default
    con = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    print_decode(_decode_result([False]), con, max_seq_len=32)  # the prompt itself is past it: said
    assert "RoPE tables extended to 72 positions: a prompt past model.max_seq_len" in con.export_text()
    assert CONTENDED_MARK not in con.export_text()


def test_a_contended_step_line_marks_its_rate():
    from scaletool.fmt import CONTENDED_MARK
    from scaletool.train.metrics import console_line

    busy = console_line(7, {"loss/train": 5.0, "throughput/tokens_per_s": 1234.0, "contention/contended": 1.0})
    quiet = console_line(7, {"loss/train": 5.0, "throughput/tokens_per_s": 1234.0, "contention/contended": 0.0})
    assert f"tok/s 1,234 {CONTENDED_MARK}" in busy and CONTENDED_MARK not in quiet
