"""Tests for st.layer_stack, the drop-in for hk.layer_stack.

Ports the behaviours of Haiku's own ``layer_stack_test.py`` and checks each
against two independent references:

* a Python loop that slices the stacked parameters and applies a plainly
  ``hk.transform``-ed single layer (values, and ``jax.grad`` through it);
* ``hk.layer_stack`` itself: for the same function the parameter and state
  trees have the same keys, shapes and dtypes, and given Haiku's parameters,
  state and rng ``st.layer_stack`` computes the same outputs and new state.

Where stacktools deliberately differs (initial state, two stacks with the same
name), the test says so and shows Haiku's behaviour.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st

from haiku_helpers import (D, assert_close, jitted, layer_slice, random_like, random_x,
                           restack, signature, sin_loss, stack_layers)
from haiku_helpers import check_jax_usage  # pylint: disable=unused-import  # autouse fixture

INIT_KEY = jax.random.PRNGKey(42)
APPLY_KEY = jax.random.PRNGKey(7)
NO_PER_LAYER = "__layer_stack_no_per_layer"
WITH_PER_LAYER = "__layer_stack_with_per_layer"


# ---------------------------------------------------------------------------
# Helpers (more in haiku_helpers).


def _loop(f, params, x_args, *, num_layers, prefix=NO_PER_LAYER, ys=None,
          reverse=False, state=None, fn_kwargs=None):
  """The reference: ``f`` applied layer by layer to sliced params (no rng).

  With ``ys=None`` it mirrors ``layer_stack(n)(f)(*x_args)``; with ``ys`` (a
  tuple, maybe empty, of arrays with a leading layer axis) it mirrors
  ``layer_stack(n, with_per_layer_inputs=True)(f)(x_args[0], *ys)`` and
  returns ``(x, zs)``. Returns the new state too when ``state`` is given.

  Runs as one jitted program: op by op, each of its operations would compile
  as a program of its own.
  """
  loop = functools.partial(_loop_body, f, num_layers=num_layers, prefix=prefix,
                           reverse=reverse, fn_kwargs=fn_kwargs)
  return jax.jit(loop)(params, x_args, ys, state)


def _loop_body(f, params, x_args, ys, state, *, num_layers, prefix, reverse, fn_kwargs):
  layer = hk.transform_with_state(f)
  per_layer = ys is not None
  carry = x_args[0] if per_layer else tuple(x_args)
  zs, states = [None] * num_layers, [None] * num_layers
  for i in (reversed(range(num_layers)) if reverse else range(num_layers)):
    layer_state = {} if state is None else layer_slice(state, prefix, i)
    if per_layer:
      (carry, zs[i]), states[i] = layer.apply(
          layer_slice(params, prefix, i), layer_state, None, carry,
          *[y[i] for y in ys], **(fn_kwargs or {}))
    else:
      out, states[i] = layer.apply(layer_slice(params, prefix, i), layer_state,
                                   None, *carry, **(fn_kwargs or {}))
      carry = (out,) if len(x_args) == 1 else out
  if per_layer:
    out = (carry, stack_layers(zs))
  else:
    out = carry[0] if len(x_args) == 1 else carry
  if state is None:
    return out
  return out, restack(states, prefix)


def _assert_like_hk(build, *args, rng=None, reverse=None):
  """Checks ``build(st.layer_stack)`` against ``build(hk.layer_stack)``.

  ``build(ls)`` returns the function to transform, written once for both.
  Asserts identical param/state keys, shapes and dtypes (from both inits,
  traced only), then applies both to the same parameters and state in
  Haiku's layout (random, shaped like Haiku's) and the same rng, and asserts
  equal outputs and new state.

  Returns:
    ``(st_transformed, params, state, (st_out, st_new_state))``.
  """
  kw = {} if reverse is None else {"reverse": reverse}
  hk_t = hk.transform_with_state(build(hk.layer_stack))
  st_t = hk.transform_with_state(build(st.layer_stack))
  hk_params, hk_state = jax.eval_shape(
      lambda *a: hk_t.init(INIT_KEY, *a, **kw), *args)
  st_params, st_state = jax.eval_shape(
      lambda *a: st_t.init(INIT_KEY, *a, **kw), *args)
  assert signature(st_params) == signature(hk_params)
  assert signature(st_state) == signature(hk_state)
  params, state = random_like(hk_params), random_like(hk_state, seed=1)

  @jax.jit
  def both(params, state, rng, *args):
    return (hk_t.apply(params, state, rng, *args, **kw),
            st_t.apply(params, state, rng, *args, **kw))

  hk_out, st_out = both(params, state, rng, *args)
  assert_close(st_out, hk_out)
  return st_t, params, state, st_out


def _residual(x):
  x = x + jnp.tanh(hk.Linear(D, name="linear1")(x))
  x = x + 0.5 * jnp.tanh(hk.Linear(D, name="linear2")(x))
  return x / (1.0 + jnp.mean(jnp.abs(x)))


# ---------------------------------------------------------------------------
# Equivalence with an unrolled loop (Haiku's test_layer_stack and _grads).


@pytest.mark.parametrize("unroll", [1, 2, 4])
def test_matches_unrolled_loop_values_and_grads(unroll):
  n = 5  # Not a multiple of 2 or 4: the unrolled scan has a remainder.
  x = random_x()
  st_t, params, _, (out, _) = _assert_like_hk(
      lambda ls: lambda x: ls(n, unroll=unroll)(_residual)(x), x)
  assert signature(params) == {
      f"{NO_PER_LAYER}/linear1": {"b": ((n, D), "float32"), "w": ((n, D, D), "float32")},
      f"{NO_PER_LAYER}/linear2": {"b": ((n, D), "float32"), "w": ((n, D, D), "float32")},
  }
  assert_close(out, _loop(_residual, params, (x,), num_layers=n))

  def stacked_loss(p, x):
    return sin_loss(st_t.apply(p, {}, None, x)[0])

  def loop_loss(p, x):
    return sin_loss(_loop(_residual, p, (x,), num_layers=n))

  grads = jax.jit(jax.grad(stacked_loss, argnums=(0, 1)))(params, x)
  assert_close(grads, jax.jit(jax.grad(loop_loss, argnums=(0, 1)))(params, x),
                rtol=1e-4, atol=1e-5)


def test_multiple_args():
  n = 4

  def inner(x, y):
    x_out = x + jnp.tanh(hk.Linear(D, name="linear1")(y))
    y_out = y + jnp.tanh(hk.Linear(D, name="linear2")(x))
    return x_out, y_out

  x, y = random_x(seed=0), random_x(seed=1)
  _, params, _, (out, _) = _assert_like_hk(
      lambda ls: lambda x, y: ls(n)(inner)(x, y), x, y)
  assert isinstance(out, tuple) and len(out) == 2
  assert_close(out, _loop(inner, params, (x, y), num_layers=n))


def test_container_carry():
  n = 3

  def inner(tree):
    h = tree["a"] + jnp.tanh(hk.Linear(D)(tree["b"][0]))
    return {"a": h, "b": (tree["b"][0] * 0.5 + h, tree["b"][1] + 1.0)}

  tree = {"a": random_x(seed=0), "b": (random_x(seed=1), jnp.zeros(()))}
  _, params, _, (out, _) = _assert_like_hk(
      lambda ls: lambda t: ls(n)(inner)(t), tree)
  assert_close(out, _loop(inner, params, (tree,), num_layers=n))
  assert float(out["b"][1]) == n


def test_varargs_rejected():
  class VarArgs(hk.Module):

    def __call__(self, *args):
      return args

  class NoVarArgs(hk.Module):

    def __call__(self, x):
      return x

  def build(module_cls):
    return hk.transform(lambda x: st.layer_stack(2)(module_cls())(x))

  x = jnp.ones([5])
  jax.eval_shape(build(NoVarArgs).init, INIT_KEY, x)
  with pytest.raises(ValueError, match=r"`VarArgs.__call__` must not take \*args"):
    jax.eval_shape(build(VarArgs).init, INIT_KEY, x)
  with pytest.raises(ValueError, match=r"must not take \*args.*def f\(x, y\)"):
    st.layer_stack(2)(lambda *xs: xs)
  # hk.layer_stack's wording too, so code matching Haiku's error keeps working
  # (Haiku's test_layer_stack_no_varargs, run in haiku_layer_stack_test.py).
  def f(*xs):
    return xs
  for ls in (st.layer_stack, hk.layer_stack):
    with pytest.raises(ValueError, match=(
        r"The function `f` should not have any `varargs` \(that is \*args\) "
        r"argument")):
      ls(2)(f)


# ---------------------------------------------------------------------------
# Per-layer inputs.


def test_per_layer_inputs_threading():
  n = 5

  def f(x, y):
    x = x + y * jax.nn.one_hot(y.astype(jnp.int32), len(x)) / 10
    return x, 2 * y

  x = np.zeros(n, np.float32)
  ys = np.arange(n).astype(np.float32)
  _, _, _, ((out, zs), _) = _assert_like_hk(
      lambda ls: lambda x, ys: ls(n, with_per_layer_inputs=True)(f)(x, ys), x, ys)
  assert zs.shape == (n,)
  np.testing.assert_allclose(out, [0, .1, .2, .3, .4], rtol=1e-6)
  np.testing.assert_array_equal(zs, 2 * ys)


def test_per_layer_inputs_multiple_args():
  n, batch = 3, 5

  def f(x, a, b):
    w_init = hk.initializers.Constant(jnp.eye(D))
    return hk.Linear(D, w_init=w_init)(x) * a + b, None

  def build(ls):
    return lambda x, a, b: ls(n, with_per_layer_inputs=True)(f)(x, a, b)

  x, a, b = jnp.zeros([batch, D]), jnp.full([n], 2.0), jnp.ones([n])
  st_t, params, _, ((out, z), _) = _assert_like_hk(build, x + 1.0, a + random_x((n,)), b)
  assert z is None
  expected, _ = _loop(f, params, (x + 1.0,), num_layers=n, prefix=WITH_PER_LAYER,
                      ys=(a + random_x((n,)), b))
  assert_close(out, expected)
  # Haiku's port: with its own init (identity, zero bias) x -> 2x + 1 three
  # times from 0 gives 7.
  st_t = jitted(st_t)
  params, state = st_t.init(INIT_KEY, x, a, b)
  (out, _), _ = st_t.apply(params, state, None, x, a, b)
  np.testing.assert_array_equal(out, np.full([batch, D], 7.0))


@pytest.mark.parametrize("container", ["dict", "tuple"])
def test_container_per_layer_outputs(container):
  n, batch, width = 3, 2, 2

  def f(x):
    w_init = hk.initializers.Constant(jnp.eye(width))
    out = hk.Linear(width, w_init=w_init)(x)
    if container == "dict":
      z = {"raw_output": out, "output_projection": jnp.sum(out)}
    else:
      z = (out, (jnp.sum(out), jnp.max(out)))
    return out + jnp.ones_like(out), z

  x = jnp.zeros([batch, width])
  st_t, params, _, ((out, z), _) = _assert_like_hk(
      lambda ls: lambda x: ls(n, with_per_layer_inputs=True)(f)(x), x + 0.5)
  assert_close((out, z), _loop(f, params, (x + 0.5,), num_layers=n,
                                prefix=WITH_PER_LAYER, ys=()))
  # Haiku's port, with its own (identity) init.
  st_t = jitted(st_t)
  params, state = st_t.init(INIT_KEY, x)
  (out, z), _ = st_t.apply(params, state, None, x)
  raw, proj = ((z["raw_output"], z["output_projection"]) if container == "dict"
               else (z[0], z[1][0]))
  assert out.shape == (batch, width)
  assert raw.shape == (n, batch, width)
  assert proj.shape == (n,)
  np.testing.assert_array_equal(np.sum(proj), 12.0)
  np.testing.assert_array_equal(raw, np.broadcast_to(
      np.array([0.0, 1.0, 2.0])[:, None, None], (n, batch, width)))


# ---------------------------------------------------------------------------
# Nested stacks.


def test_nested_stack_shapes_match_hk():
  def build(ls):
    def fn(x):
      inner = ls(10)(lambda x: hk.Linear(100)(x))
      return ls(20)(inner)(x)
    return hk.transform(fn)

  x = jax.ShapeDtypeStruct((10, 100), jnp.float32)
  st_shapes = signature(jax.eval_shape(build(st.layer_stack).init, INIT_KEY, x))
  hk_shapes = signature(jax.eval_shape(build(hk.layer_stack).init, INIT_KEY, x))
  assert st_shapes == hk_shapes
  assert st_shapes == {f"{NO_PER_LAYER}/{NO_PER_LAYER}/linear": {
      "w": ((20, 10, 100, 100), "float32"), "b": ((20, 10, 100), "float32")}}


def test_nested_stack_values_match_double_loop():
  outer_n, inner_n = 3, 2

  def layer(x):
    return x + jnp.tanh(hk.Linear(D)(x))

  x = random_x()
  _, params, _, (out, _) = _assert_like_hk(
      lambda ls: lambda x: ls(outer_n)(ls(inner_n)(layer))(x), x)
  (name,) = params

  @jax.jit
  def double_loop(x, w, b):
    for i in range(outer_n):
      for j in range(inner_n):
        x = x + jnp.tanh(x @ w[i, j] + b[i, j])
    return x
  assert_close(out, double_loop(x, params[name]["w"], params[name]["b"]))


# ---------------------------------------------------------------------------
# Reverse.


def _affine(x):
  return hk.Linear(x.shape[-1], name="affine")(x)


@pytest.mark.parametrize("reverse", [False, True])
def test_reverse_matches_reversed_loop(reverse):
  n = 4
  x = random_x()
  _, params, _, (out, _) = _assert_like_hk(
      lambda ls: lambda x, reverse: ls(n)(_affine)(x, reverse=reverse),
      x, reverse=reverse)
  assert_close(out, _loop(_affine, params, (x,), num_layers=n, reverse=reverse))
  other = _loop(_affine, params, (x,), num_layers=n, reverse=not reverse)
  assert not np.allclose(out, other, rtol=1e-3)


def test_reverse_with_per_layer_inputs_keeps_zs_in_layer_order():
  n = 4

  def f(x, extra):
    out = hk.Linear(x.shape[-1])(x) * extra
    return out, out

  extra = (jnp.arange(n) + 1.0) * 0.7
  x = random_x()
  _, params, _, ((out, zs), _) = _assert_like_hk(
      lambda ls: lambda x, e, reverse: ls(n, with_per_layer_inputs=True)(f)(
          x, e, reverse=reverse), x, extra, reverse=True)
  expected = _loop(f, params, (x,), num_layers=n, prefix=WITH_PER_LAYER,
                   ys=(extra,), reverse=True)
  assert_close((out, zs), expected)
  # zs[i] is layer i's output; layer 0 is applied last and gives the final x.
  assert_close(out, zs[0])


def test_reverse_passed_to_layer_fn_in_nested_stacks():
  outer_n, inner_n = 2, 2

  def inner_fn(x, extra):
    out = hk.Linear(x.shape[-1])(x) * extra
    return out, out

  def build(ls):
    def outer_fn(x, extra, reverse=False):
      return ls(inner_n, with_per_layer_inputs=True)(inner_fn)(
          x, extra, reverse=reverse)

    def fn(x, extra, reverse):
      return ls(outer_n, with_per_layer_inputs=True,
                pass_reverse_to_layer_fn=True)(outer_fn)(x, extra, reverse=reverse)
    return fn

  extra = (jnp.arange(outer_n * inner_n).reshape(outer_n, inner_n) + 1.0) * 0.7
  x = random_x()
  for reverse in (False, True):
    _, params, _, ((out, zs), _) = _assert_like_hk(build, x, extra, reverse=reverse)
    (name,) = params
    assert zs.shape == (outer_n, inner_n) + x.shape
    # Reference: all outer*inner layers, flattened, in (reversed) order.
    order = [(i, j) for i in range(outer_n) for j in range(inner_n)]
    expected, expected_zs = x, np.zeros(zs.shape, np.float32)
    for i, j in (reversed(order) if reverse else order):
      w, b = params[name]["w"][i, j], params[name]["b"][i, j]
      expected = (expected @ w + b) * extra[i, j]
      expected_zs[i, j] = expected
    assert_close((out, zs), (expected, expected_zs))


@pytest.mark.parametrize("pass_reverse", [False, True])
def test_pass_reverse_to_layer_fn(pass_reverse):
  n = 3
  seen = []

  def f(x, reverse=None):
    seen.append(reverse)
    return x + (1.0 if reverse else 0.0)

  fn = hk.transform(lambda x: st.layer_stack(
      n, pass_reverse_to_layer_fn=pass_reverse)(f)(x, reverse=True))
  out = fn.apply({}, None, jnp.zeros(()))
  assert set(seen) == ({True} if pass_reverse else {None})
  assert float(out) == (n if pass_reverse else 0.0)


# ---------------------------------------------------------------------------
# Parameter reuse.


def test_parameter_reuse():
  n = 5

  def block(x):
    return jax.nn.relu(hk.Linear(output_size=x.shape[-1], with_bias=False)(x))

  def build(ls):
    class MLP(hk.Module):

      def __call__(self, x):
        return ls(n)(block)(x)

    def f(x):
      mlp = MLP()
      return mlp(mlp(x))
    return f

  x = jnp.abs(random_x((2, 2)))
  _, params, _, (out, _) = _assert_like_hk(build, x)
  # 5 layers * (2 * 2 weights) = 20: the second call reuses the first's.
  assert hk.data_structures.tree_size(params) == 20
  (prefix,) = [k.rsplit("/", 1)[0] for k in params]
  once = _loop(block, params, (x,), num_layers=n, prefix=prefix)
  assert_close(out, _loop(block, params, (once,), num_layers=n, prefix=prefix))

  # Outside a module, two calls make two stacks, as in Haiku.
  def build_top(ls):
    def f(x):
      stack = ls(n)(block)
      return stack(stack(x))
    return hk.transform(f)
  shapes = signature(jax.eval_shape(build_top(st.layer_stack).init, INIT_KEY, x))
  assert shapes == signature(jax.eval_shape(build_top(hk.layer_stack).init, INIT_KEY, x))
  assert sorted(shapes) == [f"{NO_PER_LAYER}/linear", f"{NO_PER_LAYER}_1/linear"]


# ---------------------------------------------------------------------------
# Randomness.


def test_per_layer_keys_distinct_and_same_as_hk():
  n = 6

  def f(x):
    return x, jax.random.normal(hk.next_rng_key(), (3,))

  def build(ls):
    return lambda x: ls(n, with_per_layer_inputs=True)(f)(x)

  _, _, _, ((_, zs), _) = _assert_like_hk(build, random_x(), rng=APPLY_KEY)
  assert zs.shape == (n, 3)
  assert len({tuple(np.asarray(row).tolist()) for row in zs}) == n
  _, _, _, ((_, zs_other), _) = _assert_like_hk(build, random_x(), rng=INIT_KEY)
  assert not np.any(np.asarray(zs) == np.asarray(zs_other))


def test_dropout_same_as_hk():
  n = 4

  def f(x):
    return hk.dropout(hk.next_rng_key(), 0.5, x)

  x = jnp.ones((3, 16))
  _, _, _, (out, _) = _assert_like_hk(lambda ls: lambda x: ls(n)(f)(x), x,
                                      rng=APPLY_KEY)
  # Four independent masks of keep-probability 1/2: 2**4 where all kept.
  assert set(np.unique(np.asarray(out)).tolist()) <= {0.0, 16.0}
  assert 0 < np.count_nonzero(out) < out.size


def test_rng_none():
  n = 3
  det = hk.transform(lambda x: st.layer_stack(n)(_affine)(x))
  x = random_x()
  params = random_like(jax.eval_shape(det.init, INIT_KEY, x))
  assert_close(det.apply(params, None, x),
                _loop(_affine, params, (x,), num_layers=n))

  rand = hk.transform(lambda x: st.layer_stack(n)(
      lambda x: x + jax.random.normal(hk.next_rng_key(), x.shape))(x))
  # Haiku's own error (a ValueError subclass, MissingRNGError).
  with pytest.raises(ValueError, match="You must pass a non-None PRNGKey"):
    jax.eval_shape(lambda x: rand.apply({}, None, x), x)


def test_drop_in_leaves_the_rest_of_the_model_unchanged():
  """The stack draws as many keys as hk.layer_stack, at init and at apply."""
  def build(ls):
    def fn(x):
      x = hk.Linear(D, name="pre")(x)
      x = ls(3)(lambda x: x + jnp.tanh(hk.Linear(D)(x)))(x)
      x = hk.Linear(D, name="post")(x)
      return x + jax.random.normal(hk.next_rng_key(), x.shape)
    return hk.transform(fn)

  x = random_x()
  hk_params = jax.jit(build(hk.layer_stack).init)(INIT_KEY, x)
  st_params = jax.jit(build(st.layer_stack).init)(INIT_KEY, x)
  for name in ("pre", "post"):
    jax.tree.map(np.testing.assert_array_equal, st_params[name], hk_params[name])
  # The stacked layers differ: vmapped init vs Haiku's sequential one.
  assert signature(st_params) == signature(hk_params)
  assert_close(build(st.layer_stack).apply(hk_params, APPLY_KEY, x),
                build(hk.layer_stack).apply(hk_params, APPLY_KEY, x))


# ---------------------------------------------------------------------------
# State.


def _counter(x):
  count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
  hk.set_state("count", count + 1)
  last = hk.get_state("last", [x.shape[-1]], jnp.float32, init=jnp.zeros)
  hk.set_state("last", last + jnp.mean(x, axis=0))
  return x + jnp.tanh(hk.Linear(x.shape[-1])(x))


def test_state_matches_hk_and_loop():
  n = 3
  x = random_x()
  st_t, params, state, (out, new_state) = _assert_like_hk(
      lambda ls: lambda x: ls(n)(_counter)(x), x)
  expected = _loop(_counter, params, (x,), num_layers=n, state=state)
  assert_close((out, new_state), expected)
  prefix = f"{NO_PER_LAYER}/~"
  np.testing.assert_array_equal(new_state[prefix]["count"], state[prefix]["count"] + 1)

  # st.layer_stack's initial state is the block's own (zeros); Haiku's init
  # runs every layer once, so its state starts one step in.
  hk_t = jitted(hk.transform_with_state(lambda x: hk.layer_stack(n)(_counter)(x)))
  st_t = jitted(st_t)
  params, st_state = st_t.init(INIT_KEY, x)
  _, hk_state = hk_t.init(INIT_KEY, x)
  np.testing.assert_array_equal(st_state[prefix]["count"], np.zeros(n, np.int32))
  np.testing.assert_array_equal(st_state[prefix]["last"], np.zeros((n, D)))
  np.testing.assert_array_equal(hk_state[prefix]["count"], np.ones(n, np.int32))
  _, new_state = st_t.apply(params, st_state, None, x)
  np.testing.assert_array_equal(new_state[prefix]["count"], np.ones(n, np.int32))
  # Every layer saw a different input, so each advanced its own state.
  assert len({tuple(np.asarray(r).tolist()) for r in new_state[prefix]["last"]}) == n


def _two_stacks_same_name(layer_stack):
  def counter(x):
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    return x

  def fn(x):
    x = layer_stack(2, name="stack")(counter)(x)
    return layer_stack(2, name="stack")(counter)(x)

  return hk.transform_with_state(fn)


@pytest.mark.parametrize("layer_stack", [
    st.layer_stack,
    pytest.param(hk.layer_stack, marks=pytest.mark.xfail(
        strict=True, reason="hk.layer_stack's updater writes to the requested "
        "name, so the second stack's state lands on the first's")),
], ids=["st", "hk"])
def test_two_stacks_with_one_name_keep_separate_state(layer_stack):
  t = _two_stacks_same_name(layer_stack)
  x = jnp.ones([2])
  state = {"stack/~": {"count": jnp.array([3, 4])},
           "stack_1/~": {"count": jnp.array([10, 20])}}
  assert signature(jax.eval_shape(t.init, INIT_KEY, x)[1]) == signature(state)
  _, new_state = t.apply({}, state, None, x)
  np.testing.assert_array_equal(new_state["stack/~"]["count"], [4, 5])
  np.testing.assert_array_equal(new_state["stack_1/~"]["count"], [11, 21])


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("num_layers,error,match", [
    (0, ValueError, r"layer_stack: num_layers must be >= 1, got 0"),
    (-1, ValueError, r"layer_stack: num_layers must be >= 1, got -1"),
    (2.5, TypeError, r"layer_stack: num_layers must be an int >= 1, got 2\.5"),
])
def test_bad_num_layers(num_layers, error, match):
  with pytest.raises(error, match=match):
    st.layer_stack(num_layers)


def test_bad_remat_and_unroll():
  with pytest.raises(ValueError, match=r"remat='bogus' is not a checkpoint "
                     r"policy\. Accepted: False, None, True, 'none', 'full', "
                     r"'nested', 'offload', 'save_all'"):
    st.layer_stack(2, remat="bogus")
  with pytest.raises(ValueError, match=r"layer_stack: unroll=0 is not accepted: use an int >= 1"):
    st.layer_stack(2, unroll=0)


def test_per_layer_function_must_return_a_pair():
  fn = hk.transform(lambda x, ys: st.layer_stack(2, with_per_layer_inputs=True)(
      lambda x, y: x + y)(x, ys))
  with pytest.raises(TypeError, match=r"must return a pair \(x, z\), but it "
                     r"returned an array of shape \(3,\)"):
    jax.eval_shape(fn.init, INIT_KEY, jnp.zeros(3), jnp.ones((2, 3)))


def test_per_layer_function_error_suggests_a_real_fix():
  # layer_stack has no .fold: the hint must point at with_per_layer_inputs.
  fn = hk.transform(lambda x, ys: st.layer_stack(2, with_per_layer_inputs=True)(
      lambda x, y: x + y)(x, ys))
  with pytest.raises(TypeError, match=r"with_per_layer_inputs") as info:
    jax.eval_shape(fn.init, INIT_KEY, jnp.zeros(3), jnp.ones((2, 3)))
  assert "layer_stack.fold" not in str(info.value)


def test_per_layer_input_with_wrong_leading_axis():
  fn = hk.transform(lambda x, ys: st.layer_stack(3, with_per_layer_inputs=True)(
      lambda x, y: (x + y, None))(x, ys))
  with pytest.raises(ValueError, match=r"per_layer positional argument 0 has a "
                     r"leading axis of 2, but the stack has num_layers=3"):
    jax.eval_shape(fn.init, INIT_KEY, jnp.zeros(3), jnp.ones((2, 3)))


def test_carry_shape_change():
  fn = hk.transform(lambda x: st.layer_stack(2, name="growing")(
      lambda x: jnp.concatenate([x, x]))(x))
  # In the block's words: its args, not the loop's carry.
  with pytest.raises(TypeError, match=r"^layer_stack 'growing': the block changed args\[0\] from "
                     r"float32\[3\] to float32\[6\]; each layer's output is the next"):
    jax.eval_shape(fn.init, INIT_KEY, jnp.zeros(3))
