"""Tests for ``st.over_layers``: optax per layer on stacked parameters.

The reference for every case is the same optax transformation run on each
layer separately: ``st.unstack_params`` -> one optimizer per layer (and one
on the leaves under no stack) in a Python loop -> ``st.stack_params``,
several steps, on real parameter trees of ``st.Stacked`` (plain and
mixed-layer). Compositions (``optax.chain``, ``optax.masked``,
``optax.MultiSteps``) are checked against the same composition of Adam
without ``over_layers``: Adam is elementwise, so the two agree.
"""

import functools
import os
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stacktools as st

D, L = 6, 4
STEPS = 3
PATTERN = ("a", "a", "b")


def _block_a():
  return lambda x: x + jnp.tanh(hk.Linear(D, name="fc")(x))


def _block_b():
  return lambda x: x + jax.nn.relu(hk.Linear(D + 2, name="up")(x))[..., :D]


@functools.cache   # JAX arrays are immutable: every test may share one init
def _params(pattern=None, num_layers=L):
  def model(x):
    x = hk.Linear(D, name="embed")(x)
    if pattern is None:
      x = st.Stacked(_block_a, num_layers, name="h").fold(x)
    else:
      x = st.Stacked({"a": _block_a, "b": _block_b}, num_layers, pattern=pattern,
                     name="h").fold(x)
    return hk.Linear(3, name="head")(x)
  return jax.jit(hk.transform(model).init)(jax.random.PRNGKey(0), jnp.ones((2, 5)))


def _grads(params, steps=STEPS):
  """A different random gradient per step (shapes of ``params``): the same
  list each time for the same shapes."""
  leaves, tree = jax.tree.flatten(params)
  return _grads_of(tree, tuple(a.shape for a in leaves), steps)


@functools.cache
def _grads_of(tree, shapes, steps):
  out = []
  for s in range(steps):
    keys = jax.random.split(jax.random.PRNGKey(100 + s), len(shapes))
    out.append(tree.unflatten([jax.random.normal(k, shape) for k, shape in zip(keys, shapes)]))
  return out


def _run(tx, params, grads, eager=False):
  """``tx.init``, then ``tx.update`` per gradient, jitted unless ``eager``
  (see :data:`EAGER`)."""
  init, step = _programs(tx, eager)
  state = init(params)
  for g in grads:
    params, state = step(params, g, state)
  return params, state


def _programs(tx, eager=False):
  """``tx``'s init and one step (``(params, grad, state[, factor])`` ->
  ``(params, state)``, the updates scaled by ``factor`` when given), jitted
  unless ``eager``: run op by op, every operation compiles as a program of
  its own."""
  def step(params, grad, state, factor=None):
    updates, state = tx.update(grad, state, params)
    if factor is not None:
      updates = jax.tree.map(lambda u: u * factor, updates)
    return optax.apply_updates(params, updates), state
  return (tx.init, step) if eager else (jax.jit(tx.init), jax.jit(step))


@functools.cache
def _plain_reference(name):
  """``_reference`` of ``TRANSFORMS[name]`` on the plain stack (two tests use Muon's)."""
  params = _params()
  return _reference(TRANSFORMS[name], params, _grads(params), eager=name in EAGER)


def _reference(make_tx, params, grads, pattern=None, scale=None, eager=False):
  """``make_tx()``'s optimizer on each layer of the unstacked params, and on
  the rest, each with a state of its own.

  Each layer's step is jitted unless ``eager`` (see :data:`EAGER`): one
  program for every layer of a shape, where op by op each operation compiles
  as a program of its own (jitted whole, the loop of every layer and step is
  one large program, as slow to compile).
  """
  flat = st.unstack_params(params, "h", pattern=pattern)
  depth = 1 + max(int(k.split("/")[1][len("layer_"):]) for k in flat if k.startswith("h/layer_"))
  groups = {i: [k for k in flat if k.startswith(f"h/layer_{i}/")] for i in range(depth)}
  groups["rest"] = [k for k in flat if not k.startswith("h/")]
  # An optax transformation is pure (its state is passed in and out): one
  # serves every layer, each with a state of its own.
  tx = make_tx()
  init, step = _programs(tx, eager)
  states = {g: init({k: flat[k] for k in keys}) for g, keys in groups.items()}
  for grad in grads:
    flat_grad = st.unstack_params(grad, "h", pattern=pattern)
    for g, keys in groups.items():
      factor = scale(g) if scale is not None and g != "rest" else None
      new, states[g] = step({k: flat[k] for k in keys}, {k: flat_grad[k] for k in keys},
                            states[g], factor)
      flat.update(new)
  return st.stack_params(flat, "h", pattern=pattern)


