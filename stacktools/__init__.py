"""stacktools: stack a repeated block's parameters and apply it with one scan."""

from stacktools._arguments import per_kind
from stacktools._arguments import layer_index
from stacktools._arguments import per_layer
from stacktools._drop_in import layer_stack
from stacktools.depth import take_layers
from stacktools.loops import fold
from stacktools.loops import map  # pylint: disable=redefined-builtin
from stacktools.loops import scan
from stacktools.optim import over_layers
from stacktools.params import stack_params
from stacktools.params import unstack_params
from stacktools.pipeline import Pipeline
from stacktools.plan import plan_remat
from stacktools.policy import checkpoint_name
from stacktools.policy import CheckpointPolicy
from stacktools.report import remat_report
from stacktools.loop_plan import per_depth
from stacktools.seq import BlockSeq
from stacktools.sharding import stacked_partition_specs
from stacktools.stack import Stacked

# The classes of values the public factories return, importable for
# isinstance checks; they are not part of the surface a user writes.
from stacktools._arguments import PerKind
from stacktools._arguments import PerLayer
from stacktools.optim import OverLayersState
from stacktools.plan import RematPlan
from stacktools.report import RematReport
from stacktools.loop_plan import PerDepth
# The alias table by its first name; CheckpointPolicy.ALIASES is its home.
from stacktools.policy import REMAT_ALIASES

from stacktools._version import __version__

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
