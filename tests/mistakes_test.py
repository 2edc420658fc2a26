"""Mistakes a new user makes, each of which was silent or a deep traceback once.

Every test here failed before its fix:

* typed PRNG keys (``jax.random.key``) broke ``remat="nested"``;
* numpy integers were accepted by ``st.fold`` but refused by ``Stacked``;
* an explicit nested outer size larger than the stack was silently clamped;
* a policy naming a value no block tags (a typo) saved nothing, silently;
* a module instance instead of a factory failed deep inside Haiku;
* ``unstack_params`` of unstacked params returned a wrong tree;
* ``stacked_partition_specs`` with a mistyped axis or stack name replicated
  or sharded silently.

References are independent of the code under test: ``jax.grad`` of a plain
Python loop over the same keys and weights, and hand-written layouts.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import stacktools as st

ALIASES = tuple(st.REMAT_ALIASES)
N, D = 4, 3


# ---------------------------------------------------------------------------
# Typed PRNG keys, every alias.


def _noisy_step(carry, key):
  return jnp.tanh(carry + jax.random.normal(key, carry.shape))


def _loop_reference(carry, keys):
  for i in range(keys.shape[0]):
    carry = _noisy_step(carry, keys[i])
  return carry


@pytest.mark.parametrize("remat", ALIASES)
def test_fold_over_typed_keys_every_alias(remat):
  keys = jax.random.split(jax.random.key(0), 5)
  init = jnp.linspace(-1.0, 1.0, D)
  loss = lambda fold: jax.jit(jax.value_and_grad(lambda c: jnp.sum(fold(c, keys) ** 2)))
  value, grad = loss(st.fold(_noisy_step, remat=remat))(init)
  ref_value, ref_grad = loss(_loop_reference)(init)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5)


class _DropoutBlock(hk.Module):

  def __call__(self, x):
    h = hk.Linear(x.shape[-1])(x)
    return x + hk.dropout(hk.next_rng_key(), 0.5, h)


def _stack_fn(remat, cls):
  def fn(x):
    return cls(lambda: _DropoutBlock(name="block"), N, remat=remat, name="h").fold(x)
  return hk.transform(fn)


@pytest.mark.parametrize("remat", ALIASES)
def test_stacked_with_typed_keys_every_alias(remat):
  """Init and apply with jax.random.key, against BlockSeq on the same params."""
  x = jnp.ones((2, D))
  stacked, seq = _stack_fn(remat, st.Stacked), _stack_fn(remat, st.BlockSeq)
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


# ---------------------------------------------------------------------------
# numpy integers are integers everywhere; True is not.


class _Linear(hk.Module):

  def __call__(self, x):
    return x + hk.Linear(x.shape[-1])(x)


def test_numpy_ints_accepted_everywhere():
  x = jnp.ones((2, D))

  def with_ints(num_layers, unroll):
    def fn(x):
      a = st.Stacked(_Linear, num_layers, unroll=unroll, name="a").fold(x)
      b = st.BlockSeq(_Linear, num_layers, name="b").fold(a)
      return st.layer_stack(num_layers, unroll=unroll, name="c")(_Linear())(b)
    return hk.transform(fn)

  plain = with_ints(3, 2)
  numpy = with_ints(np.int64(3), np.int32(2))
  params = jax.jit(plain.init)(jax.random.PRNGKey(0), x)
  assert jax.tree.map(jnp.shape, jax.eval_shape(numpy.init, jax.random.PRNGKey(0), x)) \
      == jax.tree.map(jnp.shape, params)
  np.testing.assert_allclose(jax.jit(numpy.apply)(params, None, x),
                             jax.jit(plain.apply)(params, None, x), rtol=1e-6)
  ws = jnp.ones((3, D))
  assert st.fold(lambda c, w: c * w, length=np.int64(3), unroll=np.int64(2))(
      jnp.ones(D), ws).shape == (D,)


@pytest.mark.parametrize("make", [
    lambda: st.Stacked(_Linear, True),
    lambda: st.BlockSeq(_Linear, True),
    lambda: st.layer_stack(True),
])
def test_true_is_not_a_layer_count(make):
  with pytest.raises(TypeError, match=r"num_layers must be an int >= 1, got True"):
    hk.transform(make).init(None)


# ---------------------------------------------------------------------------
# An explicit outer size larger than the loop.


def test_nested_outer_larger_than_stack_is_an_error():
  policy = st.CheckpointPolicy(nested=100)
  with pytest.raises(ValueError, match=r"nested=100\) asks for 100 outer chunks, "
                     r"but the loop has only 5 steps.*between 1 and 5"):
    st.fold(lambda c, x: c + x, remat=policy)(jnp.zeros(D), jnp.ones((5, D)))
  for cls in (st.Stacked, st.BlockSeq):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: CheckpointPolicy"
                       r"\(nested=7\).*only 2 steps"):
      hk.transform(lambda x: cls(_Linear, 2, remat=st.CheckpointPolicy(nested=7))
                   .fold(x)).init(jax.random.PRNGKey(0), jnp.ones((1, D)))
  with pytest.raises(ValueError, match=r"between 1 and 5"):
    st.CheckpointPolicy(nested=6).nested_split(5)
  # The outer size equal to the length is fine: one step per chunk.
  assert st.CheckpointPolicy(nested=5).nested_split(5) == (5, 1, 0)


# ---------------------------------------------------------------------------
# Names a policy saves must be tagged in the block.


def _tagging_block(carry, w):
  h = st.checkpoint_name(jnp.tanh(carry @ w), "mlp_hidden")
  # Tagged with JAX's own function: found too (through the jaxpr).
  out = jax.ad_checkpoint.checkpoint_name(h @ w.T, "attn_out")
  return carry + out


@pytest.mark.parametrize("policy", [
    st.CheckpointPolicy(save_block_internals=["mlp_hiden"]),
    st.CheckpointPolicy(save_block_internals=["mlp_hiden"], nested=True),
    st.CheckpointPolicy(offload_block_internals=["mlp_hiden"]),
])
def test_policy_naming_an_untagged_value_is_an_error(policy):
  ws = jnp.ones((N, D, D)) * 0.1
  run = lambda c: jnp.sum(st.fold(_tagging_block, remat=policy)(c, ws))
  with pytest.raises(ValueError, match=r"saves or offloads the block internals "
                     r"\['mlp_hiden'\].*The block tags \['attn_out', 'mlp_hidden'\] "
                     r"\('mlp_hiden': did you mean 'mlp_hidden'\?\)"):
    jax.grad(run)(jnp.ones((2, D)))


def test_policy_naming_tagged_values_runs():
  ws = jnp.ones((N, D, D)) * 0.1
  reference = jax.grad(lambda c: jnp.sum(st.fold(_tagging_block)(c, ws)))(jnp.ones((2, D)))
  for names in (["mlp_hidden"], ["attn_out"], ["mlp_hidden", "attn_out"]):
    policy = st.CheckpointPolicy(save_block_internals=names)
    got = jax.grad(lambda c: jnp.sum(st.fold(_tagging_block, remat=policy)(c, ws)))(
        jnp.ones((2, D)))
    np.testing.assert_allclose(got, reference, rtol=1e-6)


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_stack_policy_naming_an_untagged_value_is_an_error(cls):
  class Block(hk.Module):
    def __call__(self, x):
      return x + st.checkpoint_name(hk.Linear(D)(x), "proj")

  policy = st.CheckpointPolicy(save_block_internals=["proj", "prj"])
  f = hk.transform(lambda x: cls(Block, N, remat=policy, name="h").fold(x))
  with pytest.raises(ValueError, match=r"\['prj'\].*The block tags \['proj'\]"):
    f.init(jax.random.PRNGKey(0), jnp.ones((2, D)))


# ---------------------------------------------------------------------------
# A module instance is not a factory.


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_module_instance_instead_of_factory(cls):
  def fn(x):
    return cls(hk.Linear(D), N).fold(x)
  with pytest.raises(TypeError, match=rf"{cls.__name__} got a module instance, "
                     r"Linear.*pass a factory \(a class or a lambda\)"):
    hk.transform(fn).init(jax.random.PRNGKey(0), jnp.ones((2, D)))


# ---------------------------------------------------------------------------
# unstack_params refuses params that are unstacked already.


def test_unstack_params_twice_is_refused():
  params = {"m/h/block/linear": {"w": np.ones((D, D, D), np.float32)},
            "m/embed": {"embeddings": np.ones((5, D), np.float32)}}
  unstacked = st.unstack_params(params, "m/h")
  assert sorted(unstacked) == ["m/embed"] + [f"m/h/layer_{i}/block/linear" for i in range(D)]
  with pytest.raises(ValueError, match=r"under 'm/h' look unstacked already.*"
                     r"m/h/layer_<i>/\.\.\. for layers 0\.\.2.*st\.stack_params"):
    st.unstack_params(unstacked, "m/h")


# ---------------------------------------------------------------------------
# stacked_partition_specs: names that match nothing.


def _params():
  return {"h/block/linear": {"w": jax.ShapeDtypeStruct((N, 8, 8), jnp.float32)},
          "embed": {"embeddings": jax.ShapeDtypeStruct((16, 8), jnp.float32)}}


def test_partition_specs_unknown_fsdp_axis():
  mesh = AbstractMesh((2, 4), ("data", "fsdp"))
  with pytest.raises(ValueError, match=r"fsdp_axis='fdsp' is not an axis of the "
                     r"mesh, whose axes are \['data', 'fsdp'\]"):
    st.stacked_partition_specs(_params(), mesh, stacked=["h"], fsdp_axis="fdsp")
  specs = st.stacked_partition_specs(_params(), mesh, stacked=["h"], fsdp_axis="fsdp")
  assert specs["h/block/linear"]["w"] == P(None, None, "fsdp")


def test_partition_specs_unknown_stack():
  mesh = AbstractMesh((4,), ("fsdp",))
  with pytest.raises(ValueError, match=r"stacked=\['hh'\] names 'hh', but no "
                     r"parameter lies under it.*\['embed', 'h/block/linear'\]"):
    st.stacked_partition_specs(_params(), mesh, stacked=["hh"])
