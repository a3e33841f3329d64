"""Imports every result module so that each registers its kinds (see :func:`scaletool.results.registered`)."""
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
