"""Imports every result module so that each registers its kinds (see :func:`scaletool.results.registered`)."""
import scaletool.results.decode  # noqa: F401
