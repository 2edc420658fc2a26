"""How a stack's layers run: the engine's loop, or a pipeline of chunks.

``Stacked`` and ``layer_stack`` (``_stacked.py``, ``_layer_stack.py``) run
a block through :func:`run_stacked`, inside their module:

1. The block is wrapped in an inner ``hk.transform_with_state``.
2. Init is ``jax.vmap(inner.init)`` over one key per layer, lifted into the
   outer transform with ``hk.transparent_lift_with_state``, so that every
   parameter and state leaf gains a leading ``num_layers`` axis.
3. Apply is the engine (``remat/_loops.py``) over ``LayerSlice`` (params,
   state, rng, per-layer arguments, layer index) with ``inner.apply`` as the
   step, running the loop plan of the stack's ``remat=``. A stack of one
   block is a pattern of one kind, period 1; a mixed-layer stack keeps one
   parameter stack per kind (``h/<kind>/...``) and the same engine loops over
   its periods.
4. The per-layer state that comes out of the scan goes back to Haiku through
   the lift's state updater, which knows the module's unique name (so two
   stacks with the same requested name keep their state apart).

At apply under a mesh whose pipe axis is larger than 1, step 3 is a
pipeline instead, whose stages each run the engine's loop over their chunk
of layers (:func:`stage_chunk`). Which pipeline loop runs, and the checks
that only the mesh can tell, are chosen here too:

* ``pipelines/_run_forward.py``, for ``gpipe`` and ``circular``: forwards
  only; an outer ``jax.grad`` differentiates the whole loop.
* ``pipelines/_run_with_loss.py``, for ``1f1b``, ``interleaved`` and
  ``zb``: the loss, and each microbatch's backward, inside the loop, after
  ``pipelines/_ends.py`` has made ``Stacked.loss``'s parts pure.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Optional, Union

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from stacktools.core import _checks
from stacktools.pipelines import _ends
from stacktools.pipelines import _pipeline
from stacktools.pipelines import _run_forward
from stacktools.pipelines import _run_with_loss
from stacktools.remat import _loops
from stacktools.remat import _policy
from stacktools.remat import _segments
from stacktools.step import _arguments
from stacktools.step import _layer_step
from stacktools.step import _pattern

PyTree = Any


class _KindParams(hk.Module):
  """The scope of one kind's parameters and state: ``<stack>/<kind>/...``."""

  def __call__(self, inner, init_keys, x, sliced, indices):
    return _layer_step.lift_layers(inner, init_keys, x, sliced, indices)


def run_stacked(inners: Mapping[str, hk.TransformedWithState], x: PyTree,
                arguments: _arguments.BlockArguments, *, pattern: _pattern.Pattern,
                mode: str, remat: Any, unroll: Union[int, bool], reverse: bool,
                pipeline: Optional[_pipeline.Pipeline] = None,
                layer_drop: Optional[np.ndarray] = None,
                ends: Optional[tuple[Any, ...]] = None) -> tuple[PyTree, PyTree]:
  """Inits (vmapped, per kind) and applies (the engine) a stack.

  Call inside the stack's module. A stack of one block is the pattern of one
  kind, period 1, whose parameters live directly under the stack's name; a
  mixed-layer stack's kinds each live under ``<stack>/<kind>/``. Layer ``i``
  gets the ``i``-th of the stack's per-layer keys at init and at apply, as in
  ``BlockSeq``.

  With ``layer_drop`` (per-layer rates), each step skips its layer at random
  (see :func:`stacktools.step._layer_step.droppable`), at apply only.

  With a ``pipeline`` and a mesh whose pipe axis is larger than 1, apply runs
  the layers as that pipeline; init (never differentiated, never split) runs
  them as a plain stack.

  With ``ends = (embed, head, inputs, targets)`` (:meth:`Stacked.loss`) the
  carry is ``embed(inputs)`` and the result ``(head(x, targets), ys)``; a
  ``1f1b``, ``interleaved`` or ``zb`` pipeline runs all three per microbatch
  in its own loop.
  """
  n = pattern.num_layers
  stages = pipeline.stages() if pipeline is not None else 1
  pipelined = stages > 1 and not hk.running_init()   # init runs the plain stack
  loop_ends = None
  if pipelined and pipeline.computes_loss:
    # The pipeline runs embed and head in its loop: the carry is only a shape
    # here, and nothing is left to finish after it.
    x, loop_ends = _ends.prepare_ends(pipeline, ends, arguments)
    ends = None
  elif ends is not None:
    embed, _, inputs, _ = ends
    x = embed(inputs)
  keys = _layer_step.draw_layer_keys(n)
  xs, updaters = _layer_step.lift_kinds(
      inners, x, arguments, pattern, keys,
      lambda kind: _layer_step.lift_layers if pattern.is_plain else _KindParams(name=kind))
  rates = _layer_step.drop_rates(layer_drop, keys)
  steps = {kind: _layer_step.droppable(
      _layer_step.checked_step(inners[kind], mode, arguments,
                               None if pattern.is_plain else kind), rates)
           for kind in pattern.names}
  plan = _segments.plan_for(
      steps, x, xs, pattern, remat, reverse=reverse, init=hk.running_init(),
      tags=lambda: _layer_step.kind_tags(pattern, inners, x, arguments))
  if pipelined:
    x, ys = _run_pipelined(steps, x, xs, updaters, plan, pipeline=pipeline,
                           stages=stages, num_layers=n, arguments=arguments,
                           unroll=unroll, ends=loop_ends)
    return _finish(x, ys, ends)
  x, results = _loops.run(steps, x, xs, pattern, plan, unroll=unroll)
  for kind in pattern.names:
    updaters[kind].update(results[kind].state)
  if mode == "fold":
    return _finish(x, None, ends)
  ys = arguments.with_writes(pattern.outputs({k: r.y for k, r in results.items()}),
                             {k: r.writes for k, r in results.items()}, pattern)
  return _finish(x, ys, ends)


