"""Tests for stochastic depth: ``layer_drop=`` on ``st.Stacked`` and ``st.BlockSeq``.

The reference is a Python loop over the stacked parameters, sliced per layer
and applied by a plain-``jnp`` copy of each block, that draws the per-layer
keys the way the stack documents (the transform's second key, split per
layer; layer ``i`` dropped when ``bernoulli(fold_in(key_i, DROP_SALT),
rate_i)``), skips dropped layers with a Python ``if`` and scales a kept
layer's update by ``1 / (1 - rate)``. Values and ``jax.grad`` gradients are
compared for every remat alias, per-depth segments, a mixed-layer pattern
and BlockSeq.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st
from stacktools.step import _layer_step

from haiku_helpers import check_jax_usage  # pylint: disable=unused-import  # autouse fixture

D, L = 4, 6
KEY = jax.random.PRNGKey(7)
X = jax.random.normal(jax.random.PRNGKey(1), (3, D))
RATES = [0.5, 0.2, 0.6, 0.0, 0.5, 0.4]
PATTERN = ("a", "a", "b")


def _block_a():
  return lambda x: x + jnp.tanh(hk.Linear(D, name="fc")(x))


def _block_b():
  return lambda x: x + 0.5 * jax.nn.relu(hk.Linear(D, name="fc")(x))


def _ref_a(p, x):
  return x + jnp.tanh(x @ p["fc"]["w"] + p["fc"]["b"])


def _ref_b(p, x):
  return x + 0.5 * jax.nn.relu(x @ p["fc"]["w"] + p["fc"]["b"])


def _model(cls, *, pattern=None, mode="fold", **kwargs):
  def f(x):
    if pattern is None:
      stack = cls(_block_a if mode == "fold" else _scan_block, L, name="h", **kwargs)
    else:
      stack = cls({"a": _block_a, "b": _block_b}, L, pattern=pattern, name="h", **kwargs)
    return stack.fold(x) if mode == "fold" else stack.scan(x)
  return hk.transform(f)


def _scan_block():
  def block(x):
    new = _block_a()(x)
    return new, jnp.sum(new - x)
  return block


def _dropped(rates):
  """Each layer's drop decision, drawn as the stack documents."""
  def keys(x):
    del x
    hk.maybe_next_rng_key()           # the init key
    return jax.random.split(hk.next_rng_key(), L)
  layer_keys = hk.transform(keys).apply({}, KEY, X)
  return [bool(jax.random.bernoulli(jax.random.fold_in(layer_keys[i], _layer_step.DROP_SALT),
                                    rates[i])) for i in range(L)]


def _reference(params, x, rates, pattern=None, dropped=None):
  """A Python loop over layers; returns ``(x, per-layer sums of the update)``.

  ``dropped``: ``_dropped(rates)``, when drawn already (outside a jit).
  """
  flat = st.unstack_params(params, "h", pattern=pattern)
  dropped = _dropped(rates) if dropped is None else dropped
  ys = []
  for i in range(L):
    if dropped[i]:
      ys.append(jnp.zeros(()))
      continue
    p = {"fc": flat[f"h/layer_{i}/fc"]}
    kind = "a" if pattern is None else pattern[i % len(pattern)]
    new = (_ref_a if kind == "a" else _ref_b)(p, x)
    ys.append(jnp.sum(new - x))
    x = x + (new - x) / (1 - rates[i]) if rates[i] else new
  return x, jnp.stack(ys)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _ref_value_and_grad(params, rates, pattern, dropped):
  """The reference's loss, outputs and gradients, jitted: its drops are Python
  bools, drawn outside (one program for every stack it is compared with)."""
  def ref_loss(params):
    x, ys = _reference(params, X, rates, pattern, dropped)
    return jnp.sum(jnp.sin(x)), (x, ys)
  return jax.value_and_grad(ref_loss, has_aux=True)(params)


