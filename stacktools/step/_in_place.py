"""Per-layer arguments written in place: ``st.per_layer(cache, in_place=True)``.

A per-layer argument marked ``in_place=True`` is never sliced into the
loop's inputs nor stacked again as its outputs. Every layer reads its own row
of the whole array, and what it writes comes back as small *writes*, each
``(update, start)``, which the stack applies to the whole array at the
layer's row after the loop::

  for i in layers:
    view = LayerView(whole, row=i)         # what the block receives
    x, view = block(x, view)               # view.read(), view = view.write(u, at)
    writes[i] = view.writes
  whole = dynamic_update_slice(whole, writes[i]) for every i   # in place
  ys = the block's ys, with each returned view replaced by the updated whole

A layer writes only its own row, so reading every row from the array the call
was given is exact, whatever order the writes land in. The whole array is
read by every step but is not an input of the loop that changes from step to
step, so a checkpointed step saves no copy of it (JAX keeps a loop-invariant
value once), and the writes after the loop update the caller's buffer in
place when it is donated: no second cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stacktools.core import _checks

PyTree = Any
Write = tuple[PyTree, jax.Array]   # (update, int32 start indices in the layer's row)


class Lineage:
  """The views one layer's call derives from one argument; the latest wins."""

  def __init__(self, label: str):
    self.label = label
    self.latest: Optional["LayerView"] = None


class LayerView:
  """One layer's view of an argument given as ``st.per_layer(..., in_place=True)``.

  The block receives it in place of its slice. :meth:`read` returns the
  layer's row (with this layer's writes so far); :meth:`write` returns a new
  view with an update written at any index of the row. A scan block returns
  the last view among its outputs, and the stack returns the whole array
  there, updated in place.

  Example::

    class Block(hk.Module):
      def __call__(self, x, cache, pos):        # cache: a LayerView
        k = hk.Linear(x.shape[-1])(x)[:, None]  # [B, 1, D]
        cache = cache.write({"k": k}, at=(0, pos))
        keys = cache.read()["k"]                # [B, T, D], with the write
        return x + jnp.einsum("bd,btd->bd", x, keys), cache

    cache = {"k": jnp.zeros((4, 2, 8, 16))}     # [num_layers, B, T, D]
    x, cache = st.Stacked(Block, num_layers=4, name="h").scan(
        jnp.ones((2, 16)), st.per_layer(cache, in_place=True), 3)
  """

  def __init__(self, whole: PyTree, row: jax.Array, lineage: Lineage,
               writes: tuple[Write, ...] = ()):
    self._whole = whole
    self._row = row
    self._lineage = lineage
    self._writes = writes
    lineage.latest = self

  @property
  def writes(self) -> tuple[Write, ...]:
    """What this layer wrote so far: ``(update, start)`` pairs, in order."""
    return self._writes

  def read(self) -> PyTree:
    """The layer's row of every leaf, with this layer's writes applied."""
    row = jax.tree_util.tree_map(
        lambda w: lax.dynamic_index_in_dim(w, self._row, keepdims=False), self._whole)
    for update, start in self._writes:
      row = jax.tree_util.tree_map(
          lambda r, u: lax.dynamic_update_slice(r, u, _starts(start)), row, update)  # pylint: disable=cell-var-from-loop
    return row

  def write(self, update: PyTree, at: Sequence[Any] = ()) -> "LayerView":
    """Writes ``update`` into the layer's row at ``at``; returns the new view.

    Args:
      update: a tree like the argument's (``{"k": ..., "v": ...}``), each leaf
        with the rank of one row and at most its size on every axis; cast to
        the argument's dtype.
      at: the start index on the row's leading axes (ints or int scalars);
        the axes after them start at 0. A concrete start (a Python or numpy
        int) whose update would not fit in the row is refused; a traced one
        (under ``jax.jit``) that would overrun an axis is moved back to fit,
        as ``lax.dynamic_update_slice`` does.

    Returns:
      A view of the same row with the write recorded; return it from the
      block (the earlier view no longer holds the latest writes).
    """
    label = self._lineage.label
    if self._lineage.latest is not self:
      raise ValueError(f"{label}: write() was called on an earlier view; call it on "
                       "the view the last write() returned (cache = cache.write(...)).")
    whole_def = jax.tree_util.tree_structure(self._whole)
    if jax.tree_util.tree_structure(update) != whole_def:
      raise ValueError(f"{label}: write() got an update of structure "
                       f"{jax.tree_util.tree_structure(update)}, but the argument is "
                       f"{whole_def}; give one update per leaf.")
    at = tuple(at) if isinstance(at, (tuple, list)) else (at,)
    cast = []
    for path, w, u in zip(jax.tree_util.tree_flatten_with_path(self._whole)[0],
                          jax.tree_util.tree_leaves(self._whole),
                          jax.tree_util.tree_leaves(update)):
      row_shape, shape = tuple(w.shape[1:]), tuple(jnp.shape(u))
      where = _checks.path_str(label, path[0])
      if len(shape) != len(row_shape) or any(s > r for s, r in zip(shape, row_shape)):
        raise ValueError(f"{where}: write() got an update of shape {shape} for a row of "
                         f"shape {row_shape}; an update has the row's rank and fits in it.")
      if len(at) > len(row_shape):
        raise ValueError(f"{where}: write(at={at!r}) has {len(at)} indices for a row of "
                         f"rank {len(row_shape)}.")
      for axis, (start, size, room) in enumerate(zip(at, shape, row_shape)):
        start = _checks.as_int(start)    # None when traced: not checkable
        if start is not None and not 0 <= start <= room - size:
          raise ValueError(
              f"{where}: write(at={at!r}) puts an update {size} long on axis {axis} "
              f"of the row at {start}, but that axis holds positions 0 to {room - 1}, "
              f"so lax.dynamic_update_slice would move the write to {max(0, min(start, room - size))} "
              f"and overwrite what is there: start between 0 and {room - size}, or "
              "give the row more room (e.g. a longer cache).")
      cast.append(jnp.asarray(u).astype(w.dtype))
    rank = len(jax.tree_util.tree_leaves(self._whole)[0].shape) - 1
    start = jnp.stack([jnp.asarray(i, jnp.int32) for i in at]
                      + [jnp.zeros((), jnp.int32)] * (rank - len(at))) if rank else (
                          jnp.zeros((0,), jnp.int32))
    if any(w.ndim - 1 != rank for w in jax.tree_util.tree_leaves(self._whole)):
      raise ValueError(f"{label}: write() needs every leaf of the argument to have the "
                       "same rank (one start index serves them all); split the "
                       "argument into one per rank.")
    return LayerView(self._whole, self._row, self._lineage,
                     self._writes + ((jax.tree_util.tree_unflatten(whole_def, cast), start),))


