"""Tests for st.take_layers and the growth helpers of stacktools.depth.

References:

* every edit equals the same edit done by hand: ``st.unstack_params``, a
  loop that renames ``layer_<i>`` modules (and zeroes the fresh layers'
  named leaves, listed here leaf by leaf), then ``st.stack_params``; exact,
  for a plain and a mixed-layer ``st.Stacked`` with Haiku state, and on the
  BlockSeq layout;
* function-preserving growth: the tests' small transformer
  (``haiku_helpers.transformer``) grown with zeroed residual outputs gives
  the logits (and, for the old layers, the gradients) of the model it was
  grown from, for fold and scan blocks, with and without a checkpointed
  loop, a pattern and BlockSeq;
* mistakes stop with one line and change nothing they were given.
"""

import copy
import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st
from stacktools import depth

from haiku_helpers import KINDS, RESIDUAL_OUTPUTS, Tiny, random_like, transformer

D = 4
X = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)


# ---------------------------------------------------------------------------
# Models: a stack of blocks with parameters and state, plain and mixed.


class Block(hk.Module):
  """A residual block with a counter and a running mean in its state."""

  def __init__(self, hidden, name=None):
    super().__init__(name=name)
    self.hidden = hidden

  def __call__(self, x):
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    mean = hk.get_state("mean", [D], jnp.float32, init=jnp.ones)
    hk.set_state("count", count + 1)
    hk.set_state("mean", 0.9 * mean + 0.1 * jnp.mean(x, axis=0))
    h = jax.nn.gelu(hk.Linear(self.hidden, name="fc")(hk.LayerNorm(-1, True, True)(x)))
    return x + hk.Linear(D, name="out")(h)


def _init(depth_, pattern=None, seed=0):
  """``(params, state)`` of a stack ``model/h`` of ``depth_`` layers: numpy
  arrays, random, shaped by the init's trace (the edits are layouts: their
  values need no init, and numpy ones no compile)."""
  return copy.deepcopy(_init_once(depth_, pattern, seed))


@functools.cache
def _init_once(depth_, pattern, seed):
  def forward(x):
    with hk.experimental.name_scope("model"):
      if pattern is None:
        stack = st.Stacked(lambda: Block(8), depth_, name="h")
      else:
        stack = st.Stacked({"a": lambda: Block(8), "b": lambda: Block(6)}, depth_,
                           pattern=pattern, name="h")
      return hk.Linear(D, name="head")(stack.fold(x))
  shapes = jax.eval_shape(hk.transform_with_state(forward).init, jax.random.PRNGKey(0), X)
  return jax.device_get(random_like(shapes, seed))


def _by_hand(params, name, indices, new=None, zeroed=(), pattern=None):
  """The edit on the per-layer dicts of st.unstack_params, stacked back."""
  layers = st.unstack_params(params, name, pattern=pattern)
  fresh = st.unstack_params(new, name, pattern=pattern) if new is not None else None
  return st.stack_params(_renamed(layers, fresh, name, indices, zeroed), name,
                         pattern=pattern)


def _renamed(layers, fresh, name, indices, zeroed):
  """Per-layer dicts: layer ``p`` is old layer ``indices[p]``, or fresh layer
  ``p`` with the leaves in ``zeroed`` (``"block/out/w"``) set to zero."""
  out = {k: v for k, v in layers.items() if not k.startswith(f"{name}/layer_")}
  for p, i in enumerate(indices):
    source, layer = (layers, i) if i is not None else (fresh, p)
    head = f"{name}/layer_{layer}"
    for key, bundle in source.items():
      if key == head or key.startswith(head + "/"):
        rest = key[len(head):]
        out[f"{name}/layer_{p}{rest}"] = {
            leaf: (np.zeros_like(value) if i is None and f"{rest[1:]}/{leaf}" in zeroed
                   else value) for leaf, value in bundle.items()}
  return out


