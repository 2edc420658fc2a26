"""Tests for stacktools/_partition_specs.py: FSDP PartitionSpecs that keep Layers axes whole.

Pure and fast: only shapes (``jax.eval_shape``), no compiles, one CPU device.
The reference is a hand-written table of the spec each parameter of the
tests' small transformer (``haiku_helpers.transformer``, with the GPT
example's module names) must get, derived from the rule stated in the
module docstring: shard the largest axis that the FSDP size divides, never a
Layers axis (last axis among equals); replicate when none divides.

The sizes are picked so that each part of the rule decides some leaf:
``d_model=6`` and ``num_layers=4`` with ``fsdp=4`` leave many stacked leaves
whose *only* divisible axis is the Layers axis (they must stay replicated),
while the unstacked embeddings (``8 x 6`` and ``12 x 6``) are sharded on axis 0.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

import stacktools as st
from stacktools.layouts import _partition_specs

from haiku_helpers import Tiny, transformer

F = "fsdp"
FSDP = 4
CFG = Tiny(vocab=12, seq_len=8, num_layers=4, heads=2, width=6)

# The hand-written expectation for CFG with fsdp=4 (shapes in the comments).
# Stacked leaves have a leading Layers axis of 4, which 4 divides but which
# must never be sharded; 6 and 18 = 3 * 6 are not divisible by 4.
EXPECTED = {
    "h/block/attn/qkv": {"w": P(), "b": P()},        # (4, 6, 18), (4, 18)
    "h/block/attn/proj": {"w": P(), "b": P()},       # (4, 6, 6), (4, 6)
    "h/block/fc": {"w": P(None, None, F),            # (4, 6, 24)
                   "b": P(None, F)},                 # (4, 24)
    "h/block/fc_out": {"w": P(None, F, None),        # (4, 24, 6): not the last axis
                       "b": P()},                    # (4, 6)
    "h/block/ln1": {"scale": P(), "offset": P()},    # (4, 6)
    "h/block/ln2": {"scale": P(), "offset": P()},    # (4, 6)
    "ln_f": {"scale": P(), "offset": P()},           # (6,)
    "head": {"w": P(None, F), "b": P(F)},            # (6, 12), (12,)
    "pos_embed": {"embeddings": P(F, None)},         # (8, 6): unstacked, axis 0
    "tok_embed": {"embeddings": P(F, None)},         # (12, 6): unstacked, axis 0
}


def param_shapes(cfg=CFG):
  return jax.eval_shape(transformer(cfg).init, jax.random.PRNGKey(0),
                        jnp.zeros((2, cfg.seq_len), jnp.int32))


def shapes_of(tree):
  return jax.tree_util.tree_map(lambda x: tuple(x.shape), tree)


def all_replicated(specs) -> bool:
  leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
  return bool(leaves) and all(spec == P() for spec in leaves)


def spec_leaves(specs):
  return jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))


def normalise(spec: P, ndim: int) -> tuple:
  """``P()`` and ``P(None, None)`` mean the same: pad to the array's rank."""
  return tuple(spec) + (None,) * (ndim - len(spec))


def assert_specs_equal(actual, expected, shapes):
  assert jax.tree_util.tree_structure(actual, is_leaf=lambda x: isinstance(x, P)) == \
      jax.tree_util.tree_structure(expected, is_leaf=lambda x: isinstance(x, P))
  for (path, a), e, s in zip(
      jax.tree_util.tree_flatten_with_path(actual, is_leaf=lambda x: isinstance(x, P))[0],
      spec_leaves(expected), jax.tree_util.tree_leaves(shapes)):
    assert normalise(a, len(s.shape)) == normalise(e, len(s.shape)), (
        f"{jax.tree_util.keystr(path)} {s.shape}: got {a}, expected {e}")


# ---------------------------------------------------------------------------
# A transformer's parameters and optimizer state.


def test_params_match_the_hand_written_specs():
  shapes = param_shapes()
  assert shapes_of(shapes)["h/block/fc_out"]["w"] == (4, 24, 6)  # the table's premise
  specs = st.stacked_partition_specs(shapes, fsdp_size=FSDP, stacked=["h"])
  assert_specs_equal(specs, EXPECTED, shapes)
  # Through a mesh: the fsdp axis's size is read from it.
  mesh = AbstractMesh((2, FSDP), ("data", "fsdp"))
  assert_specs_equal(st.stacked_partition_specs(shapes, mesh, stacked="h"),
                     EXPECTED, shapes)


