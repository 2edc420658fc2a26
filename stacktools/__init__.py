"""stacktools: stack a repeated block's parameters and apply it with one scan.

This face re-exports what a user writes (``__all__``) from the subpackages,
lowest first (each may import only those above it in this list):

* ``stacktools.core``: checks, context, the jaxpr walk;
* ``stacktools.step``: a layer's arguments and step, a stack's pattern;
* ``stacktools.remat``: checkpoint policies, a loop's segments, the engine;
* ``stacktools.layouts``: parameter layouts, depth edits, sharding, optimizers;
* ``stacktools.pipelines``: schedules, stages and the tick loops;
* ``stacktools.planner``: ``plan_remat`` and ``remat_report``;
* ``stacktools.stacks``: ``Stacked``, ``BlockSeq``, ``layer_stack``;
* ``stacktools.adapters``: low-rank adapters over a base (``st.adapters``).

``stacktools.depth`` (the growth helpers), ``stacktools.adapters`` (low-rank
adapters), ``stacktools.loops`` and ``stacktools.policy`` are public modules
too.
"""

from stacktools.layouts import over_layers
from stacktools.layouts import stack_params
from stacktools.layouts import stacked_partition_specs
from stacktools.layouts import take_layers
from stacktools.layouts import unstack_params
from stacktools.pipelines import Pipeline
from stacktools.planner import plan_remat
from stacktools.planner import remat_report
from stacktools.remat import checkpoint_name
from stacktools.remat import CheckpointPolicy
from stacktools.remat import fold
from stacktools.remat import map  # pylint: disable=redefined-builtin
from stacktools.remat import per_depth
from stacktools.remat import scan
from stacktools.stacks import BlockSeq
from stacktools.stacks import layer_stack
from stacktools.stacks import Stacked
from stacktools.step import layer_index
from stacktools.step import per_kind
from stacktools.step import per_layer

# The classes of values the public factories return, importable for
# isinstance checks; they are not part of the surface a user writes.
from stacktools.layouts import OverLayersState
from stacktools.planner import RematPlan
from stacktools.planner import RematReport
from stacktools.remat import PerDepth
from stacktools.step import PerKind
from stacktools.step import PerLayer
# The alias table by its first name; CheckpointPolicy.ALIASES is its home.
from stacktools.remat import REMAT_ALIASES

# The public modules, as attributes of the package (st.depth.repeat).
from stacktools import adapters
from stacktools import depth
from stacktools import loops
from stacktools import policy

from stacktools.core import __version__

__all__ = (
    "BlockSeq",
    "CheckpointPolicy",
    "Pipeline",
    "Stacked",
    "checkpoint_name",
    "fold",
    "layer_index",
    "layer_stack",
    "map",
    "over_layers",
    "per_depth",
    "per_kind",
    "per_layer",
    "plan_remat",
    "remat_report",
    "scan",
    "stack_params",
    "stacked_partition_specs",
    "take_layers",
    "unstack_params",
)
