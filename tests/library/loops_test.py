"""Tests for stacktools.loops: fold, scan and map with checkpoint policies.

Values and gradients are compared against a plain Python loop over sliced
``xs``, differentiated eagerly by JAX (no jit, no lax.scan); what each policy
keeps is read from ``jax.ad_checkpoint`` saved residuals and from the compiled
program's ``memory_analysis()``; bad input is checked for the message it
raises.
"""

import collections
import functools
import math
import re

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.common import fast_compile
import stacktools as st

try:  # Public in some JAX versions; only in jax._src in jax 0.10.
  from jax.ad_checkpoint import saved_residuals
except ImportError:
  from jax._src.ad_checkpoint import saved_residuals

B, D = 2, 4
# float32 tolerance: relative to each element, and absolute relative to the
# largest element of the leaf (a gradient summed over many steps loses a few
# ulps of its largest terms in its smallest entries).
RTOL, ATOL_SCALE = 1e-5, 1e-5

# One remat value per distinct policy; the synonyms False and True are checked
# separately, once each, to keep the number of compiled programs down.
POLICIES = [
    "none", "full", "nested", "offload", "save_all",
    st.CheckpointPolicy(save_block_internals=["name"]),
    st.CheckpointPolicy(nested=4),
    st.CheckpointPolicy(nested=(2, 2)),
]
POLICY_IDS = ["none", "full", "nested", "offload", "save_all", "save_name",
              "nested4", "nested2x2"]
SYNONYMS = {False: "none", None: "none", True: "full"}

# The numbers do not depend on XLA's backend optimisations, and without them
# the small loops here compile about a third faster.
FAST_COMPILE = fast_compile.CODEGEN


# ---------------------------------------------------------------------------
# Helpers: inputs, the body, the reference loop.


def _normal(seed, shape, scale=1.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _xs(n, seed=0):
  return {"w": _normal(seed, (n, D, D), 0.6),
          "b": _normal(seed + 100, (n, D), 0.3)}


def _init(seed=1):
  return {"h": _normal(seed, (B, D)),
          "c": jnp.linspace(0.1, 0.5, B, dtype=jnp.float32)}


def _fold_body(carry, x):
  pre = st.checkpoint_name(carry["h"] @ x["w"] + x["b"], "name")
  h = 0.5 * carry["h"] + jnp.tanh(pre)
  c = 0.9 * carry["c"] + jnp.sin(h).mean(-1)
  return {"h": h, "c": c}


def _scan_body(carry, x):
  new = _fold_body(carry, x)
  return new, (new["h"].sum(-1) * x["b"][0], jnp.cos(new["c"]))


def _slice(xs, i):
  """Step i's slice of xs (a traced index: one kernel for every step)."""
  i = jnp.int32(i)
  return jax.tree_util.tree_map(
      lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs)


def _ref_scan(init, xs, n, reverse, body=_scan_body):
  """The Python loop that st.scan must match; ys stay in the order of xs."""
  carry, ys = init, [None] * n
  for i in (reversed(range(n)) if reverse else range(n)):
    carry, ys[i] = body(carry, None if xs is None else _slice(xs, i))
  return carry, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)


def _ref_fold(init, xs, n, reverse):
  carry = init
  for i in (reversed(range(n)) if reverse else range(n)):
    carry = _fold_body(carry, _slice(xs, i))
  return carry


