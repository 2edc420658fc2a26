"""The memory floor of nested loops, and loops of three levels.

The reference workload: the gradient of a residual MLP stack ``x +
fc2(tanh(fc1 x))``, width 256, batch 1024, float32, so one carry is 1 MiB and
one layer's parameters 0.5 MiB. The alternative a user writes by hand is
``hk.layer_stack`` over an ``hk.remat``-ed block. Memory is the compiled
program's temp bytes (lowered and compiled, never run). Values and gradients
are compared with the same stack without checkpointing.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st

WIDTH, BATCH = 256, 1024


class Residual(hk.Module):

  def __call__(self, x):
    return x + hk.Linear(x.shape[-1], name="fc2")(jnp.tanh(hk.Linear(x.shape[-1], name="fc1")(x)))


@functools.cache   # (64, "nested") serves two tests
def _temp_bytes(num_layers, remat=None, *, layer_stack=False):
  def model(x):
    if layer_stack:
      return hk.layer_stack(num_layers)(hk.remat(lambda x: Residual()(x)))(x)
    return st.Stacked(Residual, num_layers, remat=remat, name="h").fold(x)

  loss = hk.without_apply_rng(hk.transform(lambda x: jnp.sum(model(x))))
  x = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)
  params = jax.eval_shape(loss.init, jax.random.PRNGKey(0), x)
  compiled = jax.jit(jax.grad(loss.apply)).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("num_layers", [64, 61])
def test_nested_needs_a_third_of_layer_stack_with_remat(num_layers):
  # 64 layers: 28.5 MiB (0.416x) when each chunk copied its parameters and
  # their gradient; the carries alone (8 + 8) and one layer's internals
  # need about 19.
  nested = _temp_bytes(num_layers, "nested")
  by_hand = _temp_bytes(num_layers, layer_stack=True)
  assert nested <= 0.33 * by_hand, (nested / 2**20, by_hand / 2**20)


def test_three_levels_need_less_than_two_at_64_layers():
  two = _temp_bytes(64, "nested")
  three = _temp_bytes(64, st.CheckpointPolicy(nested=(4, 4)))
  # 4 + 4 + 4 carries against 8 + 8: 4 MiB less.
  assert three <= two - 3.5 * 2**20, (three / 2**20, two / 2**20)


class Noisy(hk.Module):
  """A block with parameters, state, rng, a per-layer input and an output."""

  def __call__(self, x, scale):
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    h = jnp.tanh(hk.Linear(x.shape[-1])(x)) * scale
    h = h + 0.01 * jax.random.normal(hk.next_rng_key(), h.shape)
    return x + h, jnp.sum(h, axis=-1)


# Three levels with a remainder (11 = 2 * 2 * 2 + 3), without one (12), and a
# one-level tuple (two levels); reversed once, with the remainder: loops_test
# runs three levels both ways for every unroll, against a Python loop.
@pytest.mark.parametrize("nested,num_layers,reverse", [
    ((2, 2), 11, False), ((2, 2), 11, True), ((2, 3), 12, False), ((3,), 10, False)])
def test_three_levels_match_no_remat(nested, num_layers, reverse):
  def model(x, scales, remat):
    stack = st.Stacked(Noisy, num_layers, remat=remat, reverse=reverse, name="h")
    x, ys = stack.scan(x, st.per_layer(scales))
    return jnp.sum(x ** 2) + jnp.sum(jnp.sin(ys))

  f = hk.transform_with_state(model)
  x = jax.random.normal(jax.random.PRNGKey(1), (3, 8))
  scales = jnp.linspace(0.5, 1.5, num_layers)
  params, state = f.init(jax.random.PRNGKey(0), x, scales, "none")

  def grads(remat):
    loss = lambda p, x, s: f.apply(p, state, jax.random.PRNGKey(2), x, s, remat)[0]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, x, scales)

  got = grads(st.CheckpointPolicy(nested=nested))
  want = grads("none")
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    # float32: a gradient summed over layers loses a few ulps of its largest
    # terms in its smallest entries.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(b))))


def test_three_level_split_is_said():
  policy = st.CheckpointPolicy(nested=(4, 4))
  assert policy.nested_split(64) == (4, 4, 4, 0)
  assert policy.nested_split(70) == (4, 4, 4, 6)
  with pytest.raises(ValueError, match=r"nested=\(4, 4\)\) asks for 16 chunks"):
    st.fold(lambda h, w: h * w, remat=policy)(jnp.ones(2), jnp.ones((10, 2)))


def test_grad_of_grad_and_hessian_through_nested():
  def loss(w, h, remat):
    return jnp.sum(st.fold(lambda h, w: jnp.tanh(h * w), remat=remat)(h, w) ** 2)

  w, h = jnp.linspace(0.1, 1.0, 9), jnp.linspace(0.5, 1.5, 3)

  @functools.partial(jax.jit, static_argnums=0)   # one program per policy
  def both(remat):
    grad_of_grad = jax.grad(lambda w: jnp.sum(jax.grad(loss)(w, h, remat) ** 2))(w)
    return grad_of_grad, jax.hessian(loss)(w, h, remat)

  want = both("none")
  for remat in ("nested", st.CheckpointPolicy(nested=(2, 2))):
    got = both(remat)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_an_unread_output_with_an_infinite_derivative_gives_no_nan():
  # sqrt at 0 has an infinite derivative; a y nobody reads has a zero
  # cotangent, and zero times it must not reach the gradient (as without remat).
  def step(h, w):
    h = jnp.tanh(h * w)
    return h, jnp.sqrt(jnp.sum(h * 0.0))

  def loss(w, remat):
    h, _ = st.scan(step, remat=remat)(jnp.ones(3), w)
    return jnp.sum(h)

  w = jnp.linspace(0.1, 1.0, 9)
  want = jax.grad(loss)(w, "none")
  assert np.all(np.isfinite(want))
  for remat in ("nested", st.CheckpointPolicy(nested=(2, 2))):
    np.testing.assert_allclose(jax.grad(loss)(w, remat), want, rtol=1e-6)
