"""A stack laid out for a pipeline's stages: layers, microbatches, writes.

The plain stack's trees have a leading Layers axis ``[L, ...]`` and a batch
``[B, ...]``; a pipeline over P stages with R repeats reads them as
``[P, R, K, ...]`` (stage ``s``, repeat ``r``: the ``K = L/(R*P)`` layers of
chunk ``r*P + s``) and ``[M, B/M, ...]`` (M microbatches). Both tick loops
(``_run_forward.py``, ``_run_with_loss.py``) regroup with these layouts, pin
the layers to the pipe axis with :func:`on_pipe` and write into their
per-stage buffers with :func:`put`; the chunk each stage runs over its K
layers is the caller's (:data:`Chunk`, ``stacks/_run_stacked.py``'s
``stage_chunk``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from stacktools.core import _checks
from stacktools.pipelines import _pipeline

PyTree = Any

#: How a stage runs one chunk of its layers on one microbatch, what both
#: tick loops are handed (``stacks/_run_stacked.py``'s ``stage_chunk``: the
#: stack's engine loop over the chunk, with its step, policy and unroll)::
#:
#:   chunk(x_in, local, state, repeat, microbatch) -> (carry, results)
#:
#: ``x_in`` is the microbatch's carry; ``local`` the stage's layers (a
#: ``LayerSlice``, each leaf ``[R, K, ...]``); ``state`` chunk ``repeat``'s
#: per-layer state (``[K, ...]``); ``repeat`` which of the stage's R chunks
#: runs, ``microbatch`` which microbatch (to draw its own keys). It
#: returns the carry after the chunk's last layer and every layer's result
#: stacked (``[K, ...]``), their first two fields the layers' ``y`` and new
#: state. It is differentiable: ``_run_with_loss.py``'s backward is its
#: ``jax.vjp``.
Chunk = Callable[[PyTree, Any, PyTree, Union[int, jax.Array], Union[int, jax.Array]],
                 tuple[PyTree, Any]]


# ---------------------------------------------------------------------------
# Layouts: the plain stack's Layers axis <-> [stage, repeat, layer-in-chunk],
# its batch <-> [microbatch, row].


def to_stages(tree: PyTree, stages: int, repeats: int) -> PyTree:
  """``[L, ...] -> [P, R, K, ...]``: stage ``s``, repeat ``r`` holds chunk ``r*P + s``."""
  def one(a):
    k = a.shape[0] // (stages * repeats)
    return jnp.swapaxes(a.reshape((repeats, stages, k) + a.shape[1:]), 0, 1)
  return jax.tree_util.tree_map(one, tree)


def from_stages(tree: PyTree) -> PyTree:
  """The inverse of :func:`to_stages`: ``[P, R, K, ...] -> [L, ...]``."""
  def one(a):
    a = jnp.swapaxes(a, 0, 1)
    return a.reshape((-1,) + a.shape[3:])
  return jax.tree_util.tree_map(one, tree)


def split_microbatches(tree: PyTree, microbatches: int) -> PyTree:
  """``[B, ...] -> [M, B/M, ...]``, microbatch ``m`` the rows ``m, m+M, ...``.

  Strided rather than contiguous: a batch sharded over a data axis in
  contiguous blocks keeps every microbatch sharded the same way, with no
  data movement (``B/M`` must divide by the data axis size).
  """
  def one(path, a):
    if a.ndim == 0 or a.shape[0] % microbatches:
      raise ValueError(
          f"{_checks.where()}the pipeline cuts the carry's leading (batch) axis into "
          f"{microbatches} microbatches, but {_checks.path_str('x', path)} has "
          f"shape {tuple(a.shape)}. Make the batch size a multiple of "
          f"microbatches={microbatches} (times the data axis size, when the batch "
          "is sharded), or change microbatches.")
    return jnp.swapaxes(a.reshape((a.shape[0] // microbatches, microbatches) + a.shape[1:]),
                        0, 1)
  return jax.tree_util.tree_map_with_path(one, tree)


def merge_microbatches(tree: PyTree, axis: int = 0) -> PyTree:
  """The inverse of :func:`split_microbatches`, for ``[..., M, B/M, ...]`` at ``axis``."""
  def one(a):
    a = jnp.swapaxes(a, axis, axis + 1)
    return a.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 2:])
  return jax.tree_util.tree_map(one, tree)


# ---------------------------------------------------------------------------
# A tick's writes into its buffers.


def put(buffer: jax.Array, value: jax.Array, *index: Union[int, jax.Array, slice]
        ) -> jax.Array:
  """``buffer.at[index].set(value)`` as one ``lax.dynamic_update_slice``.

  Each entry of ``index`` is a scalar (an integer the tick's table gives:
  in range, never negative) or ``slice(None)`` (the whole axis); axes past
  ``index`` are whole. The write is what it says, one block at a dynamic
  offset, rather than the scatter that ``.at[...].set`` lowers to: XLA only
  turns that into this after the SPMD partitioner has partitioned it as a
  scatter, whose code is where jax 0.12.1 aborts for some shardings
  (docs/guides/troubleshooting.md, "Known JAX bugs"), and gpipe's loop
  compiled to 6.6% fewer temp bytes this way (benchmarks/pipeline.py's GPT
  step, pipe:4, M=8), at the same step time.

  Example::

    buf = jnp.zeros((4, 3, 2))
    put(buf, jnp.ones(3), 1, slice(None), 0)   # == buf.at[1, :, 0].set(1.0)
  """
  index = index + (slice(None),) * (buffer.ndim - len(index))
  scalar_axes = [axis for axis, i in enumerate(index) if not isinstance(i, slice)]
  starts = [jnp.zeros((), jnp.int32) if isinstance(i, slice) else jnp.asarray(i, jnp.int32)
            for i in index]
  block = jnp.expand_dims(jnp.asarray(value, buffer.dtype), scalar_axes)
  return lax.dynamic_update_slice(buffer, block, starts)


def put_tree(buffers: PyTree, values: PyTree, *index: Union[int, jax.Array, slice]
             ) -> PyTree:
  """:func:`put` on every leaf of ``buffers`` with the matching leaf of ``values``."""
  return jax.tree_util.tree_map(lambda b, v: put(b, v, *index), buffers, values)


# ---------------------------------------------------------------------------
# A stage's layers: pinned to the pipe axis.


def on_pipe(tree: PyTree, pipeline: _pipeline.Pipeline) -> PyTree:
  """Pins each leaf's leading (Layers) axis to the pipe axis, other axes free.

  The regrouping into stages is a reshape and a transpose; with the plain
  layout pinned on both sides, its gradient is regrouped back by the same
  all-to-all, instead of being gathered whole on every device.
  """
  def one(a):
    spec = PartitionSpec(pipeline.axis, *[PartitionSpec.UNCONSTRAINED] * (a.ndim - 1))
    target = (spec if pipeline.mesh is None
              else jax.sharding.NamedSharding(pipeline.mesh, spec))
    return lax.with_sharding_constraint(a, target)
  return jax.tree_util.tree_map(one, tree)
