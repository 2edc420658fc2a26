"""Tests for st.adapters: low-rank adapters over a stacked base.

Every value is checked against an independent reference:

* the same model without adapters, run unrolled (``st.BlockSeq``) on
  ``st.adapters.merge``'s weights, the adapters folded in;
* ``jax.grad`` of that merged-weight function for the adapters' gradients;
* each adapter alone, for rows that each use their own adapter;
* the base itself, bit for bit, after a fine-tune and under a fresh adapter.
"""

import os
import subprocess
import sys
import textwrap

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stacktools as st
from stacktools.adapters import _lora

from haiku_helpers import (KINDS, Tiny, assert_close, jitted, tiny_forward, tiny_tokens,
                           transformer)
from haiku_helpers import check_jax_usage  # pylint: disable=unused-import  # autouse fixture

KEY = jax.random.PRNGKey(0)
ALPHA = 4.0
TARGETS = ("attn", "fc")   # attn/qkv, attn/proj and fc (not fc_out: a segment is whole)


def adapted(cfg, targets=TARGETS, rank=2, alpha=ALPHA, **lora):
  """``hk.transform`` of the tiny transformer's logits, adapters on ``targets``."""
  def forward(tokens, index=None):
    with st.adapters.lora(targets, rank=rank, alpha=alpha, index=index, **lora):
      return tiny_forward(cfg, tokens)[0]
  return hk.without_apply_rng(hk.transform(forward))


@jax.jit
def trained_like(adapters, seed=1):
  """Adapters as after training: ``lora_b`` no longer zero."""
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return treedef.unflatten([a + 0.3 * jax.random.normal(k, a.shape)
                            for a, k in zip(leaves, keys)])


def merged_reference(cfg, params, tokens, **merge):
  """The model without adapters, unrolled, on the merged weights (one jitted
  program)."""
  def reference(params, tokens):
    merged = st.adapters.merge(params, alpha=ALPHA, **merge)
    plain = transformer(Tiny(**{**cfg.__dict__, "stack": "unrolled"}))
    if cfg.stack == "scan":
      pattern = tuple(KINDS[c] for c in cfg.pattern) or None
      merged = st.unstack_params(merged, "h", pattern=pattern)
    return plain.apply(merged, tokens)
  return jax.jit(reference)(params, tokens)


def setup(cfg, **lora):
  """``adapted(cfg)`` jitted, tokens, its base and trained-like adapters."""
  f = jitted(adapted(cfg, **lora))
  tokens = tiny_tokens(cfg)
  params = f.init(KEY, tokens)
  base, adapters = st.adapters.split(params)
  return f, tokens, base, trained_like(adapters)


@pytest.mark.parametrize("cfg", [
    Tiny(num_layers=3), Tiny(num_layers=3, stack="unrolled"),
    Tiny(num_layers=4, pattern="LG", window=3), Tiny(num_layers=3, remat="nested"),
], ids=["Stacked", "BlockSeq", "pattern", "nested"])
def test_adapted_stack_equals_merged_weights_run_unrolled(cfg):
  f, tokens, base, adapters = setup(cfg)
  params = st.adapters.join(base, adapters)
  assert_close(f.apply(params, tokens), merged_reference(cfg, params, tokens),
               rtol=1e-5, atol=1e-5)


def test_adapters_carry_the_layers_axis_and_come_from_the_vmapped_init():
  f, tokens, _, _ = setup(Tiny(num_layers=3))
  _, adapters = st.adapters.split(f.init(KEY, tokens))
  assert sorted(adapters) == ["h/block/attn/proj", "h/block/attn/qkv", "h/block/fc"]
  a, b = adapters["h/block/fc"]["lora_a"], adapters["h/block/fc"]["lora_b"]
  assert a.shape == (3, 16, 2) and b.shape == (3, 2, 64)
  assert not np.any(b) and np.std(a) > 0.1
  # Each layer its own key: no two layers' A alike.
  assert len({np.asarray(a[i]).tobytes() for i in range(3)}) == 3


@pytest.mark.parametrize("remat", [False, "nested", st.per_depth((1, "full"), (2, "none"))],
                         ids=["none", "nested", "per_depth"])
