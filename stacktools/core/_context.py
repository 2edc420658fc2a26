"""What holds while something runs: a thread-local stack of values per concern.

A ``with`` block pushes a value and pops it on the way out; code further down
the call reads the innermost value (or every one) without being passed it.
Six concerns use one: the public entry point that errors name
(``_checks``), the traces the remat planner records (``_checks``), the index
of the layer being applied (``_arguments``), the names a checkpointed step
tags (``policy``), what answers ``remat="auto"`` (``loop_plan``), and the
Linear layers that ``st.adapters.lora`` is adapting (``adapters._lora``).

Example::

  SPEAKER = ContextStack[str]()
  with SPEAKER.push("Stacked"):
    SPEAKER.innermost()          # "Stacked"
  SPEAKER.innermost("")          # "" outside
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, Optional, TypeVar

T = TypeVar("T")


class ContextStack(Generic[T]):
  """Values pushed by ``with`` blocks of this thread, innermost last."""

  def __init__(self):
    self._local = threading.local()

  def values(self) -> list[T]:
    """Every value pushed and not yet popped, outermost first."""
    if not hasattr(self._local, "values"):
      self._local.values = []
    return self._local.values

  def __bool__(self) -> bool:
    return bool(self.values())

  def innermost(self, default: Optional[T] = None) -> Optional[T]:
    """The value of the innermost ``with`` block, else ``default``."""
    values = self.values()
    return values[-1] if values else default

  @contextlib.contextmanager
  def push(self, value: T) -> Iterator[T]:
    """Makes ``value`` the innermost inside the ``with`` block."""
    self.values().append(value)
    try:
      yield value
    finally:
      self.values().pop()
