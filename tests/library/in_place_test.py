"""Tests of per-layer arguments written in place (``in_place=True``).

Every layer of the test block writes a new key at one position of its row of
a cache and reads its row back; the reference is a NumPy loop over the
layers' sliced parameters and cache rows. The in-place form is checked
against it and against today's sliced form (``st.per_layer(cache)``, new
rows stacked as the scan's output) on ``Stacked`` (unroll, remat),
``BlockSeq``, mixed-layer patterns (a ring per local layer, a full cache per
global layer) and under ``jax.grad``; a donated cache is consumed and
aliased by the compiled step, whose temp memory stays a fraction of it.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

import stacktools as st

L, B, T, D = 4, 2, 8, 3
KEY = jax.random.PRNGKey(0)
# The forms compared bit for bit below compile at XLA's default optimisation
# level. At the tests' cheap level 0 (tests/conftest.py), XLA:CPU's fusion
# emitters (jaxlib 0.12 has no others; on 0.10 the tests use the older loop
# emitters) round tanh differently in different kernels, one ulp apart, so
# two programs of the same operations differ in the last bit; at level 3
# they do not. The programs are tiny.
EXACT = {"xla_backend_optimization_level": 3}


def exact(f, *args):
  """``f(*args)``, jitted and compiled at XLA's default optimisation level."""
  return jax.jit(f).lower(*args).compile(EXACT)(*args)


class Block(hk.Module):
  """Writes ``x @ w`` at ``slot`` of its cache row, then adds the row's mean."""

  def __init__(self, window=None, name=None):
    super().__init__(name=name)
    self.window = window

  def __call__(self, x, cache, pos):
    w = hk.get_parameter("w", [D, D], init=hk.initializers.RandomNormal())
    k = jnp.tanh(x @ w)[:, None]                   # [B, 1, D]
    slot = pos if self.window is None else pos % self.window
    if isinstance(cache, dict):                    # the sliced form
      row = jax.lax.dynamic_update_slice(cache["k"], k, (0, slot, 0))
      new = {"k": row}
    else:                                          # in place
      new = cache.write({"k": k}, at=(0, slot))
      row = new.read()["k"]
    return x + jnp.mean(row, axis=1), new


def reference(ws, x, cache, pos, windows):
  """A NumPy loop: layer i writes at its slot of cache[i] and reads it."""
  x, cache = np.array(x), np.array(cache)
  for i, w in enumerate(ws):
    slot = pos if windows[i] is None else pos % windows[i]
    cache[i][:, slot] = np.tanh(x @ np.asarray(w))
    x = x + cache[i].mean(axis=1)
  return x, cache


def plain(in_place, seq=False, **config):
  def f(x, cache, pos):
    cls = st.BlockSeq if seq else st.Stacked
    return cls(Block, L, name="h", **config).scan(
        x, st.per_layer(cache, in_place=in_place), pos)
  return hk.without_apply_rng(hk.transform(f))


def data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((B, D)).astype(np.float32)
  cache = {"k": rng.standard_normal((L, B, T, D)).astype(np.float32)}
  return x, cache