def _cotangent(tree, seed):
  """A fixed random cotangent shaped like ``tree``, different at every step."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda a: rng.standard_normal(np.shape(a)).astype(np.float32), tree)


def _values_and_grads(fold, scan, init, xs, cts):
  """Outputs of a fold and a scan, and their gradients w.r.t. init and xs.

  The gradients are those of ``vdot(output, cotangent)`` for fixed random
  cotangents (a VJP): every carry leaf and every step's y counts, with its own
  weight, so a misordered ``ys`` changes them.
  """
  carry, fold_vjp = jax.vjp(fold, init, xs)
  out, scan_vjp = jax.vjp(scan, init, xs)
  return carry, fold_vjp(cts[0]), out, scan_vjp(cts[1])


@functools.cache
def _cotangents(n):
  carry = jax.eval_shape(_init)
  ys = jax.eval_shape(lambda: _ref_scan(_init(), _xs(n), n, False)[1])
  return _cotangent(carry, 2), _cotangent((carry, ys), 3)


@functools.cache
def _reference(n, reverse):
  """The Python loop, differentiated eagerly (no jit, no lax.scan)."""
  fold = lambda init, xs: _ref_fold(init, xs, n, reverse)
  scan = lambda init, xs: _ref_scan(init, xs, n, reverse)
  return _values_and_grads(fold, scan, _init(), _xs(n), _cotangents(n))


def _assert_trees_close(got, want):
  assert (jax.tree_util.tree_structure(got) ==
          jax.tree_util.tree_structure(want))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree_util.tree_leaves(want)):
    assert np.shape(a) == np.shape(b), jax.tree_util.keystr(path)
    atol = ATOL_SCALE * max(float(np.max(np.abs(b), initial=0.0)), 1e-3)
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


def _jit_run(f, *args):
  """Runs ``jax.jit(f)(*args)``, compiled once with FAST_COMPILE."""
  return jax.jit(f).lower(*args).compile(FAST_COMPILE)(*args)


def _check_against_loop(remat, n, unroll, reverse):
  fold = st.fold(_fold_body, remat=remat, unroll=unroll, reverse=reverse)
  scan = st.scan(_scan_body, remat=remat, unroll=unroll, reverse=reverse)
  got = _jit_run(functools.partial(_values_and_grads, fold, scan),
                 _init(), _xs(n), _cotangents(n))
  _assert_trees_close(got, _reference(n, reverse))


# ---------------------------------------------------------------------------
# Values and gradients against the Python loop.


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 3])
@pytest.mark.parametrize("remat", POLICIES, ids=POLICY_IDS)
def test_fold_and_scan_match_loop(remat, unroll, reverse):
  _check_against_loop(remat, 7, unroll, reverse)


@pytest.mark.parametrize("remat", list(SYNONYMS))
def test_synonyms_match_loop(remat):
  policy = st.CheckpointPolicy.from_remat
  assert policy(remat) == policy(SYNONYMS[remat])
  _check_against_loop(remat, 7, 1, True)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 3])
@pytest.mark.parametrize("n", [1, 2, 12, 13, 64])
def test_nested_lengths_match_loop(n, unroll, reverse):
  _check_against_loop("nested", n, unroll, reverse)


def test_full_unroll_matches_loop():
  _check_against_loop("nested", 4, True, False)


@pytest.mark.parametrize("nested", [3, 13])   # 13: one step per outer chunk
def test_int_nested_matches_loop(nested):
  _check_against_loop(st.CheckpointPolicy(nested=nested), 13, 1, True)


def test_nested_offload_matches_loop():
  policy = st.CheckpointPolicy(nested=True, save_carries="offload",
                               save_inputs="offload",
                               offload_block_internals=["name"])
  _check_against_loop(policy, 13, 1, True)


def _scan_loops(jaxpr):
  """``(length, unroll)`` of every lax.scan in a jaxpr, nested ones included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      found.append((eqn.params["length"], eqn.params["unroll"]))
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else [param]):
        if isinstance(sub, jex_core.ClosedJaxpr):
          found += _scan_loops(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          found += _scan_loops(sub)
  return found


@pytest.mark.parametrize("remat, want", [
    # 7 = 2 rolled iterations of 3 steps, then the last step: the engine
    # unrolls by hand (each step's kept values in buffers of their own),
    # not with lax.scan's unroll.
    (False, [(2, 1), (1, 1)]), ("full", [(2, 1), (1, 1)]),
    ("save_all", [(2, 1), (1, 1)]),
    # 7 = 2 x 3 + 1: the outer loop is rolled, the chunks' steps unrolled.
    ("nested", [(3, 1), (2, 3), (1, 3)]),
])
def test_unroll_shapes_the_step_loop(remat, want):
  fold = st.fold(_fold_body, remat=remat, unroll=3)
  jaxpr = jax.make_jaxpr(fold)(_init(), _xs(7)).jaxpr
  assert _scan_loops(jaxpr) == want


def test_unrolled_steps_keep_values_in_buffers_of_their_own():
  """With unroll=3 over 6 steps the forward loop runs 2 iterations and keeps
  each of the 3 steps' values in a buffer of 2 rows, as unroll=1 keeps one
  buffer of 6 rows: no [2, 3, ...] slab (lax.scan's unroll stacks the steps'
  values into one when it lowers the loop)."""
  def kept_shapes(unroll):
    fold = st.fold(_fold_body, remat=False, unroll=unroll)
    loss = lambda init, xs: jnp.sum(fold(init, xs)["h"] ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1))(_init(), _xs(6)).jaxpr
    forward = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    # The forward loop's outputs: the carry's leaves, then what it keeps.
    num_carry = len(jax.tree_util.tree_leaves(_init()))
    return sorted(v.aval.shape for v in forward.outvars[num_carry:])
  one, three = kept_shapes(1), kept_shapes(3)
  assert one and all(shape[0] == 6 for shape in one)
  assert len(three) == 3 * len(one)
  assert sorted(three) == sorted([(2,) + shape[1:] for shape in one] * 3)


