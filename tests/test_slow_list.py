"""The tests marked slow by measurement (tests/conftest.py's MEASURED_SLOW) exist: a renamed or removed test
leaves no stale entry behind, and a moved one is not silently back in the quick subset."""
from __future__ import annotations

import re

from conftest import MEASURED_SLOW, ROOT


def test_every_measured_slow_test_exists():
    missing = []
    for entry in sorted(MEASURED_SLOW):
        path, _, name = entry.partition("::")
        file = ROOT / path
        if not file.is_file() or not re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M):
            missing.append(entry)
    assert not missing, missing
