"""Runs a stack as a pipeline: its checks, and the GPipe/circular tick loop.

:func:`run_stack` is what ``Stacked`` calls at apply when the mesh in use
has a pipe axis larger than 1 (init always runs the plain stack), after
:func:`prepare_ends` when the schedule computes the loss. It checks what
only the mesh can tell, then runs one of two loops, each a ``lax.scan`` over
the ticks of the schedule's table inside one ``jax.shard_map`` that is
manual over the pipe axis alone:

* :func:`run` (here), for ``gpipe`` and ``circular``: forwards only; an
  outer ``jax.grad`` differentiates the whole loop.
* ``_run_with_loss.run_with_loss``, for ``1f1b``, ``interleaved`` and
  ``zb``: the loss, and each microbatch's backward, inside the loop.

GPipe and circular run one table (``_schedules.schedule``): at tick ``t``
stage ``s`` works on iteration ``j = t - s`` (repeat ``j // M``, microbatch
``j % M``) when ``0 <= j < R*M``. Stage 0 reads microbatch inputs from a
buffer of all M; what leaves the last stage goes back into that buffer (the
input of the microbatch's next repeat, or its output after the last), which
is why a circular schedule needs ``M >= P``. Every stage computes every tick
(SPMD): a tick outside the schedule is the bubble, computed and discarded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from stacktools.core import _checks
from stacktools.pipelines import _pipeline
from stacktools.pipelines import _run_with_loss
from stacktools.pipelines import _schedules
from stacktools.pipelines import _stages
from stacktools.remat import _loops
from stacktools.remat import _policy
from stacktools.remat import _segments
from stacktools.step import _arguments
from stacktools.step import _layer_step

PyTree = Any


def run_stack(steps: Mapping[str, _loops.Step], x: PyTree,
              layers: Mapping[str, _layer_step.LayerSlice], updaters: Mapping[str, Any],
              plan: _segments.LoopPlan, *, pipeline: _pipeline.Pipeline,
              stages: int, num_layers: int, arguments: _arguments.BlockArguments,
              unroll: Any, ends: Optional[_run_with_loss.Ends] = None
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
      around the stack (:func:`prepare_ends`).

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
  if ends is not None:
    loss, ys, new_state = _run_with_loss.run_with_loss(
        steps[kind], layers[kind], ends, pipeline=pipeline, stages=stages,
        policy=plan.segments[0].policy, unroll=unroll)
    updaters[kind].update(new_state)
    return loss, ys
  x, ys, new_state = run(steps[kind], x, layers[kind], pipeline=pipeline, stages=stages,
                         policy=plan.segments[0].policy, unroll=unroll)
  updaters[kind].update(new_state)
  return x, ys


# ---------------------------------------------------------------------------
# The parts around the stack, for a pipeline that computes the loss.


def prepare_ends(pipeline: _pipeline.Pipeline, ends: Optional[tuple[Any, ...]],
                 arguments: _arguments.BlockArguments
                 ) -> tuple[PyTree, _run_with_loss.Ends]:
  """The carry's shape, and ``Stacked.loss``'s parts as a loss pipeline runs them.

  Called before the stack's layers are lifted: they and the loop plan read
  the carry. ``embed`` and ``head`` become pure functions of their
  parameters, which are looked up once, here.

  Args:
    pipeline: a configuration whose schedule computes the loss.
    ends: ``(embed, head, inputs, targets)`` as ``Stacked.loss`` gives them.
    arguments: the call's arguments, whose broadcast ones get gradients.

  Returns:
    Zeros shaped as the whole batch's carry (the pipeline embeds each
    microbatch itself), and the :class:`stacktools.pipelines._run_with_loss.Ends`.

  Raises:
    ValueError: without ``ends``: such a pipeline needs the loss inside.
  """
  if ends is None:
    raise ValueError(
        f"{_checks.where()}schedule={pipeline.schedule!r} computes the loss inside the "
        "pipeline, so "
        "the stack must be called with the parts around it: "
        "blocks.loss(embed, head, inputs, targets) (or scan_loss), not fold or "
        "scan; or use schedule='gpipe'.")
  embed, head, inputs, targets = ends
  micro = pipeline.microbatches
  first = lambda t: jax.tree_util.tree_map(lambda a: a[::micro], t)  # noqa: E731
  embed, embed_params = _explicit_params(embed, "embed", first(inputs))
  x_micro = jax.eval_shape(embed, embed_params, first(inputs))
  head, head_params = _explicit_params(head, "head", x_micro, first(targets))
  x = jax.tree_util.tree_map(
      lambda s: jnp.zeros((s.shape[0] * micro,) + s.shape[1:], s.dtype), x_micro)
  return x, _run_with_loss.Ends(embed, head, embed_params, head_params, inputs,
                                 targets, arguments.broadcast, arguments.broadcast_as)


def _explicit_params(fn: Callable[..., Any], role: str,
                     *example: Any) -> tuple[Callable[..., Any], dict[str, jax.Array]]:
  """``fn`` (Haiku code) as ``fn(params, *args)``, and the params it reads.

  The parameters are looked up by full name in the transform's own (a
  ``hk.custom_getter`` records them, then substitutes the values given), so
  ``fn``'s parameters keep their names: the same tree with or without a
  pipeline.
  """
  def names():
    seen = {}

    def record(next_getter, value, context):
      seen[context.full_name] = value
      return next_getter(value)

    with hk.custom_getter(record):
      jax.eval_shape(lambda *a: fn(*a), *example)   # a fresh trace each time
    return seen

  params = names()
  try:
    again = names()
  except ValueError:   # Haiku's: a module built anew has no parameters
    again = None
  if again is None or set(again) != set(params):
    raise ValueError(
        f"{_checks.where()}Stacked.loss: {role} creates new Haiku modules each time it "
        f"is called (its parameters were {sorted(params)} the first time), but a "
        "1f1b, interleaved or zb pipeline calls it once per microbatch. Construct "
        "its modules "
        "before blocks.loss and call them inside (e.g. proj = hk.Linear(n); "
        "head = lambda x, t: loss(proj(x), t)).")

  def explicit(values, *args):
    def substitute(next_getter, value, context):
      del value
      return next_getter(values[context.full_name])

    with hk.custom_getter(substitute):
      return fn(*args)

  return explicit, params


# ---------------------------------------------------------------------------
# GPipe and circular: forwards only, one table.


def run(step: _loops.Step, x: PyTree, layers: _layer_step.LayerSlice, *,
        pipeline: _pipeline.Pipeline, stages: int, policy: _policy.CheckpointPolicy,
        unroll: Any) -> tuple[PyTree, PyTree, PyTree]:
  """Runs ``step`` over every layer as a pipeline; returns ``(x, ys, state)``.

  Args:
    step: one layer, ``step(carry, layer_slice) -> (carry, result)``, the
      result's first two fields the layer's ``y`` and new state.
    x: the carry, batch-major ``[B, ...]`` in every leaf.
    layers: every layer's params, state, apply key, per-layer arguments and
      index, each with a leading ``num_layers`` axis.
    pipeline: the configuration (``gpipe`` or ``circular``).
    stages: P (> 1).
    policy: the checkpoint policy of every layer.
    unroll: the stack's unroll, for each stage's scan over its layers.

  Returns:
    ``x`` after the last layer, the stacked ``ys`` (``[L, B, ...]``; ``None``
    for a fold) and the new per-layer state (``[L, ...]``).
  """
  micro, repeats = pipeline.microbatches, pipeline.repeats
  table = _schedules.schedule(stages, micro, repeats)
  axis = pipeline.axis
  xs = _stages.split_microbatches(x, micro)
  staged = _stages.on_pipe(_stages.to_stages(_stages.on_pipe(layers, pipeline), stages,
                                             repeats), pipeline)
  chunk = functools.partial(_stages.stage_chunk, step, policy, unroll)
  ys_shape = _checked_ys_shape(chunk, xs, staged)

  spec = PartitionSpec(axis)
  # check_vma=False: the tick loop's carries start the same on every stage
  # (zeros, the whole buffer) and vary by stage once a ppermute has run, a
  # change of type that the check would refuse in a scan carry; the outputs
  # are made equal across stages by the psum, or are per stage by their spec.
  mapped = jax.shard_map(
      functools.partial(_per_device, chunk, ys_shape, pipeline, stages), mesh=pipeline.mesh,
      in_specs=(PartitionSpec(), spec, PartitionSpec(), PartitionSpec(), PartitionSpec()),
      out_specs=(PartitionSpec(), spec, spec), axis_names=frozenset({axis}),
      check_vma=False)
  out, state, ys = mapped(xs, staged, jnp.asarray(table.microbatch),
                          jnp.asarray(table.repeat), jnp.asarray(table.busy))
  new_x = _stages.merge_microbatches(out)
  new_state = _stages.from_stages(state)
  # [P, R, K, M, mb, ...] -> [L, M, mb, ...] -> [L, B, ...]
  ys = (_stages.merge_microbatches(_stages.from_stages(ys), axis=1)
        if ys_shape is not None else None)
  return new_x, ys, new_state


def _checked_ys_shape(chunk: Callable[..., Any], xs: PyTree,
                      staged: _layer_step.LayerSlice) -> PyTree:
  """The shapes of one chunk's ``ys`` on one microbatch (``[K, mb, ...]``).

  Raises:
    ValueError: when a leaf's axis after K is not the microbatch's batch
      axis: the ys could not be put back together along the batch.
  """
  local = jax.tree_util.tree_map(lambda a: a[0], staged)
  x0 = jax.tree_util.tree_map(lambda a: a[0], xs)
  state = jax.tree_util.tree_map(lambda a: a[0], local.state)
  ys_shape = jax.eval_shape(lambda l, s: chunk(x0, l, s, 0, 0)[1][0], local, state)
  mb_size = jax.tree_util.tree_leaves(xs)[0].shape[1]
  for path, leaf in jax.tree_util.tree_flatten_with_path(ys_shape)[0]:
    # [K, mb, ...]: each layer's y must be per example to be put back together.
    if leaf.ndim < 2 or leaf.shape[1] != mb_size:
      raise ValueError(
          f"{_checks.where()}under a pipeline each layer's output y is computed per "
          f"microbatch and put back together along the batch axis, so every leaf "
          f"must have the batch as its leading axis; "
          f"{_checks.path_str('y', path)} has per-layer shape {tuple(leaf.shape[1:])} "
          f"for a microbatch of {mb_size}. Return per-example values (e.g. a "
          "loss per example, reduced after the stack), or run without a pipeline.")
  return ys_shape


class _Device(NamedTuple):
  """What one device's tick loop reads besides its carry."""

  stage: jax.Array                 # this device's index on the pipe axis
  layers: _layer_step.LayerSlice       # its stage's layers, [R, K, ...]
  chunk: Callable[..., Any]        # _stages.stage_chunk with the stack's step
  table: tuple[jax.Array, ...]     # microbatch, repeat, busy: [ticks, P]
  axis: str
  stages: int


