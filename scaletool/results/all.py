"""Every result kind: importing each result module registers its kinds; :func:`load_result` reads any of them."""
from __future__ import annotations

from typing import Any

import scaletool.results.count  # noqa: F401
import scaletool.results.decode  # noqa: F401
import scaletool.results.estimate  # noqa: F401
import scaletool.results.hardware  # noqa: F401
import scaletool.results.launch  # noqa: F401
import scaletool.results.plan  # noqa: F401
import scaletool.results.profile  # noqa: F401
import scaletool.results.recipe  # noqa: F401
import scaletool.results.report  # noqa: F401
import scaletool.results.sweep  # noqa: F401
import scaletool.results.train  # noqa: F401
from scaletool.results.base import _KINDS, Result, load_among


def registered() -> dict[str, type[Result]]:
    """Every result kind, by name."""
    return dict(_KINDS)


def load_result(data: Any, source: str = "result", kind: str | None = None) -> Result:
    """A parsed JSON document as the result of any kind it names (:func:`scaletool.results.base.load_among`)."""
    return load_among(registered(), data, source, kind)
