"""What a stacked block returns, checked in the block's words.

A stack's block returns ``x`` (a fold) or ``(x, y)`` (a scan), with ``x``
as it was given: each layer's output is the next layer's input. The checks
here name the public call (``Stacked``, ``BlockSeq``, ``layer_stack``), the
stack's module name and, in a mixed-layer stack, the block's kind, and speak
of the block's ``x`` (``args`` for ``layer_stack``), not the loop's carry.
"""

from __future__ import annotations

import builtins
from typing import Any, Optional

import jax

from stacktools.core import _checks

PyTree = Any


def check_block_carry(x: PyTree, new_x: PyTree, stack: str = "",
                      kind: Optional[str] = None) -> None:
  """A stacked block returns ``x`` as it was given, said in the block's words
  (``args`` for ``layer_stack``, whose function returns its arguments), with
  the stack's module name and, in a mixed-layer stack, the block's kind:
  "Stacked 'h': the 'G' block changed x from ..."."""
  label = "args" if _checks.who() == "layer_stack" else "x"
  (ins, in_tree), (outs, out_tree) = (jax.tree_util.tree_flatten_with_path(t) for t in (x, new_x))
  changes = ([f"{label} from {in_tree} to {out_tree}"] if in_tree != out_tree else [
      f"{_checks.path_str(label, path)} from {sa[1]}{list(sa[0])} to {sb[1]}{list(sb[0])}"
      for (path, a), (_, b) in builtins.zip(ins, outs)
      for sa, sb in [(_checks.signature(a), _checks.signature(b))] if sa != sb])
  if changes:
    owner = f"{_checks.who()} {stack!r}: " if _checks.who() and stack else _checks.where()
    block = "the block" if kind is None else f"the {kind!r} block"
    shared = "" if kind is None else " (in a mixed-layer stack, whatever its kind)"
    raise TypeError(
        f"{owner}{block} changed {changes[0]}; each layer's output is the next "
        f"layer's input{shared}, so a block returns it with the structure, shape "
        "and dtype it was given: change the block (e.g. project back to the "
        "input's width, or cast back to its dtype).")


def split_block_output(out: Any, x: PyTree, mode: str) -> tuple[Any, Any]:
  """``(new_x, y)`` from a stacked block's output, checked against the mode.

  The mode is ``"fold"`` (the block returns ``x``) or ``"scan"`` (``(x, y)``).
  """
  owner = _checks.who()
  if mode == "fold":
    if _checks.returned_a_pair_for_a_fold(x, out):
      raise TypeError(
          f"{owner}.fold: the block returned a pair (x, y), but a fold block "
          f"returns only the new x. Use {owner}.scan to collect per-layer "
          "outputs.")
    return out, None
  if not _checks.is_pair(out):
    if owner == "layer_stack":
      raise TypeError(
          "layer_stack(with_per_layer_inputs=True): the function must return a "
          f"pair (x, z), but it returned {_checks.describe(out)}. For a function that "
          "returns only x, use with_per_layer_inputs=False.")
    raise TypeError(
        f"{owner}.scan: a scan block must return a pair (x, y), but it "
        f"returned {_checks.describe(out)}. A block that returns only x is a fold "
        f"block: use {owner}.fold.")
  return out[0], out[1]
