"""The stacks a model writes: ``Stacked``, ``BlockSeq`` and ``layer_stack``.

Holds ``StackModule``, the module both stacks are (``_stack_module``), the
one function that runs a stacked call, on the engine or as a pipeline whose
stages each run the engine over their chunk, with the pipelined path's
checks (``_run_stacked``), ``Stacked`` (``_stacked``), ``BlockSeq``, its
unrolled twin (``_block_seq``), and ``layer_stack``, the drop-in for
``hk.layer_stack`` (``_layer_stack``).

May import: ``stacktools.core``, ``stacktools.step``, ``stacktools.remat``,
``stacktools.pipelines``.
"""

from stacktools.stacks._block_seq import BlockSeq
from stacktools.stacks._layer_stack import layer_stack
from stacktools.stacks._stacked import Stacked
