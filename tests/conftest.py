"""Shared test helpers: paths, a recipe writer, and a subprocess runner for the real CLI."""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
# model recipes only: recipes/quickstart.yaml is the quickstart's sweep file
MODEL_RECIPES = sorted(p for p in RECIPES.glob("*.yaml") if "grid:" not in p.read_text())



@functools.cache
def unpacked_fixture(name: str) -> Path:
    """A committed report fixture (``tests/report/fixtures/NAME``) as the report reads a results directory: its
    loose files and its packed records (``records.jsonl.xz``, committed packed as benchmark results are: the
    repository stays under 5 MB) written out, once per process, into a temporary copy removed at exit."""
    src = ROOT / "tests" / "report" / "fixtures" / name
    dst = Path(tempfile.mkdtemp(prefix=f"fixture-{name}-")) / name
    atexit.register(shutil.rmtree, dst.parent, True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("records.jsonl.xz"))
    if (src / "records.jsonl.xz").is_file():
        from scaletool import records
        records.unpack(src, dst)
    return dst

#: Tests marked slow by measurement rather than by what they start: the slowest of ``python -m pytest -m "not slow"
#: --durations`` on a 2-core machine (2026-11-27, 1-minute load 5-9: each above 3.5 s there; docs/testing.md),
#: by test function, so every parameter of one is slow. They stay in the whole suite; the quick subset leaves
#: them out. Listed here rather than marked in each file: one place to read and to re-measure.
MEASURED_SLOW = frozenset({
    "tests/adversarial/test_hostile_hangs.py::test_a_grid_past_the_limit_is_one_line_naming_the_count",
    "tests/adversarial/test_hostile_reports.py::test_a_hostile_results_directory_reports_without_a_traceback",
    "tests/benchmarks/test_bench_suite.py::test_a_committed_report_regenerates_from_the_committed_results_on_a_cpu",
    "tests/benchmarks/test_bench_suite.py::test_a_deadline_that_is_not_a_positive_number_is_one_error_line",
    "tests/benchmarks/test_bench_suite.py::test_a_study_needing_more_gpus_than_present_is_one_error_line",
    "tests/benchmarks/test_flashinfer_trim.py::test_trimmed_wheel_has_exact_record_and_installs",
    "tests/benchmarks/test_moe_bench.py::test_bad_arguments_are_one_error_line",
    "tests/benchmarks/test_moe_layer_driver.py::test_the_points_asked_for_run_with_their_accumulation",
    "tests/benchmarks/test_probe_scripts.py::test_profile_step_refuses_bad_arguments_in_one_line",
    "tests/benchmarks/test_probe_scripts.py::test_without_a_cuda_gpu_the_probe_says_so",
    "tests/cli/test_count_modules.py::test_piped_count_says_each_stage_on_stderr_and_keeps_stdout_one_json_document",
    "tests/decode/test_bench.py::test_api_decode_returns_the_typed_result_for_a_recipe_object",
    "tests/decode/test_bench.py::test_every_point_is_warmed_before_it_is_timed_so_no_point_is_cold",
    "tests/decode/test_steps.py::test_compiled_static_step_reproduces_the_eager_reference",
    "tests/decode/test_steps.py::test_compiled_step_records_its_compile_and_has_no_graph_break",
    "tests/decode/test_steps.py::test_the_compile_sees_programmatic_dependent_launch_as_asked",
    "tests/kernels/test_mla_decode.py::test_the_kernel_is_a_custom_operator_with_a_fake_implementation",
    "tests/kernels/test_mla_tuning.py::test_the_dry_run_prints_the_pruned_grid_without_a_gpu",
    "tests/predict/test_calibrate.py::test_bad_input_is_one_error_line",
    "tests/plan/test_plan.py::test_attention_variants_are_planned_too",
    "tests/plan/test_plan.py::test_verify_runs_the_best_layouts_here_and_measures_them",
    "tests/report/test_dynamics.py::test_the_report_draws_the_section",
    "tests/report/test_dynamics.py::test_without_a_divergence_the_collapse_claim_cannot_tell_but_says_what_came_before_the_spikes",
    "tests/report/test_report.py::test_hostile_strings_are_escaped_everywhere",
    "tests/report/test_report.py::test_the_claim_check_appears_only_with_the_price_transformer",
    "tests/test_docstrings.py::test_no_docstring_in_scaletool_runs_past_20_lines",
    "tests/test_threads.py::test_affinity_mask_bounds_the_share",
    "tests/train/test_float8.py::test_train_on_the_cpu_refuses_in_one_line_and_writes_nothing",
    "tests/train/test_weight_cast.py::test_a_dropless_moe_layers_experts_keep_one_copy_and_train_to_autocasts_numbers",
    "tests/train/test_weight_cast.py::test_a_resumed_run_refreshes_the_copies_from_the_checkpoint",
    "tests/train/test_weight_cast.py::test_bad_accumulation_keys_are_one_line_and_write_nothing",
    "tests/train/test_weight_cast.py::test_fp16_with_its_grad_scaler_and_checkpointed_blocks_give_the_same_numbers_too",
    "tests/train/test_weight_cast.py::test_train_refuses_in_one_line_and_writes_nothing",
    "tests/train/test_weight_cast.py::test_training_gives_autocasts_numbers_bit_for_bit",
})


