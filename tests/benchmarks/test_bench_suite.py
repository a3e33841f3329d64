"""The benchmark suite: every study validates and names files that exist; the runner resumes, records the
environment beside each result, refuses what it cannot run in one line; a committed report regenerates."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from scaletool import records
from scaletool.bench.runner import RUNS_FILE, plan, run_study
from scaletool.bench.study import StudyError, load_study, study_names
from scaletool.cli import COMMANDS
from scaletool.records import read_record

STUDY_NAMES = study_names()


def bench(*args: str, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "scaletool.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def test_the_shell_scripts_became_studies():
    studies = {"single-gpu", "two-gpu", "decode", "profile-mha-vs-mla", "tp", "tp-2gpu", "tp-4gpu", "scaling-4gpu",
               "regenerate-reports"}
    assert studies <= set(STUDY_NAMES)
    assert not list((ROOT / "benchmarks").glob("*.sh"))


@pytest.mark.parametrize("name", STUDY_NAMES)
def test_every_study_validates_and_names_existing_files(name):
    study = load_study(name)
    assert study.commands and study.description
    for recipe in study.recipes:
        assert (ROOT / recipe).is_file(), recipe
    for c in study.commands:
        assert c.argv[0] in ("scaletool", "python", "torchrun")
        if c.argv[0] == "scaletool":
            assert c.argv[1] in COMMANDS, c.argv
        if c.argv[0] == "python" and c.argv[1] != "-m" and c.argv[1] != "-c":
            assert (ROOT / c.argv[1]).is_file(), c.argv  # the benchmark script it calls
        for a in c.argv:
            if a.startswith("recipes/") and "{out}" not in a:
                assert (ROOT / a).exists(), (c.name, a)
        for src, _ in c.inputs:
            assert records.exists(ROOT / src), src  # a repository file, loose or in its run folder's bundle


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


def test_a_command_naming_a_missing_script_or_command_is_refused(tmp_path):
    p = _write(tmp_path, "gpus: 0\ncommands:\n"
               "  - {name: a, argv: [python, benchmarks/scripts/no_such_script.py], stdout: a.txt}\n"
               "  - {name: b, argv: [scaletool, trian, recipes/tiny.yaml], stdout: b.txt}\n"
               "  - {name: c, argv: [bash, -c, 'rm -rf /'], stdout: c.txt}\n"
               "  - {name: d, argv: [python, -c, 'print(1)'], stdout: d.txt, shell: true}\n")
    with pytest.raises(StudyError) as e:
        load_study(str(p))
    text = "\n".join(e.value.problems)
    assert "no_such_script.py' is not a file of this repository" in text
    assert "'scaletool trian' is no scaletool command; did you mean 'train'?" in text
    assert "argv starts with one of scaletool, python, torchrun (got 'bash')" in text
    assert "unknown key 'shell'" in text


def test_list_prints_every_study():
    r = bench("--list")
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()[1:]] == STUDY_NAMES
    r = bench("tp", "--list")
    assert r.returncode == 0 and "mla-1b-global8-tp4 -> tp/mla-1b-global8-tp4.json" in r.stdout


def test_a_study_needing_more_gpus_than_present_is_one_error_line(tmp_path):
    p = _write(tmp_path, "gpus: 1024\ncommands:\n  - {name: a, argv: [python, -c, 'print(1)'], stdout: a.txt}\n")
    r = bench(str(p), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: study s needs 1024 GPU(s), but this machine shows {_gpus()}"]
    assert not (tmp_path / "out").exists()


def _gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("args, message", [
    (["no-such-study"], "error: no-such-study: no such study;"),
    (["decode", "--only", "nothing*"], "error: --only 'nothing*' matches no command of study decode"),
    (["--bogus"], "error: unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_error_line(args, message):
    r = bench(*args, "--dry-run")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(message), r.stderr


def test_the_runner_records_each_result_and_resumes(tmp_path):
    count = tmp_path / "count"
    p = _write(tmp_path, f"""gpus: 0
commands:
  - name: "echo-{{word}}"
    matrix: {{word: [one, two]}}
    argv: [python, -c, "import sys; open(sys.argv[2], 'a').write('x'); print(sys.argv[1])", "{{word}}", "{count}"]
    stdout: "words/{{word}}.txt"
  - name: fails
    argv: [python, -c, "import sys; print('partial'); sys.exit(3)"]
    stdout: fails.txt
  - name: writes
    argv: [python, -c, "import sys; open(sys.argv[1], 'w').write('done')", "{{out}}/written.txt"]
    result: written.txt
