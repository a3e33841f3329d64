"""Shared test helpers: paths, a recipe writer, and a subprocess runner for the real CLI."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
# model recipes only: recipes/quickstart.yaml is the quickstart's sweep file
MODEL_RECIPES = sorted(p for p in RECIPES.glob("*.yaml") if "grid:" not in p.read_text())


def pytest_collection_modifyitems(config, items):
    """A distributed test is a slow one: ``-m "not slow"`` leaves out every multi-process job."""
    for item in items:
        if item.get_closest_marker("distributed") is not None:
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
