"""Imports every result module so that each registers its kinds (see :func:`scaletool.results.registered`)."""
from scaletool.results import profile, train  # noqa: F401