def test_scan_ys_keep_xs_order_when_reversed():
  xs = jnp.arange(6.0)
  body = lambda c, x: (c + x, c * 10.0 + x)   # y: the carry before the step.
  for remat in [False, "full", "nested"]:
    carry, ys = st.scan(body, remat=remat, reverse=True)(jnp.float32(0.0), xs)
    # Steps run 5, 4, ..., 0; step i's y lands at ys[i], as in lax.scan.
    before = {5: 0.0}
    for i in range(4, -1, -1):
      before[i] = before[i + 1] + xs[i + 1]
    want = np.array([before[i] * 10.0 + i for i in range(6)])
    np.testing.assert_allclose(ys, want, rtol=1e-6)
    np.testing.assert_allclose(carry, 15.0, rtol=1e-6)
    _, lax_ys = jax.lax.scan(body, jnp.float32(0.0), xs, reverse=True)
    np.testing.assert_allclose(ys, lax_ys, rtol=1e-6)


def _map_fn(x):
  pre = st.checkpoint_name(jnp.tanh(x["b"] @ x["w"]), "name")
  return {"y": jnp.sin(pre) * x["b"], "s": jnp.sum(pre ** 2)}


def _map_loss(run):
  def loss(xs):
    ys = run(xs)
    n = ys["s"].shape[0]
    return (jnp.sum(ys["y"] * jnp.arange(1.0, n + 1.0)[:, None]) +
            jnp.sum(ys["s"] * jnp.arange(n)))
  return loss


def _ref_map(xs):
  n = xs["w"].shape[0]
  ys = [_map_fn(_slice(xs, i)) for i in range(n)]
  return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)


@functools.cache
def _map_reference(n):
  """The Python loop and its gradient, eagerly."""
  xs = _xs(n)
  return _ref_map(xs), jax.grad(_map_loss(_ref_map))(xs)


@pytest.mark.parametrize("remat", POLICIES + list(SYNONYMS),
                         ids=POLICY_IDS + [str(r) for r in SYNONYMS])
def test_map_matches_loop(remat):
  mapped = st.map(_map_fn, remat=remat)
  run = lambda xs: (mapped(xs), jax.grad(_map_loss(mapped))(xs))
  _assert_trees_close(_jit_run(run, _xs(7)), _map_reference(7))


def _counter_body(carry, x):
  assert x is None
  h, c = carry
  h = jnp.tanh(0.8 * h + 0.3 * c[:, None])
  return (h, 0.5 * c + jnp.sin(h).mean(-1))


@pytest.mark.parametrize("remat", [False, "full",
                                   st.CheckpointPolicy(nested=2)])
def test_xs_none_with_length(remat):
  init = (jnp.linspace(-0.5, 1.0, B * D).reshape(B, D), jnp.zeros(B))
  scan_body = lambda carry, x: (_counter_body(carry, x),
                                jnp.sum(carry[0] ** 2, axis=-1) + carry[1])

  def run(init):
    fold = st.fold(_counter_body, length=5, remat=remat)
    scan = st.scan(scan_body, length=5, remat=remat)
    loss = lambda init: jnp.sum(fold(init)[0] ** 2)
    return fold(init), scan(init, None), jax.grad(loss)(init)

  def ref(init):
    fold = lambda init: _ref_scan(init, None, 5, False,
                                  lambda c, x: (_counter_body(c, x), 0))[0]
    loss = lambda init: jnp.sum(fold(init)[0] ** 2)
    return (fold(init), _ref_scan(init, None, 5, False, scan_body),
            jax.grad(loss)(init))

  _assert_trees_close(_jit_run(run, init), ref(init))