def _assert_equal(actual, expected):
  """Same modules, names, shapes, dtypes and bits."""
  assert sorted(actual) == sorted(expected)
  for module, bundle in expected.items():
    assert sorted(actual[module]) == sorted(bundle), module
    for leaf, value in bundle.items():
      got = actual[module][leaf]
      assert np.shape(got) == np.shape(value) and got.dtype == value.dtype, (module, leaf)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(value), err_msg=f"{module}/{leaf}")


# ---------------------------------------------------------------------------
# Each edit equals the same edit by hand.

PLAIN_EDITS = {
    "select": [0, 2],
    "reorder": [2, 0, 1],
    "repeat": depth.repeat(3, 6),
    "tile": depth.tile(3, 6),
    "insert_new": depth.insert_new(3, 5),
    "fresh_first": [None, 1, None, 1, 0],
}


@pytest.mark.parametrize("edit", PLAIN_EDITS)
def test_plain_stack_params_and_state_equal_the_edit_by_hand(edit):
  indices = PLAIN_EDITS[edit]
  params, state = _init(3)
  before = copy.deepcopy(jax.device_get(params))
  new_params = new_state = None
  kwargs = {}
  if None in indices:
    new_params, new_state = _init(len(indices), seed=1)
    kwargs = dict(new=new_params, zero=("out",))   # out/w and out/b of a block
  got = st.take_layers(params, "model/h", indices, **kwargs)
  _assert_equal(got, _by_hand(params, "model/h", indices, new_params,
                              zeroed={"block/out/w", "block/out/b"}))
  got_state = st.take_layers(state, "model/h", indices, new=new_state)
  _assert_equal(got_state, _by_hand(state, "model/h", indices, new_state))
  # The result is a model at the new depth: Haiku applies it.
  _, new_state_shape = _init(len(indices))
  assert jax.tree.map(jnp.shape, got_state) == jax.tree.map(jnp.shape, new_state_shape)
  _assert_equal(jax.device_get(params), before)   # nothing given was changed


PATTERN = ("a", "a", "b")
PATTERN_EDITS = {
    "first_period": [0, 1, 2],
    "reorder_within_kinds": [1, 0, 5, 4, 3, 2],
    "partial_period": [0, 1, 2, 4],
    "tile": depth.tile(6, 12),
    "repeat_periods": depth.repeat(6, 12, period=3),
    "insert_new_periods": depth.insert_new(6, 9, period=3),
    "fresh_layers_of_each_kind": [0, None, None, 3, 4, 5],
}


@pytest.mark.parametrize("edit", PATTERN_EDITS)
def test_mixed_layer_stack_params_and_state_equal_the_edit_by_hand(edit):
  indices = PATTERN_EDITS[edit]
  params, state = _init(6, PATTERN)
  new_params = new_state = None
  kwargs = {}
  if None in indices:
    new_params, new_state = _init(len(indices), PATTERN, seed=1)
    kwargs = dict(new=new_params, zero=("out/w",))
  got = st.take_layers(params, "model/h", indices, pattern=PATTERN, **kwargs)
  _assert_equal(got, _by_hand(params, "model/h", indices, new_params,
                              zeroed={"block/out/w"}, pattern=PATTERN))
  got_state = st.take_layers(state, "model/h", indices, pattern=PATTERN, new=new_state)
  _assert_equal(got_state, _by_hand(state, "model/h", indices, new_state, pattern=PATTERN))
  # The kinds' stacks have the counts of the pattern at the new depth.
  want, _ = _init(len(indices), PATTERN)
  assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, want)


