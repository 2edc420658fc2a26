"""Tests for st.stack_params / st.unstack_params: Stacked <-> BlockSeq layouts.

The references are independent of params.py: hand-written layouts sliced
with numpy, and the layouts Haiku itself gives ``st.Stacked`` and
``st.BlockSeq`` (from ``jax.eval_shape`` of their inits, and in one test from
real inits, which must agree value for value).
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stacktools as st

N, D = 3, 4
KEY = jax.random.PRNGKey(0)


# ---------------------------------------------------------------------------
# Helpers.


def _signature(bundles):
  """``{module: {name: (shape, dtype)}}`` of Haiku params or state."""
  return {m: {n: (tuple(np.shape(v)), str(v.dtype)) for n, v in b.items()}
          for m, b in bundles.items()}


def _assert_equal(actual, expected):
  """Same keys, dtypes and bits."""
  assert _signature(actual) == _signature(expected)
  for m, bundle in expected.items():
    for n, value in bundle.items():
      np.testing.assert_array_equal(np.asarray(actual[m][n]), np.asarray(value))


def _stacked_layout(n=N, seed=0):
  """A Stacked layout under "model/h" (several modules, dtypes), plus others."""
  rng = np.random.default_rng(seed)
  return {
      "model/h/block/linear": {"w": rng.standard_normal((n, D, D)).astype(np.float32),
                               "b": jnp.asarray(rng.standard_normal((n, D)), jnp.bfloat16)},
      "model/h/block/norm": {"scale": jnp.asarray(rng.standard_normal((n, D)), jnp.float32)},
      "model/h/block/~": {"count": np.arange(n, dtype=np.int32)},
      "model/embed": {"embeddings": rng.standard_normal((7, D)).astype(np.float32)},
      "model/head": {"w": rng.standard_normal((D, 2)).astype(np.float32)},
  }


class Block(hk.Module):

  def __call__(self, x):
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    x = x + hk.Linear(D)(x)
    return hk.LayerNorm(-1, True, True)(x)


def _model(cls, n=N):
  def fn(x):
    x = hk.Linear(D, name="embed")(x)
    x = cls(Block, n, name="h").fold(x)
    return hk.Linear(2, name="head")(x)
  return hk.transform_with_state(fn)


def _nested(outer_cls, inner_cls, outer_n=2, inner_n=3):
  def fn(x):
    def inner(x):
      return inner_cls(lambda: hk.Linear(D), inner_n, name="inner").fold(x)
    return outer_cls(lambda: inner, outer_n, name="outer").fold(x)
  return hk.transform(fn)


def _shapes(t, *args):
  return jax.eval_shape(t.init, KEY, *args)


# ---------------------------------------------------------------------------
# Layouts and round trips.


def test_unstack_slices_each_layer():
  params = _stacked_layout()
  out = st.unstack_params(params, "model/h")
  expected = {k: v for k, v in params.items() if not k.startswith("model/h/")}
  for i in range(N):
    for module in ("block/linear", "block/norm", "block/~"):
      expected[f"model/h/layer_{i}/{module}"] = {
          n: v[i] for n, v in params[f"model/h/{module}"].items()}
  _assert_equal(out, expected)


@pytest.mark.parametrize("n", [1, 3, 12])
def test_round_trip_is_exact(n):
  # 12 layers: layer_10 and layer_11 must not sort between layer_1 and layer_2.
  params = _stacked_layout(n)
  unstacked = st.unstack_params(params, "model/h")
  assert sum(k.startswith("model/h/layer_") for k in unstacked) == 3 * n
  restacked = st.stack_params(unstacked, "model/h")
  _assert_equal(restacked, params)
  # And the other way round.
  _assert_equal(st.unstack_params(restacked, "model/h"), unstacked)


def test_module_named_exactly_prefix():
  params = {"h": {"w": np.arange(N * 2.0).reshape(N, 2)}}
  unstacked = st.unstack_params(params, "h")
  _assert_equal(unstacked, {f"h/layer_{i}": {"w": params["h"]["w"][i]}
                            for i in range(N)})
  _assert_equal(st.stack_params(unstacked, "h"), params)


def test_keys_outside_the_prefix_untouched():
  w = np.ones((N, D))
  params = {
      "h/block/linear": {"w": w},
      "head/linear": {"w": np.ones((2, D))},        # Shares "h" as a string prefix.
      "h2/block/linear": {"w": np.ones((5, D))},   # Another stack.
      "enc/h/block/linear": {"w": np.ones((5, D))},  # "h" deeper in the tree.
  }
  out = st.unstack_params(params, "h")
  assert sorted(out) == sorted(["head/linear", "h2/block/linear", "enc/h/block/linear"]
                               + [f"h/layer_{i}/block/linear" for i in range(N)])
  for key in ("head/linear", "h2/block/linear", "enc/h/block/linear"):
    assert out[key]["w"] is params[key]["w"]
  assert params["h/block/linear"]["w"] is w  # The input is not modified.

  seq = {"a.b/layer_0/l": {"w": np.zeros(2)}, "a.b/layer_1/l": {"w": np.ones(2)},
         "aXb/layer_0/l": {"w": np.ones(3)}, "a.b/layer_x/l": {"w": np.ones(4)},
         "a.b/layers_0/l": {"w": np.ones(5)}}
  out = st.stack_params(seq, "a.b")
  assert sorted(out) == ["a.b/l", "a.b/layer_x/l", "a.b/layers_0/l", "aXb/layer_0/l"]
  for key in ("aXb/layer_0/l", "a.b/layer_x/l", "a.b/layers_0/l"):
    assert out[key]["w"] is seq[key]["w"]
  np.testing.assert_array_equal(out["a.b/l"]["w"], [[0, 0], [1, 1]])


def test_params_and_state_match_blockseq_layout():
  x = jax.ShapeDtypeStruct((2, D), jnp.float32)
  stacked_params, stacked_state = _shapes(_model(st.Stacked), x)
  seq_params, seq_state = _shapes(_model(st.BlockSeq), x)
  def zeros(tree):
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), tree)
  assert "h/block/linear" in stacked_params
  assert "h/layer_0/block/linear" in seq_params
  assert _signature(st.unstack_params(zeros(stacked_params), "h")) == _signature(seq_params)
  assert _signature(st.unstack_params(zeros(stacked_state), "h")) == _signature(seq_state)
  assert _signature(st.stack_params(zeros(seq_params), "h")) == _signature(stacked_params)
  assert _signature(st.stack_params(zeros(seq_state), "h")) == _signature(stacked_state)
  assert seq_state["h/layer_2/block"]["count"].dtype == jnp.int32


def test_nested_layouts():
  x = jax.ShapeDtypeStruct((2, D), jnp.float32)
  rng = np.random.default_rng(0)
  stacked = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype),
                         _shapes(_nested(st.Stacked, st.Stacked), x))
  assert _signature(stacked) == {"outer/inner/linear": {
      "w": ((2, 3, D, D), "float32"), "b": ((2, 3, D), "float32")}}
  # Outer level first: each outer layer holds an inner Stacked layout ...
  outer_unstacked = st.unstack_params(stacked, "outer")
  assert _signature(outer_unstacked) == _signature(
      _shapes(_nested(st.BlockSeq, st.Stacked), x))
  # ... then each inner stack.
  fully = outer_unstacked
  for i in range(2):
    fully = st.unstack_params(fully, f"outer/layer_{i}/inner")
  assert _signature(fully) == _signature(_shapes(_nested(st.BlockSeq, st.BlockSeq), x))
  np.testing.assert_array_equal(fully["outer/layer_1/inner/layer_2/linear"]["w"],
                                stacked["outer/inner/linear"]["w"][1, 2])
  # And back, innermost first.
  back = fully
  for i in range(2):
    back = st.stack_params(back, f"outer/layer_{i}/inner")
  _assert_equal(back, outer_unstacked)
  _assert_equal(st.stack_params(back, "outer"), stacked)


def test_nested_blockseq_init_is_unstacked_stacked_init():
  x = jnp.ones((2, D))
  stacked = jax.jit(_nested(st.Stacked, st.Stacked).init)(KEY, x)
  seq = jax.jit(_nested(st.BlockSeq, st.BlockSeq).init)(KEY, x)
  expected = st.unstack_params(stacked, "outer")
  for i in range(2):
    expected = st.unstack_params(expected, f"outer/layer_{i}/inner")
  # As in stacked_test: the same vmapped draws, which XLA's cheapest CPU code
  # generation (conftest.py) may round one ulp apart in the two programs.
  assert _signature(seq) == _signature(expected)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-7, atol=0),
               seq, expected)


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("fn", [st.unstack_params, st.stack_params])
@pytest.mark.parametrize("prefix", ["", "h/", None])
def test_bad_prefix(fn, prefix):
  with pytest.raises(ValueError, match=r"prefix=.* must be a module name such as "
                     r"'model/h' \(no trailing '/'\)"):
    fn({"h/block/linear": {"w": np.ones((N, D))}}, prefix)


def test_unstack_nothing_under_prefix():
  params = {"head/linear": {"w": np.ones((N, D))}, "model/h/block": {"w": np.ones((N, D))}}
  with pytest.raises(ValueError, match=r"unstack_params: no module is named 'h' or "
                     r"lies under it; the modules are \['head/linear', "
                     r"'model/h/block'\]\. Pass the Stacked module's full name"):
    st.unstack_params(params, "h")


def test_stack_nothing_under_prefix():
  params = {"h/block/linear": {"w": np.ones((N, D))},
            "head/layer_0/linear": {"w": np.ones(D)}}
  with pytest.raises(ValueError, match=r"stack_params: no module named "
                     r"h/layer_<i>/\.\.\.; the modules are \['h/block/linear', "
                     r"'head/layer_0/linear'\]\. Pass the BlockSeq module's full name"):
    st.stack_params(params, "h")


def test_stack_missing_layers():
  params = {f"h/layer_{i}/linear": {"w": np.ones(D)} for i in (0, 2, 4)}
  with pytest.raises(ValueError, match=r"stack_params: h/layer_<i>/linear is missing "
                     r"for layers \[1, 3\] of 0\.\.4; every layer needs the same modules"):
    st.stack_params(params, "h")
  # A module that only some layers hold.
  params = {f"h/layer_{i}/linear": {"w": np.ones(D)} for i in range(N)}
  params["h/layer_1/extra"] = {"w": np.ones(D)}
  with pytest.raises(ValueError, match=r"h/layer_<i>/extra is missing for layers "
                     r"\[0, 2\] of 0\.\.2"):
    st.stack_params(params, "h")


def test_stack_mismatched_names():
  params = {f"h/layer_{i}/linear": {"w": np.ones(D), "b": np.ones(D)} for i in range(N)}
  params["h/layer_2/linear"] = {"w": np.ones(D), "bias": np.ones(D)}
  with pytest.raises(ValueError, match=r"stack_params: h/layer_2/linear holds "
                     r"\['bias', 'w'\] but layer_0 holds \['b', 'w'\]; every layer "
                     r"needs the same names"):
    st.stack_params(params, "h")


def test_stack_mismatched_shapes_names_the_module():
  params = {f"h/layer_{i}/linear": {"w": np.ones((D, D))} for i in range(N)}
  params["h/layer_1/linear"] = {"w": np.ones((D, D + 1))}
  with pytest.raises(ValueError, match=r"h/layer_1/linear"):
    st.stack_params(params, "h")


def test_unstack_mismatched_leading_axes():
  params = {"h/a": {"w": np.ones((N, D))}, "h/b": {"w": np.ones((N + 1, D))}}
  with pytest.raises(ValueError, match=r"unstack_params: the leaves under 'h' "
                     r"disagree on the Layers axis: \{'h/a/w': 3, 'h/b/w': 4\}"):
    st.unstack_params(params, "h")


def test_unstack_scalar_leaf():
  params = {"h/a": {"w": np.ones((N, D)), "step": np.int32(0)}}
  with pytest.raises(ValueError, match=r"unstack_params: h/a/step is a scalar; every "
                     r"leaf under 'h' needs a leading Layers axis"):
    st.unstack_params(params, "h")


def test_unstack_params_twice_is_refused():
  # Once it returned a wrong tree.
  params = {"m/h/block/linear": {"w": np.ones((D, D, D), np.float32)},
            "m/embed": {"embeddings": np.ones((5, D), np.float32)}}
  unstacked = st.unstack_params(params, "m/h")
  assert sorted(unstacked) == ["m/embed"] + [f"m/h/layer_{i}/block/linear" for i in range(D)]
  with pytest.raises(ValueError, match=r"under 'm/h' look unstacked already.*"
                     r"m/h/layer_<i>/\.\.\. for layers 0\.\.3.*st\.stack_params"):
    st.unstack_params(unstacked, "m/h")


# ---------------------------------------------------------------------------
# What reads a stack's layout (unstack_params, take_layers, over_layers): a
# mixed-layer stack without its pattern, a module that is not a stack.


def _mixed_params(counts):
  """Kinds' stacks under h (``{kind: layers}``), and an unstacked head."""
  return {f"h/{kind}/linear": {"w": np.arange(c * 4.0).reshape(c, 2, 2) + 100 * k}
          for k, (kind, c) in enumerate(counts.items())} | {
              "head": {"w": np.ones((3, 5)), "b": np.zeros(5)}}


