"""stacktools: stack a repeated block's parameters and apply it with one scan."""

from stacktools.params import stack_params
from stacktools.params import unstack_params
from stacktools.policy import CheckpointPolicy
from stacktools.policy import checkpoint_name
from stacktools.scan import fold
from stacktools.scan import map  # pylint: disable=redefined-builtin
from stacktools.scan import scan
from stacktools.seq import BlockSeq
from stacktools.sharding import stacked_partition_specs
from stacktools.stack import layer_index
from stacktools.stack import layer_stack
from stacktools.stack import per_layer
from stacktools.stack import PerLayer
from stacktools.stack import Stacked

__version__ = "0.1.0"

__all__ = (
    "BlockSeq",
    "CheckpointPolicy",
    "PerLayer",
    "Stacked",
    "checkpoint_name",
    "fold",
    "layer_index",
    "layer_stack",
    "map",
    "per_layer",
    "scan",
    "stack_params",
    "stacked_partition_specs",
    "unstack_params",
)