def test_length_matching_xs_is_accepted():
  got = st.fold(_fold_body, length=7)(_init(), _xs(7))
  _assert_trees_close(got, _ref_fold(_init(), _xs(7), 7, False))


# ---------------------------------------------------------------------------
# CheckpointPolicy.nested_split.


def nested_split(n, nested):
  """How ``CheckpointPolicy(nested=nested)`` splits a loop of ``n`` steps."""
  return st.CheckpointPolicy(nested=nested).nested_split(n)


@pytest.mark.parametrize("n", range(1, 101))
def test_nested_split_covers_length_sublinearly(n):
  outer, inner, remainder = nested_split(n, True)
  assert outer >= 1 and inner >= 1 and remainder >= 0
  assert outer * inner + remainder == n
  assert remainder < inner
  peak = outer + (remainder > 0) + inner
  assert peak <= 2 * math.ceil(math.sqrt(n)) + 1, (outer, inner, remainder)


@pytest.mark.parametrize("n", [13, 61, 97])
def test_nested_split_of_prime_is_not_trivial(n):
  split = nested_split(n, True)
  assert split not in [(1, n, 0), (n, 1, 0)]
  outer, inner, _ = split
  assert max(outer, inner) <= math.isqrt(n) + 2, split


@pytest.mark.parametrize("n, nested, want", [
    (13, 4, (4, 3, 1)), (12, 4, (4, 3, 0)), (64, 8, (8, 8, 0)),
    (5, 1, (1, 5, 0)), (3, 3, (3, 1, 0)),
])
def test_nested_split_int(n, nested, want):
  assert nested_split(n, nested) == want


def test_nested_split_rejects_empty_loop():
  with pytest.raises(ValueError, match="length >= 1"):
    nested_split(0, True)


def test_nested_split_of_a_policy_that_is_not_nested():
  with pytest.raises(ValueError, match="not nested"):
    st.CheckpointPolicy().nested_split(5)


# ---------------------------------------------------------------------------
# What each policy keeps: saved residuals of a fold of an MLP-like block.

RB, RD = 3, 4   # Carry (RB, RD); weights (N, RD, RD): the shapes differ.


def _mlp_block(h, w):
  return h + jnp.tanh(st.checkpoint_name(h @ w, "pre"))


def _residuals(remat, n, block=_mlp_block):
  """(aval, description) for each value the backward pass keeps."""
  def loss(ws, h):
    return jnp.sum(st.fold(block, remat=remat)(h, ws))
  return saved_residuals(loss, jnp.ones((n, RD, RD)), jnp.ones((RB, RD)))


def _computed(residuals):
  """Residuals that are not the function's own arguments."""
  return [aval for aval, desc in residuals if "from the argument" not in desc]


def _on_host(aval):
  space = getattr(aval, "memory_space", None)
  return "host" in str(space).lower() or "<host>" in str(aval)


def _per_layer(avals, n):
  return [a for a in avals if a.shape == (n, RB, RD)]


def test_full_keeps_only_the_carries():
  computed = _computed(_residuals("full", 8))
  assert [a.shape for a in computed] == [(8, RB, RD)], computed


def test_named_internal_adds_one_stacked_residual():
  full = _per_layer(_computed(_residuals("full", 8)), 8)
  policy = st.CheckpointPolicy(save_block_internals=["pre"])
  named = _computed(_residuals(policy, 8))
  assert len(_per_layer(named, 8)) == len(full) + 1 == 2, named
  assert len(named) == 2, named


def test_name_nothing_tags_is_an_error():
  # Once it silently saved nothing; now the typo is named at trace time.
  policy = st.CheckpointPolicy(save_block_internals=["not_there"])
  with pytest.raises(ValueError, match=r"\['not_there'\], but no block tags"):
    _residuals(policy, 8)


