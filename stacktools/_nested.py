"""A nested loop whose backward pass recomputes it chunk by chunk, by hand.

``remat="nested"`` keeps the carry entering each chunk of steps and, in the
backward pass, recomputes one chunk's carries at a time. Written with
``jax.checkpoint`` around a chunk's inner ``lax.scan`` (as a user would
write it), every chunk also materialises its slice of the stacked inputs
(the layers' parameters) and the gradient of that slice before adding it
into the whole gradient: two chunks of parameters beyond the carries.

:func:`scan` writes the backward pass itself instead (a ``jax.custom_vjp``).
Each step reads its own row of the inputs, forward and backward, and writes
its row of their gradient into one buffer of the inputs' size, in place.
What stays live is the carries (one per chunk, and the chunk's own while it
is differentiated) and one step's internals: the floor the carries allow.

The steps run three times, as under ``jax.checkpoint``: once forward, once
to recompute a chunk's carries, once inside each step's own ``jax.vjp``
(where the step's checkpoint policy still decides what that step keeps).
Forward-mode differentiation (``jax.jvp``) of such a loop is not defined,
as for any ``jax.custom_vjp``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PyTree = Any
Split = tuple[int, int, int]


def scan(body: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]], carry: PyTree,
         xs: PyTree, *, split: Split, reverse: bool = False,
         unroll: int | bool = 1) -> tuple[PyTree, PyTree]:
  """``lax.scan(body, carry, xs)`` split into chunks for the backward pass.

  Example::

    carry, ys = scan(body, carry, xs, split=(8, 8, 0))   # 64 steps

  Args:
    body: ``body(carry, x) -> (carry, y)``; may close over traced values
      (they are differentiated too).
    carry: the initial carry.
    xs: the inputs, every leaf leading with ``outer * inner + remainder``.
    split: ``(outer, inner, remainder)``: ``outer`` chunks of ``inner``
      steps, then one chunk of ``remainder`` steps (none when 0).
    reverse: run from the last row of ``xs`` to the first.
    unroll: steps per rolled iteration of each inner loop.

  Returns:
    ``(carry, ys)`` as ``lax.scan`` returns them.
  """
  first_row = jax.tree_util.tree_map(lambda a: a[0], xs)
  converted, consts = _closure_convert(body, carry, first_row)
  return _nested(converted, split, reverse, unroll, carry, xs, consts)


def _closure_convert(fun: Callable[..., Any], *args: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """``fun`` with every value it closes over made an explicit argument.

  Like ``jax.closure_convert``, but it hoists every constant: that one
  leaves integer tracers in the closure, which leak when the backward pass
  is traced outside the loop that made them (a pipeline's tick loop).
  """
  closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
  out_tree = jax.tree_util.tree_structure(out_shape)

  def converted(*args_and_consts):
    flat = jax.tree_util.tree_leaves(args_and_consts[:len(args)])
    out = jax.core.eval_jaxpr(closed.jaxpr, args_and_consts[len(args):], *flat)
    return jax.tree_util.tree_unflatten(out_tree, out)

  return converted, tuple(closed.consts)


def _row(tree: PyTree, i: Any) -> PyTree:
  return jax.tree_util.tree_map(
      lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _differentiable(a: Any) -> bool:
  return jnp.issubdtype(a.dtype, jnp.inexact)


def _no_cotangent(a: Any) -> np.ndarray:
  """The cotangent of an integer value: JAX's zero-size ``float0``."""
  return np.zeros(np.shape(a), dtype=jax.dtypes.float0)


def _ct_row(ct: Any, i: Any) -> Any:
  if ct.dtype == jax.dtypes.float0:
    return np.zeros(ct.shape[1:], dtype=jax.dtypes.float0)
  return lax.dynamic_index_in_dim(ct, i, keepdims=False)


class _Loop:
  """The chunks of one loop, in index space (``reverse`` runs them backwards)."""

  def __init__(self, body, split, reverse, unroll, xs, consts):
    self.body, self.reverse, self.unroll = body, reverse, unroll
    self.outer, self.inner, self.remainder = split
    self.xs, self.consts = xs, consts

  def steps(self, carry, base, size, keep_carries):
    """Runs rows ``[base, base + size)``; ys, and each step's input carry."""
    def step(c, j):
      new_c, y = self.body(c, _row(self.xs, base + j), *self.consts)
      return new_c, ((c, y) if keep_carries else y)
    return lax.scan(step, carry, jnp.arange(size), reverse=self.reverse,
                    unroll=self.unroll)

  def forward(self, carry):
    """Every step; ``(carry, ys, each chunk's input carry)``."""
    def main(c):
      def chunk(c, k):
        new_c, ys = self.steps(c, k * self.inner, self.inner, False)
        return new_c, (c, ys)
      c, (entry, ys) = lax.scan(chunk, c, jnp.arange(self.outer), reverse=self.reverse)
      flat = jax.tree_util.tree_map(
          lambda a: a.reshape((-1,) + a.shape[2:]), ys)
      return c, (entry, flat)

    def rest(c):
      new_c, ys = self.steps(c, self.outer * self.inner, self.remainder, False)
      return new_c, (c, ys)

    parts = [main, rest] if self.remainder else [main]
    results = [None] * len(parts)
    for p in (reversed(range(len(parts))) if self.reverse else range(len(parts))):
      carry, results[p] = parts[p](carry)
    ys = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *(r[1] for r in results))
    entries = tuple(r[0] for r in results)
    return carry, ys, entries

  def chunk_backward(self, entry, base, size, ct_ys, state):
    """Recomputes a chunk's carries, then differentiates it step by step."""
    _, (carries, _) = self.steps(entry, base, size, True)

    def step(state, j):
      ct, grad_xs, grad_consts = state
      i = base + j
      _, vjp = jax.vjp(self.body, _row(carries, j), _row(self.xs, i), *self.consts)
      ct_y = jax.tree_util.tree_map(lambda a: _ct_row(a, i), ct_ys)
      ct, ct_x, *ct_consts = vjp((ct, ct_y))
      # Each step writes only its own row: the buffer is updated in place.
      grad_xs = jax.tree_util.tree_map(
          lambda g, d: g if g is None else lax.dynamic_update_index_in_dim(g, d, i, 0),
          grad_xs, ct_x, is_leaf=lambda g: g is None)
      grad_consts = jax.tree_util.tree_map(
          lambda g, d: g if g is None else g + d, grad_consts, tuple(ct_consts),
          is_leaf=lambda g: g is None)
      return (ct, grad_xs, grad_consts), None

    state, _ = lax.scan(step, state, jnp.arange(size), reverse=not self.reverse,
                        unroll=self.unroll)
    return state

  def backward(self, entries, ct_carry, ct_ys):
    """``(ct of the initial carry, grads of xs, grads of consts)``."""
    def zeros(tree):
      return jax.tree_util.tree_map(
          lambda a: jnp.zeros_like(a) if _differentiable(a) else None, tree)

    state = (ct_carry, zeros(self.xs), zeros(self.consts))

    def main(state):
      def chunk(state, k):
        entry = _row(entries[0], k)
        return self.chunk_backward(entry, k * self.inner, self.inner, ct_ys, state), None
      state, _ = lax.scan(chunk, state, jnp.arange(self.outer), reverse=not self.reverse)
      return state

    def rest(state):
      return self.chunk_backward(entries[1], self.outer * self.inner,
                                 self.remainder, ct_ys, state)

    parts = [main, rest] if self.remainder else [main]
    for p in (range(len(parts)) if self.reverse else reversed(range(len(parts)))):
      state = parts[p](state)
    ct_carry, grad_xs, grad_consts = state

    def fill(grads, primals):
      return jax.tree_util.tree_map(
          lambda g, a: _no_cotangent(a) if g is None else g, grads, primals,
          is_leaf=lambda g: g is None)
    return ct_carry, fill(grad_xs, self.xs), fill(grad_consts, self.consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _nested(body, split, reverse, unroll, carry, xs, consts):
  carry, ys, _ = _Loop(body, split, reverse, unroll, xs, consts).forward(carry)
  return carry, ys


def _nested_fwd(body, split, reverse, unroll, carry, xs, consts):
  carry, ys, entries = _Loop(body, split, reverse, unroll, xs, consts).forward(carry)
  return (carry, ys), (xs, consts, entries)


def _nested_bwd(body, split, reverse, unroll, residuals, cts):
  xs, consts, entries = residuals
  ct_carry, ct_ys = cts
  return _Loop(body, split, reverse, unroll, xs, consts).backward(entries, ct_carry, ct_ys)


_nested.defvjp(_nested_fwd, _nested_bwd)