""")
    study, out = load_study(str(p)), tmp_path / "out"
    lines: list[str] = []
    assert run_study(study, out, log=lines.append, allow_dirty=True) == 1
    assert (out / "words" / "one.txt").read_text() == "one\n" and (out / "written.txt").read_text() == "done"
    assert not (out / "fails.txt").exists()  # a failed command leaves no result to be mistaken for one
    records = [json.loads(line) for line in (out / RUNS_FILE).read_text().splitlines()]
    assert [(r["command"], r["status"], r["returncode"]) for r in records] == [
        ("echo-one", "ok", 0), ("echo-two", "ok", 0), ("fails", "failed", 3), ("writes", "ok", 0)]
    env = records[0]["environment"]
    assert {"date_utc", "cards", "torch", "cuda", "python", "driver", "commit", "tree_differs_from_commit"} <= set(env)
    assert env["torch"] and records[0]["argv"][:2] == ["python", "-c"] and records[0]["result"] == "words/one.txt"
    # rerun: only the failed command runs again
    assert [s.done for s in plan(study, out)] == [True, True, False, True]
    assert run_study(study, out, log=lines.append, allow_dirty=True) == 1
    assert count.read_text() == "xx"
    assert [json.loads(line)["command"] for line in (out / RUNS_FILE).read_text().splitlines()][4:] == ["fails"]
    assert sum("skipped, its result exists" in line for line in lines) == 3


def test_a_command_past_its_timeout_is_stopped(tmp_path):
    p = _write(tmp_path, "commands:\n  - name: sleeps\n    argv: [python, -c, 'import time; time.sleep(120)']\n"
               "    stdout: never.txt\n    timeout_s: 1\n")
    out = tmp_path / "out"
    assert run_study(load_study(str(p)), out, log=lambda _: None, allow_dirty=True) == 1
    rec = json.loads((out / RUNS_FILE).read_text())
    assert rec["status"] == "timeout" and rec["wall_s"] < 100 and not (out / "never.txt").exists()


def test_the_deadline_stops_the_running_command_and_starts_no_other_and_a_rerun_resumes(tmp_path):
    p = _write(tmp_path, "commands:\n  - name: sleeps\n    argv: [python, -c, 'import time; time.sleep(120)']\n"
               "    stdout: never.txt\n  - name: after\n    argv: [python, -c, 'print(1)']\n    stdout: after.txt\n")
    out, lines = tmp_path / "out", []
    study = load_study(str(p))
    assert run_study(study, out, log=lines.append, deadline_s=1, allow_dirty=True) == 1
    rec = json.loads((out / RUNS_FILE).read_text())
    assert rec["status"] == "deadline" and not (out / "never.txt").exists() and not (out / "after.txt").exists()
    assert any("after: not started, the deadline" in line for line in lines)
    assert [s.done for s in plan(study, out)] == [False, False]
    assert run_study(study, out, only=["after"], log=lines.append, allow_dirty=True) == 0
    assert (out / "after.txt").read_text() == "1\n"


def test_a_deadline_that_is_not_a_positive_number_is_one_error_line(tmp_path):
    for bad in ("soon", "-5", "0", "nan"):
        r = bench("cpu", "--deadline", bad, "--out", str(tmp_path / "o"))
        assert r.returncode == 2 and r.stderr.count("error:") == 1, (bad, r.stderr)
        assert not (tmp_path / "o").exists()


def _body(report: Path) -> list[str]:
    """A report.md (loose or, committed, bundled) without its header (when and from which directory it was
    generated)."""
    return [line for line in read_record(report).splitlines() if not line.startswith(("Generated ", "- **"))]


def test_a_committed_report_regenerates_from_the_committed_results_on_a_cpu(tmp_path):
    name = "profile-breakdown-cpu-2026-11-26"
    r = bench("regenerate-reports", "--only", "profile-breakdown-cpu", "--out", str(tmp_path), "--allow-dirty")
    assert r.returncode == 0, r.stderr
    new = tmp_path / name
    assert (new / "report.html").is_file() and list((new / "plots").glob("*.png"))
    committed = ROOT / "benchmarks" / "results" / "profile-breakdown" / "cpu-2026-11-26"
    assert _body(new / "report.md") == _body(committed / "report.md")
    assert (new / "results.csv").read_bytes() == read_record(committed / "results.csv").encode()  # bundled, byte for byte
    assert json.loads((tmp_path / RUNS_FILE).read_text())["status"] == "ok"

