"""Importing DeepSpeed without its log lines on stdout.

DeepSpeed's logger writes to the ``sys.stdout`` it finds at its first import (its accelerator notice
comes at import), so a command's ``--json`` would no longer be the whole of stdout. Inside
:func:`quiet_deepspeed` prints go to stderr, the notice at import is dropped, and the logger's
handlers write to whatever ``sys.stderr`` is when they write.
"""
from __future__ import annotations

import contextlib
import logging
import sys


class _Stderr:
    """``sys.stderr`` as it is at each write (a test runner or a redirection may replace it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@contextlib.contextmanager
def quiet_deepspeed():
    """Import DeepSpeed (if not yet) and run the block with its log lines and prints on stderr."""
    logger, notice = logging.getLogger("DeepSpeed"), (lambda record: False)
    with contextlib.redirect_stdout(sys.stderr):
        logger.addFilter(notice)  # the accelerator it picked, at import: nothing to act on when reading files
        try:
            import deepspeed  # noqa: F401  (its logger comes with it)
        finally:
            logger.removeFilter(notice)
        for h in logging.getLogger("DeepSpeed").handlers:
            if type(h) is logging.StreamHandler and not isinstance(h.stream, _Stderr):  # its own, not a test runner's
                h.setStream(_Stderr())
        yield
