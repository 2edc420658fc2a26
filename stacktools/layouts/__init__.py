"""Parameter layouts: stacked and unstacked, depth edits, sharding, optimizers.

Holds ``stack_params`` / ``unstack_params`` (``_stack_params``), depth edits
along the Layers axis (``_depth_edits``, checked by ``_depth_checks``; the
growth helpers are public as ``stacktools.depth``), FSDP specs that keep the
Layers axis whole (``_partition_specs``) and an optimizer run once per layer
(``_over_layers``).

May import: ``stacktools.core``, ``stacktools.step``.
"""

from stacktools.layouts._depth_edits import take_layers
from stacktools.layouts._over_layers import over_layers
from stacktools.layouts._over_layers import OverLayersState
from stacktools.layouts._partition_specs import stacked_partition_specs
from stacktools.layouts._stack_params import stack_params
from stacktools.layouts._stack_params import unstack_params