def _tagging_step(carry, w):
  h = st.checkpoint_name(jnp.tanh(carry @ w), "mlp_hidden")
  # Tagged with JAX's own function: found too (through the jaxpr).
  out = jax.ad_checkpoint.checkpoint_name(h @ w.T, "attn_out")
  return carry + out


@pytest.mark.parametrize("policy", [
    st.CheckpointPolicy(save_block_internals=["mlp_hiden"]),
    st.CheckpointPolicy(save_block_internals=["mlp_hiden"], nested=True),
    st.CheckpointPolicy(offload_block_internals=["mlp_hiden"]),
])
def test_a_typo_in_a_saved_or_offloaded_name_lists_the_tags_and_suggests(policy):
  ws = jnp.ones((4, 3, 3)) * 0.1
  run = lambda c: jnp.sum(st.fold(_tagging_step, remat=policy)(c, ws))
  with pytest.raises(ValueError, match=r"saves or offloads the block internals "
                     r"\['mlp_hiden'\].*The block tags \['attn_out', 'mlp_hidden'\] "
                     r"\('mlp_hiden': did you mean 'mlp_hidden'\?\)"):
    jax.grad(run)(jnp.ones((2, 3)))


def test_names_tagged_by_either_function_are_saved():
  ws = jnp.ones((4, 3, 3)) * 0.1
  reference = jax.grad(lambda c: jnp.sum(st.fold(_tagging_step)(c, ws)))(jnp.ones((2, 3)))
  for names in (["mlp_hidden"], ["attn_out"], ["mlp_hidden", "attn_out"]):
    policy = st.CheckpointPolicy(save_block_internals=names)
    got = jax.grad(lambda c: jnp.sum(st.fold(_tagging_step, remat=policy)(c, ws)))(
        jnp.ones((2, 3)))
    np.testing.assert_allclose(got, reference, rtol=1e-6)


def test_no_remat_keeps_more_than_full():
  none = _per_layer(_computed(_residuals(False, 8)), 8)
  full = _per_layer(_computed(_residuals("full", 8)), 8)
  assert len(none) > len(full)


def _gated_block(h, w):
  return h + jnp.tanh(st.checkpoint_name(h @ w, "pre")) * h


def test_no_remat_keeps_all_but_elementwise_values():
  # Without remat a loop step keeps every value but the outputs of
  # elementwise operations, recomputed from what it keeps (here tanh and its
  # derivative, from the matmul's output "pre"); save_all keeps those too.
  # The gate reads tanh's value in the backward pass, so save_all keeps more
  # than none whatever form JAX gives tanh's derivative (jax 0.12 writes it
  # as one value, one_minus_square, which save_all keeps in place of "pre").
  none = _residuals(False, 8, _gated_block)
  everything = _residuals("save_all", 8, _gated_block)
  shapes = lambda r: collections.Counter(a.shape for a, _ in r)
  assert shapes(none) < shapes(everything), (none, everything)
  # Stacked per layer: none keeps each layer's carry and "pre"; save_all
  # keeps elementwise values (tanh's, its derivative's) besides the carry.
  per_layer = (8, RB, RD)
  assert shapes(none)[per_layer] == 2, none
  assert shapes(everything)[per_layer] == 3, everything


def _tagged_elementwise_block(h, w):
  pre = st.checkpoint_name(h @ w, "pre")
  return h + st.checkpoint_name(jnp.tanh(pre), "act") * h


def test_no_remat_keeps_a_tagged_value_as_its_maker_would():
  # A tag is the identity: without remat the tagged matmul output is kept
  # (as the untagged one is) and the tagged tanh is recomputed from it, as an
  # untagged tanh is. Keeping every tagged value once doubled the attention
  # residuals of the GPT on a TPU.
  def untagged(h, w):
    return h + jnp.tanh(h @ w) * h
  shapes = lambda r: collections.Counter(a.shape for a in _computed(r))
  tagged = _residuals(False, 8, _tagged_elementwise_block)
  assert shapes(tagged) == shapes(_residuals(False, 8, untagged)), tagged
  assert shapes(tagged)[(8, RB, RD)] == 2, tagged   # the carry and "pre"
  # A policy that names a tag still keeps it.
  kept = _residuals(st.CheckpointPolicy(save_block_internals=["act"]), 8,
                    _tagged_elementwise_block)
  assert shapes(kept)[(8, RB, RD)] == 2, kept       # the carry and "act"
  # The gradients do not change with what is kept.
  # Weights that keep tanh away from saturation, where its derivative is
  # round-off.