def _check(model, params, rates, pattern=None, scan=False):
  def loss(params):
    out = model.apply(params, KEY, X)
    return jnp.sum(jnp.sin(out[0]) if scan else jnp.sin(out)), out

  (value, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  (ref_value, ref_out), ref_grads = _ref_value_and_grad(
      params, tuple(rates), pattern, tuple(_dropped(rates)))
  # A sum of sines of every output: float32 sums in another order (another
  # CPU's vector width) differ by a few ulps of the sum; a layer dropped or
  # kept wrongly moves it by far more.
  np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
  if scan:
    np.testing.assert_allclose(out[0], ref_out[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[1], ref_out[1], rtol=1e-5, atol=1e-6)
  else:
    np.testing.assert_allclose(out, ref_out[0], rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


REMATS = ["none", "full", "nested", "offload", "save_all"]


@pytest.mark.parametrize("remat", REMATS + ["per_depth"])
def test_stacked_equals_a_python_loop_that_draws_the_same_keys(remat):
  if remat == "per_depth":
    remat = st.per_depth("none:2,full:4")
  model = _model(st.Stacked, remat=remat, layer_drop=RATES)
  params = model.init(KEY, X)
  dropped = _dropped(RATES)
  assert any(dropped) and not all(dropped)   # the case skips some layers
  _check(model, params, RATES)


def test_blockseq_drops_the_same_layers():
  stacked = _model(st.Stacked, layer_drop=RATES)
  params = stacked.init(KEY, X)
  seq = _model(st.BlockSeq, remat="full", layer_drop=RATES)
  got = seq.apply(st.unstack_params(params, "h"), KEY, X)
  np.testing.assert_allclose(got, _reference(params, X, RATES)[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got, stacked.apply(params, KEY, X), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("remat", ["none", "nested"])
def test_a_mixed_layer_stack_drops_by_global_index(remat):
  rates = [0.0, 0.0, 0.9, 0.0, 0.0, 0.9]       # only the b layers (2 and 5) may drop
  model = _model(st.Stacked, pattern=PATTERN, remat=remat, layer_drop=rates)
  params = model.init(KEY, X)
  _check(model, params, rates, PATTERN)
  assert [i for i, d in enumerate(_dropped(rates)) if d] in ([2], [5], [2, 5])


def test_a_scan_block_gives_zeros_for_a_dropped_layer():
  model = _model(st.Stacked, mode="scan", remat="full", layer_drop=0.5)
  params = model.init(KEY, X)
  rates = [0.5] * L
  _check(model, params, rates, scan=True)
  _, ys = model.apply(params, KEY, X)
  assert [bool(y == 0) for y in ys] == _dropped(rates)


def test_rate_zero_is_the_plain_stack_to_the_bit():
  plain = _model(st.Stacked, remat="full")
  params = plain.init(KEY, X)
  for rates in (0.0, [0.0] * L):
    zero = _model(st.Stacked, remat="full", layer_drop=rates)
    np.testing.assert_array_equal(zero.apply(params, KEY, X), plain.apply(params, KEY, X))
    np.testing.assert_array_equal(zero.apply(params, None, X), plain.apply(params, None, X))


def test_evaluation_without_layer_drop_runs_every_layer():
  params = _model(st.Stacked, layer_drop=0.5).init(KEY, X)
  got = _model(st.Stacked, layer_drop=None).apply(params, None, X)
  np.testing.assert_allclose(got, _reference(params, X, [0.0] * L)[0], rtol=1e-6, atol=1e-6)


def test_a_dropped_layer_keeps_its_state():
  def block():
    def f(x):
      count = hk.get_state("count", (), jnp.int32, init=jnp.zeros)
      hk.set_state("count", count + 1)
      return x + hk.Linear(D, name="fc")(x)
    return f
  model = hk.transform_with_state(
      lambda x: st.Stacked(block, L, layer_drop=RATES, name="h").fold(x))
  params, state = model.init(KEY, X)
  _, new_state = model.apply(params, state, KEY, X)
  (module,) = new_state
  moved = new_state[module]["count"] - state[module]["count"]
  assert moved.tolist() == [0 if d else 1 for d in _dropped(RATES)]


@pytest.mark.parametrize("layer_drop, error, message", [
    (1.0, ValueError, r"Stacked: layer_drop=1.0 has a rate outside \[0, 1\)"),
    ([0.1, 0.2], ValueError, r"Stacked: layer_drop= has 2 rates, but the stack has "
     r"num_layers=6"),
    ("0.1", TypeError, r"Stacked: layer_drop='0.1' is not a rate"),
])
def test_bad_rates_are_named(layer_drop, error, message):
  with pytest.raises(error, match=message):
    _model(st.Stacked, layer_drop=layer_drop).init(KEY, X)


def test_traced_rates_are_named():
  # Once it failed with a generic message under jax.jit.
  params = jax.eval_shape(_model(st.Stacked).init, KEY, X)
  apply = lambda rates: _model(st.Stacked, layer_drop=rates).apply(params, KEY, X)  # noqa: E731
  with pytest.raises(TypeError, match=r"^Stacked: layer_drop= was given a traced value "
                     r"\(an array of shape \(6,\).*the rates are fixed when the stack is "
                     r"built, so they must be concrete: Python floats or a numpy array"):
    jax.eval_shape(apply, jnp.asarray(RATES))
  # Concrete rates, closed over, trace.
  assert jax.eval_shape(lambda: apply(np.asarray(RATES))).shape == X.shape


def test_apply_without_an_rng_is_refused():
  model = _model(st.BlockSeq, layer_drop=0.1)
  params = model.init(KEY, X)
  with pytest.raises(ValueError, match=r"BlockSeq: layer_drop= skips layers at random, "
                     r"which needs an rng.*layer_drop=None"):
    model.apply(params, None, X)


def test_a_scan_output_without_zeros_is_refused():
  def block():
    return lambda x: (x + hk.Linear(D, name="fc")(x), jax.random.key(0))
  model = hk.transform(lambda x: st.Stacked(block, L, layer_drop=0.1, name="h").scan(x))
  params = model.init(KEY, X)
  with pytest.raises(TypeError, match=r"Stacked: layer_drop= gives a dropped layer's "
                     r"scan output zeros, but y is key<fry>"):
    model.apply(params, KEY, X)