def _assert_close(got, want, rtol=1e-6):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    b = np.asarray(b)
    scale = float(np.max(np.abs(b))) or 1.0
    np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=rtol * scale,
                               err_msg=jax.tree_util.keystr(path))


MUON = lambda: optax.contrib.muon(0.05, weight_decay=0.01)  # pylint: disable=unnecessary-lambda-assignment
# Factored from 4 rows and columns up, so that the small test matrices are
# factored (the default factors only sides of 128 and more).
ADAFACTOR = lambda: optax.adafactor(0.01, min_dim_size_to_factor=4)  # pylint: disable=unnecessary-lambda-assignment
ADAM = lambda: optax.adamw(0.01, weight_decay=0.1)  # pylint: disable=unnecessary-lambda-assignment
TRANSFORMS = {"muon": MUON, "adafactor": ADAFACTOR, "adam": ADAM}
#: Run op by op on both sides of a comparison. Muon's Newton-Schulz iterations
#: amplify the last-bit differences of jit's fusion: jitted, the stack's
#: optimizer or the reference differs by up to 3.5x the tolerance of 1e-6,
#: where op by op the two are bitwise equal.
EAGER = {"muon"}


ELEMENTWISE = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "lion": lambda: optax.lion(1e-3)}


@pytest.mark.parametrize("name", list(TRANSFORMS) + list(ELEMENTWISE))
def test_plain_stack_equals_one_optimizer_per_layer(name):
  params = _params()
  grads = _grads(params)
  make = {**TRANSFORMS, **ELEMENTWISE}[name]
  got, state = _run(st.over_layers(make(), stacked=["h"]), params, grads, eager=name in EAGER)
  _assert_close(got, _plain_reference(name) if name in TRANSFORMS
                else _reference(make, params, grads))
  # Every state leaf of the stack leads with its layers.
  for leaf in jax.tree.leaves(state.layers["h"]):
    assert leaf.shape[0] == L


@pytest.mark.parametrize("name", TRANSFORMS)
def test_mixed_layer_stack_equals_one_optimizer_per_layer(name):
  params = _params(PATTERN, num_layers=5)   # a a b a a
  grads = _grads(params)
  scale = lambda i: 1.0 + 0.5 * i    # global indices follow the pattern  # pylint: disable=unnecessary-lambda-assignment
  tx = st.over_layers(TRANSFORMS[name](), stacked={"h": PATTERN}, scale=scale)
  got, state = _run(tx, params, grads, eager=name in EAGER)
  _assert_close(got, _reference(TRANSFORMS[name], params, grads, PATTERN, scale,
                                eager=name in EAGER))
  assert set(state.layers) == {"h/a", "h/b"}
  assert {leaf.shape[0] for leaf in jax.tree.leaves(state.layers["h/a"])} == {4}
  assert {leaf.shape[0] for leaf in jax.tree.leaves(state.layers["h/b"])} == {1}


def test_muon_on_the_stacked_tensor_is_another_optimizer():
  params = _params()
  grads = _grads(params)
  want = _plain_reference("muon")
  per_layer, _ = _run(st.over_layers(MUON(), stacked=["h"]), params, grads, eager=True)
  # Muon's default: a 3-D leaf is not a matrix, so it gets AdamW instead.
  default, _ = _run(MUON(), params, grads)
  # Muon's default dimension numbers forced onto [L, in, out]: orthogonalizes
  # over (L, in), with out as the batch.
  forced, _ = _run(optax.contrib.muon(
      0.05, weight_decay=0.01, muon_weight_dimension_numbers=lambda p: jax.tree.map(
          lambda a: optax.contrib.MuonDimensionNumbers() if a.ndim >= 2 else None, p)),
                   params, grads)
  w = "h/fc"
  np.testing.assert_allclose(per_layer[w]["w"], want[w]["w"], rtol=0, atol=1e-6)
  for naive in (default, forced):
    assert float(jnp.max(jnp.abs(naive[w]["w"] - want[w]["w"]))) > 1e-2


