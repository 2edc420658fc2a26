"""Mistakes that the library once accepted without a word, or named too vaguely.

Every test here failed before its fix:

* ``only=`` labels that name no candidate were dropped when another label
  was known, so the planner planned among fewer candidates than asked;
* ``measure=True`` with ``jax.ShapeDtypeStruct`` arguments failed inside JAX
  after compiling a candidate;
* a ``st.Pipeline`` axis that the mesh in use lacks ran as a plain stack;
* a kind with no layer, or a factory that no layer uses, was accepted;
* ``st.Pipeline`` said "got a int" for ``microbatches=0``;
* ``stack_params`` with the wrong pattern reported missing layers without a
  word about the pattern;
* a per-depth spec with another separator than ``,`` was reported as an
  unknown policy.

The runs that must still work are checked against independent references:
``jax.grad`` of a Python loop, and the layouts written by hand.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st

D = 3


def _step(carry, w):
  return carry + 0.5 * jnp.tanh(carry @ w)


def _tagged_step(name):
  def step(carry, w):
    return carry + 0.5 * st.checkpoint_name(jnp.tanh(carry @ w), name)
  return step


def _python_loop(step, carry, ws):
  for i in range(ws.shape[0]):
    carry = step(carry, ws[i])
  return carry


WS = 0.3 * jax.random.normal(jax.random.PRNGKey(0), (4, D, D))
C = jnp.ones((2, D))


def _auto_grad(*steps):
  """``grad`` of a chain of ``remat="auto"`` folds, one per step function."""
  def loss(c):
    for step in steps:
      c = st.fold(step, remat="auto")(c, WS)
    return jnp.sum(c ** 2)
  return jax.grad(loss)


# ---------------------------------------------------------------------------
# Planner: only= labels, measure=True on shapes.


@pytest.mark.parametrize("plan", [
    lambda only: st.plan_remat(_auto_grad(_step), C, budget="1GiB", measure=False,
                               only=only),
    lambda only: st.remat_report(_auto_grad(_step), C, only=only),
])
@pytest.mark.parametrize("only", [["full", "bogus"], ["bogus"]])
def test_unknown_only_label_is_an_error(plan, only):
  with pytest.raises(ValueError) as info:
    plan(only)
  message = str(info.value)
  assert "'bogus'" in message and "'full'" in message and "'nested'" in message, message
  assert "none:1,full:3" in message, message   # the known labels, per-depth ones too


def test_only_label_of_another_stack_is_kept():
  # save:a is a candidate of the first loop only; it is not unknown.
  step = _auto_grad(_tagged_step("a"), _tagged_step("b"))
  plan = st.plan_remat(step, C, budget="1GiB", measure=False, only=["full", "save:a"])
  assert sorted(tuple(r.plan.values()) for r in plan.report.rows) == [
      ("full", "full"), ("save:a", "full")]
  with plan:
    got = jax.jit(step)(C)
  want = jax.grad(lambda c: jnp.sum(_python_loop(
      _tagged_step("b"), _python_loop(_tagged_step("a"), c, WS), WS) ** 2))(C)
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("call,subject", [
    (lambda args: st.plan_remat(_auto_grad(_step), *args, budget="1GiB"), "st.plan_remat"),
    (lambda args: st.remat_report(_auto_grad(_step), *args, measure=True),
     "st.remat_report"),
])
def test_measure_needs_arrays(call, subject):
  shapes = (jax.ShapeDtypeStruct(C.shape, C.dtype),)
  with pytest.raises(ValueError, match=rf"^{subject}: measure=True runs the "
                     r"candidates it times, but args\[0\] is a jax.ShapeDtypeStruct.*"
                     r"pass arrays, or measure=False"):
    call(shapes)


def test_shapes_without_measure_still_plan():
  shapes = (jax.ShapeDtypeStruct(C.shape, C.dtype),)
  plan = st.plan_remat(_auto_grad(_step), *shapes, budget="1GiB", measure=False,
                       only=["full"])
  assert plan.labels == {"loop_0": "full"}


# ---------------------------------------------------------------------------
# Pipeline: an axis the mesh lacks, and the values shown.


def _pipelined(axis):
  return hk.without_apply_rng(hk.transform(lambda x: jnp.sum(st.Stacked(
      lambda: (lambda x: x + hk.Linear(D)(jnp.tanh(x))), 4, remat="full", name="h",
      pipeline=st.Pipeline(axis=axis, microbatches=2)).fold(x) ** 2)))


def test_pipeline_axis_missing_from_the_mesh_is_an_error():
  x = jnp.ones((4, D))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("pipe", "data"))
  params = _pipelined("pipee").init(jax.random.PRNGKey(0), x)   # no mesh: plain
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"^Stacked: st\.Pipeline\(axis='pipee'\) "
                       r"names an axis that the mesh in use lacks: its axes are "
                       r"\['pipe', 'data'\]"):
      jax.jit(jax.grad(_pipelined("pipee").apply))(params, x)
    # The right name runs (a pipe axis of size 1 is the plain stack).
    got = jax.jit(jax.grad(_pipelined("pipe").apply))(params, x)
  w, b = params["h/linear"]["w"], params["h/linear"]["b"]

  def loop(w, b):
    y = x
    for i in range(4):
      y = y + jnp.tanh(y) @ w[i] + b[i]
    return jnp.sum(y ** 2)
  want = jax.grad(loop, (0, 1))(w, b)
  np.testing.assert_allclose(got["h/linear"]["w"], want[0], rtol=1e-5)
  np.testing.assert_allclose(got["h/linear"]["b"], want[1], rtol=1e-5)


@pytest.mark.parametrize("make,shown", [
    (lambda: st.Pipeline(microbatches=0), "microbatches must be an integer >= 1, got 0."),
    (lambda: st.Pipeline(repeats=1.5, schedule="circular"),
     "repeats must be an integer >= 1, got 1.5."),
    (lambda: st.Pipeline(axis=""), "got ''."),
    (lambda: st.Pipeline(axis=3), "got 3."),
    (lambda: st.Pipeline().table(0), "stages must be an int >= 1, got 0."),
])
def test_pipeline_errors_show_the_value(make, shown):
  with pytest.raises((TypeError, ValueError)) as info:
    make()
  assert shown in str(info.value), str(info.value)


# ---------------------------------------------------------------------------
# Patterns: every kind has a layer, every factory a kind.


def _block(scale):
  return lambda: (lambda x: x + scale * hk.Linear(D)(x))


def _trace(cls, make_block, num_layers, pattern):
  f = hk.transform(lambda x: cls(make_block, num_layers, pattern=pattern, name="h").fold(x))
  return jax.eval_shape(f.init, jax.random.PRNGKey(0), jnp.ones((2, D)))


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_factory_no_layer_uses_is_an_error(cls):
  blocks = {"A": _block(1.0), "B": _block(0.5), "C": _block(0.25)}
  with pytest.raises(ValueError, match=rf"^{cls.__name__}: make_block\['C'\] is the "
                     r"factory of a kind that pattern=\('A', 'B'\) never names, so it "
                     r"has 0 layers"):
    _trace(cls, blocks, 6, "AB")


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_kind_with_no_layer_is_an_error(cls):
  blocks = {"A": _block(1.0), "B": _block(0.5)}
  with pytest.raises(ValueError, match=rf"^{cls.__name__}: num_layers=2 ends before "
                     r"the first 'B' layer of pattern=\('A', 'A', 'B'\), so the kind "
                     r"'B' has 0 layers \(layer counts: \{'A': 2, 'B': 0\}\).*"
                     r"num_layers >= 3"):
    _trace(cls, blocks, 2, "AAB")
  # From its first layer on, it has one.
  shapes = _trace(cls, blocks, 3, "AAB")
  layer = "h/B/linear" if cls is st.Stacked else "h/layer_2/linear"
  assert shapes[layer]["w"].shape[-2:] == (D, D)


# ---------------------------------------------------------------------------
# stack_params: a wrong pattern is named as the likely cause.


def test_stack_params_with_another_pattern_suggests_the_pattern():
  blocks = {"A": lambda: (lambda x: x + hk.Linear(D, name="a")(x)),
            "B": lambda: (lambda x: x * hk.Linear(D, name="b")(x))}
  f = hk.transform(lambda x: st.Stacked(blocks, 6, pattern="AAB", name="h").fold(x))
  params = f.init(jax.random.PRNGKey(0), jnp.ones((2, D)))
  unstacked = st.unstack_params(params, "h", pattern="AAB")
  # The layout by hand: layers 0, 1, 3, 4 are A's, 2 and 5 B's.
  assert sorted(k for k in unstacked if k.endswith("/a")) == [
      f"h/layer_{i}/a" for i in (0, 1, 3, 4)]
  with pytest.raises(ValueError, match=r"h/layer_<i>/a is missing for layers \[2, 5\] "
                     r"of 0\.\.5.*pattern=\('A', 'B', 'B'\) makes layers \[1, 2, 4, 5\] "
                     r"'B' layers.*If the layers were built with another pattern, pass "
                     r"that one"):
    st.stack_params(unstacked, "h", pattern="ABB")
  restacked = st.stack_params(unstacked, "h", pattern="AAB")
  jax.tree.map(np.testing.assert_array_equal, restacked, params)


# ---------------------------------------------------------------------------
# per_depth's string form: the separator is a comma.


@pytest.mark.parametrize("spec,sep,fixed", [
    ("none:2;full:2", ";", "none:2,full:2"),
    ("none:2 full:2", " ", "none:2,full:2"),
    ("none:1 / full:2/nested:1", "/", "none:1,full:2,nested:1"),
])
def test_per_depth_wrong_separator(spec, sep, fixed):
  with pytest.raises(ValueError, match=None) as info:
    st.per_depth(spec)
  message = str(info.value)
  assert message.startswith(f"st.per_depth({spec!r}): segments are separated by "
                            f"commas, not {sep!r}: write {fixed!r}"), message
  assert str(st.per_depth(fixed)) == fixed


def test_per_depth_unknown_alias_is_still_named():
  with pytest.raises(ValueError, match=r"'bogus' is not a checkpoint policy"):
    st.per_depth("none:2,bogus:2")