def _finish(x: PyTree, ys: PyTree, ends: Optional[tuple[Any, ...]]) -> tuple[PyTree, PyTree]:
  """``(x, ys)``; with ``ends``, ``(head(x, targets), ys)`` as :meth:`Stacked.loss`
  returns it (``ys`` without a gradient, as a 1F1B pipeline gives them)."""
  if ends is None:
    return x, ys
  _, head, _, targets = ends
  return head(x, targets), None if ys is None else jax.lax.stop_gradient(ys)


# ---------------------------------------------------------------------------
# A pipelined stack: its checks, its loop, and a stage's chunk of layers.


def _run_pipelined(steps: Mapping[str, _loops.Step], x: PyTree,
                   layers: Mapping[str, _layer_step.LayerSlice], updaters: Mapping[str, Any],
                   plan: _segments.LoopPlan, *, pipeline: _pipeline.Pipeline,
                   stages: int, num_layers: int, arguments: _arguments.BlockArguments,
                   unroll: Any, ends: Optional[_ends.Ends] = None
                   ) -> tuple[PyTree, PyTree]:
  """Runs a stack's layers as ``pipeline`` over ``stages`` stages (at apply).

  The checks that need the mesh come first (the depth against the stages,
  no in-place argument, one checkpoint policy for every stage); the layers'
  new state goes back to Haiku through their updater.

  Args:
    steps: ``{kind: step}`` of the stack's one kind, ``step(carry,
      layer_slice) -> (carry, result)``.
    x: the carry, batch-major ``[B, ...]`` in every leaf.
    layers: ``{kind: LayerSlice}``, every leaf with a leading ``num_layers``
      axis.
    updaters: ``{kind: the lift's state updater}``.
    plan: the stack's loop plan; a pipeline runs one segment.
    pipeline: the configuration.
    stages: P (> 1), the size of the pipe axis.
    num_layers: the stack's depth.
    arguments: the call's arguments (an in-place one cannot be pipelined).
    unroll: the stack's unroll, for each stage's scan over its layers.
    ends: for a schedule that computes the loss inside its loop, the parts
      around the stack (``_ends.prepare_ends``).

  Returns:
    ``(x, ys)``: the carry after the last layer and the stacked ``ys``
    (``None`` for a fold); with ``ends``, ``(loss, ys)``, ``ys`` without a
    gradient.
  """
  pipeline.check(num_layers, stages)
  for arg in list(arguments.in_place.values())[:1]:
    raise ValueError(
        f"{arg.label} cannot be pipelined: each stage holds only its own "
        "layers' rows. Pass it without in_place=True, or run without a pipeline.")
  if len(plan.segments) > 1:
    raise ValueError(
        f"{_checks.where()}a pipelined stack runs every stage with one "
        f"checkpoint policy, but remat gives {len(plan.segments)} per-depth "
        "segments. Pass one policy (e.g. remat='full' or 'nested'), or run "
        "without a pipeline.")
  (kind,) = steps   # one kind: Stacked refuses pattern= with a pipeline
  chunk = functools.partial(stage_chunk, steps[kind], plan.segments[0].policy, unroll)
  if ends is not None:
    loss, ys, new_state = _run_with_loss.run_with_loss(
        chunk, layers[kind], ends, pipeline=pipeline, stages=stages)
    updaters[kind].update(new_state)
    return loss, ys
  x, ys, new_state = _run_forward.run(chunk, x, layers[kind], pipeline=pipeline,
                                      stages=stages)
  updaters[kind].update(new_state)
  return x, ys


def stage_chunk(step: _loops.Step, policy: _policy.CheckpointPolicy, unroll: Any,
                x_in: PyTree, local: _layer_step.LayerSlice, state: PyTree,
                repeat: Union[int, jax.Array], microbatch: Union[int, jax.Array]
                ) -> tuple[PyTree, Any]:
  """The K layers of chunk ``repeat`` on one microbatch, with the stack's policy.

  Bound to ``step``, ``policy`` and ``unroll`` (``functools.partial``), it is
  the chunk a pipeline's stages run: ``pipelines/_stages.py``'s ``Chunk``
  says what the other arguments are and what it returns.

  Each layer's parameters are picked from the stage's ``[R, K, ...]``
  arrays inside the layer's step, that is inside its checkpoint: the
  backward pass then keeps the stage's own parameters once (a loop
  invariant) rather than a copy of every chunk at every tick.

  Args:
    step: one layer, ``step(carry, layer_slice) -> (carry, result)``, the
      result's first two fields the layer's ``y`` and new state.
    policy: the checkpoint policy of every layer.
    unroll: the stack's unroll, for the scan over the chunk's layers.
    x_in, local, state, repeat, microbatch: as ``Chunk`` says.
  """
  def layer_step(carry, xs):
    k, layer_state = xs
    pick = lambda a: a[repeat, k]  # noqa: E731
    rng = None
    if local.rng is not None:   # a fresh key per microbatch, the same on every stage
      rng = jax.random.fold_in(pick(local.rng), microbatch)
    layer = _layer_step.LayerSlice(
        jax.tree_util.tree_map(pick, local.params), layer_state, rng,
        jax.tree_util.tree_map(pick, local.sliced), pick(local.index))
    return step(carry, layer)

  chunk_size = local.index.shape[1]
  return _loops.loop(layer_step, x_in, (jnp.arange(chunk_size), state), chunk_size,
                    policy, unroll)
