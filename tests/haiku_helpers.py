"""Helpers shared by the Haiku combinator tests (layer_stack, Stacked)."""

import functools

import jax
import numpy as np

RTOL, ATOL = 1e-5, 1e-5


def random_input(shape, seed=0):
  return jax.random.uniform(jax.random.PRNGKey(seed), shape, minval=-1.0, maxval=1.0)


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