def _one_lane_block(h, w):
  # A wide value of which the backward pass reads one lane, as the splash
  # attention kernel's 128-lane softmax statistics: recomputing the lane's
  # slice would keep the wide value for every layer.
  wide = jnp.concatenate([h @ w] * 32, axis=-1)          # (RB, 32 * RD)
  return h + jnp.exp(jnp.sin(wide)[:, :1])


def test_no_remat_keeps_a_small_slice_not_what_it_was_cut_from():
  shapes = collections.Counter(a.shape for a in _computed(
      _residuals(False, 8, _one_lane_block)))
  assert shapes[(8, RB, 1)] == 1, shapes           # the lane, kept
  assert not any(s[-1] == 32 * RD for s in shapes), shapes
  # A slice of a third (jnp.split of qkv) is still recomputed, from the
  # value it was cut from, which the backward pass keeps anyway.
  assert st.policy.SMALL_SLICE < 1 / 3
  ws = 0.3 * jax.random.normal(jax.random.PRNGKey(0), (8, RD, RD))
  h = 0.5 * jnp.ones((RB, RD))

  def unrolled(ws, h):
    for w in ws:
      h = _one_lane_block(h, w)
    return jnp.sum(h)
  loss = lambda ws, h: jnp.sum(st.fold(_one_lane_block, remat=False)(h, ws))
  for got, want in zip(jax.jit(jax.grad(loss, (0, 1)))(ws, h),
                       jax.jit(jax.grad(unrolled, (0, 1)))(ws, h)):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
  ws = 0.3 * jax.random.normal(jax.random.PRNGKey(0), (8, RD, RD))
  h = 0.5 * jnp.ones((RB, RD))
  grads = [jax.jit(jax.grad(lambda ws: jnp.sum(st.fold(_tagged_elementwise_block,
                                                       remat=r)(h, ws))))(ws)
           for r in (False, "save_all", "full")]
  for g in grads[1:]:   # float32 sums in another order (jax 0.12): a few ulps
    np.testing.assert_allclose(g, grads[0], rtol=2e-5,
                               atol=1e-6 * float(jnp.max(jnp.abs(grads[0]))))


def test_nested_keeps_sqrt_n_carries():
  n = 64
  residuals = _residuals("nested", n)
  computed = _computed(residuals)
  assert not [a for a in computed if a.shape and a.shape[0] == n], residuals
  carry_elems = sum(a.size for a in computed
                    if jnp.issubdtype(a.dtype, jnp.floating))
  assert 0 < carry_elems <= (2 * math.sqrt(n) + 2) * RB * RD, residuals


def test_offload_keeps_carries_on_host_and_reads_inputs_where_they_are():
  n = 8
  computed = _computed(_residuals("offload", n))
  on_host = [a for a in computed if _on_host(a)]
  on_device = [a for a in computed if not _on_host(a)]
  assert [a.shape for a in on_host if a.shape == (n, RB, RD)] == [(n, RB, RD)]
  # The per-layer weights are the loop's inputs: no host copy of them.
  assert not [a for a in computed if a.shape == (n, RD, RD)], computed
  assert not _per_layer(on_device, n), computed
  # A policy that asks for the inputs on host still gets them there.
  policy = st.CheckpointPolicy(save_carries="offload", save_inputs="offload")
  on_host = [a for a in _computed(_residuals(policy, n)) if _on_host(a)]
  assert [a.shape for a in on_host if a.shape == (n, RD, RD)] == [(n, RD, RD)]


def test_nested_offload_keeps_outer_carries_on_host():
  policy = st.CheckpointPolicy(nested=True, save_carries="offload")
  computed = _computed(_residuals(policy, 16))
  floats = [a for a in computed if jnp.issubdtype(a.dtype, jnp.floating)]
  assert floats and all(_on_host(a) for a in floats), computed
  assert not [a for a in floats if a.shape[0] == 16], computed