def _per_device(chunk: Callable[..., Any], ys_shape: PyTree,
                pipeline: _pipeline.Pipeline, stages: int, xs: PyTree,
                staged: _layer_step.LayerSlice, micro_idx: jax.Array, repeat_idx: jax.Array,
                busy: jax.Array) -> tuple[PyTree, PyTree, PyTree]:
  """One device's share of the ``shard_map``: its stage's tick loop.

  Returns:
    The outputs of every microbatch (the same on every stage), and the
    stage's new state and ys (``[1, R, K, ...]``, ``[1, R, K, M, mb, ...]``).
  """
  micro, repeats, axis = pipeline.microbatches, pipeline.repeats, pipeline.axis
  stage = lax.axis_index(axis)
  local = jax.tree_util.tree_map(lambda a: a[0], staged)   # [R, K, ...]
  zeros_like = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)  # noqa: E731
  ys_buf = jax.tree_util.tree_map(
      lambda s: jnp.zeros((repeats,) + s.shape[:1] + (micro,) + s.shape[1:], s.dtype),
      ys_shape)
  device = _Device(stage, local, chunk, (micro_idx, repeat_idx, busy), axis, stages)
  init = (xs, zeros_like(jax.tree_util.tree_map(lambda a: a[0], xs)), local.state,
          ys_buf)
  (buf, _, state, ys_buf), _ = lax.scan(functools.partial(_tick, device), init,
                                        jnp.arange(micro_idx.shape[0]))
  # Only stage 0's buffer holds the outputs; the sum hands them to every stage.
  out = jax.tree_util.tree_map(
      lambda b: lax.psum(jnp.where(stage == 0, b, jnp.zeros_like(b)), axis), buf)
  expand = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)  # noqa: E731
  return out, expand(state), expand(ys_buf)


