"""One trace of a step: the auto stacks it runs, and each one's cost model.

While a step is traced, ``remat="auto"`` is answered by a context
(``segments.plan_context``): here :class:`_Discovery`, which records each
stack (a ``_stack_info.StackInfo``) and the trace of each kind of its
layers, and runs it as the reference candidate (``"full"``). From those
layers' traces :func:`trace` builds each stack's cost model
(``_cost_model.StackModel``), so it stands above the cost model; what it
returns, ``_cost_model.Traced``, is what ``_compile.Candidates`` predicts
every plan from. In pseudo-code::

  traced = trace(step_fn, *args)          # stacks, each layer's trace, FLOPs
  traced.models[key].cost(candidate)      # predicted, no compile
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from stacktools.core import _jaxpr
from stacktools.planner import _cost_model
from stacktools.planner import _results
from stacktools.planner import _search
from stacktools.planner import _stack_info
from stacktools.remat import _policy


class _Discovery:
  """Records every auto stack and its layers' traces; traces them as ``"full"``."""

  def __init__(self):
    self.stacks: dict[str, _stack_info.StackInfo] = {}
    self.layers: dict[str, list[Any]] = {}
    self._keys = _stack_info.StackKeys()

  def remat_for(self, key, length, probe, period=1, looped=True):
    key = self._keys(key)
    if key not in self.stacks:
      with _jaxpr.recording_traces() as traces:   # one per kind of block
        tagged = sorted(probe() - set(_policy.RESERVED_NAMES))
      self.stacks[key] = _stack_info.StackInfo(key, length, tuple(tagged), period, looped)
      self.layers[key] = traces
    return _policy.REMAT_ALIASES[_search.REFERENCE]


def trace(step_fn: Callable[..., Any], *args: Any) -> _cost_model.Traced:
  """Traces ``step_fn(*args)`` once, abstractly: its auto stacks and models."""
  context = _Discovery()
  closed = jax.make_jaxpr(_results.under(context, step_fn))(*args)
  if not context.stacks:
    raise ValueError(
        "No stack in step_fn uses remat='auto', so there is nothing to plan. "
        "Build the stacks to plan with remat='auto' (st.Stacked(..., "
        "remat='auto')).")
  models = {key: _cost_model.StackModel(info.num_layers,
                                   [_cost_model.Layer(c, a) for c, a in context.layers[key]],
                                   looped=info.looped)
            for key, info in context.stacks.items()}
  return _cost_model.Traced(stacks=tuple(context.stacks.values()), models=models,
                            step_flops=_jaxpr.jaxpr_flops(closed.jaxpr), jaxpr=closed)


def discover(step_fn: Callable[..., Any], *args: Any) -> tuple[_stack_info.StackInfo, ...]:
  """The stacks built with ``remat="auto"`` that ``step_fn(*args)`` runs."""
  return trace(step_fn, *args).stacks
