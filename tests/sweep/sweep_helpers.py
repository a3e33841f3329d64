"""Helpers for the sweep tests: finding processes by an environment marker, writing sweep files."""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import yaml
from conftest import RECIPES

from scaletool.sweep.store import RESULTS_FILE

MARK = "SCALETOOL_TEST_MARK"
# tiny.yaml as MHA, so points name only what they change (MLA head dims then take their defaults)
AS_MHA = {"model.attention": "mha", "model.kv_lora_rank": 0, "model.qk_nope_head_dim": None,
          "model.qk_rope_head_dim": None, "model.v_head_dim": None}


def new_mark() -> str:
    return uuid.uuid4().hex


def marked(mark: str) -> list[int]:
    """Live (not zombie) processes whose environment carries ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
            state = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != b"Z":
            out.append(int(name))
    return out


def wait_for(cond, timeout: float = 180.0, step: float = 0.05):
    """Poll ``cond()`` until it is truthy; its value, or None at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step)
    return None


def write_sweep(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump({"recipe": str(RECIPES / "tiny.yaml"), **spec}, sort_keys=False))
    return path


def lines(results: Path) -> list[dict]:
    return [json.loads(line) for line in (results / RESULTS_FILE).read_text().splitlines()]
