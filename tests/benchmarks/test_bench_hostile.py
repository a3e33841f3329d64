"""The benchmark runner against hostile studies and output folders, and the provenance of what it records:
a tree that differs from its commit is refused (or its diff recorded), links planted inside OUT are refused
before anything runs through them, alias bombs and huge matrices are one error line, escape sequences are
printed escaped."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_bench_suite import bench

from scaletool.bench.runner import RUNS_FILE, run_study
from scaletool.bench.study import MAX_COMMANDS, StudyError, load_study

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="the runner's provenance reads git")


def _study(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


def _marker_study(tmp_path: Path, extra: str = "", result: str = "stdout: r.txt") -> tuple[Path, Path]:
    """A study whose one command leaves a marker file when it runs (so a test can tell it never ran)."""
    marker = tmp_path / "ran"
    code = f"open('{marker}', 'w').write('x'); print('done')"
    return _study(tmp_path, f"commands:\n  - name: a\n    argv: [python, -c, \"{code}\"]\n"
                            f"    {result}\n{extra}"), marker


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    """A checkout of its own, clean at its one commit."""
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    (r / "kept.py").write_text("x = 1\n")
    _git(r, "add", "kept.py")
    _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return r


def test_a_clean_tree_is_recorded_with_its_commit(tmp_path, repo):
    study_file, marker = _marker_study(tmp_path)
    out = tmp_path / "out"
    assert run_study(load_study(str(study_file)), out, log=lambda _: None, repo=repo) == 0
    env = json.loads((out / RUNS_FILE).read_text())["environment"]
    assert env["commit"] == _git(repo, "rev-parse", "HEAD").strip() and env["tree_differs_from_commit"] is False
    assert marker.is_file() and not list(out.glob("tree-*.diff"))


def test_a_tree_that_differs_from_its_commit_is_refused_before_anything_runs(tmp_path, repo):
    (repo / "kept.py").write_text("x = 2\n")
    study_file, marker = _marker_study(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(StudyError) as e:
        run_study(load_study(str(study_file)), out, log=lambda _: None, repo=repo)
    assert "differs from its commit" in e.value.problems[0] and "--allow-dirty" in e.value.problems[0]
    assert not marker.exists() and (out / RUNS_FILE).read_text() == ""


def test_allow_dirty_records_the_difference_beside_the_runs(tmp_path, repo):
    (repo / "kept.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 3\n")  # untracked, not ignored: part of what ran
    study_file, marker = _marker_study(tmp_path)
    out = tmp_path / "out"
    assert run_study(load_study(str(study_file)), out, log=lambda _: None, repo=repo, allow_dirty=True) == 0
    env = json.loads((out / RUNS_FILE).read_text())["environment"]
    assert env["tree_differs_from_commit"] is True
    diff = (out / env["tree_diff"]).read_text()
    assert "-x = 1" in diff and "+x = 2" in diff and "+y = 3" in diff and "new.py" in diff
    # the diff applies to the commit: the tree that ran can be rebuilt from the record
    _git(repo, "stash", "-u", "-q")
    _git(repo, "apply", str(out / env["tree_diff"]))
    assert (repo / "kept.py").read_text() == "x = 2\n" and (repo / "new.py").read_text() == "y = 3\n"


@pytest.mark.parametrize("where", ["runs.jsonl", "logs", "r.md.partial", "logs/a.stderr"])
def test_a_link_planted_inside_out_is_refused_and_nothing_is_written_through_it(tmp_path, where):
    study_file, marker = _marker_study(tmp_path, result="stdout: r.md")
    out, victim = tmp_path / "o", tmp_path / "victim"
    (out / "logs").mkdir(parents=True)
    if where == "logs":
        (out / "logs").rmdir()
        victim.mkdir()
    else:
        victim.write_text("keep")
    (out / where).symlink_to(victim)
    r = bench(str(study_file), "--out", str(out), "--allow-dirty")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("error:") == 1, r.stderr
    assert "symbolic link" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()  # refused before the command ran
    assert (list(victim.iterdir()) == []) if victim.is_dir() else victim.read_text() == "keep"


@pytest.mark.parametrize("link", ["file", "folder"])
def test_an_input_is_never_copied_over_a_link_target(tmp_path, link):
    study_file, marker = _marker_study(tmp_path, extra="    inputs:\n      - {from: recipes/tiny.yaml, to: in/tiny.yaml}\n")
    out, victim = tmp_path / "o", tmp_path / "victim"
    (out / "in").mkdir(parents=True) if link == "file" else out.mkdir()
    if link == "file":
        victim.write_text("keep")
        (out / "in" / "tiny.yaml").symlink_to(victim)
    else:
        victim.mkdir()
        (out / "in").symlink_to(victim)
    r = bench(str(study_file), "--out", str(out), "--allow-dirty")
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "symbolic link" in r.stderr, r.stderr
    assert not marker.exists()
    assert (list(victim.iterdir()) == []) if link == "folder" else victim.read_text() == "keep"


def test_a_fifo_at_the_records_is_refused_not_waited_on(tmp_path):
    import os
    study_file, marker = _marker_study(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    os.mkfifo(out / RUNS_FILE)
    r = bench(str(study_file), "--out", str(out), "--allow-dirty", timeout=120)
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "not a regular file" in r.stderr, r.stderr
    assert not marker.exists()


def test_an_alias_bomb_in_the_description_is_one_error_line(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    p = _study(tmp_path, "\n".join(["x-anchors:"] + ["  " + line for line in levels])
               + "\ndescription: *a8\ncommands:\n  - {name: a, argv: [python, -c, '1'], stdout: a.txt}\n")
    t0 = time.process_time()
    for args in (["--dry-run"], ["--list"]):
        r = bench(str(p), *args, timeout=120)
        assert r.returncode == 2 and r.stdout == "" and r.stderr.count("error:") == 1, r.stderr
        assert "YAML aliases are expanded" in r.stderr
    assert time.process_time() - t0 < 60  # the parent's CPU: the refusal is not a walk of 10^9 values


def test_a_matrix_of_huge_product_is_one_error_line_without_expanding_it(tmp_path):
    values = "[" + ", ".join(str(i) for i in range(100)) + "]"
    matrix = ", ".join(f"v{i}: *v" for i in range(1, 6))
    p = tmp_path / "s.yaml"
    p.write_text(f"commands:\n  - name: 'c-{{v0}}-{{v1}}-{{v2}}-{{v3}}-{{v4}}-{{v5}}'\n"
                 f"    matrix: {{v0: &v {values}, {matrix}}}\n    argv: [python, -c, '1']\n"
                 "    stdout: 'r-{v0}-{v1}-{v2}-{v3}-{v4}-{v5}.txt'\n")
    r = bench(str(p), "--dry-run", timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == [f"error: s.yaml: its matrices expand to {100 ** 6:,} commands; a study runs at "
                                     f"most {MAX_COMMANDS:,}"]


def test_escape_sequences_in_a_description_are_printed_escaped(tmp_path):
    p = _study(tmp_path, 'description: "red \\e[31m title \\e]0;pwned\\a done"\n'
                         "commands:\n  - {name: a, argv: [python, -c, \"print('\\e[2J')\"], stdout: a.txt}\n")
    for args in (["--dry-run"], ["--list"]):
        r = bench(str(p), *args)
        assert r.returncode == 0, r.stderr
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\\x1b[31m" in r.stdout


@pytest.mark.parametrize("text, says", [
    ("gpus: '2'\ncommands: [{name: a, argv: [python], stdout: a}]\n", "gpus: input should be a valid integer"),
    ("gpus: 2000\ncommands: [{name: a, argv: [python], stdout: a}]\n", "gpus: input should be less than or equal to 1024"),
    ("commands: []\n", "commands: list should have at least 1 item"),
    ("commands: [{name: a, argv: [python], stdout: a, timeout_s: true}]\n", "command 1: timeout_s"),
    ("commands: [{name: a, argv: [python], stdout: a, env: {'A-B': x}}]\n", "command 1: env"),
    ("commands: [{name: a, argv: [python, [1]], stdout: a}]\n", "command 1: argv.1: value error, expected a string"),
    ("commands: [{name: a, argv: [python], stdout: a, cwd: /tmp}]\n", "command 1: cwd: input should be 'repo' or 'out'"),
    ("commands: [{name: a, argv: [python], stdout: a, matrix: {x: []}}]\n", "command 1: matrix.x: list should have at least"),
    ("descripton: x\ncommands: [{name: a, argv: [python], stdout: a}]\n",
     "unknown key 'descripton'; did you mean 'description'?"),
    ("commands: [{name: a, argv: [python], stdout: a, inputs: [{from: recipes/tiny.yaml}]}]\n",
     "command 1: inputs.0.to: missing"),
])
def test_a_malformed_study_is_one_error_line_per_problem(tmp_path, text, says):
    p = _study(tmp_path, text)
    with pytest.raises(StudyError) as e:
        load_study(str(p))
    assert any(says in line for line in e.value.problems), e.value.problems
    r = bench(str(p), "--dry-run")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == len(e.value.problems)
    assert all(line.startswith("error: ") for line in r.stderr.splitlines()) and "Traceback" not in r.stderr
