"""The committed results: one folder per run (STUDY/CARD-DATE[-LABEL]), each naming the commit it ran, its record
files packed in one xz bundle, and with a README generated from its records; nothing generated that can be
regenerated (HTML, PNG, logs); the tracked bytes under 5 MB (issue 42)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from scaletool import records
from scaletool.bench import readme

RUNS = readme.run_dirs()
RUN_NAME = re.compile(r"^(cpu|h100|h200|[0-9]+xh[0-9]+)-20[0-9]{2}-[01][0-9]-[0-3][0-9](-[a-z0-9][a-z0-9-]*)?$")


def test_there_are_committed_runs_and_no_benchmark_data_left_in_recipes():
    assert len(RUNS) > 50
    assert not (ROOT / "recipes" / "benchmarks").exists()
    assert {p.suffix for p in (ROOT / "recipes").rglob("*") if p.is_file()} <= {".yaml"}


@pytest.mark.parametrize("run", RUNS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_run_is_named_by_card_and_date_names_its_commit_and_has_its_generated_readme(run):
    assert RUN_NAME.match(run.name), run.name
    assert (run / readme.README).read_text() == readme.generate(run)  # regenerate: python -m scaletool.bench readme
    assert "**Commit:** `" in (run / readme.README).read_text()
    for p in run.rglob("*"):
        assert not re.fullmatch(r"call[0-9]+.*", p.name), p  # calls are runs, not folders inside one
        assert p.suffix not in (".html", ".png", ".log", ".stderr"), p


@pytest.mark.parametrize("run", RUNS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_run_keeps_its_records_packed_and_its_readme_links_resolve(run):
    loose = [p for p in run.rglob("*") if p.is_file() and records.is_record_name(p.name)]
    assert loose == [], f"loose record files: run python -m scaletool.bench pack {run.relative_to(ROOT)}"
    assert (run / records.BUNDLE).is_file() or not any(records.records(run)), run
    rels = [r.rel for r in records.records(run)]  # the bundle reads, whole and checked
    assert rels == sorted(rels) and all(records.path_problem(r) is None for r in rels if r != "provenance.json")
    for md in [run / readme.README, run.parent / readme.README]:
        for target in re.findall(r"\]\(([^)\s#]+)", md.read_text() if md.is_file() else ""):
            if not re.match(r"^[a-z]+:", target):
                assert (md.parent / target).exists(), f"{md.relative_to(ROOT)}: {target}: no such file"


def test_the_tracked_bytes_stay_under_5_mb():
    """Issue 42: a clone stays small. Record files are committed packed (python -m scaletool.bench pack)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in listed.stdout.decode().split("\0") if p]
    total = sum(p.lstat().st_size for p in paths if p.exists() or p.is_symlink())
    assert total < 5_000_000, f"{total:,} tracked bytes"


def test_the_study_folders_hold_runs_and_notes_only():
    for study in (ROOT / "benchmarks" / "results").iterdir():
        assert study.is_dir(), study
        assert {p.name for p in study.iterdir() if p.is_file()} <= {"README.md"}, study


def test_readme_check_names_a_stale_readme_and_refuses_a_link(tmp_path):
    run = tmp_path / "results" / "s" / "cpu-2026-01-01"
    run.mkdir(parents=True)
    (run / "runs.jsonl").write_text(json.dumps({"command": "a", "status": "ok", "wall_s": 1.5, "result": "a.json",
                                                "environment": {"commit": "abc123", "cards": [],
                                                                "tree_differs_from_commit": False}}) + "\n")
    (run / "a.json").write_text(json.dumps({"title": "\x1b[31mx"}))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "scaletool.bench", "readme", *args], capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
    assert cli(str(run), "--check").returncode == 1
    assert cli(str(run)).returncode == 0 and cli(str(run), "--check").returncode == 0
    text = (run / "README.md").read_text()
    assert "`abc123` (runner's; clean tree)" in text and "| a | ok | 1.5 |" in text
    assert "\x1b" not in text
    (run / "README.md").unlink()
    (run / "README.md").symlink_to(tmp_path / "victim")
    r = cli(str(run))
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "symbolic link" in r.stderr, r.stderr
    assert not (tmp_path / "victim").exists()
    r = cli(str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and r.stdout == ""


def test_a_train_summary_line_gives_each_gpus_share_of_the_jobs_tokens(tmp_path):
    """summary.json's timing is the whole job's tokens/s: the README's "tok/s per GPU" divides each figure by the
    world size (a 2-GPU run of 18,428 tokens/s reads 9,214)."""
    summary = {"metrics": {"throughput/tokens_per_s_per_gpu": 9214.0}, "environment": {"world_size": 2},
               "recipe": {"model": {"attention": "gqa", "d_model": 4096}, "parallel": {"engine": "fsdp"}},
               "timing": {"tokens_per_s": {"median": 18428.0, "p10": 18344.0, "p90": 18520.0, "n": 7}}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    line = readme.summarise(path, path.read_text())
    assert "fsdp × 2: 9,214 (9,172–9,260, n=7) tok/s per GPU" in line, line
