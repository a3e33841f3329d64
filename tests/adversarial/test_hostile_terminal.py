"""Text that reaches the terminal from files and other processes: a lock holder's command line (whatever a
hostile recipe or sweep name put in it) and text from result files are printed with their control characters
escaped, so an escape sequence (clear the screen, set the title, move the cursor) is shown, not run."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from hostile import ROOT, invoke

from scaletool.fmt import printable

SEQUENCES = ["\x1b[2J\x1b[H", "\x1b]0;pwned\x07", "\x9b31m", "a\rb", "\x1b[8m hidden", "\u2028line"]


@pytest.mark.parametrize("seq", SEQUENCES)
def test_printable_escapes_every_control_character(seq):
    shown = printable(seq)
    assert shown.isprintable() and not any(c in shown for c in "\x1b\x07\x9b\r\u2028")


@pytest.mark.parametrize("seq", SEQUENCES)
def test_a_lock_holders_text_is_printed_escaped(tmp_path, seq):
    out = tmp_path / "run"
    what = f"scaletool train {seq}.yaml"
    hold = ("import sys, time; from pathlib import Path; from scaletool.sweep.lock import run_lock\n"
            "with run_lock(Path(sys.argv[1]), sys.argv[2]):\n"
            "    print('held', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out), what], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        lines, _ = invoke(["train", "tiny", "--out", str(out)])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert len(lines) == 1 and f"in use by pid {holder.pid}" in lines[0], lines
    assert lines[0].isprintable(), lines


@pytest.mark.parametrize("content", ['{"pid": Infinity, "host": "h"}', '{"pid": 1e400, "host": "h"}',
                                     '{"pid": "' + "9" * 5000 + '", "host": "h"}', "[1]", "\xff"])
def test_a_lock_file_with_garbage_names_no_holder_and_raises_nothing(tmp_path, content):
    from scaletool.sweep.lock import _holder

    path = tmp_path / ".lock"
    path.write_bytes(content.encode("utf-8", "surrogateescape") if content != "\xff" else b"\xff")
    assert _holder(path).startswith("another process")


def test_a_holder_record_with_escapes_is_escaped(tmp_path):
    from scaletool.sweep.lock import _holder

    path = tmp_path / ".lock"
    path.write_text(json.dumps({"pid": 7, "host": "h\x1b[2J", "what": "x\x1b]0;t\x07"}))
    shown = _holder(path)
    assert shown.isprintable() and "\\x1b" in shown
