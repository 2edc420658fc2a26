"""A ``lax.scan`` that runs ``unroll`` steps per rolled iteration, each step's
kept values in buffers of their own.

``lax.scan(..., unroll=k)`` (JAX 0.10 to 0.12) gathers the k steps' outputs,
and after differentiation the values the backward pass keeps, into ``[k, ...]``
slabs of ``[L/k, k, ...]`` buffers: the slabs are stacked, relaid out and
read back as ops of their own. On a TPU v5e, at the GPT-2-medium shape in
bfloat16, that made ``unroll=2`` 1.19x the step of ``unroll=1`` and
``unroll=4`` 1.23x (``benchmarks/scan_gap.py``). Here the k steps of an
iteration read rows ``j`` of the inputs reshaped to ``[L/k, k, ...]`` (a free
reshape of the leading axis), so each step's kept values are the
``[L/k, ...]`` outputs of one step of the rolled loop, written and read as
with ``unroll=1``.

May import: nothing in stacktools but ``stacktools.core``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any


def rows(tree: PyTree, start: int, stop: int) -> PyTree:
  """Every leaf's rows ``[start, stop)`` (no slice when that is all of it)."""
  return jax.tree_util.tree_map(
      lambda a: a if (start, stop) == (0, a.shape[0]) else a[start:stop], tree)


def scan(body: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]], carry: PyTree,
         xs: PyTree, length: int, *, unroll: Union[int, bool] = 1,
         reverse: bool = False) -> tuple[PyTree, PyTree]:
  """``lax.scan(body, carry, xs, length=length, reverse=reverse)``, ``unroll``
  steps per rolled iteration.

  Example::

    def body(c, x, j=None):
      x = x if j is None else x[j]
      return c + x, c
    carry, ys = scan(body, 0.0, jnp.arange(7.0), 7, unroll=3)
    # two rolled iterations of 3 steps, then the last step

  Args:
    body: ``body(carry, x) -> (carry, y)``; in the rolled loop called as
      ``body(carry, slab, j)``, where ``slab`` holds the iteration's ``unroll``
      steps' inputs and the step's own are row ``j`` of each leaf. Cutting
      that row inside the step's ``jax.checkpoint`` lets the backward pass
      cut it again from the loop's inputs; cut outside, every row would be
      kept, a copy of the inputs.
    carry: the initial carry.
    xs: the inputs, each leaf leading with ``length``.
    length: the number of steps.
    unroll: steps per rolled iteration; ``True`` (or at least ``length``)
      unrolls every step, as ``lax.scan`` does.
    reverse: run the steps from the last to the first; ``ys`` stays in the
      order of ``xs``.

  Returns:
    ``(carry, ys)`` as ``lax.scan`` returns them. The last ``length % unroll``
    steps run after the rolled loop (before it, when ``reverse``).
  """
  k = unroll
  if k is True or k >= length:
    return lax.scan(body, carry, xs, length=length, reverse=reverse, unroll=True)
  if k == 1:
    return lax.scan(body, carry, xs, length=length, reverse=reverse)
  trips, rest = divmod(length, k)
  order = (lambda items: list(reversed(items))) if reverse else list

  def k_steps(carry, slab):
    outs = [None] * k
    for j in order(range(k)):
      carry, outs[j] = body(carry, slab, j)
    return carry, jax.tree_util.tree_map(lambda *o: jnp.stack(o), *outs)

  def rolled(carry):
    slabs = jax.tree_util.tree_map(lambda a: a.reshape((trips, k) + a.shape[1:]),
                                   rows(xs, 0, trips * k))
    carry, ys = lax.scan(k_steps, carry, slabs, length=trips, reverse=reverse)
    return carry, jax.tree_util.tree_map(
        lambda a: a.reshape((trips * k,) + a.shape[2:]), ys)

  def last_steps(carry):
    return lax.scan(body, carry, rows(xs, trips * k, length), length=rest,
                    reverse=reverse, unroll=True)

  parts = [rolled] + ([last_steps] if rest else [])
  outs = []
  for part in order(parts):
    carry, out = part(carry)
    outs.append(out)
  if len(outs) == 1:
    return carry, outs[0]
  return carry, jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *order(outs))