@pytest.mark.parametrize("pattern", [None, PATTERN])
def test_blockseq_layout_equals_the_edit_by_hand(pattern):
  indices = [0, None, 2, 0, None, 5] if pattern else [2, None, 0, 0, None]
  params, _ = _init(6 if pattern else 3, pattern)
  new, _ = _init(len(indices), pattern, seed=1)
  layers = st.unstack_params(params, "model/h", pattern=pattern)
  fresh = st.unstack_params(new, "model/h", pattern=pattern)
  got = st.take_layers(layers, "model/h", indices, pattern=pattern, new=fresh,
                       zero=("block/out",))
  _assert_equal(got, _renamed(layers, fresh, "model/h", indices,
                              {"block/out/w", "block/out/b"}))
  # The same edit in the Stacked layout, unstacked, is the same.
  stacked = st.take_layers(params, "model/h", indices, pattern=pattern, new=new,
                           zero=("block/out",))
  _assert_equal(got, st.unstack_params(stacked, "model/h", pattern=pattern))


def test_numpy_in_numpy_out_and_traceable():
  params = jax.device_get(_init(3)[0])
  got = st.take_layers(params, "model/h", [2, 2])
  assert all(isinstance(v, np.ndarray) for v in jax.tree.leaves(got))
  # Under jax.eval_shape (as the GPT example checks a depth map at start-up).
  shapes = jax.eval_shape(lambda p: st.take_layers(p, "model/h", [2, 2]), params)
  assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, got)


@pytest.mark.jax_independent
def test_helpers_spell_the_growth_schemes():
  assert depth.repeat(2, 4) == [0, 0, 1, 1]
  assert depth.repeat(2, 3) == [0, 0, 1]
  assert depth.tile(2, 4) == [0, 1, 0, 1]
  assert depth.tile(3, 4) == [0, 1, 2, 0]
  assert depth.insert_new(2, 4) == [0, None, 1, None]
  assert depth.insert_new(3, 4) == [0, None, 1, 2]
  assert depth.insert_new(2, 2) == [0, 1]
  assert depth.repeat(4, 8, period=2) == [0, 1, 0, 1, 2, 3, 2, 3]
  assert depth.tile(4, 8, period=2) == [0, 1, 2, 3, 0, 1, 2, 3]
  assert depth.insert_new(4, 8, period=2) == [0, 1, None, None, 2, 3, None, None]
  for helper in (depth.repeat, depth.tile, depth.insert_new):
    with pytest.raises(ValueError, match="grows a stack"):
      helper(4, 2)
    with pytest.raises(ValueError, match="whole periods"):
      helper(4, 6, period=4)
    with pytest.raises(ValueError, match="positive int"):
      helper(0, 2)


@pytest.mark.jax_independent
@pytest.mark.parametrize("n, m, want", [
    (4, 6, [0, 0, 1, 1, 2, 3]),
    (3, 7, [0, 0, 0, 1, 1, 2, 2]),
    (2, 3, [0, 0, 1]),
    (3, 6, [0, 0, 1, 1, 2, 2]),
])
def test_repeat_gives_the_lower_layers_the_extra_copies(n, m, want):
  # repeat(4, 6) once gave copies 2, 1, 2, 1.
  assert depth.repeat(n, m) == want
  # Per period, the same: repeat(4, 6) over periods of 2 layers.
  assert depth.repeat(2 * n, 2 * m, period=2) == [2 * u + j for u in want for j in (0, 1)]


# ---------------------------------------------------------------------------
# Function-preserving growth of a small transformer.


def _tiny(num_layers, block, remat, **kw):
  return transformer(Tiny(num_layers=num_layers, block=block, remat=remat, **kw))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 13, (3, 8)), jnp.int32)


def _params(model, seed):
  """Random parameters of the model's shapes (nothing compiled)."""
  return random_like(jax.eval_shape(model.init, jax.random.PRNGKey(0), TOKENS), seed)


def _logits_and_grads(model, params):
  def loss(p):
    logits = model.apply(p, TOKENS)
    return jnp.mean(jnp.sin(logits)), logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


