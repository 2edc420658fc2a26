"""What each remat candidate costs, predicted from one trace of the step.

A stack's candidates differ in what its loop keeps for the backward pass and
what it recomputes, and the repeated structure makes both per-layer
quantities times counts. The planner's discovery trace already traces each
stack's step once (to find the names its block tags); this module takes that
trace and, for every per-layer policy a candidate uses, traces the forward
and backward pass of *one layer* under the policy (no compile) to read:

* the bytes the loop keeps per layer: the residuals the backward pass reads
  from the forward pass, less the layer's slice of the stacked inputs (read
  from them at no cost) and values that depend on neither carry nor slice
  (loop invariants); offloaded residuals are counted apart;
* the FLOPs of the layer's forward and backward pass, recomputation included,
  and of its forward pass alone (a nested chunk runs it once more).

A candidate is then a sum over its segments (``per_depth``) of counts times
these, plus what the loop's shape adds: a nested segment keeps one carry per
outer chunk and, while one chunk is differentiated, that chunk's residuals,
its slice of the inputs and their gradient; a per-depth seam copies the
sliced inputs, and the gradient of a slice is padded to the whole stack one
leaf at a time. What the step holds besides (the loss, the optimiser, one
layer's working set) is the same for every candidate: the planner learns it
from one compiled candidate (see ``_remat_report.py``; ``_compile.Candidates``
calibrates every prediction by it).

In pseudo-code::

  per policy p:   kept[p], host[p], flops[p] = trace(vjp(layer under p))
  per candidate:  temp = rest + max over segments s (kept before s + peak(s))
                  flops = flops_of_step_traced + sum(n_s * flops[p_s]) - L * flops[full]

:class:`Traced` is the model of a whole step: its stacks' models and its
FLOPs, as ``_trace.trace`` builds them from its one trace; :func:`predict`
prices every plan with those two (``traced.models``, ``traced.step_flops``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Union

import jax
import numpy as np
from jax.extend import core as jex_core

from stacktools.core import _jaxpr
from stacktools.planner import _stack_info
from stacktools.remat import _nested_split
from stacktools.remat import _policy
from stacktools.remat import _segments


def _aval_bytes(aval: Any) -> int:
  return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _cpu_widens_16_bit_floats() -> bool:
  """Whether the compiled program keeps 16-bit float residuals as float32:
  measured on XLA's CPU backend of jaxlib 0.10 (it computes them in float32),
  not of jaxlib 0.12 (it keeps bfloat16), nor on a TPU."""
  return jax.default_backend() == "cpu" and jax.__version_info__ < (0, 12)


def _kept_bytes(aval: Any, widened: bool) -> int:
  """What the compiled program keeps of a residual: its bytes, or, where
  ``widened``, a 16-bit float's as float32's. XLA's CPU backend computes
  bfloat16 and float16 in float32 and keeps the float32 values (a mixed
  precision GPT's residuals compiled to 1.5-2x their bfloat16 bytes there)."""
  if widened and np.dtype(aval.dtype).itemsize == 2 and jax.numpy.issubdtype(
      aval.dtype, jax.numpy.floating):
    return math.prod(aval.shape) * 4
  return _aval_bytes(aval)


def _is_var(v: Any) -> bool:
  return not isinstance(v, jex_core.Literal)


def _struct(leaf: Any) -> jax.ShapeDtypeStruct:
  aval = jax.typeof(leaf)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One layer under one per-layer policy.

  Attributes:
    kept: device bytes the loop keeps per layer for the backward pass.
    host: bytes it keeps per layer in host memory (offloaded).
    flops: FLOPs of the forward and backward pass, recomputation included.
    forward_flops: FLOPs of the forward pass alone.
  """

  kept: int
  host: int
  flops: int
  forward_flops: int


class Layer:
  """One kind of layer of a stack: its traced step, costed under any policy.

  Built from the closed jaxpr of ``step(carry, x)`` that discovery traced;
  its constants become inputs, so the step is traced again under each policy
  from shapes alone.
  """

  def __init__(self, closed: Any, args: tuple[Any, Any]):
    jaxpr = closed.jaxpr
    self._jaxpr = jaxpr.replace(constvars=[], invars=list(jaxpr.constvars) + list(jaxpr.invars))
    self._consts = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.constvars]
    carry, x = args
    self.carry = jax.tree_util.tree_map(_struct, carry)
    self.x = jax.tree_util.tree_map(_struct, x)
    # The outputs a cotangent flows back through (not integer ones).
    self._float_outs = [i for i, v in enumerate(jaxpr.outvars)
                        if jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact)]
    self.outs = [jax.ShapeDtypeStruct(jaxpr.outvars[i].aval.shape,
                                      jaxpr.outvars[i].aval.dtype) for i in self._float_outs]
    self.forward_flops = _jaxpr.jaxpr_flops(jaxpr)
    x_leaves = [_aval_bytes(a) for a in jax.tree_util.tree_leaves(self.x)]
    self.carry_bytes = sum(_aval_bytes(a) for a in jax.tree_util.tree_leaves(self.carry))
    self.input_bytes = sum(x_leaves)
    self.largest_input_leaf = max(x_leaves, default=0)
    self._memo: dict[_policy.CheckpointPolicy, LayerCost] = {}

  def _apply(self, consts, carry, x):
    leaves = list(consts) + jax.tree_util.tree_leaves((carry, x))
    outs = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(self._jaxpr, []))(*leaves)
    return [outs[i] for i in self._float_outs]

  def cost(self, policy: _policy.CheckpointPolicy) -> LayerCost:
    """The layer's cost as a step of a loop under ``policy``."""
    if policy not in self._memo:
      self._memo[policy] = self._cost(policy)
    return self._memo[policy]

  def _cost(self, policy: _policy.CheckpointPolicy) -> LayerCost:
    def forward_backward(consts, carry, x, cotangents):
      step = policy.checkpoint_step(lambda c, x: self._apply(consts, c, x), looped=True)
      _, vjp = jax.vjp(step, carry, x)
      return vjp(cotangents)

    jaxpr = jax.make_jaxpr(forward_backward)(self._consts, self.carry, self.x,
                                             self.outs).jaxpr
    n_consts = len(self._consts)
    n_carry = len(jax.tree_util.tree_leaves(self.carry))
    n_x = len(jax.tree_util.tree_leaves(self.x))
    invars = jaxpr.invars
    carry_vars = set(invars[n_consts:n_consts + n_carry])
    varying = carry_vars | set(invars[n_consts + n_carry:n_consts + n_carry + n_x])
    backward = set(invars[n_consts + n_carry + n_x:])   # the cotangents
    defined_backward: set[Any] = set()
    residuals: set[Any] = set()
    for eqn in jaxpr.eqns:
      ins = [v for v in eqn.invars if _is_var(v)]
      if any(v in backward for v in ins):
        residuals.update(v for v in ins if v not in backward)
        backward.update(eqn.outvars)
        defined_backward.update(eqn.outvars)
      elif any(v in varying for v in ins):
        varying.update(eqn.outvars)   # depends on the carry or the slice
    kept = host = 0
    widened = _cpu_widens_16_bit_floats()
    for v in residuals - defined_backward:
      # The slice of the inputs is read from them; a value that depends on
      # neither carry nor slice is a loop invariant, kept once.
      if v not in varying or (v in invars and v not in carry_vars):
        continue
      if str(getattr(v.aval, "memory_space", "")).endswith("Host"):
        host += _aval_bytes(v.aval)
      else:
        kept += _kept_bytes(v.aval, widened)
    return LayerCost(kept=kept, host=host, flops=_jaxpr.jaxpr_flops(jaxpr),
                     forward_flops=self.forward_flops)


@dataclasses.dataclass(frozen=True)
class StackCost:
  """A stack under one candidate.

  Attributes:
    flops: FLOPs of the stack's forward and backward passes.
    kept: device bytes held from the stack's forward pass until its backward
      pass is done with them (residuals, outer carries, copies at seams).
    peak: device bytes the stack holds at its busiest in the backward pass
      (``kept`` plus a nested chunk's transient), at least ``kept``.
    host: bytes kept in host memory.
  """

  flops: int
  kept: int
  peak: int
  host: int


class StackModel:
  """A stack's layers (one per kind of block), costed under any candidate.

  A stack of several kinds is costed as equal shares of its kinds: the
  discovery trace gives each kind's step but not its count. An unrolled
  stack (``looped=False``, ``BlockSeq``) is costed per layer as a loop's
  step (what XLA keeps of an unrolled layer is what the engine's loop step
  keeps: it fuses the elementwise values into their consumers), but a
  per-depth mix there has no seams to copy.
  """

  def __init__(self, num_layers: int, layers: Sequence[Layer], looped: bool = True):
    if not layers:
      raise ValueError("A stack model needs the trace of at least one layer.")
    self.num_layers = num_layers
    self.looped = looped
    self.layers = tuple(layers)
    self.carry_bytes = layers[0].carry_bytes
    self.input_bytes = sum(l.input_bytes for l in layers) / len(layers)
    self.largest_input_leaf = max(l.largest_input_leaf for l in layers)

  def layer_cost(self, policy: _policy.CheckpointPolicy) -> LayerCost:
    """The mean over kinds of one layer's cost under ``policy``."""
    costs = [l.cost(policy) for l in self.layers]
    mean = lambda f: sum(getattr(c, f) for c in costs) / len(costs)
    return LayerCost(kept=mean("kept"), host=mean("host"), flops=mean("flops"),
                     forward_flops=mean("forward_flops"))

  def cost(self, remat: Any) -> StackCost:
    """The stack's cost under a candidate (a policy or per-depth segments,
    normalised where the candidates are made)."""
    parts = (remat.segments if isinstance(remat, _segments.PerDepth)
             else ((self.num_layers, remat),))
    flops = kept = peak = host = 0
    if len(parts) > 1 and self.looped:
      # Each segment's slice of the stacked inputs is a copy, and the
      # gradient of a slice is padded to the whole stack one leaf at a time.
      kept = self.num_layers * (self.input_bytes + self.largest_input_leaf)
    for count, policy in parts:
      if policy.nested:
        layer = self.layer_cost(policy.inner())
        host += count * layer.host
        if policy.save_carries == "offload":
          # Chunks under jax.checkpoint (loops._Runner._nested), split as
          # segments.plan_loop splits them: each chunk copies its slice of
          # the inputs and their gradient; a remainder pads a leaf's gradient.
          outer, inner, rem = _nested_split.split_nested(
              count, policy.nested, carry_bytes=self.carry_bytes or 1,
              layer_bytes=self.input_bytes, largest_leaf_bytes=self.largest_input_leaf)
          flops += count * (layer.flops + layer.forward_flops)
          longest = max(inner, rem)
          transient = longest * (layer.kept + 2 * self.input_bytes)
          transient += (rem > 0) * count * self.largest_input_leaf
          kept += (outer + (rem > 0)) * self.carry_bytes
          peak = max(peak, kept + transient)
          continue
        # The engine's own backward pass (stacktools/remat/_nested_scan.py): carries
        # alone; each level but the innermost keeps one carry per chunk, and
        # each level runs the forward pass once more (the forward, each
        # level's recomputation, then each step's own jax.vjp).
        *sizes, rem = _nested_split.split_nested(count, policy.nested,
                                              carry_bytes=self.carry_bytes or 1)
        levels = len(sizes)
        flops += count * (layer.flops + levels * layer.forward_flops)
        kept += (sum(sizes[:-1]) + (rem > 0)) * self.carry_bytes
        transient = max(sizes[-1], rem) * self.carry_bytes + layer.kept
        peak = max(peak, kept + transient)
      else:
        layer = self.layer_cost(policy)
        flops += count * layer.flops
        kept += count * layer.kept
        host += count * layer.host
    return StackCost(flops=int(flops), kept=int(kept), peak=int(max(peak, kept)),
                     host=int(host))


@dataclasses.dataclass(frozen=True)
class Traced:
  """What one trace of the step tells the planner.

  Attributes:
    stacks: the auto stacks, in the order the step runs them.
    models: stack key -> its cost model.
    step_flops: FLOPs of the step with every stack ``"full"``.
    jaxpr: the step's closed jaxpr, so traced.
  """

  stacks: tuple[_stack_info.StackInfo, ...]
  models: Mapping[str, StackModel]
  step_flops: int
  jaxpr: Any

  def text(self) -> str:
    """The step's jaxpr as text: what a remembered plan is keyed on."""
    return str(self.jaxpr)


@dataclasses.dataclass(frozen=True)
class Prediction:
  """One candidate plan of a step, predicted.

  Attributes:
    flops: FLOPs of the whole step, recomputation included.
    saved_bytes: bytes the step keeps for its backward passes (device and
      host).
    temp_bytes: compiled temp memory, less what the step holds besides its
      stacks (the same for every plan; see :func:`predict`).
  """

  flops: int
  saved_bytes: int
  temp_bytes: int


def predict(models: Mapping[str, StackModel], plan: Mapping[str, Any], *,
            step_flops: int, host_is_device: bool) -> Prediction:
  """The cost of a step whose stacks run ``plan`` (stack key -> remat).

  Stacks run forward in the order of ``models`` and backward in reverse, so
  while one stack is differentiated, the stacks before it still hold what
  they kept.

  Args:
    models: each stack's model, in the order the step runs them.
    plan: stack key -> remat value.
    step_flops: FLOPs of the step traced with every stack ``"full"``.
    host_is_device: count offloaded bytes in temp memory (on a CPU, host
      memory is the device's).

  Returns:
    The prediction.
  """
  full = _policy.REMAT_ALIASES["full"]
  flops, held, peak, saved, host = step_flops, 0, 0, 0, 0
  for key, model in models.items():
    cost = model.cost(plan[key])
    flops += cost.flops - model.cost(full).flops
    peak = max(peak, held + cost.peak)
    held += cost.kept
    saved += cost.kept + cost.host
    host += cost.host
  return Prediction(flops=int(flops), saved_bytes=int(saved),
                    temp_bytes=int(peak + (host if host_is_device else 0)))


def single_loop(remat: Union[_policy.CheckpointPolicy, _segments.PerDepth, Any]) -> bool:
  """Whether a candidate runs each stack as one flat loop (compiles fastest)."""
  return isinstance(remat, _policy.CheckpointPolicy) and not remat.nested