def test_adapter_grads_equal_jax_grad_of_the_merged_weight_function(remat):
  cfg = Tiny(num_layers=3, remat=remat)
  f, tokens, base, adapters = setup(cfg)
  loss = lambda logits: jnp.mean(jnp.sin(logits))
  got = jax.jit(jax.grad(lambda a: loss(f.apply(st.adapters.join(base, a), tokens))))(
      adapters)
  want = jax.jit(jax.grad(lambda a: loss(merged_reference(
      cfg, st.adapters.join(base, a), tokens))))(adapters)
  assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_adapters_train_under_remat_auto():
  cfg = Tiny(num_layers=3, remat="auto")
  _, tokens, base, adapters = setup(cfg)
  # Not setup's jitted apply: traced once, it would keep the remat of its
  # first trace under every plan.
  f = adapted(cfg)
  loss = lambda a: jnp.mean(jnp.sin(f.apply(st.adapters.join(base, a), tokens)))
  plan = st.plan_remat(jax.grad(loss), adapters, budget="1GiB", measure=False)
  with plan:
    got = jax.jit(jax.grad(loss))(adapters)
  ref_f, _, _, _ = setup(Tiny(num_layers=3))
  want = jax.jit(jax.grad(lambda a: jnp.mean(jnp.sin(ref_f.apply(st.adapters.join(base, a),
                                                                   tokens)))))(adapters)
  assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_layer_stack_takes_adapters_too():
  def forward(x, merged=None):
    with st.adapters.lora("dense", rank=2):
      return st.layer_stack(3)(lambda y: jnp.tanh(hk.Linear(8, name="dense")(y)))(x)
  f = jitted(hk.without_apply_rng(hk.transform(forward)))
  x = jax.random.normal(KEY, (4, 8))
  base, adapters = st.adapters.split(f.init(KEY, x))
  params = st.adapters.join(base, trained_like(adapters))

  @jax.jit
  def reference(params, x):
    merged = st.adapters.merge(params)["__layer_stack_no_per_layer/dense"]
    for i in range(3):
      x = jnp.tanh(x @ merged["w"][i] + merged["b"][i])
    return x
  assert adapters["__layer_stack_no_per_layer/dense"]["lora_a"].shape == (3, 8, 2)
  assert_close(f.apply(params, x), reference(params, x))


def test_each_row_on_its_own_adapter_equals_that_adapter_alone():
  cfg = Tiny(num_layers=3)
  tokens = tiny_tokens(cfg, batch=4)
  alone = jitted(adapted(cfg))
  base, _ = st.adapters.split(alone.init(KEY, tokens))
  many = [trained_like(st.adapters.split(alone.init(jax.random.PRNGKey(s), tokens))[1], s)
          for s in range(3)]
  stacked = st.adapters.stack(many)
  index = jnp.array([2, 0, 1, 2])
  rows = jitted(adapted(cfg, count=3)).apply(st.adapters.join(base, stacked), tokens, index)
  rows, tokens = np.asarray(rows), np.asarray(tokens)   # sliced by numpy, not op by op
  for r, i in enumerate(index.tolist()):
    want = alone.apply(st.adapters.join(base, many[i]), tokens[r:r + 1])
    assert_close(rows[r:r + 1], want)
  # The base is there once: the stacked adapters add the adapters' bytes only.
  nbytes = lambda t: sum(a.nbytes for a in jax.tree.leaves(t))
  assert nbytes(stacked) == sum(nbytes(a) for a in many)
  merge = jax.jit(st.adapters.merge, static_argnames=("alpha", "adapter"))
  assert_close(merge(st.adapters.join(base, stacked), alpha=ALPHA, adapter=1),
               merge(st.adapters.join(base, many[1]), alpha=ALPHA))


@pytest.mark.parametrize("shape", [(5, 1, 16), (5, 16)])
def test_a_decode_step_picks_each_rows_adapter_and_never_sees_the_others(shape):
  """Off the CPU, a decode step (one token a row) selects each row's adapter
  (``_lora.one_token_a_row``) instead of gathering it: each row gets its own
  adapter's delta, and an adapter gone non-finite reaches only its rows."""
  keys = jax.random.split(KEY, 3)
  x = jax.random.normal(keys[0], shape)
  a = jax.random.normal(keys[1], (3, 16, 4))
  b = jax.random.normal(keys[2], (3, 4, 8))
  picks = [2, 0, 1, 2, 0]
  rows = jnp.array(picks)

  def each_alone(x, a, b, r):
    return (x[r] @ a[picks[r]]) @ b[picks[r]]

  # Each side one jitted program (run op by op, each of their operations
  # compiles as a program of its own); compared row by row in numpy.
  pick = jax.jit(_lora.one_token_a_row)
  alone = np.asarray(jax.jit(lambda x, a, b: jnp.stack([each_alone(x, a, b, r)
                                                        for r in range(5)]))(x, a, b))
  got = np.asarray(pick(x, a, b, rows))
  for r in range(5):
    assert_close(got[r], alone[r])
  # Its gradients are those of the rows' own products (a step trained on
  # one token a row takes this path too).
  weights = jax.random.normal(jax.random.fold_in(KEY, 7), got.shape)
  loss = lambda x, a, b: jnp.sum(weights * _lora.one_token_a_row(x, a, b, rows))
  want = lambda x, a, b: sum(jnp.sum(weights[r] * each_alone(x, a, b, r)) for r in range(5))
  assert_close(jax.jit(jax.grad(loss, (0, 1, 2)))(x, a, b),
               jax.jit(jax.grad(want, (0, 1, 2)))(x, a, b))
  broken_a, broken_b = a.at[1].set(jnp.nan), b.at[1].set(jnp.inf)
  got = np.asarray(pick(x, broken_a, broken_b, rows))
  assert not np.isfinite(got[2]).any()   # row 2 is on the broken adapter
  for r in (0, 1, 3, 4):
    assert_close(got[r], alone[r])