@pytest.mark.parametrize("call, arg", [
    (lambda p: st.over_layers(optax.sgd(1.0), stacked=["h"]).init(p),
     r"stacked=\{'h': pattern\}"),
    (lambda p: st.take_layers(p, "h", [0, 1]), "pattern="),
    (lambda p: st.unstack_params(p, "h"), "pattern="),
], ids=["over_layers", "take_layers", "unstack_params"])
def test_a_mixed_stack_whose_kinds_disagree_asks_for_its_pattern(call, arg):
  # Once it said only that the leaves disagree.
  params = _mixed_params({"A": 4, "B": 2})   # pattern AAB over 6 layers
  with pytest.raises(ValueError, match=r"the leaves under 'h' disagree on the Layers "
                     r"axis: .*Each of \['A', 'B'\] has a Layers axis of its own, as the "
                     rf"kinds of a mixed-layer stack.*do: pass the pattern the stack was "
                     rf"built with as {arg}"):
    call(params)
  state = st.over_layers(optax.sgd(1.0, momentum=0.9), stacked={"h": "AAB"}).init(params)
  assert state.layers["h/A"][0].trace["h/A/linear"]["w"].shape == (4, 2, 2)


@pytest.mark.parametrize("call, subject, fix", [
    (lambda p: st.over_layers(optax.sgd(1.0), stacked=["head"]).init(p), "over_layers",
     "Pass as stacked= only the full name that a st.Stacked or st.layer_stack was "
     "given (e.g. 'model/h'); leaves under no stack go to the optimizer as they are, "
     "so drop it from stacked=."),
    (lambda p: st.take_layers(p, "head", [0]), "take_layers", "Pass as name= only"),
    (lambda p: st.unstack_params(p, "head"), "unstack_params", "Pass as prefix= only"),
], ids=["over_layers", "take_layers", "unstack_params"])
def test_a_module_that_is_not_a_stack_is_named_so(call, subject, fix):
  params = _mixed_params({"A": 2, "B": 2})
  with pytest.raises(ValueError) as info:
    call(params)
  message = str(info.value)
  assert message.startswith(f"{subject}: 'head' is not a stack: a stack's leaves all "
                            "lead with its Layers axis (num_layers), but head/b has 5 "
                            "rows and head/w 3."), message
  assert fix in message, message
