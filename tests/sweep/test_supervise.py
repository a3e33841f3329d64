"""The run supervisor with real process trees: nothing a command starts outlives it, whatever the command
does (leave its session, exit early, ignore SIGTERM) and however the sweep ends (its pipe closes)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from sweep_helpers import MARK, marked, new_mark, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="subreapers and /proc are Linux")]

# A command whose grandchild leaves the session (as torchrun's ranks do) and ignores SIGTERM and SIGHUP.
DAEMON = "setsid sh -c 'trap \"\" TERM HUP; sleep 600' & "


def supervise(script: str, mark: str, grace: float = 2.0) -> tuple[subprocess.Popen, int]:
    """Start ``sh -c script`` under a supervisor; return it and the write end of its pipe."""
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "scaletool.sweep.supervise", "--watch", str(r), "--grace",
                             str(grace), "--", "sh", "-c", script], pass_fds=(r,), env={**os.environ, MARK: mark},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(r)
    return proc, w


def test_stragglers_in_other_sessions_die_when_the_command_exits():
    mark = new_mark()
    proc, w = supervise(DAEMON + "echo started; sleep 0.3; exit 3", mark)
    try:
        assert proc.wait(timeout=300) == 3  # the command's own status
    finally:
        os.close(w)
    assert marked(mark) == []


def test_closing_the_pipe_kills_the_whole_tree_at_once():
    """What a sweep killed with SIGKILL does: its end of the pipe closes, the supervisor reads EOF."""
    mark = new_mark()
    proc, w = supervise(DAEMON + "sleep 600", mark)
    assert wait_for(lambda: len(marked(mark)) >= 4, timeout=300)  # supervisor, sh, setsid'd sh, sleeps
    os.close(w)
    proc.wait(timeout=300)
    assert marked(mark) == []


def test_sigterm_stops_gracefully_then_kills_what_ignores_it():
    mark = new_mark()
    # the command itself ignores TERM as well: only the SIGKILL after the grace period ends it
    proc, w = supervise("trap 'echo got TERM' TERM; " + DAEMON + "while :; do sleep 0.1; done", mark, grace=1.0)
    try:
        assert wait_for(lambda: len(marked(mark)) >= 4, timeout=300)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        os.close(w)
    assert rc == -signal.SIGKILL  # re-raised: the parent sees how the command ended
    assert b"got TERM" in proc.stdout.read()  # the group got SIGTERM first
    assert marked(mark) == []


def test_a_signal_that_ends_the_command_is_re_raised():
    mark = new_mark()
    proc, w = supervise("kill -TERM $$", mark)
    try:
        assert proc.wait(timeout=300) == -signal.SIGTERM
    finally:
        os.close(w)
    assert b"Traceback" not in proc.stderr.read()


def test_a_command_that_cannot_start_is_exit_127_with_a_line():
    r, w = os.pipe()
    res = subprocess.run([sys.executable, "-m", "scaletool.sweep.supervise", "--watch", str(r), "--",
                          "/nonexistent/binary"], pass_fds=(r,), capture_output=True, text=True, timeout=300)
    os.close(r)
    os.close(w)
    assert res.returncode == 127 and "cannot start /nonexistent/binary" in res.stderr
