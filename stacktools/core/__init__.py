"""The core every other subpackage stands on: checks, context, the jaxpr walk.

Holds the trace-time checks and their wording (``_checks``), the one
mechanism for what holds while something runs (``_context``), the one walk
of a jaxpr (``_jaxpr``: FLOPs, tagged names, recorded traces) and the
package's version (``_version``).

May import: nothing of stacktools.
"""

from stacktools.core._version import __version__