# ---------------------------------------------------------------------------
# Memory of the compiled gradient program (lower and compile, never run).


@functools.cache
def _temp_bytes(remat, n, width=256, batch=1024):
  def loss(ws, h):
    return jnp.sum(st.fold(_mlp_block, remat=remat)(h, ws))
  compiled = jax.jit(jax.grad(loss)).lower(
      jnp.zeros((n, width, width)), jnp.zeros((batch, width))).compile()
  return compiled.memory_analysis().temp_size_in_bytes


SAVE_PRE = st.CheckpointPolicy(save_block_internals=["pre"])


def test_memory_order_64_layers():
  # Here "none" keeps what the named policy keeps (each layer's carry and
  # "pre"; tanh is recomputed): compared as residuals, since their compiled
  # bytes are equal or nearly so, in an order that XLA's version decides.
  shapes = lambda remat: sorted(a.shape for a, _ in _residuals(remat, 8))
  assert shapes(False) == shapes(SAVE_PRE), (shapes(False), shapes(SAVE_PRE))
  named = _temp_bytes(SAVE_PRE, 64)
  full, nested = _temp_bytes("full", 64), _temp_bytes("nested", 64)
  assert named > full > nested, (named, full, nested)
  assert nested <= 0.5 * full, (nested, full)


def test_memory_nested_prime_length():
  nested, full = _temp_bytes("nested", 61), _temp_bytes("full", 61)
  assert nested <= 0.6 * full, (nested, full)


def test_memory_none_no_more_than_save_all():
  assert _temp_bytes(False, 64) <= _temp_bytes("save_all", 64)


# ---------------------------------------------------------------------------
# Bad input.


def _ones_xs(**leading):
  return {k: jnp.ones((n, D)) for k, n in leading.items()}


def _add_body(carry, x):
  return {"h": carry["h"] + x["w"].sum()}


def _h():
  return {"h": jnp.ones((B, D))}


@pytest.mark.parametrize("loop", [st.fold, st.scan])
def test_leading_axis_not_length(loop):
  with pytest.raises(ValueError,
                     match=r"xs\['w'\] has a leading axis of 7, but length=5"):
    loop(_add_body, length=5)(_h(), _ones_xs(w=7))


@pytest.mark.parametrize("loop", [st.fold, st.scan])
def test_leaves_with_different_leading_axes(loop):
  with pytest.raises(ValueError,
                     match=r"xs\['w'\] has a leading axis of 6, but "
                     r"xs\['a'\] has 5"):
    loop(_add_body)(_h(), _ones_xs(a=5, w=6))


@pytest.mark.parametrize("loop", [st.fold, st.scan])
def test_xs_none_needs_length(loop):
  with pytest.raises(ValueError, match=r"xs is None.*length=N"):
    loop(lambda c, x: c)(_h())


def test_scalar_leaf_in_xs():
  xs = {"w": jnp.ones((5, D)), "s": 1.0}
  with pytest.raises(ValueError, match=r"xs\['s'\] is a scalar"):
    st.fold(_add_body)(_h(), xs)


@pytest.mark.parametrize("length", [-1, 2.0, True])
def test_bad_length(length):
  with pytest.raises(ValueError, match=re.escape(f"length={length!r}")):
    st.fold(_add_body, length=length)(_h(), None)


@pytest.mark.parametrize("loop", [st.fold, st.scan])
@pytest.mark.parametrize("unroll", [0, -1, 1.5])
def test_bad_unroll(loop, unroll):
  with pytest.raises(ValueError, match=rf"unroll={unroll}.*int >= 1"):
    loop(_add_body, unroll=unroll)


@pytest.mark.parametrize("remat", [False, "full", "nested"])
def test_fold_body_returning_pair(remat):
  body = lambda c, x: (_add_body(c, x), x["w"].sum())
  with pytest.raises(TypeError, match=r"pair \(carry, y\).*use st\.scan"):
    st.fold(body, remat=remat)(_h(), _ones_xs(w=4))


