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
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

PyTree = Any
Split = tuple[int, int, int]


def scan(body: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]], carry: PyTree,
         xs: PyTree, *, split: Split, reverse: bool = False,
         unroll: int | bool = 1) -> tuple[PyTree, PyTree]:
  """``lax.scan(body, carry, xs)`` split into chunks for the backward pass.

  Example::

    body = lambda h, w: (jnp.tanh(h * w), h.sum())
    h, sums = scan(body, jnp.ones(3), jnp.ones((64, 3)), split=(8, 8, 0))
    assert sums.shape == (64,)

  Args:
    body: ``body(carry, x) -> (carry, y)``; may close over traced values
      (they are differentiated too).
    carry: the initial carry.
    xs: the inputs, every leaf leading with ``outer * inner + remainder``.
    split: ``(outer, inner, remainder)``: ``outer`` chunks of ``inner``
      steps, then one chunk of ``remainder`` steps (none when 0); or with
      more levels, ``(outer, middle, inner, remainder)``: ``outer`` chunks
      of ``middle`` chunks of ``inner`` steps. Each level keeps one carry
      per chunk while it is differentiated.
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
  """The chunks of one loop, in index space (``reverse`` runs them backwards).

  ``levels`` are the chunk counts from the outermost level in, the last
  being the steps of an innermost chunk; ``remainder`` steps follow the
  chunks, as one more chunk of a single level.
  """

  def __init__(self, body, split, reverse, unroll, xs, consts):
    self.body, self.reverse, self.unroll = body, reverse, unroll
    self.levels, self.remainder = tuple(split[:-1]), split[-1]
    self.xs, self.consts = xs, consts

  def _parts(self, main, rest, backward=False):
    """``main`` and ``rest`` (the remainder, if any) in the order they run."""
    parts = [main, rest] if self.remainder else [main]
    return parts[::-1] if self.reverse != backward else parts

  def steps(self, carry, base, size, keep_carries):
    """Runs rows ``[base, base + size)``; ys, and each step's input carry."""
    def step(c, j):
      new_c, y = self.body(c, _row(self.xs, base + j), *self.consts)
      return new_c, ((c, y) if keep_carries else y)
    return lax.scan(step, carry, jnp.arange(size), reverse=self.reverse,
                    unroll=self.unroll)

  def chunks(self, carry, base, levels, keep_ys):
    """Runs ``levels[0]`` chunks of ``prod(levels[1:])`` steps from row ``base``.

    Returns the carry, the ys (when ``keep_ys``) and each chunk's input carry.
    """
    size = math.prod(levels[1:])

    def chunk(c, k):
      new_c, ys = self.steps(c, base + k * size, size, False)
      return new_c, (c, ys if keep_ys else None)

    carry, (entries, ys) = lax.scan(chunk, carry, jnp.arange(levels[0]),
                                    reverse=self.reverse)
    ys = jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:]), ys)
    return carry, ys, entries

  def forward(self, carry):
    """Every step; ``(carry, ys, the outer chunks' input carries)``."""
    main_rows = math.prod(self.levels)
    results = {}

    def main(c):
      c, results["main_ys"], results["main"] = self.chunks(c, 0, self.levels, True)
      return c

    def rest(c):
      results["rest"] = c
      c, results["rest_ys"] = self.steps(c, main_rows, self.remainder, False)
      return c

    for part in self._parts(main, rest):
      carry = part(carry)
    ys = results["main_ys"]
    if self.remainder:
      ys = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), ys,
                                  results["rest_ys"])
    return carry, ys, (results["main"], results.get("rest"))

  def backward_steps(self, entry, base, size, ct_ys, state):
    """Recomputes one innermost chunk's carries, then differentiates it."""
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

  def backward_chunks(self, entries, base, levels, ct_ys, state):
    """Differentiates ``levels[0]`` chunks, given each one's input carry.

    A chunk of several levels first recomputes its own chunks' input
    carries, then differentiates them from the last to the first.
    """
    size = math.prod(levels[1:])

    def chunk(state, k):
      start, entry = base + k * size, _row(entries, k)
      if len(levels) == 2:
        return self.backward_steps(entry, start, size, ct_ys, state), None
      _, _, inner_entries = self.chunks(entry, start, levels[1:], False)
      return self.backward_chunks(inner_entries, start, levels[1:], ct_ys, state), None

    state, _ = lax.scan(chunk, state, jnp.arange(levels[0]), reverse=not self.reverse)
    return state

  def backward(self, entries, ct_carry, ct_ys):
    """``(ct of the initial carry, grads of xs, grads of consts)``."""
    def zeros(tree):
      return jax.tree_util.tree_map(
          lambda a: jnp.zeros_like(a) if _differentiable(a) else None, tree)

    main_entries, rest_entry = entries
    state = [(ct_carry, zeros(self.xs), zeros(self.consts))]

    def main():
      state[0] = self.backward_chunks(main_entries, 0, self.levels, ct_ys, state[0])

    def rest():
      state[0] = self.backward_steps(rest_entry, math.prod(self.levels),
                                     self.remainder, ct_ys, state[0])

    for part in self._parts(main, rest, backward=True):
      part()
    ct_carry, grad_xs, grad_consts = state[0]

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
  carry, xs, consts = jax.tree_util.tree_map(lambda p: p.value, (carry, xs, consts))
  carry, ys, entries = _Loop(body, split, reverse, unroll, xs, consts).forward(carry)
  return (carry, ys), (xs, consts, entries)


def _nested_bwd(body, split, reverse, unroll, residuals, cts):
  xs, consts, entries = residuals
  ct_carry, ct_ys = jax.tree_util.tree_map(_instantiate, cts[0]), cts[1]
  # A y that nothing downstream reads has a symbolic zero cotangent: its
  # derivative is left out, as JAX's own backward pass leaves it out (where
  # it is infinite, zero times it would be nan).
  wanted = [not isinstance(ct, SymbolicZero) for ct in jax.tree_util.tree_leaves(ct_ys)]

  def body_of_wanted(c, x, *k):
    c, y = body(c, x, *k)
    return c, [y for y, w in zip(jax.tree_util.tree_leaves(y), wanted) if w]

  ct_ys = [ct for ct, w in zip(jax.tree_util.tree_leaves(ct_ys), wanted) if w]
  loop = _Loop(body_of_wanted, split, reverse, unroll, xs, consts)
  return loop.backward(entries, ct_carry, ct_ys)


def _instantiate(ct: Any) -> Any:
  if not isinstance(ct, SymbolicZero):
    return ct
  if ct.aval.dtype == jax.dtypes.float0:
    return np.zeros(ct.aval.shape, dtype=jax.dtypes.float0)
  return jnp.zeros(ct.aval.shape, ct.aval.dtype)


_nested.defvjp(_nested_fwd, _nested_bwd, symbolic_zeros=True)
