"""One layer's step: what a call gives its layers, and a stack's pattern.

Holds the arguments a call gives its layers (``_arguments``: ``per_layer``,
``per_kind``, ``layer_index``, their binding per layer and the write-back of
in-place arguments), the views an in-place argument gives a block
(``_in_place``), the pattern of kinds a stack is laid out in (``_pattern``),
what a block returns, checked in its words (``_block_output``), and the
layer step every loop runs (``_layer_step``).

May import: ``stacktools.core``.
"""

from stacktools.step._arguments import layer_index
from stacktools.step._arguments import per_kind
from stacktools.step._arguments import per_layer
from stacktools.step._arguments import PerKind
from stacktools.step._arguments import PerLayer