@pytest.mark.parametrize("remat", [False, "full", "nested"])
@pytest.mark.parametrize("out, described", [
    (lambda c, x: c["h"] + 1.0, r"an array of shape \(2, 4\)"),
    (lambda c, x: (c, x, x), "a tuple of 3"),
    (lambda c, x: c, "a dict"),
])
def test_scan_body_not_returning_pair(remat, out, described):
  with pytest.raises(TypeError, match=rf"pair \(new_carry, y\).*{described}"):
    st.scan(out, remat=remat)(_h(), _ones_xs(w=4))


@pytest.mark.parametrize("loop", ["fold", "scan"])
@pytest.mark.parametrize("remat", [False, "full", "nested"])
def test_carry_shape_change(loop, remat):
  new = lambda c, x: {"h": c["h"][:, :2]}
  with pytest.raises(TypeError, match=re.escape(
      "changed carry['h'] from float32[2, 4] to float32[2, 2]")):
    _run_bad_body(loop, remat, new)


@pytest.mark.parametrize("loop", ["fold", "scan"])
@pytest.mark.parametrize("remat", [False, "full", "nested"])
def test_carry_dtype_change(loop, remat):
  new = lambda c, x: {"h": c["h"].astype(jnp.bfloat16)}
  with pytest.raises(TypeError, match=re.escape(
      "changed carry['h'] from float32[2, 4] to bfloat16[2, 4]")):
    _run_bad_body(loop, remat, new)


@pytest.mark.parametrize("loop", ["fold", "scan"])
@pytest.mark.parametrize("remat", [False, "full", "nested"])
def test_carry_structure_change(loop, remat):
  new = lambda c, x: {"h": c["h"], "extra": x["w"]}
  with pytest.raises(TypeError, match=r"changed the structure of the carry"):
    _run_bad_body(loop, remat, new)


def _run_bad_body(loop, remat, new):
  xs = _ones_xs(w=4)
  if loop == "fold":
    return st.fold(new, remat=remat)(_h(), xs)
  return st.scan(lambda c, x: (new(c, x), 0.0), remat=remat)(_h(), xs)


def test_map_needs_xs():
  with pytest.raises(ValueError, match=r"st\.map needs xs.*got None"):
    st.map(jnp.sin)(None)


def test_nested_beats_full_when_layers_outweigh_carries():
  # 1 MiB of weights per layer against a 128 KiB carry: chunks must stay short,
  # or a chunk's weights and their gradient cost more than the carries saved.
  # (Counting carries alone chose 11 x 11 + 7 here and needed 33.1 MiB.)
  ws, h = jnp.zeros((128, 512, 512)), jnp.zeros((64, 512))

  def temp(remat):
    loss = lambda ws, h: st.fold(lambda h, w: jnp.tanh(h @ w), remat=remat)(h, ws).sum()
    compiled = jax.jit(jax.grad(loss)).lower(ws, h).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp("nested") < 0.85 * temp("full")


# ---------------------------------------------------------------------------
# Typed PRNG keys as xs (they once broke remat="nested"), and numpy ints.


def _noisy_step(carry, key):
  return jnp.tanh(carry + jax.random.normal(key, carry.shape))


def _noisy_loop(carry, keys):
  for i in range(keys.shape[0]):
    carry = _noisy_step(carry, keys[i])
  return carry


@pytest.mark.parametrize("remat", list(st.REMAT_ALIASES))
def test_fold_over_typed_keys_every_alias(remat):
  keys = jax.random.split(jax.random.key(0), 5)
  init = jnp.linspace(-1.0, 1.0, 3)
  loss = lambda fold: jax.jit(jax.value_and_grad(lambda c: jnp.sum(fold(c, keys) ** 2)))
  value, grad = loss(st.fold(_noisy_step, remat=remat))(init)
  ref_value, ref_grad = loss(_noisy_loop)(init)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5)


def test_numpy_ints_are_lengths_and_unrolls():
  # Stacked, BlockSeq and layer_stack take them too (stacked_test.py).
  ws = jnp.ones((3, D))
  assert st.fold(lambda c, w: c * w, length=np.int64(3), unroll=np.int64(2))(
      jnp.ones(D), ws).shape == (D,)
