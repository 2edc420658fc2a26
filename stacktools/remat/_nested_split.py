"""How a nested loop is split: the arithmetic of ``remat="nested"``.

Arithmetic (no JAX): :func:`split_nested` gives the chunk sizes of a
two-level (or deeper) loop, weighing the carries it keeps against the
per-layer inputs a chunk differentiates at once; :func:`three_levels` the
outer sizes of a three-level one. The loop planner, the cost model and
``CheckpointPolicy.nested_split`` all read it here.
"""

from __future__ import annotations

import math
from typing import Union

from stacktools.core import _checks

def split_nested(length: int, nested: Union[bool, int, tuple[int, ...]], *,
                 carry_bytes: float = 1.0, layer_bytes: float = 0.0,
                 largest_leaf_bytes: float = 0.0, period: int = 1) -> tuple[int, ...]:
  """How a nested loop of ``length`` steps is split.

  Example::

    assert split_nested(61, True) == (8, 7, 5)   # 8 chunks of 7 steps, then 5 steps

  With ``nested=True`` the split minimises an estimate of the bytes the
  backward pass holds at its peak:

  * the carries: one per outer chunk, plus the ``inner`` carries of the
    chunk being differentiated;
  * the chunk's slice of ``xs`` and its gradient, ``2 * inner * layer_bytes``
    (this is what makes nested worse than full when a layer's parameters are
    much larger than its carry, unless chunks are kept short);
  * with a remainder, the gradient of its slice of ``xs`` is padded to the
    full length one leaf at a time: ``length * largest_leaf_bytes``.

  With the default sizes this counts carries alone.

  Args:
    length: the number of steps.
    nested: ``True`` to choose the split, an int number of full outer
      chunks, at most ``length``, or a tuple of chunk counts per level
      (their product at most ``length``).
    carry_bytes: the size of the carry.
    layer_bytes: the size of one step's slice of ``xs``.
    largest_leaf_bytes: the size of the largest leaf of one step's slice.
    period: the layers in one step (a mixed-layer stack loops over periods
      of its pattern), for the error message.

  Returns:
    ``(outer, inner, remainder)`` with ``outer * inner + remainder == length``:
    ``outer`` chunks of ``inner`` steps, then one chunk of ``remainder``
    steps when ``remainder > 0``. For a tuple ``nested=(a, b)``,
    ``(a, b, inner, remainder)`` with ``a * b * inner + remainder == length``.

  Raises:
    ValueError: when ``nested`` is an int larger than ``length``.
  """
  if length < 1:
    raise ValueError(f"A nested loop needs length >= 1, got {length}.")
  if nested is True:
    def peak_bytes(inner):
      outer, remainder = divmod(length, inner)
      has_rem = remainder > 0
      estimate = (carry_bytes * (outer + has_rem + inner) +
                  2 * layer_bytes * max(inner, remainder) +
                  has_rem * length * largest_leaf_bytes)
      return estimate, has_rem, abs(inner - outer)
    inner = min(range(1, length + 1), key=peak_bytes)
    outer, remainder = divmod(length, inner)
    return outer, inner, remainder
  sizes = nested if isinstance(nested, tuple) else (nested,)
  if math.prod(sizes) > length:
    if period == 1:
      asked, has = "", f"the loop has only {length} steps"
    else:
      asked = " of whole periods"
      has = (f"the stack (or this per_depth segment) has {length} whole periods "
             f"of {period} layers")
    raise ValueError(
        f"{_checks.where()}CheckpointPolicy(nested={nested}) asks for "
        f"{math.prod(sizes)} {'outer ' if len(sizes) == 1 else ''}chunks{asked}, but {has}. Use nested=True to let stacktools "
        f"choose the split, or an outer size between 1 and {length}.")
  inner, remainder = divmod(length, math.prod(sizes))
  return (*sizes, inner, remainder)


def three_levels(length: int) -> Optional[tuple[int, int]]:
  """The ``nested=(outer, middle)`` that keeps the fewest carries, if it pays.

  Example::

    assert three_levels(64) == (4, 4)   # 4 + 4 + 4 carries against 8 + 8

  A third level costs one more forward pass, so it is offered (by the
  planner, see :func:`stacktools.planner._search.candidates`) only where it keeps at
  least two carries fewer than the best two-level split.

  Args:
    length: the number of steps.

  Returns:
    ``(outer, middle)`` for ``CheckpointPolicy(nested=...)``, or ``None``.
  """
  def peak(sizes):   # carries live at the backward pass's peak
    *outer, inner, remainder = split_nested(length, sizes)
    return sum(outer) + (remainder > 0) + max(inner, remainder), sizes

  two = min(peak((a,)) for a in range(1, length + 1))
  three = min(peak((a, b)) for a in range(1, length + 1)
              for b in range(1, length // a + 1))
  return three[1] if three[0] <= two[0] - 2 else None
