"""Imports every result module so that each registers its kinds (see :func:`scaletool.results.registered`)."""
import scaletool.results.count  # noqa: F401
import scaletool.results.estimate  # noqa: F401
