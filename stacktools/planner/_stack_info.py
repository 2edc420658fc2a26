"""What the planner knows of a stack, and a plan fixed per stack: the shared vocabulary.

A *stack* is any loop built with ``remat="auto"`` (a ``Stacked``,
``BlockSeq`` or ``layer_stack`` named by its Haiku module name, or an
``st.fold``/``st.scan`` named by the order in which it is traced):
:class:`StackInfo` is what one trace tells of it, and :class:`StackKeys`
names it as the contexts that answer ``remat="auto"`` do. :class:`Fixed` is
the context that answers with a chosen candidate per stack key: what a
``RematPlan`` enters, and what every compiled candidate is traced under.

It stands below the rest of the planner and imports none of the engine:
what planning returns (``_results.py``), the candidates (``_search.py``)
and the trace (``_trace.py``) all speak of stacks in these terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class StackInfo:
  """A stack found by tracing: its key, depth and the names its block tags.

  ``period`` is the layers in one step of its loop (a mixed-layer pattern's
  length; 1 for a stack of one block): a nested split counts steps.
  ``looped=False`` for a stack whose layers run unrolled (``BlockSeq``).
  """

  key: str
  num_layers: int
  tagged_names: tuple[str, ...]
  period: int = 1
  looped: bool = True


class StackKeys:
  """Keys for loops: their own (Haiku module names) or ``loop_<k>`` by order."""

  def __init__(self):
    self._count = 0

  def __call__(self, key: Optional[str]) -> str:
    if key is not None:
      return key
    key, self._count = f"loop_{self._count}", self._count + 1
    return key


class Fixed:
  """Answers with a fixed choice per stack key."""

  def __init__(self, choice: Mapping[str, Any]):
    self.choice = choice
    self._keys = StackKeys()

  def remat_for(self, key, length, probe, period=1, looped=True):
    del length, probe, period, looped
    key = self._keys(key)
    if key not in self.choice:
      raise ValueError(
          f"remat='auto': the plan has no choice for the stack {key!r}; it "
          f"plans {sorted(self.choice)}. Plan the same step function that you "
          "trace under the plan (stacks are named by module name; pure loops "
          "by the order in which they are traced).")
    return self.choice[key]
