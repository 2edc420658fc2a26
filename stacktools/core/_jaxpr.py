"""The one walk of a jaxpr: the FLOPs it costs and the names it tags.

:func:`sub_jaxprs` is how every walk here steps into scans, conds,
checkpoints and jitted calls. :func:`names_tagged_in` finds the names a
function gives to ``checkpoint_name`` (what a policy may save), and records
the traces it makes for the remat planner (:func:`recording_traces`).

FLOPs of a traced function, loops counted as many times as they run.

XLA's ``compiled.cost_analysis()`` counts the body of a loop once, whatever
its trip count: a 32-layer scan reports the FLOPs of one layer, and two
consecutive loops (``per_depth``) report twice a single loop's. Comparing
remat plans needs the real total, recomputation included, so this module
counts it from the jaxpr of the function: a ``scan`` body is counted
``length`` times, and the backward pass's recomputation appears in the
jaxpr (inside ``remat`` equations) where a policy asks for it.

Counted: ``dot_general`` as ``2 * output elements * contracted size``; every
other arithmetic equation as one FLOP per output element. Pure data movement
(reshapes, slices, broadcasts, copies) counts nothing.
"""

from __future__ import annotations

import math
import contextlib
import difflib
from typing import Any

import jax

from stacktools.core import _context

# Equations that move or relabel data without arithmetic.
_DATA_MOVEMENT = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
    "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad",
    "gather", "scatter", "copy", "copy_p", "convert_element_type", "iota",
    "select_n", "rev", "device_put", "name", "optimization_barrier",
    "random_bits", "random_wrap", "random_unwrap", "random_seed",
    "threefry2x32", "stop_gradient", "squeeze", "split",
})


def _elements(var: Any) -> int:
  shape = getattr(getattr(var, "aval", None), "shape", ())
  return math.prod(shape)


def _dot_flops(eqn: Any) -> int:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs_shape = eqn.invars[0].aval.shape
  contracted = math.prod(lhs_shape[d] for d in lhs_contract)
  return 2 * _elements(eqn.outvars[0]) * contracted


def sub_jaxprs(eqn: Any) -> list[Any]:
  """The jaxprs inside an equation (a scan's body, a cond's branches, ...)."""
  found = []
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      sub = getattr(sub, "jaxpr", sub)    # a ClosedJaxpr holds a Jaxpr
      if hasattr(sub, "eqns"):
        found.append(sub)
  return found


def jaxpr_flops(jaxpr: Any) -> int:
  """FLOPs of a jaxpr, sub-jaxprs included, scans times their length."""
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    subs = sub_jaxprs(eqn)
    if subs:
      if name == "cond":     # one branch runs: count the dearest
        total += max(jaxpr_flops(s) for s in subs)
      else:                  # a while loop's trip count is unknown: once
        repeat = eqn.params.get("length", 1) if name == "scan" else 1
        total += repeat * sum(jaxpr_flops(s) for s in subs)
    elif name == "dot_general":
      total += _dot_flops(eqn)
    elif name not in _DATA_MOVEMENT:
      total += sum(_elements(v) for v in eqn.outvars)
  return total


def flops(fn: Any, *args: Any) -> int:
  """FLOPs of ``fn(*args)``, traced abstractly (``args`` may be shapes)."""
  return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


_RECORDINGS = _context.ContextStack[list[Any]]()


def recording_traces() -> contextlib.AbstractContextManager[list[Any]]:
  """Collects ``(closed_jaxpr, args)`` of every :func:`names_tagged_in` trace.

  The remat planner reads a loop's step from the trace that finds its names
  (one per kind of block), rather than tracing the step again. Only the
  innermost recording collects, so a stack inside a block is not mistaken
  for the outer stack's step.
  """
  return _RECORDINGS.push([])


def names_tagged_in(fn: Any, *args: Any) -> set[str]:
  """Every name given to ``checkpoint_name`` when ``fn(*args)`` is traced.

  Walks the jaxpr, sub-jaxprs (scans, conds, checkpoints, jits) included, so
  names tagged with ``jax.ad_checkpoint.checkpoint_name`` count too.
  """
  names: set[str] = set()
  closed = jax.make_jaxpr(fn)(*args)
  if _RECORDINGS:
    _RECORDINGS.innermost().append((closed, args))

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "name":
        names.add(eqn.params["name"])
      for sub in sub_jaxprs(eqn):
        walk(sub)

  walk(closed.jaxpr)
  return names


def check_names_tagged(wanted: Any, step: Any, carry: Any, x: Any, *,
                       reserved: Any = ()) -> None:
  """Every name a policy saves or offloads must be tagged in the block.

  A name that nothing tags (a typo, or a tag removed from the block) would
  otherwise save nothing, silently.
  """
  tagged = names_tagged_in(step, carry, x) - set(reserved)
  missing = [name for name in wanted if name not in tagged]
  if not missing:
    return
  hints = []
  for name in missing:
    close = difflib.get_close_matches(name, sorted(tagged), n=1)
    if close:
      hints.append(f" ({name!r}: did you mean {close[0]!r}?)")
  tagged_list = sorted(tagged) if tagged else "no names"
  raise ValueError(
      f"The checkpoint policy saves or offloads the block internals {missing}, "
      "but no block tags a value with "
      f"{'that name' if len(missing) == 1 else 'those names'}, so nothing would "
      f"be saved for it. The block tags {tagged_list}{''.join(hints)}. Fix the "
      "name in the policy, or tag the value in the block with "
      "st.checkpoint_name(value, name).")
