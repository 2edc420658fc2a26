"""stacktools: stack a repeated block's parameters and apply it with one scan."""

from stacktools._kinds import per_kind
from stacktools._kinds import PerKind
from stacktools._layers import layer_index
from stacktools._layers import per_layer
from stacktools._layers import PerLayer
from stacktools.loops import fold
from stacktools.loops import map  # pylint: disable=redefined-builtin
from stacktools.loops import nested_split
from stacktools.loops import scan
from stacktools.params import stack_params
from stacktools.params import unstack_params
from stacktools.pipeline import Pipeline
from stacktools.pipeline import schedule as pipeline_schedule
from stacktools.plan import plan_remat
from stacktools.plan import RematPlan
from stacktools.policy import checkpoint_name
from stacktools.policy import CheckpointPolicy
from stacktools.policy import REMAT_ALIASES
from stacktools.report import remat_report
from stacktools.report import RematReport
from stacktools.segments import parse_per_depth
from stacktools.segments import per_depth
from stacktools.segments import PerDepth
from stacktools.seq import BlockSeq
from stacktools.sharding import stacked_partition_specs
from stacktools.stack import layer_stack
from stacktools.stack import Stacked

__version__ = "0.1.0"

__all__ = (
    "BlockSeq",
    "CheckpointPolicy",
    "PerDepth",
    "PerKind",
    "PerLayer",
    "Pipeline",
    "REMAT_ALIASES",
    "RematPlan",
    "RematReport",
    "Stacked",
    "checkpoint_name",
    "fold",
    "layer_index",
    "layer_stack",
    "map",
    "nested_split",
    "parse_per_depth",
    "per_depth",
    "per_kind",
    "per_layer",
    "pipeline_schedule",
    "plan_remat",
    "remat_report",
    "scan",
    "stack_params",
    "stacked_partition_specs",
    "unstack_params",
)
