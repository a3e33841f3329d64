"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``).

Why not Playwright: it would add a large driver package to the test dependencies for a handful of
protocol calls; the protocol over a pipe needs only the standard library and the system Chromium
(Debian's ``chromium`` package). Messages are JSON objects separated by NUL bytes: commands go to the
browser's fd 3, responses and events come back on its fd 4.
"""
from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """``$SCALETOOL_CHROMIUM``, else the first Chromium on PATH."""
    if os.environ.get("SCALETOOL_CHROMIUM"):
        return os.environ["SCALETOOL_CHROMIUM"]
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless browser with one page; :meth:`load` opens a file and collects its console errors."""

    def __init__(self, exe: str, width: int = 1400, height: int = 900, timeout: float = 30.0):
        self.width, self.height, self.timeout = width, height, timeout
        self.profile = tempfile.mkdtemp(prefix="scaletool-chromium-")
        self._log = tempfile.TemporaryFile()  # Chromium's own log, shown if it dies
        cmd_r, self._cmd_w = os.pipe()
        self._evt_r, evt_w = os.pipe()
        args = [exe, "--headless", "--remote-debugging-pipe", "--no-first-run", "--no-default-browser-check",
                "--disable-gpu", "--disable-extensions", "--disable-dev-shm-usage", "--mute-audio",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"]
        if os.geteuid() == 0:  # Chromium refuses to run its sandbox as root (CI containers)
            args.insert(1, "--no-sandbox")
        # The child's fds 3 (commands) and 4 (replies) are our pipe ends: copies above 10 first, so
        # that moving one onto 3 or 4 cannot overwrite the other; dup2 leaves the targets inheritable,
        # and every other descriptor of ours is close-on-exec (PEP 446), hence close_fds=False.
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_r, evt_w)]
        self.proc = subprocess.Popen(args, close_fds=False, preexec_fn=lambda: [os.dup2(fd, n) for fd, n in zip(ends, (3, 4))],
                                     stdout=subprocess.DEVNULL, stderr=self._log)
        for fd in (cmd_r, evt_w, *ends):
            os.close(fd)
        self._id = 0
        self._inbox: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            self.call(method, session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self._evt_r, 1 << 16):
            buf += chunk
            *messages, buf = buf.split(b"\0")
            for m in messages:
                self._inbox.put(json.loads(m))
        self._inbox.put(None)

    def call(self, method: str, session: bool = False, **params) -> dict:
        """Send one command and wait for its reply; events that arrive meanwhile are kept in ``events``."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._next()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _next(self) -> dict:
        try:
            msg = self._inbox.get(timeout=self.timeout)
        except queue.Empty:
            raise BrowserError(f"no reply from Chromium in {self.timeout:.0f} s") from None
        if msg is None:
            self._log.seek(0)
            raise BrowserError(f"Chromium exited: {self._log.read().decode(errors='replace')[-2000:]}")
        return msg

    def load(self, path: Path) -> None:
        """Open a file and wait for its load event."""
        self.call("Page.navigate", session=True, url=Path(path).resolve().as_uri())
        deadline = time.monotonic() + self.timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            if time.monotonic() > deadline:
                raise BrowserError(f"{path}: no load event in {self.timeout:.0f} s")
            self.events.append(self._next())

    def evaluate(self, expression: str):
        res = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise BrowserError(f"script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads the page reported so far."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif e.get("method") == "Runtime.exceptionThrown":
                out.append(str(p.get("exceptionDetails", {}).get("text")))
            elif e.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(f"{p['entry'].get('text')} ({p['entry'].get('url', '')})")
        return out

    def screenshot(self, path: Path) -> None:
        """A PNG of the whole page at the emulated width."""
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=self.width, height=height,
                  deviceScaleFactor=1, mobile=False)
        import base64

        Path(path).write_bytes(base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png")["data"]))
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=self.width, height=self.height,
                  deviceScaleFactor=1, mobile=False)

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except BrowserError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
