"""``CheckpointPolicy`` and the ``remat=`` aliases, at their first public path.

The policies live in :mod:`stacktools.remat`; this module keeps
``from stacktools.policy import CheckpointPolicy`` and the names the guides
cite (``stacktools.policy.RECOMPUTED``, ``SMALL_SLICE``) working.
"""

from stacktools.remat._policy import CARRY_NAME
from stacktools.remat._policy import checkpoint_name
from stacktools.remat._policy import CheckpointPolicy
from stacktools.remat._policy import INPUT_NAME
from stacktools.remat._policy import OUTER_CARRY_NAME
from stacktools.remat._policy import RECOMPUTED
from stacktools.remat._policy import REMAT_ALIASES
from stacktools.remat._policy import RematSpec
from stacktools.remat._policy import RESERVED_NAMES
from stacktools.remat._policy import SaveOption
from stacktools.remat._policy import SMALL_SLICE