def pytest_collection_modifyitems(config, items):
    """A distributed test is a slow one: ``-m "not slow"`` leaves out every multi-process job; so is every
    test of :data:`MEASURED_SLOW`."""
    for item in items:
        if item.get_closest_marker("distributed") is not None or item.nodeid.split("[")[0] in MEASURED_SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def write_recipe(tmp_path):
    """Write a recipe mapping (or raw text) to a YAML file and return its path."""
    def _write(content, name: str = "recipe.yaml") -> Path:
        p = tmp_path / name
        p.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
        return p
    return _write


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m scaletool ARGS`` as a real subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "scaletool", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or ROOT)


def assert_counted_exactly(res: dict) -> None:
    """A ``count`` result whose parameters and FLOPs (both counters; decoding too) equal the closed forms exactly."""
    f = res["flops"]
    assert res["params"]["measured"] == res["params"]["total"]
    assert f["flop_counter"]["forward"] == f["analytic"]["forward_full"]
    assert f["flop_counter"]["train"] == f["analytic"]["train_full"]
    assert f["fvcore"]["forward"] == f["analytic"]["forward_full"]
    for label, d in (f.get("decode") or {}).items():  # one decoded token per decode mode (lm)
        assert d["flop_counter"] == d["analytic"], label


@pytest.fixture
def small_fs(tmp_path, request):
    """A directory on a tiny tmpfs of its own (needs permission to mount: root), for read-only and full disks;
    512 KiB, or the size given by indirect parametrisation (``"2m"``)."""
    d = tmp_path / "fs"
    d.mkdir()
    size = getattr(request, "param", "512k")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()[:80]}): read-only and full disks untested")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def fill(fs: Path) -> Path:
    """Fill the file system under ``fs`` to its last block; the filler file (unlink it to free the space)."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: the last block is taken
            while os.write(fd, b"\0" * 4096):
                continue
    finally:
        os.close(fd)
    return filler


class FakeClock:
    """A clock that moves only when a test says so: timing code reads it instead of the wall clock, so a
    test asserts which work fell into which timed sample, never how fast the machine was."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch):
    """Every step timer (decode benchmark, training loop) reads a :class:`FakeClock`."""
    import types

    from scaletool.measure import timing
    from scaletool.train import clock as train_clock

    fake = FakeClock()
    ns = types.SimpleNamespace(perf_counter=fake.perf_counter, monotonic=fake.perf_counter, time=fake.perf_counter)
    monkeypatch.setattr(timing, "time", ns)
    monkeypatch.setattr(train_clock, "time", ns)
    return fake


@contextlib.contextmanager
def no_hang(seconds: float = 180):
    """Fail (TimeoutError) if the body runs longer than ``seconds``: a guard against a hang, sized far
    above any busy machine's time for the body, never a speed check."""
    import signal

    def _expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
