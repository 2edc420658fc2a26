"""FLOPs of a traced function, loops counted as many times as they run.

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
from typing import Any

import jax

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


def _sub_jaxprs(eqn: Any) -> list[Any]:
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
    subs = _sub_jaxprs(eqn)
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