def _starts(start: jax.Array) -> tuple[jax.Array, ...]:
  return tuple(start[d] for d in range(start.shape[0]))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Written:
  """Where a block returned a view: no leaves, filled with the whole array later.

  ``kind`` is the kind whose tree it names, for a :func:`per_kind` argument.
  """

  key: str
  kind: Optional[str] = None


def is_view(value: Any) -> bool:
  return isinstance(value, LayerView)


def settle(y: PyTree, views: Mapping[str, tuple[LayerView, Optional[str]]],
           mode: str) -> tuple[PyTree, dict[str, tuple[Write, ...]]]:
  """Takes the views out of a block's output: ``(y, writes by argument key)``.

  ``views`` holds, by argument key, the view the layer was given and its
  kind (for a per-kind argument). Every view in ``y`` becomes a
  :class:`Written` marker; a view written but not returned, or an earlier
  view returned, is an error (the writes would be lost).
  """
  returned = {}

  def mark(leaf):
    if not is_view(leaf):
      return leaf
    for key, (view, kind) in views.items():
      if leaf._lineage is view._lineage:  # pylint: disable=protected-access
        if leaf._lineage.latest is not leaf:  # pylint: disable=protected-access
          raise ValueError(f"{view._lineage.label}: the block returned an earlier view; "  # pylint: disable=protected-access
                           "return the one its last write() gave back.")
        returned[key] = leaf
        return Written(key, kind)
    raise ValueError(f"{_checks.who()}: the block returned a view of an in-place "
                     "argument that this layer was not given.")

  y = jax.tree_util.tree_map(mark, y, is_leaf=is_view)
  writes = {}
  for key, (view, _) in views.items():
    latest = view._lineage.latest  # pylint: disable=protected-access
    if latest.writes and key not in returned:
      how = ("a fold block returns only x: use scan, and return the view in y"
             if mode == "fold" else "return the view the last write() gave back in y")
      raise ValueError(f"{view._lineage.label} was written by the block but the view "  # pylint: disable=protected-access
                       f"is not among its outputs, so the writes would be lost; {how}.")
    writes[key] = latest.writes
  return y, writes


def write_rows(whole: PyTree, rows: np.ndarray, writes: Sequence[Write]) -> PyTree:
  """``whole`` with ``writes[j]`` (leading axis: one per row) applied at ``rows[j]``.

  A loop of ``dynamic_update_slice`` over the rows: XLA updates ``whole``'s
  buffer in place, touching only the written elements.
  """
  if not writes:
    return whole
  rows = np.asarray(rows, np.int32)

  def one_row(j, whole):
    row = rows[j] if isinstance(j, int) else jnp.asarray(rows)[j]
    for update, start in writes:
      index = (row,) + _starts(start[j])
      whole = jax.tree_util.tree_map(
          lambda w, u: lax.dynamic_update_slice(w, u[j][None], index), whole, update)  # pylint: disable=cell-var-from-loop
    return whole

  if len(rows) == 1:
    return one_row(0, whole)
  # A loop rather than one update per row: under jax.grad, XLA copies the
  # whole array for each of a chain of updates (the transposed chain reads
  # and writes the same cotangent), but not inside a loop.
  return lax.fori_loop(0, len(rows), one_row, whole)


def fill(ys: PyTree, wholes: Mapping[str, PyTree]) -> PyTree:
  """The stack's ys: every :class:`Written` marker replaced by its whole array."""
  def put(leaf):
    if not isinstance(leaf, Written):
      return leaf
    whole = wholes[leaf.key]
    return whole if leaf.kind is None else whole[leaf.kind]
  return jax.tree_util.tree_map(put, ys, is_leaf=lambda v: isinstance(v, Written))
