"""stacktools: stack a repeated block's parameters and apply it with one scan."""

from stacktools.policy import CheckpointPolicy
from stacktools.policy import checkpoint_name
from stacktools.scan import fold
from stacktools.scan import map  # pylint: disable=redefined-builtin
from stacktools.scan import scan

__version__ = "0.1.0"

__all__ = (
    "CheckpointPolicy",
    "checkpoint_name",
    "fold",
    "map",
    "scan",
)