def test_layer_wise_scale_from_an_array():
  params = _params()
  grads = _grads(params)
  factors = [0.8 ** (L - 1 - i) for i in range(L)]
  got, _ = _run(st.over_layers(ADAM(), stacked="h", scale=factors), params, grads)
  _assert_close(got, _reference(ADAM, params, grads, scale=lambda i: factors[i]))


def test_frozen_layers_stay_bit_identical_through_adamw_with_weight_decay():
  params = _params()
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   st.over_layers(optax.adamw(0.05, weight_decay=0.5), stacked=["h"],
                                  frozen=range(0, 2)))
  new, state = _run(tx, params, _grads(params, steps=20))
  for name, value in new["h/fc"].items():
    np.testing.assert_array_equal(value[:2], params["h/fc"][name][:2])
    assert float(jnp.min(jnp.abs(value[2:] - params["h/fc"][name][2:]).max(axis=-1))) > 0
  # Their optimizer state did not move either: zero moments, count 0.
  adam = state[1].layers["h"][0]
  assert adam.count.tolist() == [0, 0, 20, 20]
  for moment in (adam.mu, adam.nu):
    assert not np.any(moment["h/fc"]["w"][:2])
  # The rest trained.
  assert float(jnp.max(jnp.abs(new["head"]["w"] - params["head"]["w"]))) > 0


def test_frozen_layers_of_a_mixed_layer_stack_by_global_index():
  params = _params(PATTERN, num_layers=5)   # a a b a a: layer 2 is the b
  tx = st.over_layers(optax.adamw(0.05, weight_decay=0.5), stacked={"h": PATTERN},
                      frozen={1, 2})
  new, _ = _run(tx, params, _grads(params))
  np.testing.assert_array_equal(new["h/b/up"]["w"], params["h/b/up"]["w"])
  # a's rows are layers 0, 1, 3, 4: row 1 (layer 1) frozen, the rest move.
  moved = jnp.abs(new["h/a/fc"]["w"] - params["h/a/fc"]["w"]).max(axis=(1, 2))
  assert moved[1] == 0 and bool(jnp.all(moved[jnp.array([0, 2, 3])] > 0))


def _adam_pair(wrap):
  """``wrap(over_layers(adam))`` and ``wrap(adam)``: equal, adam being elementwise."""
  return wrap(st.over_layers(optax.adam(0.01), stacked=["h"])), wrap(optax.adam(0.01))


@pytest.mark.parametrize("wrap", [
    lambda tx: optax.chain(optax.clip_by_global_norm(0.5), tx),
    lambda tx: optax.masked(tx, lambda p: jax.tree.map(lambda a: a.ndim > 1, p)),
    lambda tx: optax.MultiSteps(tx, every_k_schedule=2),
], ids=["chain", "masked", "multisteps"])
def test_composes_with_optax(wrap):
  params = _params()
  grads = _grads(params, steps=4)
  ours, theirs = _adam_pair(wrap)
  got, _ = _run(ours, params, grads)
  want, _ = _run(theirs, params, grads)
  _assert_close(got, want)
  assert float(jnp.max(jnp.abs(got["h/fc"]["w"] - params["h/fc"]["w"]))) > 0