def test_layers_axis_is_never_sharded():
  shapes = param_shapes()
  specs = st.stacked_partition_specs(shapes, fsdp_size=FSDP, stacked=["h"])
  for module, leaves in specs.items():
    for name, spec in leaves.items():
      if module.startswith("h/"):
        assert normalise(spec, 2)[0] is None, (module, name, spec)
  # Without stacked=, the same tree is free to shard the Layers axis: a
  # (4, 6) LayerNorm scale then goes on its leading axis of 4.
  free = st.stacked_partition_specs(shapes, fsdp_size=FSDP)
  assert normalise(free["h/block/ln1"]["scale"], 2) == (F, None)


def test_adamw_moments_get_the_param_specs_and_counts_are_replicated():
  shapes = param_shapes()
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, weight_decay=0.01))
  opt_shapes = jax.eval_shape(optimizer.init, shapes)
  specs = st.stacked_partition_specs(opt_shapes, fsdp_size=FSDP, stacked=["h"])
  adam = specs[1][0]
  assert isinstance(adam, optax.ScaleByAdamState)
  assert_specs_equal(adam.mu, EXPECTED, shapes)
  assert_specs_equal(adam.nu, EXPECTED, shapes)
  # Everything else (step counts) is a scalar, replicated.
  counts = [(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(opt_shapes)[0]
            if not any(getattr(k, "name", None) in ("mu", "nu") for k in path)]
  assert counts, "expected adam's and the schedule's step counts"
  spec_by_path = dict(jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: isinstance(x, P))[0])
  for path, leaf in counts:
    assert leaf.shape == ()
    assert spec_by_path[path] == P(), jax.tree_util.keystr(path)


def test_fsdp_size_one_or_no_fsdp_axis_replicates_everything():
  shapes = param_shapes()
  devices = np.asarray(jax.devices()[:1])
  meshes = [Mesh(devices.reshape(1, 1), ("data", "fsdp")),   # fsdp of size 1
            Mesh(devices.reshape(1), ("data",)),             # no fsdp axis at all
            AbstractMesh((8,), ("data",))]                   # no fsdp axis, 8 devices
  for mesh in meshes:
    assert all_replicated(st.stacked_partition_specs(shapes, mesh, stacked=["h"])), mesh
  assert all_replicated(st.stacked_partition_specs(shapes, fsdp_size=1, stacked=["h"]))
  # A mesh whose sharding axis has another name: fsdp_axis= picks it.
  mesh = AbstractMesh((FSDP,), ("model",))
  assert all_replicated(st.stacked_partition_specs(shapes, mesh, stacked=["h"]))
  renamed = st.stacked_partition_specs(shapes, mesh, stacked=["h"], fsdp_axis="model")
  assert renamed["tok_embed"]["embeddings"] == P("model", None)


def test_needs_a_mesh_or_a_size():
  with pytest.raises(ValueError, match="mesh or fsdp_size"):
    st.stacked_partition_specs({"m": {"w": jnp.zeros(4)}})


def _two_modules():
  return {"h/block/linear": {"w": jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)},
          "embed": {"embeddings": jax.ShapeDtypeStruct((16, 8), jnp.float32)}}


def test_an_fsdp_axis_the_mesh_lacks_is_an_error():
  # Once it replicated everything, silently.
  mesh = AbstractMesh((2, 4), ("data", "fsdp"))
  with pytest.raises(ValueError, match=r"fsdp_axis='fdsp' is not an axis of the "
                     r"mesh, whose axes are \['data', 'fsdp'\]"):
    st.stacked_partition_specs(_two_modules(), mesh, stacked=["h"], fsdp_axis="fdsp")
  specs = st.stacked_partition_specs(_two_modules(), mesh, stacked=["h"], fsdp_axis="fsdp")
  assert specs["h/block/linear"]["w"] == P(None, None, "fsdp")


def test_a_stack_name_no_parameter_lies_under_is_an_error():
  # Once it sharded the stack's Layers axis, silently.
  mesh = AbstractMesh((4,), ("fsdp",))
  with pytest.raises(ValueError, match=r"stacked=\['hh'\] names 'hh', but no "
                     r"parameter lies under it.*\['embed', 'h/block/linear'\]"):
    st.stacked_partition_specs(_two_modules(), mesh, stacked=["hh"])


# ---------------------------------------------------------------------------
# The rule on hand-made trees.