def _tick(device: _Device, carry: tuple[PyTree, PyTree, PyTree, PyTree],
          t: jax.Array) -> tuple[tuple[PyTree, PyTree, PyTree, PyTree], None]:
  """Tick ``t``: every stage runs its chunk on what it holds and passes it on.

  The carry is ``(buf, incoming, state, ys_buf)``: stage 0's buffer of every
  microbatch, what arrived from the previous stage, the stage's per-layer
  state and its buffer of ys.
  """
  stage, local, stages, axis = device.stage, device.layers, device.stages, device.axis
  micro_idx, repeat_idx, busy = device.table
  shift = [(s, (s + 1) % stages) for s in range(stages)]
  buf, incoming, state, ys_buf = carry
  m, r, ok = micro_idx[t, stage], repeat_idx[t, stage], busy[t, stage]
  first = jax.tree_util.tree_map(lambda b: b[m], buf)
  x_in = jax.tree_util.tree_map(lambda a, b: jnp.where(stage == 0, a, b),
                                first, incoming)
  x_out, results = device.chunk(
      x_in, local, jax.tree_util.tree_map(lambda a: a[r], state), r, m)
  ys, new_state = results[0], results[1]   # a stage refuses in-place writes
  state = _stages.put_tree(
      state, jax.tree_util.tree_map(lambda old, new: jnp.where(ok, new, old[r]),
                                    state, new_state), r)
  ys_buf = _stages.put_tree(
      ys_buf, jax.tree_util.tree_map(lambda b, y: jnp.where(ok, y, b[r, :, m]), ys_buf, ys),
      r, slice(None), m)
  sent = jax.tree_util.tree_map(lambda a: lax.ppermute(a, axis, shift), x_out)
  # What the last stage finished this tick arrives at stage 0: the input
  # of its microbatch's next repeat, or its output after the last.
  m_last, ok_last = micro_idx[t, stages - 1], busy[t, stages - 1]
  keep = ok_last & (stage == 0)
  buf = _stages.put_tree(
      buf, jax.tree_util.tree_map(lambda b, v: jnp.where(keep, v, b[m_last]), buf, sent),
      m_last)
  return (buf, sent, state, ys_buf), None
