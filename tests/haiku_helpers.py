"""Helpers shared by the Haiku combinator tests (layer_stack, Stacked, BlockSeq).

A test module imports what it uses by name; importing ``check_jax_usage``
makes it an autouse fixture of that module.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

RTOL, ATOL = 1e-5, 1e-5
B, D = 3, 8  # The default batch and width of test inputs.


@pytest.fixture(autouse=True)
def check_jax_usage():
  """As in Haiku's own layer_stack tests: flag JAX transforms misused inside a
  Haiku transform."""
  with hk.config.context(check_jax_usage=True):
    yield


def random_input(shape, seed=0):
  return jax.random.uniform(jax.random.PRNGKey(seed), shape, minval=-1.0, maxval=1.0)


def random_x(shape=(B, D), seed=0):
  """A test input, uniform in [-1, 1): ``(B, D)`` unless told."""
  return random_input(shape, seed)


def random_like(shapes, seed=0):
  """Random arrays shaped like ``shapes`` (a tree of ShapeDtypeStructs).

  Floats are normal with scale 0.4; int leaves (state counters) are small
  non-negative ints.
  """
  rng = np.random.default_rng(seed)

  def sample(s):
    if jnp.issubdtype(s.dtype, jnp.integer):
      return jnp.asarray(rng.integers(0, 5, s.shape), s.dtype)
    return jnp.asarray(0.4 * rng.standard_normal(s.shape), s.dtype)

  return jax.tree.map(sample, shapes)


def layer_slice(bundles, prefix, i):
  """Layer ``i`` of stacked params/state, with ``prefix/`` cut from the names."""
  return {k[len(prefix) + 1:]: {n: v[i] for n, v in b.items()}
          for k, b in bundles.items() if k.startswith(prefix + "/")}


def stack_layers(trees):
  """Per-layer trees (a sequence) -> one tree with a leading layer axis."""
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def restack(per_layer, prefix):
  """Inverse of ``layer_slice`` over all layers: per-layer params/state ->
  stacked, with ``prefix/`` put back on the names."""
  return {f"{prefix}/{k}": b for k, b in stack_layers(per_layer).items()}


def sin_loss(tree):
  """A scalar loss of every leaf whose gradient is not constant."""
  return sum(jnp.sum(jnp.sin(3.0 * leaf)) for leaf in jax.tree.leaves(tree))


def signature(bundles):
  """``{module: {name: (shape, dtype)}}`` of Haiku params or state."""
  return {m: {n: (tuple(v.shape), str(v.dtype)) for n, v in b.items()}
          for m, b in bundles.items()}


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
  """Same tree structure, and every leaf close."""
  assert (jax.tree_util.tree_structure(actual)
          == jax.tree_util.tree_structure(expected))
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol),
               actual, expected)
