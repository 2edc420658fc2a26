"""Depth edits on stacked parameters: ``take_layers`` and its index helpers.

The public module of the growth helpers (``st.depth.repeat``, ``tile``,
``insert_new``), which return index lists for :func:`take_layers`. The
edits live in ``stacktools.layouts``.
"""

from stacktools.layouts._depth_edits import insert_new
from stacktools.layouts._depth_edits import repeat
from stacktools.layouts._depth_edits import take_layers
from stacktools.layouts._depth_edits import tile

__all__ = ("insert_new", "repeat", "take_layers", "tile")
