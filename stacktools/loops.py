"""Loops over a leading axis with a checkpoint policy: fold, scan and map.

Pure JAX (no Haiku): research code can use these alone. Each is curried like
Haliax's: configure first, then call with the initial carry and the inputs::

  carry = st.fold(step, remat="nested")(init, xs)
  carry, ys = st.scan(step, remat=True)(init, xs)
  ys = st.map(fn)(xs)

``"nested"`` runs a two-level loop: an outer ``lax.scan`` whose every step is
checkpointed as a whole and runs an inner ``lax.scan`` over a chunk of the
layers. Only the outer carries are kept, and one chunk's carries while that
chunk is differentiated, so memory grows like ``2*sqrt(N)`` carries. A length
that does not factor well (a prime) gets one more, shorter, checkpointed chunk
at the end rather than a worse split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
from jax import lax

from stacktools import _checks
from stacktools import policy as policy_lib
from stacktools import segments as segments_lib

Carry = TypeVar("Carry")
Y = TypeVar("Y")
PyTree = Any


def fold(f: Callable[[Carry, Any], Carry], *, length: Optional[int] = None,
         remat: policy_lib.RematSpec = False, unroll: Union[int, bool] = 1,
         reverse: bool = False) -> Callable[..., Carry]:
  """A loop that threads a carry through ``f`` once per element of ``xs``.

  The moral equivalent of::

    for x in xs:
      carry = f(carry, x)

  Example::

    def layer(h, w):
      return jnp.tanh(h @ w)

    h = st.fold(layer, remat="nested")(h0, ws)   # ws: [num_layers, d, d]

  Args:
    f: ``f(carry, x) -> carry``; the carry keeps its structure, shapes and
      dtypes.
    length: the number of steps; needed when ``xs`` is ``None``, checked
      against the leading axis of ``xs`` otherwise.
    remat: a checkpoint policy or alias (see :class:`CheckpointPolicy`),
      :func:`per_depth` segments, or ``"auto"`` (see :func:`plan_remat`).
    unroll: steps per rolled loop iteration (>= 1), or ``True`` to unroll
      fully, as in ``jax.lax.scan``.
    reverse: run from the last element of ``xs`` to the first.

  Returns:
    ``run(init, xs=None) -> carry``.
  """
  remat = segments_lib.as_remat(remat)
  unroll = _checks.check_unroll(unroll)

  def step(carry, x):
    new_carry = f(carry, x)
    _checks.check_fold_output(carry, new_carry)
    return new_carry, None

  def run(init: Carry, xs: PyTree = None) -> Carry:
    n = _checks.loop_length(xs, length)
    carry, _ = _loop(step, init, xs, n, remat, unroll, reverse)
    return carry

  return run


def scan(f: Callable[[Carry, Any], tuple[Carry, Y]], *,
         length: Optional[int] = None, remat: policy_lib.RematSpec = False,
         unroll: Union[int, bool] = 1,
         reverse: bool = False) -> Callable[..., tuple[Carry, Y]]:
  """Like :func:`fold`, but ``f`` also returns a per-step output, stacked.

  The moral equivalent of::

    ys = []
    for x in xs:
      carry, y = f(carry, x)
      ys.append(y)
    return carry, stack(ys)

  Example::

    def layer(h, w):
      h = jnp.tanh(h @ w)
      return h, jnp.linalg.norm(h)

    h, norms = st.scan(layer, remat=True)(h0, ws)   # norms: [num_layers]

  Args:
    f: ``f(carry, x) -> (carry, y)``.
    length: as in :func:`fold`.
    remat: as in :func:`fold`.
    unroll: as in :func:`fold`.
    reverse: as in :func:`fold`; ``ys`` stays in the order of ``xs``.

  Returns:
    ``run(init, xs=None) -> (carry, ys)``, every leaf of ``ys`` with a leading
    axis of the loop length.
  """
  remat = segments_lib.as_remat(remat)
  unroll = _checks.check_unroll(unroll)

  def step(carry, x):
    out = f(carry, x)
    _checks.check_scan_output(out)
    new_carry, y = out
    _checks.check_carry(carry, new_carry)
    return new_carry, y

  def run(init: Carry, xs: PyTree = None) -> tuple[Carry, Y]:
    n = _checks.loop_length(xs, length)
    return _loop(step, init, xs, n, remat, unroll, reverse)

  return run


def map(f: Callable[[Any], Y], *,  # pylint: disable=redefined-builtin
        remat: policy_lib.RematSpec = False) -> Callable[[PyTree], Y]:
  """Applies ``f`` to each element along the leading axis of ``xs`` in a loop.

  Uses less memory than ``jax.vmap`` (one element at a time), like
  ``jax.lax.map``, and takes a checkpoint policy.

  Example::

    ys = st.map(lambda x: jnp.sort(x))(xs)

  Args:
    f: ``f(x) -> y``.
    remat: as in :func:`fold`.

  Returns:
    ``run(xs) -> ys``.
  """
  scan_f = scan(lambda carry, x: (carry, f(x)), remat=remat)

  def run(xs: PyTree) -> Y:
    if not jax.tree_util.tree_leaves(xs):
      raise ValueError("st.map needs xs with at least one array to map over; "
                       f"got {_checks.describe(xs)}.")
    _, ys = scan_f(None, xs)
    return ys

  return run


# ---------------------------------------------------------------------------
# The loop itself.


def _loop(step, init, xs, n, remat, unroll, reverse):
  """Runs the loop segment by segment (one segment unless ``per_depth``)."""
  if n == 0:
    return lax.scan(step, init, xs, length=n, reverse=reverse, unroll=unroll)

  def probe():   # the names the body tags, for a plan that discovers loops
    first = jax.tree_util.tree_map(lambda a: a[0], xs)
    return _checks.names_tagged_in(step, init, first)

  segments = segments_lib.segments_for(remat, n, probe=probe)
  if len(segments) == 1:
    return _loop_segment(step, init, xs, n, segments[0].policy, unroll, reverse)
  # Consecutive loops over static slices of the same xs: the caller's xs and
  # ys keep one leading axis, as for a single policy.
  ys = [None] * len(segments)
  carry = init
  for i in (reversed(range(len(segments))) if reverse else range(len(segments))):
    start, length, policy = segments[i]
    part = jax.tree_util.tree_map(lambda a: a[start:start + length], xs)  # pylint: disable=cell-var-from-loop
    carry, ys[i] = _loop_segment(step, carry, part, length, policy, unroll, reverse)
  return carry, jax.tree_util.tree_map(lambda *p: jnp.concatenate(p), *ys)


def _loop_segment(step, init, xs, n, policy, unroll, reverse):
  if policy.disable:
    return lax.scan(step, init, xs, length=n, reverse=reverse, unroll=unroll)
  if not policy.nested:
    return lax.scan(policy.checkpoint_step(step), init, xs, length=n,
                    reverse=reverse, unroll=unroll)
  return _nested_loop(step, init, xs, n, policy, unroll, reverse)


def _nested_loop(step, init, xs, n, policy, unroll, reverse):
  layer_leaf_bytes = [_checks.nbytes(a, skip_leading=True)
                      for a in jax.tree_util.tree_leaves(xs)]
  outer, inner, remainder = policy_lib.split_nested(
      n, policy.nested,
      carry_bytes=sum(_checks.nbytes(c) for c in jax.tree_util.tree_leaves(init)) or 1,
      layer_bytes=sum(layer_leaf_bytes), largest_leaf_bytes=max(layer_leaf_bytes, default=0))
  inner_step = policy.inner().checkpoint_step(step)

  def run_chunk(carry, chunk_xs, size):
    return lax.scan(inner_step, carry, chunk_xs, length=size, reverse=reverse,
                    unroll=unroll)

  # Each chunk is cut from the full xs inside the outer loop (a dynamic
  # slice), rather than reshaping or splitting xs up front: a split copy of
  # xs, and of its gradient, would cost as much memory as the carries saved.
  def outer_step(carry, chunk_index):
    start = chunk_index * inner
    chunk_xs = jax.tree_util.tree_map(
        lambda a: lax.dynamic_slice_in_dim(a, start, inner, axis=0), xs)
    return run_chunk(carry, chunk_xs, inner)

  def main_part(carry):
    carry, ys = lax.scan(policy.checkpoint_chunk(outer_step), carry,
                         jnp.arange(outer), reverse=reverse)
    return carry, jax.tree_util.tree_map(
        lambda y: y.reshape((outer * inner,) + y.shape[2:]), ys)

  def remainder_part(carry):
    rem_xs = jax.tree_util.tree_map(lambda a: a[outer * inner:], xs)
    return policy.checkpoint_chunk(lambda c, x: run_chunk(c, x, remainder))(
        carry, rem_xs)

  if not remainder:
    return main_part(init)
  if reverse:
    carry, ys_rem = remainder_part(init)
    carry, ys_main = main_part(carry)
  else:
    carry, ys_main = main_part(init)
    carry, ys_rem = remainder_part(carry)
  ys = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b], axis=0),
                              ys_main, ys_rem)
  return carry, ys
