"""``fold``, ``scan`` and ``map`` over layers, at their first public path.

The engine lives in :mod:`stacktools.remat`; this module keeps
``from stacktools.loops import fold`` working.
"""

from stacktools.remat._loops import fold
from stacktools.remat._loops import map  # pylint: disable=redefined-builtin
from stacktools.remat._loops import scan