def test_a_fresh_adapter_changes_nothing():
  cfg = Tiny(num_layers=3)
  f, tokens, _, _ = setup(cfg)
  params = f.init(KEY, tokens)
  base, _ = st.adapters.split(params)
  # Both applies eager, not setup's jitted one: a bitwise comparison of two
  # programs, which jit's fusion could make differ.
  np.testing.assert_array_equal(adapted(cfg).apply(params, tokens),
                                transformer(cfg).apply(base, tokens))


def test_a_lora_fine_tune_leaves_the_base_bit_identical_and_without_state():
  cfg = Tiny(num_layers=3)
  f, tokens, base, _ = setup(cfg)
  _, adapters = st.adapters.split(f.init(KEY, tokens))
  before = jax.tree.map(np.array, base)
  tx = st.over_layers(optax.adamw(1e-2), stacked=["h"], scale=[1.0, 0.5, 0.25])
  state = jax.jit(tx.init)(adapters)

  @jax.jit
  def step(adapters, state, base):
    loss = lambda a: jnp.mean(jnp.square(f.apply(st.adapters.join(base, a), tokens)))
    value, grads = jax.value_and_grad(loss)(adapters)
    updates, state = tx.update(grads, state, adapters)
    return optax.apply_updates(adapters, updates), state, value

  losses = []
  for _ in range(5):
    adapters, state, value = step(adapters, state, base)
    losses.append(float(value))
  assert losses[-1] < losses[0]
  jax.tree.map(np.testing.assert_array_equal, base, before)
  # The optimizer holds state of the adapters only: no leaf of the base's size.
  state_bytes = sum(a.nbytes for a in jax.tree.leaves(state))
  assert state_bytes < 3 * sum(a.nbytes for a in jax.tree.leaves(adapters))
  # Layer-wise rates: layer 2's adapter moved less than layer 0's.
  b = adapters["h/block/fc"]["lora_b"]
  assert float(jnp.abs(b[2]).mean()) < float(jnp.abs(b[0]).mean())


@pytest.mark.parametrize("lora, phrase", [
    (dict(targets="mlp"), r"the target 'mlp' matches no hk.Linear; the Linear layers "
                          r"called were: block/attn/proj, .*head"),
    (dict(rank=0), r"rank=0; the rank of an adapter is a positive int"),
    (dict(rank=-1), r"rank=-1"),
    (dict(rank=17), r"rank=17 is over the width of block/attn/qkv \(\[16, 48\]\); give a "
                    r"rank of at most 16"),
    (dict(targets=""), r"names no module"),
    (dict(count=2), r"index must be an int array \[batch\]"),
], ids=["no-match", "rank-0", "rank-negative", "rank-over-width", "no-targets",
        "count-without-index"])
def test_bad_input_gets_one_clear_line(lora, phrase):
  cfg = Tiny(num_layers=2)
  kwargs = dict(targets=TARGETS, rank=2) | lora
  with pytest.raises(ValueError, match=phrase) as info:
    adapted(cfg, **kwargs).init(KEY, tiny_tokens(cfg))
  assert "\n" not in info.value.args[0]   # JAX may add its traceback note after it


def test_adapters_of_another_base_are_refused():
  f, tokens, base, adapters = setup(Tiny(num_layers=3))
  _, _, _, wider = setup(Tiny(num_layers=3, width=32, heads=2))
  deeper = setup(Tiny(num_layers=4))[3]
  for other, phrase in [(wider, r"lora_a \[3, 32, 2\].*does not fit the base's weight "
                                r"\[16, 16\] over leading axes \[3\]"),
                        (deeper, r"does not fit the base's weight")]:
    with pytest.raises(ValueError, match=phrase):
      st.adapters.join(base, other)
  with pytest.raises(ValueError, match="which the base has no weight 'w' of"):
    st.adapters.join({"other": {"w": jnp.ones([16, 48])}}, adapters)
  with pytest.raises(ValueError, match="adapters 1 differ from adapters 0"):
    st.adapters.stack([adapters, deeper])
  with pytest.raises(ValueError, match="say which to fold in with adapter=i"):
    st.adapters.merge(st.adapters.join(base, st.adapters.stack([adapters, adapters])))
  assert f is not None


