"""Remat: checkpoint policies, the loop's segments, and the engine loops.

Holds ``CheckpointPolicy`` and the ``remat=`` aliases (``_policy``), the only
caller of ``jax.checkpoint`` (``_checkpoint``), the arithmetic of a nested
split (``_nested_split``) and the nested loop's hand-written backward pass
(``_nested_scan``), a scan that unrolls without stacking its steps' values
(``_unrolled_scan``), what a ``remat=`` value becomes for one loop: its
segments in layer order (``_segments``, with ``per_depth``), and the engine
that runs them, with ``fold``, ``scan`` and ``map`` on it (``_loops``).

May import: ``stacktools.core``, ``stacktools.step``.
"""

from stacktools.remat._loops import fold
from stacktools.remat._loops import map  # pylint: disable=redefined-builtin
from stacktools.remat._loops import scan
from stacktools.remat._policy import checkpoint_name
from stacktools.remat._policy import CheckpointPolicy
from stacktools.remat._policy import REMAT_ALIASES
from stacktools.remat._policy import RematSpec
from stacktools.remat._segments import per_depth
from stacktools.remat._segments import PerDepth
