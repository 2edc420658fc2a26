"""The GPipe and circular pipelines: forwards only, one tick loop.

:func:`run` runs a stack's layers as a ``gpipe`` or ``circular`` pipeline:
a ``lax.scan`` over the ticks of the schedule's table inside one
``jax.shard_map`` that is manual over the pipe axis alone. It runs the
forwards only; an outer ``jax.grad`` differentiates the whole loop. (The
schedules that compute the loss and run each microbatch's backward inside
their loop are ``_run_with_loss.py``'s; ``stacks/_run_stacked.py`` chooses
between the two and checks what only the mesh can tell.)

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from stacktools.core import _checks
from stacktools.pipelines import _pipeline
from stacktools.pipelines import _schedules
from stacktools.pipelines import _stages
from stacktools.step import _layer_step

PyTree = Any


def run(chunk: _stages.Chunk, x: PyTree, layers: _layer_step.LayerSlice, *,
        pipeline: _pipeline.Pipeline, stages: int) -> tuple[PyTree, PyTree, PyTree]:
  """Runs every layer as a pipeline, a chunk at a time; returns ``(x, ys, state)``.

  Args:
    chunk: how a stage runs one chunk of its layers on one microbatch
      (:data:`_stages.Chunk`).
    x: the carry, batch-major ``[B, ...]`` in every leaf.
    layers: every layer's params, state, apply key, per-layer arguments and
      index, each with a leading ``num_layers`` axis.
    pipeline: the configuration (``gpipe`` or ``circular``).
    stages: P (> 1).

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


def _checked_ys_shape(chunk: _stages.Chunk, xs: PyTree,
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
  chunk: _stages.Chunk             # one chunk of the stage's layers (run's chunk)
  table: tuple[jax.Array, ...]     # microbatch, repeat, busy: [ticks, P]
  axis: str
  stages: int


def _per_device(chunk: _stages.Chunk, ys_shape: PyTree,
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