def test_a_linear_matched_by_two_nested_contexts_is_refused():
  cfg = Tiny(num_layers=2)
  tokens = tiny_tokens(cfg)

  def nested(outer, inner):
    def forward(tokens):
      with st.adapters.lora(outer, rank=2, alpha=ALPHA):
        with st.adapters.lora(inner, rank=2, alpha=ALPHA):
          return tiny_forward(cfg, tokens)[0]
    return hk.without_apply_rng(hk.transform(forward))

  # The same Linear in both: its adapter (the same parameters) added twice.
  with pytest.raises(ValueError, match=r"block/attn/.* is matched by two "
                                       r"st.adapters.lora contexts") as info:
    nested(TARGETS, "attn").init(KEY, tokens)
  assert "\n" not in info.value.args[0]
  # Other Linears in each: the adapters of one context around all of them.
  # Both applies eager (a bitwise comparison of two programs).
  _, _, base, adapters = setup(cfg)
  params = st.adapters.join(base, adapters)
  np.testing.assert_array_equal(nested("attn", "fc").apply(params, tokens),
                                adapted(cfg).apply(params, tokens))


def test_adapter_gradients_copy_no_wide_activation():
  # The backward pass of an adapted MLP, gradients of the adapters only,
  # against the same pass to the input only (a frozen base): the adapters'
  # weight gradients transpose their [tokens, rank] operands, never a
  # [tokens, width] one (1.21x the temp when they contracted batch and seq).
  def forward(x):
    with st.adapters.lora(["up", "down"], rank=2):
      return hk.Linear(16, name="down")(jax.nn.gelu(hk.Linear(64, name="up")(x)))

  f = hk.without_apply_rng(hk.transform(forward))
  x = jnp.ones([4, 16, 16])
  params = jax.jit(f.init)(KEY, x)
  base, adapters = st.adapters.split(params)
  loss = lambda p, x: jnp.mean(jnp.square(f.apply(p, x)))
  temp = lambda fn, *args: jax.jit(fn).lower(*args).compile().memory_analysis(
  ).temp_size_in_bytes
  lora = temp(jax.grad(lambda a, b, x: loss(st.adapters.join(b, a), x)), adapters, base, x)
  frozen = temp(jax.grad(lambda x, p: loss(p, x)), x, params)
  assert lora <= 1.05 * frozen, (lora, frozen)


def test_targets_match_whole_segments_of_the_module_path():
  from stacktools.adapters._lora import matches  # pylint: disable=import-outside-toplevel
  assert matches("attn", "block/attn/qkv") and matches("block/attn", "h/block/attn/qkv")
  assert matches("fc*", "block/fc_out") and not matches("fc", "block/fc_out")
  assert not matches("attn/proj", "block/attn/qkv")


_PIPELINE = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \\
        " --xla_force_host_platform_device_count=4"
    import haiku as hk, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    import stacktools as st

    def model(pipeline):
      def loss(x):
        with st.adapters.lora("mlp", rank=2):
          def block(y):
            return y + hk.Linear(8, name="mlp")(jnp.tanh(y))
          y = st.Stacked(lambda: hk.to_module(block)(name="b"), 8, pipeline=pipeline,
                         name="h").fold(x)
        return jnp.mean(jnp.square(y))
      return hk.without_apply_rng(hk.transform(loss))

    x = jax.random.normal(jax.random.PRNGKey(1), (8, 8))
    plain = model(None)
    base, adapters = st.adapters.split(plain.init(jax.random.PRNGKey(0), x))
    adapters = jax.tree.map(lambda a: a + 0.1, adapters)
    grad = lambda f: jax.jit(jax.value_and_grad(
        lambda a: f.apply(st.adapters.join(base, a), x)))(adapters)
    ref = grad(plain)
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("pipe",))
    with jax.set_mesh(mesh):
      got = grad(model(st.Pipeline(microbatches=4)))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    print("OK")
    """)


def test_adapters_in_a_pipeline_equal_the_plain_stack():
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  done = subprocess.run([sys.executable, "-c", _PIPELINE], cwd=root, capture_output=True,
                        text=True, timeout=600, check=False)
  assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
