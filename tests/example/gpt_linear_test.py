"""Tests for examples/gpt/linear.py: hk.Linear's values, gradients and
parameters, with every dot of the CPU backward pass row-major.

Also the model without biases (``GPTConfig(bias=False)``, nanoGPT's default).
"""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.gpt import linear
from examples.gpt import model as model_lib
from examples.gpt import model_config


def random(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# x narrower than g (the transposed x is the cheaper copy), wider than g, and
# with leading batch and time axes.
SHAPES = [((24, 8), (8, 32)), ((24, 32), (32, 8)), ((3, 5, 16), (16, 12))]


@pytest.mark.parametrize("x_shape,w_shape", SHAPES)
def test_matmul_has_the_value_and_gradients_of_x_at_w(x_shape, w_shape):
  x, w = random(x_shape, 0), random(w_shape, 1)
  probe = random(x_shape[:-1] + w_shape[-1:], 2)

  def loss(mm):
    return lambda x, w: jnp.sum(jnp.sin(mm(x, w)) * probe)

  np.testing.assert_allclose(linear.matmul(x, w), x @ w, rtol=1e-6, atol=1e-6)
  got = jax.grad(loss(linear.matmul), argnums=(0, 1))(x, w)
  want = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
  for g, r in zip(got, want):
    assert g.shape == r.shape
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def leading_axis_dots(fn, *args) -> list[str]:
  """The compiled program's dots whose left operand contracts its leading
  axis (the slow kind on CPU)."""
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  return [line for line in hlo.splitlines()
          if re.search(r" dot\(", line)
          and re.search(r"lhs_contracting_dims=\{0\}", line)]


@pytest.mark.parametrize("x_shape,w_shape", SHAPES)
def test_backward_pass_has_no_dot_contracting_the_leading_axis(x_shape, w_shape):
  x, w = random(x_shape, 0), random(w_shape, 1)

  def grads(mm):
    return jax.grad(lambda x, w: jnp.sum(mm(x, w) ** 2), argnums=(0, 1))

  # The plain weight gradient x.T @ g has one; matmul's has none.
  assert leading_axis_dots(grads(jnp.matmul), x, w)
  assert not leading_axis_dots(grads(linear.matmul), x, w)


def test_linear_has_hk_linears_parameters_and_outputs():
  x = random((2, 7, 12), 3)

  def net(layer):
    return hk.transform(lambda x: layer(10, name="proj")(jax.nn.relu(layer(12, name="fc")(x))))

  ours, theirs = net(linear.Linear), net(hk.Linear)
  params = theirs.init(jax.random.PRNGKey(0), x)
  assert jax.tree_util.tree_map(jnp.shape, ours.init(jax.random.PRNGKey(0), x)) == \
      jax.tree_util.tree_map(jnp.shape, params)
  # Same init too: the same rng draws the same weights.
  np.testing.assert_array_equal(ours.init(jax.random.PRNGKey(0), x)["fc"]["w"],
                                params["fc"]["w"])
  np.testing.assert_allclose(ours.apply(params, None, x), theirs.apply(params, None, x),
                             rtol=1e-6, atol=1e-6)
  loss = lambda f: lambda p: jnp.sum(f.apply(p, None, x) ** 2)
  got, want = jax.grad(loss(ours))(params), jax.grad(loss(theirs))(params)
  for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


TOKENS = jnp.zeros((2, 9), jnp.int32)


def tiny_gpt_loss(bias: bool) -> hk.Transformed:
  """A 2-layer GPT's loss, with or without biases."""
  cfg = model_config.GPTConfig(vocab_size=11, seq_len=8, num_layers=2, num_heads=2,
                               d_model=8, bias=bias)
  return hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)[0]))


def test_gpt_without_bias_has_no_bias_or_offset():
  def names(bias):
    loss = tiny_gpt_loss(bias)
    params = loss.init(jax.random.PRNGKey(0), TOKENS)
    assert np.isfinite(float(jax.jit(loss.apply)(params, TOKENS)))
    return {f"{module}/{name}" for module, leaves in params.items() for name in leaves}

  with_bias, without = names(True), names(False)
  removed = with_bias - without
  assert without < with_bias
  # Every linear layer's b and every layer norm's offset, nothing else.
  assert removed and all(n.endswith(("/b", "/offset")) for n in removed)
  assert not any(n.endswith(("/b", "/offset")) for n in without)


def test_resuming_across_bias_says_which_flag_differs():
  from examples.gpt import restoring  # pylint: disable=g-import-not-at-top
  from examples.gpt import saving  # pylint: disable=g-import-not-at-top

  def shapes(bias):
    return jax.eval_shape(tiny_gpt_loss(bias).init, jax.random.PRNGKey(0), TOKENS)

  for saved, wanted in ((True, False), (False, True)):
    with pytest.raises(saving.CheckpointError, match="--bias"):
      restoring.check_matches("ckpt/100", shapes(saved), shapes(wanted))
  restoring.check_matches("ckpt/100", shapes(False), shapes(False))
