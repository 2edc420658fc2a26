"""Low-rank adapters (LoRA) over a base model, stacked or not.

Holds :func:`lora`, the context that adds adapters to chosen ``hk.Linear``
layers by module-path pattern and applies them to the activations, each
layer's on the stack's Layers axis, and one of many per batch row on an
adapter axis (``_lora``); and the adapter trees: :func:`split` from the
base, :func:`join` back, :func:`stack` on an adapter axis, :func:`merge`
into a plain checkpoint of the base's structure (``_trees``). Public as
``stacktools.adapters`` (``st.adapters.lora``), beside ``st.depth``.

May import: ``stacktools.core``.
"""

from stacktools.adapters._lora import lora
from stacktools.adapters._trees import join
from stacktools.adapters._trees import merge
from stacktools.adapters._trees import split
from stacktools.adapters._trees import stack

__all__ = ("join", "lora", "merge", "split", "stack")