CONFIGS = [dict(), dict(unroll=2), dict(unroll=True), dict(remat="full"),
           dict(remat="nested"), dict(remat=st.per_depth("none:1,full:3"))]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_stacked_in_place_equals_sliced_form_and_reference(config):
  x, cache = data()
  sliced, in_place = plain(False, **config), plain(True, **config)
  params = sliced.init(KEY, x, cache, 3)

  def both(params, x, cache):
    return sliced.apply(params, x, cache, 3), in_place.apply(params, x, cache, 3)

  (x1, c1), (x2, c2) = exact(both, params, x, cache)
  want_x, want_cache = reference(params["h/block"]["w"], x, cache["k"], 3, [None] * L)
  np.testing.assert_allclose(x2, want_x, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(c2["k"], want_cache, rtol=1e-6)
  np.testing.assert_array_equal(x2, x1)
  np.testing.assert_array_equal(c2["k"], c1["k"])


def test_block_seq_in_place_equals_stacked():
  x, cache = data()
  stacked = plain(True)
  params = stacked.init(KEY, x, cache, 5)
  seq = plain(True, seq=True, remat="full")
  unstacked = st.unstack_params(params, "h")
  assert set(seq.init(KEY, x, cache, 5)) == set(unstacked)
  x1, c1 = exact(stacked.apply, params, x, cache, 5)
  x2, c2 = exact(seq.apply, unstacked, x, cache, 5)
  np.testing.assert_allclose(x2, x1, rtol=1e-6)
  np.testing.assert_array_equal(c2["k"], c1["k"])


@pytest.mark.parametrize("seq", [False, True], ids=["Stacked", "BlockSeq"])
def test_pattern_per_kind_rings_and_per_layer_cache(seq):
  """Local layers write a ring of 3 slots (per kind), global ones a full
  cache; a per-layer in-place argument of the whole stack goes alongside."""
  n, window, pattern = 5, 3, ("local", "local", "global")
  kinds = [pattern[i % 3] for i in range(n)]
  counts = {"local": kinds.count("local"), "global": kinds.count("global")}
  rng = np.random.default_rng(1)
  x = rng.standard_normal((B, D)).astype(np.float32)
  caches = {"local": {"k": rng.standard_normal((counts["local"], B, window, D)).astype(np.float32)},
            "global": {"k": rng.standard_normal((counts["global"], B, T, D)).astype(np.float32)}}
  extra = {"k": rng.standard_normal((n, B, T, D)).astype(np.float32)}

  class Two(hk.Module):
    """The block, then a second write into a per-layer cache of the stack."""

    def __init__(self, window):
      super().__init__(name=None)
      self.window = window

    def __call__(self, x, cache, other, pos):
      x, cache = Block(self.window, name="block")(x, cache, pos)
      if isinstance(other, dict):
        other = {"k": jax.lax.dynamic_update_slice(other["k"], x[:, None], (0, pos, 0))}
      else:
        other = other.write({"k": x[:, None]}, at=(0, pos))
      return x, (cache, other)

  def f(in_place):
    def run(x, caches, extra, pos):
      cls = st.BlockSeq if seq else st.Stacked
      stack = cls({"local": lambda: Two(window), "global": lambda: Two(None)}, n,
                  pattern=pattern, ys_by_kind=True, remat="full", name="h")
      return stack.scan(x, st.per_kind(caches, in_place=in_place),
                        st.per_layer(extra, in_place=in_place), pos)
    return hk.without_apply_rng(hk.transform(run))

  pos = 4   # past the ring's end: the local layers write slot 1
  sliced = f(False)
  params = sliced.init(KEY, x, caches, extra, pos)
  x1, ys1 = exact(sliced.apply, params, x, caches, extra, pos)
  x2, ys2 = exact(f(True).apply, params, x, caches, extra, pos)
  np.testing.assert_allclose(x2, x1, rtol=1e-6)
  for kind in counts:   # in place: the whole tree; sliced: the kind's stacked rows
    np.testing.assert_array_equal(ys2[kind][0]["k"], ys1[kind][0]["k"])
  # The per-layer argument comes back whole from every kind; the sliced form
  # stacks each kind's rows in kind order.
  for kind in counts:
    ids = [i for i in range(n) if kinds[i] == kind]
    np.testing.assert_array_equal(np.asarray(ys2[kind][1]["k"])[ids], ys1[kind][1]["k"])
  np.testing.assert_array_equal(ys2["local"][1]["k"], ys2["global"][1]["k"])
  # Against the NumPy loop.
  def w_of(prefix):
    (name,) = [k for k in params if k.startswith(prefix) and k.endswith("/block")]
    return params[name]["w"]

  if seq:
    ws = [w_of(f"h/layer_{i}/") for i in range(n)]
  else:
    ranks = {"local": 0, "global": 0}
    ws = []
    for kind in kinds:
      ws.append(w_of(f"h/{kind}/")[ranks[kind]])
      ranks[kind] += 1
  xs, ring_rows, global_rows, x_ref = [], [], [], np.array(x)
  ranks = {"local": 0, "global": 0}
  for i, kind in enumerate(kinds):
    row = np.array(caches[kind]["k"][ranks[kind]])
    slot = pos % window if kind == "local" else pos
    row[:, slot] = np.tanh(x_ref @ np.asarray(ws[i]))
    x_ref = x_ref + row.mean(axis=1)
    (ring_rows if kind == "local" else global_rows).append(row)
    xs.append(x_ref)
    ranks[kind] += 1
  np.testing.assert_allclose(x2, x_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ys2["local"][0]["k"], np.stack(ring_rows), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ys2["global"][0]["k"], np.stack(global_rows), rtol=1e-5, atol=1e-6)
  want_extra = extra["k"].copy()
  want_extra[:, :, pos] = np.stack(xs)
  np.testing.assert_allclose(ys2["local"][1]["k"], want_extra, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat", ["none", "full", "nested"])
def test_gradients_equal_the_sliced_form(remat):
  x, cache = data()
  sliced, in_place = plain(False, remat=remat), plain(True, remat=remat)
  params = sliced.init(KEY, x, cache, 2)

  def loss(transformed):
    def f(params, x, cache):
      out, new = transformed.apply(params, x, cache, 2)
      return jnp.sum(out ** 2) + jnp.sum(new["k"] ** 2)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  want = loss(sliced)(params, x, cache)
  got = loss(in_place)(params, x, cache)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def _big(num_layers, in_place, remat=False, stack=st.Stacked):
  b, t, d = 4, 512, 64

  class Attend(hk.Module):
    def __call__(self, x, cache, pos):
      k = hk.Linear(d)(x)[:, None]
      if isinstance(cache, dict):
        row = jax.lax.dynamic_update_slice(cache["k"], k, (0, pos, 0))
        new = {"k": row}
      else:
        new = cache.write({"k": k}, at=(0, pos))
        row = new.read()["k"]
      return x + jnp.tanh(jnp.einsum("bd,btd->bd", x, row)), new

  f = hk.without_apply_rng(hk.transform(lambda x, c, p: stack(
      Attend, num_layers, remat=remat, name="h").scan(
          x, st.per_layer(c, in_place=in_place), p)))
  x = jnp.ones((b, d))
  cache = {"k": jnp.zeros((num_layers, b, t, d))}
  return f, f.init(KEY, x, cache, 0), x, cache


def test_donated_cache_is_consumed_and_aliased_with_little_temp():
  f, params, x, cache = _big(16, True)
  cache_bytes = cache["k"].nbytes
  step = jax.jit(f.apply, donate_argnums=2)
  compiled = step.lower(params, x, cache, 7).compile()
  memory = compiled.memory_analysis()
  # The updated cache is the donated one: no second cache.
  assert memory.alias_size_in_bytes >= cache_bytes
  assert "input_output_alias" in compiled.as_text().split("\n", 1)[0]
  assert memory.temp_size_in_bytes <= 0.15 * cache_bytes, memory
  # Today's sliced form stacks a new cache: at least one more in temp or output.
  sliced = _big(16, False)
  sliced_memory = jax.jit(sliced[0].apply, donate_argnums=2).lower(
      sliced[1], x, cache, 7).compile().memory_analysis()
  assert sliced_memory.temp_size_in_bytes >= 0.9 * cache_bytes
  before = np.array(cache["k"], copy=True)
  x2, new = step(params, x, cache, 7)
  assert cache["k"].is_deleted()
  assert not np.any(np.asarray(new["k"])[:, :, 8:])
  np.testing.assert_array_equal(np.asarray(new["k"])[:, :, :7], before[:, :, :7])
  assert np.all(np.any(np.asarray(new["k"])[:, :, 7] != 0, axis=-1))


@pytest.mark.parametrize("remat,stack", [("full", st.Stacked), ("nested", st.Stacked),
                                          ("full", st.BlockSeq)], ids=str)
def test_checkpointed_steps_save_no_cache_per_layer(remat, stack):
  """Under jax.grad a checkpointed step keeps its row, not the whole cache:
  temp memory does not grow with depth (a copy per layer would be 8 or 16
  caches)."""
  ratios = []
  for n in (8, 16):
    f, params, x, cache = _big(n, True, remat, stack)

    def loss(params, cache, f=f, x=x):
      out, new = f.apply(params, x, cache, 3)
      return jnp.sum(out) + jnp.sum(new["k"])

    temp = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        params, cache).compile().memory_analysis().temp_size_in_bytes
    ratios.append(temp / cache["k"].nbytes)
  assert ratios[1] < ratios[0] + 0.5 and max(ratios) < 5, ratios


# ---------------------------------------------------------------------------
# Mistakes: one line naming the argument.


def _error(block, mode="scan", in_place=True):
  x, cache = data()

  def f(x, cache):
    stack = st.Stacked(block, L, name="h")
    return getattr(stack, mode)(x, st.per_layer(cache, in_place=in_place), 1)

  with pytest.raises((ValueError, TypeError)) as e:
    hk.transform(f).init(KEY, x, cache)
  message = str(e.value)
  assert "\n" not in message
  return message


def test_writes_not_returned_are_an_error():
  def forgets(x, cache, pos):
    cache.write({"k": x[:, None]}, at=(0, pos))
    return x, None

  message = _error(lambda: forgets)
  assert "Stacked: per_layer(in_place=True) positional argument 0" in message
  assert "not among its outputs" in message


def test_a_fold_block_cannot_write():
  def folds(x, cache, pos):
    cache.write({"k": x[:, None]}, at=(0, pos))
    return x

  message = _error(lambda: folds, mode="fold")
  assert "use scan" in message


def test_returning_an_earlier_view_is_an_error():
  def stale(x, cache, pos):
    cache.write({"k": x[:, None]}, at=(0, pos))
    return x, cache

  assert "earlier view" in _error(lambda: stale)


def test_bad_updates_and_flags():
  def wrong_shape(x, cache, pos):
    return x, cache.write({"k": x[:, None, None]}, at=(0, pos))

  assert "shape (2, 1, 1, 3)" in _error(lambda: wrong_shape)

  def wrong_tree(x, cache, pos):
    return x, cache.write({"v": x[:, None]}, at=(0, pos))

  assert "structure" in _error(lambda: wrong_tree)
  with pytest.raises(TypeError, match="in_place='yes' must be True or False"):
    st.per_layer({}, in_place="yes")
  with pytest.raises(TypeError, match="st.per_kind: in_place=1"):
    st.per_kind({}, in_place=1)


class _Writer(hk.Module):
  """Writes ones at position ``pos`` of axis 1 of its row (``[B, 4, 3]``)."""

  def __call__(self, x, cache, pos):
    cache = cache.write({"k": 1.0 + jnp.zeros((2, 1, 3))}, at=(0, pos))
    return x, cache


def _writes(pos, t=4):
  f = hk.without_apply_rng(hk.transform(lambda c: st.Stacked(_Writer, 2, name="h").scan(
      jnp.ones((2, 3)), st.per_layer(c, in_place=True), pos)[1]))
  return f.apply({}, {"k": jnp.zeros((2, 2, t, 3))})


@pytest.mark.parametrize("pos, moved", [(4, 3), (7, 3), (-1, 0)])
def test_a_concrete_write_past_the_row_is_refused(pos, moved):
  # Once it overwrote the last position.
  with pytest.raises(ValueError, match=rf"write\(at=\(0, {pos}\)\) puts an update 1 long "
                     rf"on axis 1 of the row at {pos}, but that axis holds positions 0 to "
                     rf"3, so lax.dynamic_update_slice would move the write to {moved} and "
                     r"overwrite what is there: start between 0 and 3"):
    jax.eval_shape(lambda: _writes(pos))


def test_a_write_at_the_last_position_lands_there():
  got = np.asarray(_writes(3)["k"])
  want = np.zeros((2, 2, 4, 3))
  want[:, :, 3] = 1.0
  np.testing.assert_array_equal(got, want)


def test_a_pipelined_stack_refuses_in_place_arguments():
  x, cache = data()
  # Auto axes, which a pipeline needs (AbstractMesh's default: Auto in jax
  # 0.10, Explicit in 0.12).
  mesh = AbstractMesh((2,), ("pipe",), axis_types=(AxisType.Auto,))
  pipeline = st.Pipeline(microbatches=2, mesh=mesh)

  def f(x, cache):
    return st.Stacked(lambda: Block(), L, pipeline=pipeline, name="h").scan(
        x, st.per_layer(cache, in_place=True), 1)

  transformed = hk.without_apply_rng(hk.transform(f))
  params = transformed.init(KEY, x, cache)   # init runs as a plain stack
  with pytest.raises(ValueError) as e:
    jax.eval_shape(transformed.apply, params, x, cache)
  assert str(e.value).startswith(
      "Stacked: per_layer(in_place=True) positional argument 0 cannot be pipelined")
  assert "\n" not in str(e.value)