def test_largest_divisible_axis_wins_and_ties_go_to_the_last():
  cases = [  # (shape, layer axes, fsdp, expected)
      ((4, 8, 8), 1, 4, P(None, None, F)),     # tie: the last (output features)
      ((4, 32, 8), 1, 4, P(None, F, None)),    # the larger, though not last
      ((4, 6, 10), 1, 2, P(None, None, F)),
      ((4, 6, 10), 1, 4, P()),                 # only the Layers axis divides
      ((8,), 1, 8, P()),                       # a stacked scalar per layer
      ((8,), 0, 8, P(F)),                      # the same shape, unstacked
      ((3, 12, 5), 0, 3, P(None, F, None)),    # unstacked: 3 and 12 divide; 12 wins
      ((6, 6, 4), 2, 2, P(None, None, F)),     # two Layers axes
      ((), 0, 4, P()),                         # a scalar
  ]
  for shape, layer_axes, fsdp, expected in cases:
    got = _partition_specs.fsdp_spec(shape, layer_axes, fsdp)
    assert normalise(got, len(shape)) == normalise(expected, len(shape)), (shape, layer_axes)
  assert _partition_specs.fsdp_spec((4, 8), 0, 2, fsdp_axis="shard") == P(None, "shard")


def test_module_names_match_whole_path_components():
  assert _partition_specs.num_layer_axes("h", ["h"]) == 1
  assert _partition_specs.num_layer_axes("h/block/fc", ["h"]) == 1
  assert _partition_specs.num_layer_axes("head", ["h"]) == 0     # a prefix, not a parent
  assert _partition_specs.num_layer_axes("model/h2/x", ["model/h"]) == 0
  assert _partition_specs.num_layer_axes("outer/blk/inner/lin", ["outer", "outer/blk/inner"]) == 2
  tree = {"head": {"w": jnp.zeros((8, 3))}, "h/lin": {"w": jnp.zeros((8, 3))}}
  specs = st.stacked_partition_specs(tree, fsdp_size=8, stacked=["h"])
  assert specs["head"]["w"] == P(F, None)   # unstacked: its axis 0 of 8
  assert specs["h/lin"]["w"] == P()         # stacked: its 8 is the Layers axis


def nested_model(x):
  """Three outer layers, each a block holding three inner layers."""

  def inner_block(y):
    gate = hk.get_parameter("gate", (4,), init=jnp.zeros)
    return y + hk.Linear(6, name="lin")(y) * jnp.mean(gate)

  class Outer(hk.Module):

    def __call__(self, y):
      y = st.Stacked(lambda: inner_block, 3, name="inner").fold(y)
      bias = hk.get_parameter("bias", (2,), init=jnp.zeros)
      return hk.LayerNorm(-1, True, True, name="ln")(y) + jnp.mean(bias)

  return st.Stacked(lambda: Outer(name="blk"), 3, name="outer").fold(x)


def test_nested_stacks_reserve_two_leading_axes():
  shapes = jax.eval_shape(hk.transform(nested_model).init, jax.random.PRNGKey(0),
                          jnp.zeros((2, 6)))
  assert shapes_of(shapes) == {
      "outer/blk/inner/lin": {"w": (3, 3, 6, 6), "b": (3, 3, 6)},
      "outer/blk/inner/~": {"gate": (3, 3, 4)},
      "outer/blk": {"bias": (3, 2)},
      "outer/blk/ln": {"scale": (3, 6), "offset": (3, 6)},
  }, shapes_of(shapes)
  specs = st.stacked_partition_specs(shapes, fsdp_size=3,
                                     stacked=["outer", "outer/blk/inner"])
  expected = {
      "outer/blk/inner/lin": {"w": P(None, None, None, F), "b": P(None, None, F)},
      # Both leading axes are 3 and divisible: neither may be sharded.
      "outer/blk/inner/~": {"gate": P()},
      "outer/blk": {"bias": P()},
      "outer/blk/ln": {"scale": P(None, F), "offset": P(None, F)},
  }
  assert_specs_equal(specs, expected, shapes)
  # Naming only the outer stack would (wrongly) free the inner Layers axis.
  outer_only = st.stacked_partition_specs(shapes, fsdp_size=3, stacked=["outer"])
  assert normalise(outer_only["outer/blk/inner/~"]["gate"], 3) == (None, F, None)


def test_a_leaf_with_fewer_dims_than_its_layers_axes_is_an_error():
  tree = {"outer/blk/inner/lin": {"w": jnp.zeros((3,))}}
  with pytest.raises(ValueError, match=r"outer/blk/inner/lin/w has shape \(3,\).*stacked="):
    st.stacked_partition_specs(tree, fsdp_size=3, stacked=["outer", "outer/blk/inner"])
  # A scalar under a single stack, likewise.
  with pytest.raises(ValueError, match=r"h/lin/w has shape \(\)"):
    st.stacked_partition_specs({"h/lin": {"w": jnp.zeros(())}}, fsdp_size=2, stacked="h")
