"""Every scaletool process runs with expandable segments unless the user chose an allocator setting
(scaletool.allocator): the CLI sets it for itself and the processes it starts; a user's value is left alone."""
from __future__ import annotations

import os
import subprocess
import sys

from scaletool.allocator import DEFAULT, ENV, allocator_defaults


def test_the_cli_sets_expandable_segments_and_keeps_a_users_setting():
    # --version is eager in click and ends before the group's callback: a real subcommand's path is needed
    env = {k: v for k, v in os.environ.items() if k != ENV}
    code = ("import os, sys; from scaletool.cli import main\n"
            "try:\n    main(['hardware', '--json'], standalone_mode=False)\nfinally:\n"
            f"    print('ALLOC=' + os.environ.get('{ENV}', '-'))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.splitlines()[-1] == "ALLOC=" + DEFAULT
    mine = env | {ENV: "max_split_size_mb:512"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=mine, timeout=120)
    assert got.stdout.splitlines()[-1] == "ALLOC=max_split_size_mb:512"


def test_allocator_defaults_only_fills_an_unset_value():
    env: dict[str, str] = {}
    assert allocator_defaults(env) == DEFAULT and env == {ENV: DEFAULT}
    env = {ENV: ""}
    assert allocator_defaults(env) == "" and env == {ENV: ""}