# A fold and a scan block, each with a loop without and with checkpoints.
# The other aliases compute what "none" computes, for any parameters
# (stacked_test.py: test_remat_aliases_match_no_remat), so a grown stack
# keeps its function under them too.
@pytest.mark.parametrize("block,remat", [("fold", "none"), ("scan", "nested")])
def test_zeroed_fresh_layers_keep_the_function(block, remat):
  small, big = _tiny(2, block, remat), _tiny(4, block, remat)
  params, fresh = _params(small, 0), _params(big, 1)
  indices = depth.insert_new(2, 4)
  # Jitted, as a traced edit: op by op, each of its gathers and concatenations
  # would compile as a program of its own.
  grown = jax.jit(lambda p, new: st.take_layers(p, "h", indices, new=new,
                                                zero=RESIDUAL_OUTPUTS))(params, fresh)
  (_, want), want_grads = _logits_and_grads(small, params)
  (_, got), got_grads = _logits_and_grads(big, grown)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # A zeroed block is the identity, so the old layers' gradients are too.
  old = [p for p, i in enumerate(indices) if i is not None]
  for module, bundle in want_grads.items():
    for leaf, value in bundle.items():
      mine = np.asarray(got_grads[module][leaf])   # rows picked by numpy, not a compiled gather
      np.testing.assert_allclose(mine[np.asarray(old)] if module.startswith("h/") else mine,
                                 value, rtol=1e-5, atol=1e-6, err_msg=f"{module}/{leaf}")
  # Without zero=, the fresh layers change the function: the test can fail.
  if remat == "none":
    unzeroed = jax.jit(lambda p, new: st.take_layers(p, "h", indices, new=new))(params, fresh)
    assert not np.allclose(_logits_and_grads(big, unzeroed)[0][1], want, atol=1e-3)


@pytest.mark.parametrize("kw", [dict(pattern="LG", window=4), dict(stack="unrolled")],
                         ids=["pattern", "blockseq"])
def test_zeroed_fresh_layers_keep_the_function_of_patterns_and_blockseq(kw):
  small, big = _tiny(2, "fold", "full", **kw), _tiny(4, "fold", "full", **kw)
  pattern = tuple(KINDS[c] for c in kw.get("pattern", "")) or None
  params, fresh = _params(small, 0), _params(big, 1)
  grown = jax.jit(lambda p, new: st.take_layers(  # one program, not one per operation
      p, "h", depth.insert_new(2, 4, period=len(pattern or "x")), pattern=pattern, new=new,
      zero=RESIDUAL_OUTPUTS))(params, fresh)
  np.testing.assert_allclose(jax.jit(big.apply)(grown, TOKENS),
                             jax.jit(small.apply)(params, TOKENS), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Mistakes: one line, nothing changed.

MISTAKES = {
    "out_of_range": (dict(indices=[0, 3]), r"indices\[1\]=3 is out of range: 'model/h' has 3 layers"),
    "negative": (dict(indices=[-1]), r"indices\[0\]=-1 is out of range"),
    "not_an_int": (dict(indices=[0, 1.5]), r"indices\[1\]=1.5 is not a layer index"),
    "empty": (dict(indices=[]), "indices is empty"),
    "a_string": (dict(indices="012"), "must be a list of layer indices"),
    "unknown_stack": (dict(name="model/g"), "no module of params is named 'model/g'"),
    "trailing_slash": (dict(name="model/h/"), "no trailing '/'"),
    "fresh_without_new": (dict(indices=[0, None]), r"indices\[1\] is None, a fresh layer, but no new="),
    "zero_without_new": (dict(zero=("out",)), "pass new="),
    "new_of_another_depth": (dict(indices=[0, None], new=4), "new= holds 4 layers of 'model/h', but indices make 2"),
    "zero_names_nothing": (dict(indices=[0, None], new=2, zero=("attn/proj",)),
                           r"zero=\['attn/proj'\] names no leaf"),
    "pattern_broken": (dict(pattern=PATTERN, indices=[0, 2, 1]),
                       r"puts layer 2, of kind 'b', at position 1, which pattern \('a', 'a', 'b'\) gives kind 'a'"),
    "not_the_pattern": (dict(pattern=("a", "b", "b")), r"pattern \(.a., .b., .b.\) over 3 layers has"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_mistakes_stop_with_one_line_and_change_nothing(mistake):
  changes, message = MISTAKES[mistake]
  pattern = changes.get("pattern")
  params, _ = _init(3, PATTERN if pattern else None)
  before = copy.deepcopy(jax.device_get(params))
  kwargs = dict(name="model/h", indices=[0, 1, 2], pattern=pattern, zero=changes.get("zero", ()))
  kwargs.update({k: v for k, v in changes.items() if k in ("name", "indices")})
  if "new" in changes:
    kwargs["new"] = _init(changes["new"], pattern)[0]
  with pytest.raises(ValueError, match=message) as info:
    st.take_layers(params, kwargs.pop("name"), kwargs.pop("indices"), **kwargs)
  assert "\n" not in str(info.value)
  _assert_equal(jax.device_get(params), before)


def test_new_from_another_model_is_refused():
  params, _ = _init(3)
  def forward(x):
    with hk.experimental.name_scope("model"):
      return st.Stacked(lambda: Block(5), 2, name="h").fold(x)
  other = random_like(jax.eval_shape(hk.transform_with_state(forward).init,
                                     jax.random.PRNGKey(0), X)[0])
  with pytest.raises(ValueError, match=r"new= model/h/block/fc/[wb] is float32\[(4, )?5\] per "
                     r"layer but params' is float32\[(4, )?8\]"):
    st.take_layers(params, "model/h", [0, None], new=other)


def _kinds_params(counts):
  """Stacks under model/h/<kind> (``{kind: layers}``), as a mixed-layer stack lays
  them out, or as one block with two modules does."""
  return {f"model/h/{kind}/linear": {"w": np.arange(c * 4.0).reshape(c, 2, 2) + 100 * k}
          for k, (kind, c) in enumerate(counts.items())}


def test_a_mixed_stack_without_its_pattern_is_refused():
  # Once each kind's rows were picked, as if each kind were the stack.
  params = _kinds_params({"a": 2, "b": 2})   # pattern ab over 4 layers
  with pytest.raises(ValueError, match=r"^take_layers: the modules under 'model/h' lie "
                     r"under \['a', 'b'\], as the kinds of a mixed-layer stack do.*the "
                     r"indices would pick each kind's rows.*Pass the pattern the stack was "
                     r"built with as pattern="):
    st.take_layers(params, "model/h", [0, 1])
  got = st.take_layers(params, "model/h", [0, 1], pattern="ab")   # layers 0 (a), 1 (b)
  for kind in ("a", "b"):
    np.testing.assert_array_equal(got[f"model/h/{kind}/linear"]["w"],
                                  params[f"model/h/{kind}/linear"]["w"][:1])


def test_a_stack_of_one_block_laid_out_like_kinds_edits_one_scope_at_a_time():
  params = _kinds_params({"attn": 3, "mlp": 3})   # one block with two modules
  with pytest.raises(ValueError, match=r"edit one at a time: take_layers\(params, "
                     r"'model/h/attn', indices\), then 'model/h/mlp'"):
    st.take_layers(params, "model/h", [2, 0])
  got = st.take_layers(st.take_layers(params, "model/h/attn", [2, 0]), "model/h/mlp", [2, 0])
  for scope in ("model/h/attn/linear", "model/h/mlp/linear"):
    np.testing.assert_array_equal(got[scope]["w"], params[scope]["w"][[2, 0]])


@pytest.mark.parametrize("layout", ["stacked", "blockseq"])
def test_zero_without_fresh_layers_changes_nothing(layout):
  params, new = _init(3)[0], _init(3, seed=1)[0]
  if layout == "blockseq":
    params, new = (st.unstack_params(p, "model/h") for p in (params, new))
  got = st.take_layers(params, "model/h", [1, 0, 2], new=new, zero=("out",))
  _assert_equal(got, st.take_layers(params, "model/h", [1, 0, 2]))
