"""A Haiku Linear layer whose weight gradient runs as a row-major matmul on CPU.

The weight gradient of ``y = x @ w`` is ``x.T @ g``: a matmul that contracts
the leading (token) axis of both operands. XLA:CPU hands such a dot to its
generic dot emitter, which ran the example's weight gradients at 40-50
GFLOP/s on one core, while a dot whose left operand contracts its last axis
goes to the YNNPACK library, at 65-80 GFLOP/s. :func:`matmul` transposes the
narrower of ``x`` and ``g`` into a row-major copy first (behind an
``optimization_barrier``, or XLA's simplifier folds the transpose back into
the dot), so both dots of its backward pass take the fast path. The copies
cost far less than they save: the example's train step took 0.89x the time on
one core (0.85x without biases). On other backends the gradient is the plain
one.

:class:`Linear` is ``hk.Linear`` with the same parameters (``w``, ``b``) and
names, so checkpoints are interchangeable.

Example::

  def f(x):
    return Linear(16, name="proj")(x)   # like hk.Linear(16, name="proj")
"""

from __future__ import annotations

from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np


def _rows(a: jax.Array) -> jax.Array:
  return a.reshape(-1, a.shape[-1])


def _materialized_transpose(a: jax.Array) -> jax.Array:
  # The barrier keeps the transpose a copy: without it the simplifier turns
  # ``a.T @ b`` back into a dot that contracts a's leading axis.
  return jax.lax.optimization_barrier(a.T)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x @ w`` for ``x`` of shape ``[..., n]`` and ``w`` of ``[n, m]``.

  Same value and gradients as ``x @ w``; on CPU the weight gradient is
  computed with row-major operands (see the module docstring).

  Example::

    y = matmul(jnp.ones((2, 8, 4)), jnp.ones((4, 3)))   # [2, 8, 3]
  """
  return x @ w


def _matmul_fwd(x, w):
  return x @ w, (x, w)


def _matmul_bwd(residuals, g):
  x, w = residuals
  dx = g @ w.T
  xs, gs = _rows(x), _rows(g)
  if jax.default_backend() != "cpu":
    dw = xs.T @ gs
  elif xs.shape[1] <= gs.shape[1]:
    dw = _materialized_transpose(xs) @ gs
  else:
    # Transpose the narrower g, and give back dw.T from a barrier too: a
    # transposed dot output would be folded into the same slow dot.
    dw = jax.lax.optimization_barrier(_materialized_transpose(gs) @ xs).T
  return dx, dw.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


class Linear(hk.Linear):
  """``hk.Linear`` computed with :func:`matmul`: same parameters and names."""

  def __call__(self, inputs: jax.Array, *,
               precision: Optional[jax.lax.Precision] = None) -> jax.Array:
    if precision is not None:   # matmul has no precision argument
      return super().__call__(inputs, precision=precision)
    if not inputs.shape:
      raise ValueError("Input must not be scalar.")
    input_size = self.input_size = inputs.shape[-1]
    dtype = inputs.dtype
    w_init = self.w_init
    if w_init is None:
      w_init = hk.initializers.TruncatedNormal(stddev=1.0 / np.sqrt(input_size))
    w = hk.get_parameter("w", [input_size, self.output_size], dtype, init=w_init)
    out = matmul(inputs, w)
    if self.with_bias:
      b = hk.get_parameter("b", [self.output_size], dtype, init=self.b_init)
      out = out + jnp.broadcast_to(b, out.shape)
    return out