def test_nested_stacks_run_per_matrix():
  params = {"outer/blk/inner/lin": {"w": jax.random.normal(jax.random.PRNGKey(1), (2, 3, 4, 5))},
            "outer/blk/norm": {"scale": jnp.ones((2, 5))}}
  grads = _grads(params)
  got, _ = _run(st.over_layers(MUON(), stacked=["outer", "outer/blk/inner"]), params, grads,
                eager=True)
  w = params["outer/blk/inner/lin"]["w"]
  for i in range(2):
    for j in range(3):
      sub, _ = _run(MUON(), {"lin": {"w": w[i, j]}},
                    [{"lin": {"w": g["outer/blk/inner/lin"]["w"][i, j]}} for g in grads],
                    eager=True)
      np.testing.assert_allclose(got["outer/blk/inner/lin"]["w"][i, j], sub["lin"]["w"],
                                 rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(stacked=["hh"]), r"over_layers: stacked=\['hh'\] names 'hh', but no parameter "
     r"lies under it.*'h/fc'"),
    (dict(stacked=["h"], scale=[1.0, 2.0]), r"over_layers: scale= has 2 values, but the "
     r"stack 'h' has 4 layers"),
    (dict(stacked=["h"], frozen=[3, 4, 7]), r"over_layers: frozen= names the layers "
     r"\[4, 7\], but the stack 'h' has layers 0..3"),
    (dict(stacked={"h": ("a", "b")}), r"over_layers: 'h/fc' lies under no kind of "
     r"pattern \('a', 'b'\)"),
])
def test_mistakes_are_named_at_init(kwargs, message):
  tx = st.over_layers(optax.adam(0.1), **kwargs)
  with pytest.raises(ValueError, match=message):
    tx.init(_params())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(stacked=[]), ValueError, r"over_layers: stacked= is empty"),
    (dict(stacked=["h/"]), ValueError, r"over_layers: stacked= names 'h/'; each entry"),
    (dict(stacked=["h"], scale="big"), TypeError, r"over_layers: scale='big' must be a "
     r"function of the global layer index"),
    (dict(stacked=["h"], frozen=[0.5]), TypeError, r"over_layers: frozen=\[0.5\] must be "
     r"layer indices"),
])
def test_mistakes_are_named_when_built(kwargs, error, message):
  with pytest.raises(error, match=message):
    st.over_layers(optax.adam(0.1), **kwargs)


def _scaled_update(scale):
  params = {"h/linear": {"w": jnp.ones((4, 2, 2))}}
  tx = st.over_layers(optax.sgd(1.0), stacked=["h"], scale=scale)
  return tx.update(params, tx.init(params), params)[0]["h/linear"]["w"][:, 0, 0]


def test_scale_returning_an_array_is_named():
  # Once it failed with JAX's message.
  with pytest.raises(TypeError, match=r"^over_layers: scale= returned an array of shape "
                     r"\(4,\) for layer 0 of 'h', not one number: it is called once per "
                     r"layer.*pass the sequence itself, scale=\[\.\.\.\]"):
    _scaled_update(lambda i: jnp.full(4, 0.5) ** i)
  # One number each (a 0-d array too) is fine: the update is -scale(i).
  np.testing.assert_allclose(_scaled_update(lambda i: jnp.float32(0.5) ** i),
                             [-1.0, -0.5, -0.25, -0.125])


@pytest.mark.jax_independent
def test_the_docs_say_that_only_a_patterns_counts_are_checked():
  # A pattern's order is not in the parameters; over_layers once did not say so.
  said = "not the order of the kinds, so only the counts are checked"
  assert said in " ".join(st.over_layers.__doc__.split())
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  guide = os.path.join(root, "docs", "guides", "training-rules.md")
  with open(guide, encoding="utf-8") as f:
    assert said in " ".join(f.read().split())


def test_a_blockseq_layout_is_refused():
  unstacked = st.unstack_params(_params(), "h")
  with pytest.raises(ValueError, match=r"over_layers: the parameters under 'h' are in "
                     r"the BlockSeq layout \(h/layer_<i>/...\)"):
    st.over_layers(optax.adam(0.1), stacked=["h"]).init(unstacked)


def test_import_stacktools_brings_no_optimizer_library_beyond_optax():
  code = ("import sys, stacktools\n"
          "bad = sorted({m.split('.')[0] for m in sys.modules} & {'flax', 'jaxopt', "
          "'optimistix', 'tensorflow', 'torch', 'keras', 'levanter', 'haliax'})\n"
          "print(bad)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr
