"""Tests for st.Stacked and st.BlockSeq (and what they share with layer_stack).

Every value is checked against an independent reference:

* a Python loop that slices the stacked parameters (and state) and applies a
  plainly ``hk.transform``-ed single block, differentiated with ``jax.grad``;
* BlockSeq, the unrolled twin, given ``unstack_params`` of Stacked's params
  (its gradients restacked with ``stack_params``);
* for remat policies, ``jax.grad`` of the same stack with ``remat=False``.

Most parameters are random arrays shaped by ``jax.eval_shape`` of the init
(no compile); a real init is run only where the init itself is under test.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st

from haiku_helpers import (B, D, assert_close, layer_slice, random_like,
                           random_x, restack, signature, sin_loss, stack_layers)
from haiku_helpers import check_jax_usage  # pylint: disable=unused-import  # autouse fixture

N = 4
KEY = jax.random.PRNGKey(0)
APPLY_KEY = jax.random.PRNGKey(1)

REMATS = [False, "none", True, "full", "nested", "offload", "save_all",
          st.CheckpointPolicy(save_block_internals=["name"])]
REMAT_IDS = ["False", "none", "True", "full", "nested", "offload", "save_all",
             "save_name"]


# ---------------------------------------------------------------------------
# Helpers (more in haiku_helpers).


def _no_rng(apply):
  return lambda params, *args: apply(params, None, *args)


def _out_and_grads(f, *args):
  """``(f(*args), grads of sin_loss(f(*args)) w.r.t. every argument)``."""
  def loss(*a):
    out = f(*a)
    return sin_loss(out), out
  (_, out), grads = jax.value_and_grad(
      loss, argnums=tuple(range(len(args))), has_aux=True)(*args)
  return out, grads


class Block(hk.Module):
  """A residual block with every kind of argument; ``scan=True`` returns a y."""

  def __init__(self, scan=False, name=None):
    super().__init__(name=name)
    self.scan = scan

  def __call__(self, x, ctx, gate, *, scale, bias):
    h = hk.Linear(D, name="lin")(x) + hk.Linear(D, with_bias=False, name="ctx")(ctx)
    h = st.checkpoint_name(jnp.tanh(h), "name")
    new_x = x + scale * gate * h + bias
    if self.scan:
      return new_x, {"h": h, "norm": jnp.sum(h * h)}
    return new_x


def _inputs(n=N):
  """``(x, ctx, gates, biases)``: carry, broadcast, per-layer, per-layer."""
  return (random_x(seed=0), random_x(seed=1), 0.5 + jnp.arange(n) / n,
          0.1 * random_x((n, D), seed=2))


def _stack_fn(cls, kind, n=N, **config):
  """``(x, ctx, gates, biases) -> out`` through a ``cls`` stack of Block."""
  def fn(x, ctx, gates, biases):
    stack = cls(lambda: Block(scan=kind == "scan"), n, name="h", **config)
    return getattr(stack, kind)(x, ctx, st.per_layer(gates), scale=0.5,
                                bias=st.per_layer(biases))
  return hk.transform(fn)


def _loop(params, x, ctx, gates, biases, *, kind, reverse=False, n=N):
  """The reference for ``_stack_fn``: one Block per sliced layer, in order."""
  layer = hk.transform(lambda x, *a, **k: Block(scan=kind == "scan")(x, *a, **k))
  ys = [None] * n
  for i in (reversed(range(n)) if reverse else range(n)):
    out = layer.apply(layer_slice(params, "h", i), None, x, ctx, gates[i], scale=0.5,
                      bias=biases[i])
    x, ys[i] = out if kind == "scan" else (out, None)
  if kind == "fold":
    return x
  return x, stack_layers(ys)


def _in_transform(fn, *args):
  """Traces ``fn(*args)`` inside ``hk.transform(...).init`` (no compile)."""
  return jax.eval_shape(lambda *a: hk.transform(fn).init(KEY, *a), *args)


# ---------------------------------------------------------------------------
# Stacked against a loop over sliced params, and against BlockSeq.


@pytest.mark.parametrize("kind,reverse,unroll", [
    ("fold", False, 1), ("fold", True, 2), ("scan", False, 3), ("scan", True, True)])
def test_stacked_matches_loop_and_blockseq(kind, reverse, unroll):
  args = _inputs()
  stacked = _stack_fn(st.Stacked, kind, reverse=reverse, unroll=unroll)
  seq = _stack_fn(st.BlockSeq, kind, reverse=reverse)   # a loop: no unroll
  shapes = jax.eval_shape(stacked.init, KEY, *args)
  assert signature(shapes) == {
      "h/block/lin": {"w": ((N, D, D), "float32"), "b": ((N, D), "float32")},
      "h/block/ctx": {"w": ((N, D, D), "float32")}}
  params = random_like(shapes)

  out, grads = jax.jit(functools.partial(
      _out_and_grads, _no_rng(stacked.apply)))(params, *args)
  expected = _out_and_grads(
      functools.partial(_loop, kind=kind, reverse=reverse), params, *args)
  # float32 summed in another order (a jitted scan against an eager loop):
  # gradients of magnitude ~5 differ by up to ~2e-5 in their smallest elements.
  assert_close((out, grads), expected, rtol=1e-4, atol=5e-5)

  seq_out, seq_grads = jax.jit(functools.partial(
      _out_and_grads, _no_rng(seq.apply)))(
          st.unstack_params(params, "h"), *args)
  seq_grads = (st.stack_params(seq_grads[0], "h"),) + seq_grads[1:]
  assert_close((seq_out, seq_grads), (out, grads), rtol=1e-4, atol=1e-5)


def test_blockseq_init_is_unstacked_stacked_init():
  args = _inputs()
  stacked_params = jax.jit(_stack_fn(st.Stacked, "fold").init)(KEY, *args)
  seq_params = jax.jit(_stack_fn(st.BlockSeq, "fold").init)(KEY, *args)
  expected = st.unstack_params(stacked_params, "h")
  assert signature(seq_params) == signature(expected)
  # Both draw every layer in one vmapped init from the same keys; XLA's
  # cheapest CPU code generation (conftest.py) may round a value of the two
  # programs differently (one ulp), the default one does not.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-7, atol=0),
               seq_params, expected)
  # Every layer initialised from its own key.
  w = np.asarray(stacked_params["h/block/lin"]["w"])
  assert len({w[i].tobytes() for i in range(N)}) == N


# ---------------------------------------------------------------------------
# Remat: every alias gives the values and gradients of no remat.


def _remat_fns(remat):
  """Stacked, BlockSeq and layer_stack of one block, with ``remat``."""
  n = 5  # "nested" splits 5 as 2 chunks of 2 and a remainder of 1.

  def block(x):
    h = st.checkpoint_name(jnp.tanh(hk.Linear(D, name="lin")(x)), "name")
    return x + hk.Linear(D, name="out")(h * h)

  def stacked(x):
    return st.Stacked(lambda: block, n, remat=remat, name="h").fold(x)

  def seq(x):
    return st.BlockSeq(lambda: block, n, remat=remat, name="h").fold(x)

  def layer_stack(x):
    return st.layer_stack(n, remat=remat)(block)(x)

  return {name: hk.transform(f) for name, f in
          (("stacked", stacked), ("seq", seq), ("layer_stack", layer_stack))}


def _remat_params():
  fns = _remat_fns(False)
  stacked = random_like(jax.eval_shape(fns["stacked"].init, KEY, random_x()))
  return {"stacked": stacked, "seq": st.unstack_params(stacked, "h"),
          "layer_stack": random_like(
              jax.eval_shape(fns["layer_stack"].init, KEY, random_x()), seed=3)}


@functools.lru_cache(maxsize=None)
def _remat_outputs(remat):
  fns, params = _remat_fns(remat), _remat_params()

  @jax.jit
  def run(params, x):
    return {name: _out_and_grads(_no_rng(t.apply), params[name], x)
            for name, t in fns.items()}

  return jax.device_get(run(params, random_x()))


@pytest.mark.parametrize("remat", REMATS, ids=REMAT_IDS)
def test_remat_aliases_match_no_remat(remat):
  assert_close(_remat_outputs(remat), _remat_outputs(False), rtol=1e-5, atol=1e-6)
  # The three APIs agree with each other too (same params for two of them).
  out = _remat_outputs(remat)
  assert_close(out["seq"][0], out["stacked"][0])


def test_remat_aliases_checkpoint_what_they_say():
  """``remat`` reaches jax.checkpoint: saved residuals differ between aliases."""
  try:
    from jax.ad_checkpoint import saved_residuals  # pylint: disable=g-import-not-at-top
  except ImportError:
    from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=g-import-not-at-top
  params = _remat_params()["stacked"]

  def count(remat):
    t = _remat_fns(remat)["stacked"]
    return len(saved_residuals(lambda p, x: t.apply(p, None, x), params, random_x()))

  assert count("full") < count("none")


# ---------------------------------------------------------------------------
# Randomness.


class RandomBlock(hk.Module):

  def __call__(self, x):
    mask = hk.dropout(hk.next_rng_key(), 0.5, jnp.ones_like(x))
    return x * mask, (mask, jax.random.normal(hk.next_rng_key(), (3,)))


def test_per_layer_rng_distinct_and_blockseq_reproduces_it():
  x, reverse = jnp.ones((2, 64)), True

  def fn(cls, remat=False):
    return hk.transform(lambda x: cls(RandomBlock, N, reverse=reverse,
                                      remat=remat, name="h").scan(x))

  @jax.jit
  def both(rng, x):
    return (fn(st.Stacked).apply({}, rng, x), fn(st.BlockSeq).apply({}, rng, x),
            fn(st.Stacked, "nested").apply({}, rng, x))

  (out, (masks, normals)), seq_out, nested_out = both(APPLY_KEY, x)
  assert_close(seq_out, (out, (masks, normals)), rtol=0, atol=0)
  assert_close(nested_out, (out, (masks, normals)), rtol=0, atol=0)
  assert normals.shape == (N, 3)
  assert len({tuple(np.asarray(row).tolist()) for row in normals}) == N
  masks = np.asarray(masks) != 0
  # Each layer drops a different half (its own key); the carry kept the
  # product of all masks.
  assert len({m.tobytes() for m in masks}) == N
  assert 0.3 < masks.mean() < 0.7
  np.testing.assert_array_equal(np.asarray(out) != 0, masks.all(axis=0))
  (other, _), _, _ = both(KEY, x)
  assert np.any(np.asarray(other) != np.asarray(out))


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_rng_none(cls):
  def det_block(x):
    return x + jnp.tanh(hk.Linear(D, name="lin")(x))

  det = hk.transform(lambda x: cls(lambda: det_block, N, name="h").fold(x))
  params = random_like(jax.eval_shape(det.init, KEY, random_x()))
  out = det.apply(params, None, random_x())
  if cls is st.BlockSeq:
    params = st.stack_params(params, "h")
  layer = hk.transform(det_block)
  expected = random_x()
  for i in range(N):
    expected = layer.apply(layer_slice(params, "h", i), None, expected)
  assert_close(out, expected)

  rand = hk.transform(lambda x: cls(lambda: RandomBlock(), N, name="h").scan(x))
  with pytest.raises(ValueError, match="You must pass a non-None PRNGKey"):
    jax.eval_shape(lambda x: rand.apply({}, None, x), random_x())


# ---------------------------------------------------------------------------
# Haiku state.


class CounterBlock(hk.Module):
  """Counts its calls and sums its inputs, per layer."""

  def __call__(self, x):
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    total = hk.get_state("total", [D], jnp.float32, init=jnp.zeros)
    hk.set_state("total", total + jnp.mean(x, axis=0))
    return x + jnp.tanh(hk.Linear(D)(x))


def _counter_fn(cls, reverse=False, remat=False):
  return hk.transform_with_state(lambda x: cls(
      CounterBlock, N, reverse=reverse, remat=remat, name="h").fold(x))


@pytest.mark.parametrize("reverse,remat", [(False, False), (True, "nested")])
def test_state_advances_per_layer_like_loop_and_blockseq(reverse, remat):
  x = random_x()
  stacked = _counter_fn(st.Stacked, reverse, remat)
  seq = _counter_fn(st.BlockSeq, reverse, remat)
  params, state = random_like(jax.eval_shape(stacked.init, KEY, x))
  assert signature(state) == {"h/counter_block": {
      "count": ((N,), "int32"), "total": ((N, D), "float32")}}

  @jax.jit
  def both(params, state, x):
    return (stacked.apply(params, state, None, x),
            seq.apply(st.unstack_params(params, "h"),
                      st.unstack_params(state, "h"), None, x))

  (out, new_state), (seq_out, seq_state) = both(params, state, x)
  # Reference: the single block, layer by layer, on sliced params and state.
  layer = hk.transform_with_state(lambda x: CounterBlock()(x))
  expected, states = x, [None] * N
  for i in (reversed(range(N)) if reverse else range(N)):
    expected, states[i] = layer.apply(layer_slice(params, "h", i),
                                      layer_slice(state, "h", i),
                                      None, expected)
  expected_state = restack(states, "h")
  assert_close((out, new_state), (expected, expected_state))
  np.testing.assert_array_equal(new_state["h/counter_block"]["count"],
                                state["h/counter_block"]["count"] + 1)
  assert_close((seq_out, st.stack_params(seq_state, "h")), (out, new_state))


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_init_state_is_the_blocks_initial_state(cls):
  t = _counter_fn(cls)
  x = random_x()
  params, state = t.init(KEY, x)
  if cls is st.BlockSeq:
    state = st.stack_params(state, "h")
  # Zeros, not one step in.
  np.testing.assert_array_equal(state["h/counter_block"]["count"], np.zeros(N, np.int32))
  np.testing.assert_array_equal(state["h/counter_block"]["total"], np.zeros((N, D)))
  if cls is st.BlockSeq:
    state = st.unstack_params(state, "h")
  _, state = t.apply(params, state, None, x)
  _, state = t.apply(params, state, None, x)
  if cls is st.BlockSeq:
    state = st.stack_params(state, "h")
  np.testing.assert_array_equal(state["h/counter_block"]["count"],
                                np.full(N, 2, np.int32))


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_two_stacks_with_one_name_keep_separate_state(cls):
  def count_block(x):
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    return x

  def fn(x):
    x = cls(lambda: count_block, 2, name="h").fold(x)
    return cls(lambda: count_block, 2, name="h").fold(x)

  t = hk.transform_with_state(fn)
  _, state = jax.eval_shape(t.init, KEY, random_x())
  state = jax.tree.map(lambda s: jnp.arange(s.size, dtype=s.dtype).reshape(s.shape) * 10,
                       state)
  # A function block's state lives directly under the stack ("~": no module).
  if cls is st.Stacked:
    assert sorted(state) == ["h/~", "h_1/~"]
  else:
    assert sorted(state) == ["h/layer_0/~", "h/layer_1/~", "h_1/layer_0/~",
                             "h_1/layer_1/~"]
  _, new_state = t.apply({}, state, None, random_x())
  assert_close(new_state, jax.tree.map(lambda s: s + 1, state), rtol=0, atol=0)


# ---------------------------------------------------------------------------
# st.layer_index().


def _index_block(x):
  """Records the layer index: in a param at init, in the carry and as y."""
  i = st.layer_index()
  s = hk.get_parameter("s", [], jnp.float32,
                       init=lambda shape, dtype: jnp.full(shape, i, dtype))
  return x * 10.0 + (i + 1).astype(jnp.float32), (i, s)


def _index_fn(api, reverse, n=3):
  if api == "layer_stack":
    return hk.transform(lambda x: st.layer_stack(n, with_per_layer_inputs=True)(
        _index_block)(x, reverse=reverse))
  cls = {"Stacked": st.Stacked, "BlockSeq": st.BlockSeq}[api]
  return hk.transform(lambda x: cls(lambda: _index_block, n, reverse=reverse,
                                    name="h").scan(x))


@pytest.mark.parametrize("api", ["Stacked", "BlockSeq", "layer_stack"])
def test_layer_index(api):
  x = jnp.zeros(())
  t = _index_fn(api, reverse=False)
  params = t.init(KEY, x)
  # At init, every layer's parameter was set from its own index.
  s = sorted((k, v["s"]) for k, v in params.items())
  np.testing.assert_array_equal(
      np.concatenate([np.reshape(v, -1) for _, v in s]), [0.0, 1.0, 2.0])
  out, (index, s_seen) = t.apply(params, None, x)
  np.testing.assert_array_equal(index, [0, 1, 2])
  assert index.dtype == jnp.int32
  np.testing.assert_array_equal(s_seen, [0.0, 1.0, 2.0])
  assert float(out) == 123.0  # Layers 0, 1, 2 in that order.
  out, (index, _) = _index_fn(api, reverse=True).apply(params, None, x)
  np.testing.assert_array_equal(index, [0, 1, 2])
  assert float(out) == 321.0  # Layers 2, 1, 0.


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_layer_index_under_nested_remat(cls):
  def fn(reverse):
    return hk.transform(lambda x: cls(lambda: _index_block, 5, remat="nested",
                                      reverse=reverse, name="h").scan(x))

  @jax.jit
  def both(params, x):
    return fn(False).apply(params, None, x), fn(True).apply(params, None, x)

  x = jnp.zeros(())
  params = jax.tree.map(jnp.zeros_like, jax.eval_shape(fn(False).init, KEY, x))
  (out, (index, _)), (out_reverse, (index_reverse, _)) = both(params, x)
  np.testing.assert_array_equal(index, np.arange(5))
  np.testing.assert_array_equal(index_reverse, np.arange(5))
  assert (float(out), float(out_reverse)) == (12345.0, 54321.0)


@pytest.mark.parametrize("outer_cls,inner_cls", [
    (st.Stacked, st.Stacked), (st.Stacked, st.BlockSeq), (st.BlockSeq, st.Stacked)])
def test_layer_index_in_nested_stacks_is_innermost(outer_cls, inner_cls):
  def outer_block(x):
    before = st.layer_index()
    x, (inner, _) = inner_cls(lambda: _index_block, 2, name="inner").scan(x)
    return x, (before, inner, st.layer_index())

  t = hk.transform(lambda x: outer_cls(lambda: outer_block, 3, name="outer").scan(x))
  x = jnp.zeros(())
  out, (before, inner, after) = t.apply(t.init(KEY, x), None, x)
  np.testing.assert_array_equal(before, [0, 1, 2])
  np.testing.assert_array_equal(after, [0, 1, 2])
  np.testing.assert_array_equal(inner, [[0, 1]] * 3)
  assert float(out) == 121212.0


def test_layer_index_outside_a_block():
  with pytest.raises(RuntimeError, match=r"st\.layer_index\(\) was called "
                     r"outside a stacked block.*st\.Stacked, st\.BlockSeq or "
                     r"st\.layer_stack"):
    st.layer_index()
  # Not inside a stack's block, even within a transform that holds one.
  def fn(x):
    x = st.Stacked(lambda: lambda x: x, 2, name="h").fold(x)
    return x + st.layer_index()
  with pytest.raises(RuntimeError, match="outside a stacked block"):
    _in_transform(fn, jnp.zeros(()))


# ---------------------------------------------------------------------------
# Parameter reuse and nesting.


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_parameter_reuse(cls):
  def fn(x, ctx, gates, biases):
    stack = cls(lambda: Block(), N, name="h")
    x = stack.fold(x, ctx, st.per_layer(gates), scale=0.5, bias=st.per_layer(biases))
    return stack.fold(x, ctx, st.per_layer(gates), scale=0.5, bias=st.per_layer(biases))

  t = hk.transform(fn)
  args = _inputs()
  shapes = jax.eval_shape(t.init, KEY, *args)
  one = jax.eval_shape(_stack_fn(cls, "fold").init, KEY, *args)
  assert signature(shapes) == signature(one)
  params = random_like(shapes)
  stacked_params = params if cls is st.Stacked else st.stack_params(params, "h")
  once = _loop(stacked_params, *args, kind="fold")
  assert_close(jax.jit(t.apply)(params, None, *args),
                _loop(stacked_params, once, *args[1:], kind="fold"))


def test_fold_and_scan_share_parameters():
  def block(x, collect):
    h = jnp.tanh(hk.Linear(D)(x))
    return (h, jnp.sum(h)) if collect else h

  def both(x):
    stack = st.Stacked(lambda: block, N, name="h")
    return stack.fold(x, False), stack.scan(x, True)

  t = hk.transform(both)
  shapes = jax.eval_shape(t.init, KEY, random_x())
  assert signature(shapes) == {"h/linear": {"w": ((N, D, D), "float32"),
                                             "b": ((N, D), "float32")}}
  folded, (scanned, ys) = jax.jit(t.apply)(random_like(shapes), None, random_x())
  assert_close(scanned, folded)
  assert ys.shape == (N,)


def test_nested_stacked_shapes():
  def inner(x):
    return st.Stacked(lambda: hk.Linear(100), 10, name="inner").fold(x)

  def fn(x):
    return st.Stacked(lambda: inner, 20, name="outer").fold(x)

  shapes = _in_transform(fn, jax.ShapeDtypeStruct((10, 100), jnp.float32))
  assert signature(shapes) == {"outer/inner/linear": {
      "w": ((20, 10, 100, 100), "float32"), "b": ((20, 10, 100), "float32")}}


@pytest.mark.parametrize("outer_cls", [st.Stacked, st.BlockSeq])
def test_nested_stacks_match_double_loop(outer_cls):
  outer_n, inner_n = 3, 2

  def block(x):
    return x + jnp.tanh(hk.Linear(D)(x))

  def fn(x):
    def inner(x):
      return st.Stacked(lambda: block, inner_n, name="inner").fold(x)
    return outer_cls(lambda: inner, outer_n, name="outer").fold(x)

  t = hk.transform(fn)
  params = random_like(jax.eval_shape(t.init, KEY, random_x()))
  out = jax.jit(t.apply)(params, None, random_x())
  if outer_cls is st.BlockSeq:
    params = st.stack_params(params, "outer")
  (name,) = params
  assert params[name]["w"].shape == (outer_n, inner_n, D, D)
  expected = random_x()
  for i in range(outer_n):
    for j in range(inner_n):
      expected = expected + jnp.tanh(
          expected @ params[name]["w"][i, j] + params[name]["b"][i, j])
  assert_close(out, expected)


# ---------------------------------------------------------------------------
# Memory, from the compiled program.


def test_memory_none_gt_full_gt_nested():
  n, width, batch = 48, 128, 256

  class MLPBlock(hk.Module):

    def __call__(self, x):
      return x + hk.Linear(width)(jax.nn.gelu(hk.Linear(width)(x)))

  x = jax.ShapeDtypeStruct((batch, width), jnp.float32)

  def temp_bytes(remat):
    t = hk.transform(lambda x: st.Stacked(MLPBlock, n, remat=remat, name="h").fold(x))
    params = jax.eval_shape(t.init, KEY, x)
    def loss(p, x):
      return jnp.sum(t.apply(p, None, x) ** 2)
    compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  none, full, nested = temp_bytes("none"), temp_bytes("full"), temp_bytes("nested")
  assert none > full > nested, (none, full, nested)
  carry = batch * width * 4
  # "none" keeps each layer's carry and its first matmul's output (the
  # GELU and its derivative are recomputed from it), "full" about one carry
  # per layer, "nested" about 2 * sqrt(48) ~ 14 carries (and a chunk's grads).
  # So none keeps n carry-sized values more than full, give or take the
  # workspace in which full recomputes a layer, which XLA sizes (none - full
  # measured 48.5 carries on jax 0.10.2, 47.5 on 0.12): not 2n, which a
  # kept GELU derivative would add.
  assert (n - 2) * carry < none - full < (n + 2) * carry, (none, full)
  assert full - nested > 16 * carry, (full, nested)


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_per_layer_with_wrong_leading_axis(cls):
  x, ctx, gates, biases = _inputs()
  name = cls.__name__

  def call(gates, biases):
    return lambda x: cls(lambda: Block(), N, name="h").fold(
        x, ctx, gates, scale=0.5, bias=biases)

  with pytest.raises(ValueError, match=(
      rf"{name}: per_layer positional argument 1 has a leading axis of 3, but "
      rf"the stack has num_layers={N}")):
    _in_transform(call(st.per_layer(gates[:3]), st.per_layer(biases)), x)
  with pytest.raises(ValueError, match=(
      rf"{name}: per_layer keyword argument 'bias' has a leading axis of 5, but "
      rf"the stack has num_layers={N}")):
    _in_transform(call(st.per_layer(gates), st.per_layer(random_x((5, D)))), x)
  with pytest.raises(ValueError, match=(
      rf"{name}: per_layer keyword argument 'bias'\['b'\] has a leading axis of "
      rf"2, but the stack has num_layers={N}")):
    _in_transform(call(st.per_layer(gates),
                       st.per_layer({"a": biases, "b": biases[:2]})), x)
  with pytest.raises(ValueError, match=(
      rf"{name}: per_layer positional argument 1 is a scalar.*num_layers={N}")):
    _in_transform(call(st.per_layer(jnp.float32(1.0)), st.per_layer(biases)), x)


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq, "layer_stack"])
@pytest.mark.parametrize("num_layers,error,match", [
    (0, ValueError, r"num_layers must be >= 1, got 0"),
    (-1, ValueError, r"num_layers must be >= 1, got -1"),
    (2.5, TypeError, r"num_layers must be an int >= 1, got 2\.5"),
    (True, TypeError, r"num_layers must be an int >= 1, got True"),
])
def test_bad_num_layers(cls, num_layers, error, match):
  def make():
    if cls == "layer_stack":
      return st.layer_stack(num_layers)
    return cls(lambda: Block(), num_layers)

  with pytest.raises(error, match=match):
    _in_transform(make)


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_bad_remat_unroll_and_make_block(cls):
  name = cls.__name__
  with pytest.raises(ValueError, match=r"remat='nest' is not a checkpoint policy"
                     r"\. Accepted: False, None, True, 'none', 'full', 'nested'"):
    _in_transform(lambda: cls(lambda: Block(), N, remat="nest"))
  if cls is st.Stacked:
    with pytest.raises(ValueError, match=rf"{name}: unroll=0 is not accepted: "
                       r"use an int >= 1"):
      _in_transform(lambda: cls(lambda: Block(), N, unroll=0))
  else:   # A Python loop has nothing to unroll: BlockSeq takes no unroll=.
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'unroll'"):
      _in_transform(lambda: cls(lambda: Block(), N, unroll=2))
  with pytest.raises(TypeError, match=rf"{name} needs make_block, a factory"):
    _in_transform(lambda: cls(None, N))


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_scan_block_must_return_a_pair(cls):
  name = cls.__name__
  x = random_x()
  with pytest.raises(TypeError, match=(
      rf"{name}\.scan: a scan block must return a pair \(x, y\), but it returned "
      rf"an array of shape \({B}, {D}\)\. A block that returns only x is a fold "
      rf"block: use {name}\.fold")):
    _in_transform(lambda x: cls(lambda: lambda x: x + 1, N).scan(x), x)
  with pytest.raises(TypeError, match=rf"{name}\.scan: .* returned a tuple of 3"):
    _in_transform(lambda x: cls(lambda: lambda x: (x, x, x), N).scan(x), x)


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_fold_block_returning_a_pair_suggests_scan(cls):
  name = cls.__name__
  with pytest.raises(TypeError, match=(
      rf"{name}\.fold: the block returned a pair \(x, y\), but a fold block "
      rf"returns only the new x\. Use {name}\.scan")):
    _in_transform(lambda x: cls(lambda: lambda x: (x + 1, jnp.sum(x)), N).fold(x),
                  random_x())
  # A carry that is itself a pair is a fold, not a mistake.
  out = _in_transform(
      lambda x: cls(lambda: lambda c: (c[0] + 1, c[1] * 2), N, name="h").fold(
          (x, jnp.sum(x))), random_x())
  assert out == {}


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
@pytest.mark.parametrize("kind", ["fold", "scan"])
def test_carry_shape_change(cls, kind):
  def block(x):
    new = jnp.concatenate([x, x], axis=-1)
    return (new, None) if kind == "scan" else new

  # In the block's words: the public call, the stack's name and its x, not
  # the loop's carry.
  with pytest.raises(TypeError, match=(
      rf"^{cls.__name__} 'shrinking': the block changed x from float32\[{B}, {D}\] to "
      rf"float32\[{B}, {2 * D}\]; each layer's output is the next layer's input")):
    _in_transform(lambda x: getattr(cls(lambda: block, N, name="shrinking"), kind)(x),
                  random_x())


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_carry_cannot_be_per_layer(cls):
  with pytest.raises(TypeError, match=r"the carry x cannot be per_layer"):
    _in_transform(lambda x: cls(lambda: lambda x: x, N).fold(st.per_layer(x)),
                  random_x((N, D)))


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_a_module_instance_instead_of_a_factory(cls):
  with pytest.raises(TypeError, match=rf"{cls.__name__} got a module instance, "
                     r"Linear.*pass a factory \(a class or a lambda\)"):
    _in_transform(lambda x: cls(hk.Linear(D), N).fold(x), random_x())


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_a_policy_naming_a_value_no_block_tags_is_an_error(cls):
  # Once it saved nothing, silently.
  class Tagged(hk.Module):
    def __call__(self, x):
      return x + st.checkpoint_name(hk.Linear(D)(x), "proj")

  policy = st.CheckpointPolicy(save_block_internals=["proj", "prj"])
  with pytest.raises(ValueError, match=r"\['prj'\].*The block tags \['proj'\]"):
    _in_transform(lambda x: cls(Tagged, N, remat=policy, name="h").fold(x), random_x())


# ---------------------------------------------------------------------------
# Parameters of another depth: refused, naming the stack and the fix.


def _residual():
  return lambda x: x + hk.Linear(3)(x)


def _depth_models():
  """Stacks of ``n`` layers (``n`` given later), each of a kind the check reads."""
  def stacked(n, **kw):
    return hk.transform(lambda x: st.Stacked(_residual, n, name="h", **kw).fold(x))

  def nested(n):
    inner = lambda: (lambda x: st.Stacked(_residual, n, name="inner").fold(x))  # noqa: E731
    return hk.transform(lambda x: st.Stacked(inner, 2, name="h").fold(x))

  return {
      "stacked": stacked,
      "nested_remat": lambda n: stacked(n, remat="nested"),
      "layer_stack": lambda n: hk.transform(lambda x: st.layer_stack(n, name="h")(
          lambda x: x + hk.Linear(3)(x))(x)),
      "mixed": lambda n: hk.transform(lambda x: st.Stacked(
          {"A": _residual, "B": _residual}, n, pattern="AB", name="h").fold(x)),
      "nested": nested,
  }


@pytest.mark.parametrize("kind", sorted(_depth_models()))
@pytest.mark.parametrize("made, want", [(6, 2), (2, 6)])
def test_params_of_another_depth_are_refused(kind, made, want):
  # Once a deeper stack's ran their first rows, and a shallower one's failed
  # inside lax.scan naming neither the stack nor its parameters.
  make = _depth_models()[kind]
  x = jnp.ones((2, 3))
  params = jax.eval_shape(make(made).init, KEY, x)
  with pytest.raises(ValueError) as info:
    jax.eval_shape(make(want).apply, params, None, x)
  message = str(info.value)
  rows = made // 2 if kind == "mixed" else made
  assert f"has {rows} rows on its leading (Layers) axis" in message, message
  if kind == "mixed":
    assert (f"pattern=('A', 'B') gives the kind 'A' {want // 2} of the stack's "
            f"num_layers={want}") in message, message
  else:
    assert f"the stack has num_layers={want}" in message, message
  assert message.startswith("layer_stack: " if kind == "layer_stack" else "Stacked: ")
  if kind == "mixed":
    assert "st.take_layers(params, 'h', indices, pattern=('A', 'B'))" in message
  elif kind == "nested":   # its parameters have the outer axis too: no take_layers
    assert "build the stack with num_layers=" in message and "take_layers" not in message
  else:
    assert f"build the stack with num_layers={made}" in message, message
    assert "st.take_layers(params, 'h', indices)" in message, message


def test_params_cut_to_the_depth_run():
  x = jnp.ones((2, 3))
  make = _depth_models()["stacked"]
  params = make(6).init(KEY, x)
  got = make(2).apply(st.take_layers(params, "h", [0, 3]), None, x)
  w, b = params["h/linear"]["w"], params["h/linear"]["b"]
  want = x
  for r in (0, 3):   # layer j uses row r
    want = want + want @ w[r] + b[r]
  np.testing.assert_allclose(got, want, rtol=1e-5)


# ---------------------------------------------------------------------------
# Typed PRNG keys (they once broke remat="nested"), numpy ints.


class _DropoutBlock(hk.Module):

  def __call__(self, x):
    h = hk.Linear(x.shape[-1])(x)
    return x + hk.dropout(hk.next_rng_key(), 0.5, h)


@pytest.mark.parametrize("remat", list(st.REMAT_ALIASES))
def test_typed_keys_every_alias_against_blockseq(remat):
  """Init and apply with jax.random.key, against BlockSeq on the same params."""
  x = jnp.ones((2, 3))

  def make(cls):
    return hk.transform(lambda x: cls(lambda: _DropoutBlock(name="block"), N, remat=remat,
                                      name="h").fold(x))
  stacked, seq = make(st.Stacked), make(st.BlockSeq)
  params = jax.jit(stacked.init)(jax.random.key(0), x)

  @jax.jit
  def values_and_grads(params, key):
    seq_params = st.unstack_params(params, "h")
    loss = lambda f: lambda p: jnp.sum(f.apply(p, key, x) ** 2)
    return (jax.value_and_grad(loss(stacked))(params),
            jax.value_and_grad(loss(seq))(seq_params))

  (value, grads), (seq_value, seq_grads) = values_and_grads(params, jax.random.key(1))
  np.testing.assert_allclose(value, seq_value, rtol=1e-6)
  np.testing.assert_allclose(st.unstack_params(grads, "h")["h/layer_2/block/linear"]["w"],
                             seq_grads["h/layer_2/block/linear"]["w"], rtol=1e-5)


def test_numpy_ints_are_layer_counts_and_unrolls():
  # Once st.fold took them (loops_test.py) and Stacked refused them; True is
  # not a count (test_bad_num_layers).
  x = jnp.ones((2, 3))

  def with_ints(num_layers, unroll):
    def fn(x):
      a = st.Stacked(_residual, num_layers, unroll=unroll, name="a").fold(x)
      b = st.BlockSeq(_residual, num_layers, name="b").fold(a)
      return st.layer_stack(num_layers, unroll=unroll, name="c")(_residual())(b)
    return hk.transform(fn)

  plain = with_ints(3, 2)
  numpy = with_ints(np.int64(3), np.int32(2))
  params = jax.jit(plain.init)(KEY, x)
  assert jax.tree.map(jnp.shape, jax.eval_shape(numpy.init, KEY, x)) \
      == jax.tree.map(jnp.shape, params)
  np.testing.assert_allclose(jax.jit(numpy.apply)(params, None, x),
                             jax.jit(plain.apply)(params, None, x), rtol=1e-6)
