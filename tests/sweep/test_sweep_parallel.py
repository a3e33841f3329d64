"""Runs at once: each on its own cores with its thread share and its own GPU slice; repeats of timed modes."""
from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner
from sweep_helpers import AS_MHA, lines, write_sweep

from scaletool import threads
from scaletool.cli import main
from scaletool.sweep.pool import Launch, Pool, thread_env

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"


# What a run sees of its share, written as JSON. It marks that it started and waits (up to 300 s) for the
# run named in argv[2] to have started too: both seeing the other's mark proves they ran at the same time.
PROBE = ("import json, os, pathlib, sys, time\n"
         "pathlib.Path(sys.argv[1]).touch(); other = sys.argv[2]; deadline = time.monotonic() + 300\n"
         "while other and not os.path.exists(other) and time.monotonic() < deadline: time.sleep(0.01)\n"
         "print(json.dumps({'cpus': sorted(os.sched_getaffinity(0)), 'omp': os.environ.get('OMP_NUM_THREADS'),"
         " 'share': os.environ.get('SCALETOOL_CPU_THREADS'), 'gpus': os.environ.get('CUDA_VISIBLE_DEVICES'),"
         " 'met': bool(other) and os.path.exists(other)}))\n")


def test_the_pool_gives_parallel_runs_disjoint_cores_and_gpu_slices(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(threads.SHARE_ENV, raising=False)
    marks = [str(tmp_path / f"{i}.started") for i in range(3)]
    partner = [marks[1], marks[0], ""]
    launches = [Launch([sys.executable, "-c", PROBE, marks[i], partner[i]], tmp_path / f"{i}.out",
                       tmp_path / f"{i}.err", 600, ranks=1, gpus_needed=need) for i, need in enumerate((2, 2, 0))]
    with Pool(2, gpus=["0", "1", "2", "3"], assign_gpus=True) as pool:
        started = [pool.start(launches[0]), pool.start(launches[1])]
        assert not pool.fits(2) and not pool.fits(0)  # both slots busy
        done = []
        while len(done) < 2:
            done += pool.poll()
        assert pool.fits(0)
        pool.start(launches[2])
        while len(done) < 3:
            done += pool.poll()
    assert [r.returncode for r in done] == [0, 0, 0]
    seen = [json.loads(launch.stdout.read_text()) for launch in launches]
    assert [s["gpus"] for s in seen] == ["0,1", "2,3", ""]
    cores = threads.cpu_share()
    assert {r.threads for r in started} == {max(1, cores // 2)}
    assert seen[0]["omp"] == seen[1]["omp"] == seen[0]["share"] == str(max(1, cores // 2))
    if len(os.sched_getaffinity(0)) >= 2:  # pinned to disjoint cores
        assert set(seen[0]["cpus"]).isdisjoint(seen[1]["cpus"]) and len(seen[0]["cpus"]) == cores // 2
    assert seen[0]["met"] and seen[1]["met"]  # each saw the other started: they ran at the same time


def test_ranks_of_a_run_divide_its_share_and_an_explicit_omp_wins(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env, n = thread_env(4, 2)
    assert n == 2 and env == {threads.SHARE_ENV: "4", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    assert thread_env(1, 4)[1] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert thread_env(8, 2) == ({threads.SHARE_ENV: "8", "OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}, 3)


def test_repeats_of_a_timed_mode_are_separate_runs_and_resume_knows_them(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    sweep = write_sweep(tmp_path / "s.yaml", {"set": {**AS_MHA, "train.steps": 3, "train.measure_warmup_steps": 1},
                                             "modes": ["estimate", "train"], "repeats": 2})
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out), "--parallel", "2"])
    assert res.exit_code == 0, res.output
    recs = sorted(lines(out), key=lambda r: (r["mode"], r["repeat"]))
    assert [(r["mode"], r["repeat"], r["repeats"], r["status"]) for r in recs] == [
        ("estimate", 0, 1, "ok"), ("train", 0, 2, "ok"), ("train", 1, 2, "ok")]
    assert len({r["key"] for r in recs}) == 3 and recs[1]["run_dir"] != recs[2]["run_dir"]
    assert all(r["threads"] == max(1, threads.cpu_share() // 2) for r in recs)
    # not a terminal: one plain progress line per finished run, with counts and an ETA
    progress = [ln for ln in res.output.splitlines() if ln.startswith("[")]
    assert len(progress) == 3 and progress[-1].startswith("[3/3]") and "ETA" in progress[-1]

    # a third repeat is the only thing left to do; the first two are known as done
    sweep.write_text(sweep.read_text().replace("repeats: 2", "repeats: 3"))
    plan = json.loads(CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out), "--dry-run", "--json"]).output)
    assert [(r["mode"], r["repeat"], r["state"], r["will_run"]) for r in plan["runs"]] == [
        ("estimate", 0, "done", False), ("train", 0, "done", False), ("train", 1, "done", False),
        ("train", 2, "pending", True)]


def test_repeats_go_round_the_points_so_drift_lands_in_each_points_spread(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", {"set": AS_MHA, "grid": {"model.intermediate_size": [128, 256]},
                                             "modes": ["estimate", "train"], "repeats": 2})
    res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(tmp_path / "out"), "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    runs = json.loads(res.output)["runs"]
    assert [(r["label"].split("=")[-1], r["mode"], r["repeat"]) for r in runs] == [
        ("128", "estimate", 0), ("128", "train", 0), ("256", "estimate", 0), ("256", "train", 0),
        ("128", "train", 1), ("256", "train", 1)]


def test_bad_gpu_lists_are_one_error_line_before_anything_is_written(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", {"set": AS_MHA, "modes": ["estimate"]})
    for gpus in ("0,0", "0,a b", ",", "0;rm -rf /"):
        res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(tmp_path / "out"), "--gpus", gpus])
        assert res.exit_code == 2 and "Traceback" not in res.output
        assert [ln for ln in res.output.splitlines() if ln.startswith("error: ")] == [
            f"error: GPU list {gpus!r}: expected distinct comma-separated GPU indices or UUIDs, e.g. 0,1,2,3"]
    assert not (tmp_path / "out").exists()
