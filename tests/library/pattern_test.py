"""Tests for mixed-layer stacks: ``st.Stacked``/``st.BlockSeq`` with ``pattern=``.

Every value is checked against independent references:

* a Python loop over the stacked parameters, sliced per layer and applied by
  a plain-``jnp`` copy of each kind's block (no Haiku, no stacktools), and
  differentiated with ``jax.grad``;
* ``BlockSeq`` with the same pattern (the unrolled twin), given
  ``unstack_params(..., pattern=)`` of Stacked's parameters, its gradients
  restacked with ``stack_params(..., pattern=)``.

The full matrix (patterns x depths x every alias x both directions) is in
``benchmarks/mixed_layers.py``; here a lean subset: every alias at one
depth, every depth at one alias, both directions, and per_depth segments that
cut a period. Each case is one jitted program.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.common import fast_compile
import stacktools as st

from haiku_helpers import assert_close, random_like, random_x, signature
from haiku_helpers import check_jax_usage  # pylint: disable=unused-import  # autouse fixture

D = 4
KEY = jax.random.PRNGKey(0)
P5 = ("L",) * 5 + ("G",)   # the 5:1 pattern
PLG = ("L", "G")
# XLA options that halve the CPU compile time; they change LLVM's code
# generation only, never what is computed.
FAST = fast_compile.CODEGEN
W_INIT = hk.initializers.RandomUniform(-0.5, 0.5)   # compiles faster than truncated normal


def _jit(f, *args):
  """``f(*args)``, compiled once with the fast options."""
  return jax.jit(f).lower(*args).compile(FAST)(*args)


# ---------------------------------------------------------------------------
# Two kinds of block with different parameters, and their plain-jnp copies.


class Local(hk.Module):
  """``x + tanh(x W + b) * (1 + i / 10)``, ``i`` the global layer index."""

  def __call__(self, x):
    h = jnp.tanh(hk.Linear(D, w_init=W_INIT, name="proj")(x))
    return x + 0.5 * st.checkpoint_name(h, "local_act") * (1.0 + 0.01 * st.layer_index())


class Global(hk.Module):
  """``x + W2 gelu(W1 x) / 2``: another shape of parameters."""

  def __call__(self, x):
    h = jax.nn.gelu(hk.Linear(2 * D, w_init=W_INIT, name="up")(x))
    return x + 0.25 * hk.Linear(D, with_bias=False, w_init=W_INIT, name="down")(h)


FACTORIES = {"L": lambda: Local(name="block"), "G": lambda: Global(name="block")}


def _ranks(pattern, n):
  seen, ranks = {}, []
  for i in range(n):
    k = pattern[i % len(pattern)]
    ranks.append(seen.get(k, 0))
    seen[k] = ranks[-1] + 1
  return ranks


def reference(params, x, pattern, n, reverse=False):
  """The stack as a Python loop over sliced parameters, in plain jnp."""
  ranks = _ranks(pattern, n)
  for i in (reversed(range(n)) if reverse else range(n)):
    kind, r = pattern[i % len(pattern)], ranks[i]
    if kind == "L":
      proj = params["h/L/block/proj"]
      x = x + 0.5 * jnp.tanh(x @ proj["w"][r] + proj["b"][r]) * (1.0 + 0.01 * i)
    else:
      up, down = params["h/G/block/up"], params["h/G/block/down"]
      x = x + 0.25 * (jax.nn.gelu(x @ up["w"][r] + up["b"][r]) @ down["w"][r])
  return x


def _model(cls, pattern, n, **config):
  return hk.without_apply_rng(hk.transform(
      lambda x: cls(FACTORIES, n, pattern=pattern, name="h", **config).fold(x)))


def _values_and_grads(apply, params, x):
  def loss(p, x):
    out = apply(p, x)
    return jnp.sum(jnp.sin(3.0 * out)), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return out, grads


# ---------------------------------------------------------------------------
# Values and gradients.


SAVE_NAMED = st.CheckpointPolicy(save_block_internals=["local_act"])
CASES = [   # (pattern, num_layers, remat, reverse)
    # Every alias at one depth (6 whole periods and a partial one) ...
    (PLG, 13, "none", False), (PLG, 13, "full", True), (PLG, 13, "nested", False),
    (PLG, 13, "offload", True), (PLG, 13, "save_all", False),
    # ... every depth of the 5:1 pattern at one alias ...
    (P5, 6, "full", False), (P5, 26, "full", True),
    # ... and per_depth segments that cut a period, with a kind that has two
    # runs in each period.
    (("L", "G", "L", "L"), 13, st.per_depth((5, SAVE_NAMED), (8, "nested")), True),
]


@pytest.mark.parametrize("pattern,n,remat,reverse", CASES, ids=[
    f"{''.join(p)}-{n}-{r if isinstance(r, str) else type(r).__name__}-"
    f"{'rev' if rev else 'fwd'}" for p, n, r, rev in CASES])
def test_matches_loop_and_blockseq(pattern, n, remat, reverse):
  stacked = _model(st.Stacked, pattern, n, remat=remat, reverse=reverse)
  seq = _model(st.BlockSeq, pattern, n, remat=remat, reverse=reverse)
  x = random_x((3, D))
  params = random_like(jax.eval_shape(stacked.init, KEY, x))

  def all_three(params, x):
    ref = _values_and_grads(
        lambda p, x: reference(p, x, pattern, n, reverse), params, x)
    out_st = _values_and_grads(stacked.apply, params, x)
    out_seq, (g_seq, gx_seq) = _values_and_grads(
        seq.apply, st.unstack_params(params, "h", pattern=pattern), x)
    return ref, out_st, (out_seq, (st.stack_params(g_seq, "h", pattern=pattern), gx_seq))

  ref, out_st, out_seq = _jit(all_three, params, x)
  assert_close(out_st, ref)
  assert_close(out_seq, ref)


def test_params_layout_init_and_round_trip():
  """h/<kind>/... with each kind's count; BlockSeq's init is the unstacked one."""
  x = random_x((3, D))
  stacked, seq = _jit(lambda k, x: (_model(st.Stacked, P5, 8).init(k, x),
                                    _model(st.BlockSeq, P5, 8).init(k, x)), KEY, x)
  assert signature(stacked) == {
      "h/L/block/proj": {"w": ((7, D, D), "float32"), "b": ((7, D), "float32")},
      "h/G/block/up": {"w": ((1, D, 2 * D), "float32"), "b": ((1, 2 * D), "float32")},
      "h/G/block/down": {"w": ((1, 2 * D, D), "float32")}}
  unstacked = st.unstack_params(stacked, "h", pattern=P5)
  assert sorted(unstacked) == sorted(seq)
  assert set(unstacked["h/layer_5/block/up"]) == {"w", "b"}  # layer 5 is global
  jax.tree.map(np.testing.assert_array_equal, unstacked, seq)   # the same keys
  jax.tree.map(np.testing.assert_array_equal,
               st.stack_params(unstacked, "h", pattern=P5), stacked)
  layers = [unstacked[f"h/layer_{i}/block/proj"]["w"] for i in (0, 1, 2)]
  assert not np.allclose(layers[0], layers[1])   # each layer its own key


# ---------------------------------------------------------------------------
# Per-layer and per-kind inputs, scan outputs, layer_index, state and rng.


class Cached(hk.Module):
  """A scan block with a per-kind cache (its own length) and a per-layer gate."""

  def __init__(self, length, name=None):
    super().__init__(name=name)
    self.length = length

  def __call__(self, x, cache, gate):
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    noise = jax.random.uniform(hk.next_rng_key(), ())
    w = hk.get_parameter("w", [D, self.length], init=hk.initializers.RandomNormal())
    x = x + gate * jnp.tanh(cache @ w.T)
    new_cache = cache + jnp.mean(x, axis=-1, keepdims=True)
    return x, {"cache": new_cache, "index": st.layer_index(), "noise": noise,
               "count": count}


def _cached_model(cls, n, reverse=False, ys_by_kind=None):
  factories = {"L": lambda: Cached(3, name="c"), "G": lambda: Cached(5, name="c")}
  def fn(x, caches, gates):
    stack = cls(factories, n, pattern=("L", "L", "G"), reverse=reverse,
                ys_by_kind=ys_by_kind, name="h")
    return stack.scan(x, st.per_kind(caches), gate=st.per_layer(gates))
  return hk.transform_with_state(fn)


def _cached_inputs(n):
  counts = {"L": sum(i % 3 != 2 for i in range(n)), "G": n // 3}
  caches = {"L": random_x((counts["L"], 2, 3), seed=1),
            "G": random_x((counts["G"], 2, 5), seed=2)}
  return random_x((2, D)), caches, random_x((n, 1, 1), seed=3)


def test_per_kind_inputs_outputs_index_state_rng():
  n, reverse = 8, True   # L L G L L G L L: a partial period at the end
  x, caches, gates = _cached_inputs(n)
  stacked = _cached_model(st.Stacked, n, reverse)
  seq = _cached_model(st.BlockSeq, n, reverse)
  params, state = jax.eval_shape(stacked.init, KEY, x, caches, gates)
  params = random_like(params)
  state = jax.tree.map(lambda s: jnp.full(s.shape, 7, s.dtype), state)
  rng = jax.random.PRNGKey(5)

  def both(params, state):
    out_st = stacked.apply(params, state, rng, x, caches, gates)
    (x_seq, ys_seq), state_seq = seq.apply(
        st.unstack_params(params, "h", pattern="LLG"),
        st.unstack_params(state, "h", pattern="LLG"), rng, x, caches, gates)
    return out_st, ((x_seq, ys_seq), st.stack_params(state_seq, "h", pattern="LLG"))

  ((x_st, ys), state_st), out_seq = _jit(both, params, state)
  assert_close(((x_st, ys), state_st), out_seq)
  # Outputs differ in shape by kind, so they come back per kind, kind order.
  assert set(ys) == {"L", "G"}
  assert ys["L"]["cache"].shape == (6, 2, 3) and ys["G"]["cache"].shape == (2, 2, 5)
  np.testing.assert_array_equal(ys["L"]["index"], [0, 1, 3, 4, 6, 7])
  np.testing.assert_array_equal(ys["G"]["index"], [2, 5])
  np.testing.assert_array_equal(ys["L"]["count"], state["h/L/c"]["count"])
  np.testing.assert_array_equal(state_st["h/G/c"]["count"], state["h/G/c"]["count"] + 1)
  noise = np.concatenate([ys["L"]["noise"], ys["G"]["noise"]])
  assert len(set(noise.tolist())) == n   # a distinct key per layer

  # The reference loop, layer by layer, in the direction of the stack.
  ranks = _ranks("LLG", n)
  h = x
  for i in (reversed(range(n)) if reverse else range(n)):
    kind, r = "LLG"[i % 3], ranks[i]
    w = params[f"h/{kind}/c"]["w"][r]
    h = h + gates[i] * jnp.tanh(caches[kind][r] @ w.T)
    np.testing.assert_allclose(ys[kind]["cache"][r],
                               caches[kind][r] + jnp.mean(h, -1, keepdims=True),
                               rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(x_st, h, rtol=1e-5, atol=1e-6)


def test_outputs_in_layer_order_when_kinds_agree():
  n = 7
  def fn(x, agree, by_kind):
    blocks = {"L": lambda: (lambda x: (x * 2.0, st.layer_index())),
              "G": lambda: (lambda x: (x + 1.0, -st.layer_index()))}
    if not agree:
      blocks["G"] = lambda: (lambda x: (x + 1.0, jnp.zeros(3)))
    return st.Stacked(blocks, n, pattern="LLG", ys_by_kind=by_kind, name="h").scan(x)

  def run(agree, by_kind):   # the blocks have no parameters
    f = hk.transform(lambda x: fn(x, agree, by_kind))
    return _jit(lambda x: f.apply({}, None, x), jnp.ones(2))

  _, ys = run(True, None)
  np.testing.assert_array_equal(ys, [0, 1, -2, 3, 4, -5, 6])
  _, ys = run(True, True)
  np.testing.assert_array_equal(ys["L"], [0, 1, 3, 4, 6])
  np.testing.assert_array_equal(ys["G"], [-2, -5])
  with pytest.raises(ValueError, match=r"'L' and 'G' blocks return outputs of "
                     r"different shapes .*drop ys_by_kind=False"):
    run(False, False)


# ---------------------------------------------------------------------------
# What the compiled program costs does not grow with depth or a run's length.


def _equations(jaxpr):
  """The number of equations in a jaxpr and every jaxpr inside it."""
  count = 0
  for eqn in jaxpr.eqns:
    count += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          count += _equations(sub)
  return count


def _grad_program(pattern, n, remat="full"):
  model = _model(st.Stacked, pattern, n, remat=remat)
  x = jax.ShapeDtypeStruct((3, D), jnp.float32)
  params = jax.eval_shape(model.init, KEY, x)
  step = jax.grad(lambda p, x: jnp.sum(model.apply(p, x)))
  return step, params, x


@pytest.mark.parametrize("remat", ["full", "nested"])
def test_program_does_not_grow_with_depth_or_run_length(remat):
  sizes = {}
  for pattern, n in ((P5, 12), (P5, 48), (P5, 13), (P5, 49),
                     (("L",) * 11 + ("G",), 48)):
    step, params, x = _grad_program(pattern, n, remat)
    sizes[("".join(pattern), n)] = _equations(jax.make_jaxpr(step)(params, x).jaxpr)
  assert sizes[("LLLLLG", 12)] == sizes[("LLLLLG", 48)] == sizes[("L" * 11 + "G", 48)]
  assert sizes[("LLLLLG", 13)] == sizes[("LLLLLG", 49)]   # a partial period


def test_temp_memory_grows_by_one_carry_per_layer():
  """remat="full": one carry per layer, as a stack of one block."""
  x = jax.ShapeDtypeStruct((64, D), jnp.float32)
  carry = 64 * D * 4

  def temp(cls_config, n):
    model = hk.without_apply_rng(hk.transform(
        lambda x: st.Stacked(num_layers=n, remat="full", name="h", **cls_config).fold(x)))
    params = jax.eval_shape(model.init, KEY, x)
    step = jax.grad(lambda p, x: jnp.sum(model.apply(p, x)), argnums=(0, 1))
    return jax.jit(step).lower(params, x).compile().memory_analysis().temp_size_in_bytes

  mixed = dict(make_block=FACTORIES, pattern=P5)
  assert (temp(mixed, 36) - temp(mixed, 12)) / 24 == carry


# ---------------------------------------------------------------------------
# Mistakes, caught at trace time with the fix in the message.


def _trace(make, *args):
  f = hk.transform(make)
  jax.eval_shape(f.init, KEY, *args)


X = jnp.ones((2, D))

MISTAKES = {
    "unknown_kind": (lambda x: st.Stacked(FACTORIES, 6, pattern=("L", "Gl"), name="h").fold(x),
                     ValueError, r"pattern= names the kind 'Gl', which has no factory; "
                     r"make_block has \['G', 'L'\]\. Did you mean 'G'\?"),
    "empty_pattern": (lambda x: st.Stacked(FACTORIES, 6, pattern=(), name="h").fold(x),
                      ValueError, r"pattern= is empty; give the kinds of one period"),
    "mapping_without_pattern": (lambda x: st.BlockSeq(FACTORIES, 6, name="h").fold(x),
                                TypeError, r"needs both make_block as a mapping .* and "
                                r"pattern=.*got no pattern="),
    "pattern_without_mapping": (lambda x: st.Stacked(FACTORIES["L"], 6, pattern="LG").fold(x),
                                TypeError, r"needs both make_block as a mapping"),
    "kind_not_identifier": (lambda x: st.Stacked({"a-b": FACTORIES["L"]}, 6, pattern=("a-b",)).fold(x),
                            ValueError, r"the kind 'a-b' cannot name a module"),
    "word_as_pattern": (lambda x: st.Stacked({"local": FACTORIES["L"]}, 6, pattern="local").fold(x),
                        ValueError, r"write pattern=\('local',\)"),
    "per_kind_leading_axis": (
        lambda x: st.Stacked({"L": lambda: (lambda x, c: x + c), "G": lambda: (lambda x, c: x + c)},
                             6, pattern="LLG", name="h").fold(
            x, st.per_kind({"L": jnp.ones((3, D)), "G": jnp.ones((2, D))})),
        ValueError, r"per_kind positional argument 0\['L'\] has a leading axis of 3, "
        r"but the stack has 4 'L' layers"),
    "per_kind_missing_kind": (
        lambda x: st.Stacked({"L": lambda: (lambda x, c: x), "G": lambda: (lambda x, c: x)},
                             6, pattern="LLG").fold(x, c=st.per_kind({"L": jnp.ones((4,))})),
        ValueError, r"keyword argument 'c' has no entry for the kind 'G', which has 2 layers"),
    "per_kind_without_pattern": (
        lambda x: st.Stacked(lambda: (lambda x, c: x), 6).fold(x, st.per_kind({"L": x})),
        TypeError, r"st.per_kind marks positional argument 0 per kind of a pattern, but "
        r"this stack has no pattern=; use st.per_layer"),
    "carries_differ": (
        lambda x: st.Stacked({"L": lambda: (lambda x: x), "G": lambda: (lambda x: x[:, :2])},
                             6, pattern="LG").fold(x),
        TypeError, r"^Stacked 'stacked': the 'G' block changed x from float32\[2, 4\] to "
        r"float32\[2, 2\]; each layer's output is the next layer's input \(in a "
        r"mixed-layer stack, whatever its kind\)"),
    "saved_name_no_kind_tags": (
        lambda x: st.Stacked(FACTORIES, 6, pattern=PLG, name="h", remat=st.CheckpointPolicy(
            save_block_internals=["local_act", "typo"])).fold(x),
        ValueError, r"saves or offloads the block internals \['typo'\], but no block tags"),
    "nested_outer_over_periods": (
        lambda x: st.Stacked(FACTORIES, 13, pattern=P5, name="h",
                             remat=st.CheckpointPolicy(nested=3)).fold(x),
        ValueError, r"nested=3\) asks for 3 outer chunks of whole periods, but the stack "
        r"\(or this per_depth segment\) has 2 whole periods of 6 layers"),
}


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_mistakes_are_caught_at_trace_time(name):
  make, error, message = MISTAKES[name]
  with pytest.raises(error, match=message):
    _trace(make, X)


def test_param_rewrites_need_the_stacks_pattern():
  params = random_like(jax.eval_shape(_model(st.Stacked, P5, 13).init, KEY, X))
  with pytest.raises(ValueError, match=r"the kinds under 'h' hold \{'L': 11, 'G': 2\} "
                     r"layers, but pattern \('L', 'G'\) over 13 layers has"):
    st.unstack_params(params, "h", pattern=PLG)
  with pytest.raises(ValueError, match=r"'h/G/block/(up|down)' lies under no kind of pattern"):
    st.unstack_params(params, "h", pattern=("L",))
  unstacked = st.unstack_params(params, "h", pattern=P5)
  del unstacked["h/layer_4/block/proj"]
  with pytest.raises(ValueError, match=r"h/layer_<i>/block/proj is missing for layers \[4\]"):
    st.stack_params(unstacked, "h", pattern=P5)


def _layout(cls, make_block, num_layers, pattern):
  f = hk.transform(lambda x: cls(make_block, num_layers, pattern=pattern, name="h").fold(x))
  return jax.eval_shape(f.init, KEY, X)


def _scaled(scale):
  return lambda: (lambda x: x + scale * hk.Linear(D)(x))


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_a_factory_no_layer_uses_is_an_error(cls):
  # Once accepted in silence.
  blocks = {"A": _scaled(1.0), "B": _scaled(0.5), "C": _scaled(0.25)}
  with pytest.raises(ValueError, match=rf"^{cls.__name__}: make_block\['C'\] is the "
                     r"factory of a kind that pattern=\('A', 'B'\) never names, so it "
                     r"has 0 layers"):
    _layout(cls, blocks, 6, "AB")


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_a_kind_with_no_layer_is_an_error(cls):
  # Once accepted in silence.
  blocks = {"A": _scaled(1.0), "B": _scaled(0.5)}
  with pytest.raises(ValueError, match=rf"^{cls.__name__}: num_layers=2 ends before "
                     r"the first 'B' layer of pattern=\('A', 'A', 'B'\), so the kind "
                     r"'B' has 0 layers \(layer counts: \{'A': 2, 'B': 0\}\).*"
                     r"num_layers >= 3"):
    _layout(cls, blocks, 2, "AAB")
  # From its first layer on, it has one.
  shapes = _layout(cls, blocks, 3, "AAB")
  layer = "h/B/linear" if cls is st.Stacked else "h/layer_2/linear"
  assert shapes[layer]["w"].shape[-2:] == (D, D)


def test_stack_params_with_another_pattern_suggests_the_pattern():
  # Once it reported missing layers without a word about the pattern.
  blocks = {"A": lambda: (lambda x: x + hk.Linear(D, name="a")(x)),
            "B": lambda: (lambda x: x * hk.Linear(D, name="b")(x))}
  f = hk.transform(lambda x: st.Stacked(blocks, 6, pattern="AAB", name="h").fold(x))
  params = random_like(jax.eval_shape(f.init, KEY, X))
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
