"""Tests for stacktools.policy: CheckpointPolicy, its aliases, checkpoint_name,
and the string form of st.per_depth.

Each test compares against an independent reference: the explicit
CheckpointPolicy an alias stands for, the equations of ``jax.make_jaxpr``, or
the residuals ``jax.ad_checkpoint`` says the backward pass keeps.
"""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st
from stacktools import policy as policy_lib

try:  # Public in some JAX versions; only in jax._src in jax 0.10.
  from jax.ad_checkpoint import saved_residuals
except ImportError:
  from jax._src.ad_checkpoint import saved_residuals

ALIAS_REPRS = ("False", "None", "'none'", "True", "'full'", "'nested'",
               "'offload'", "'save_all'", "CheckpointPolicy")


def _named(residuals, name):
  """The residuals that are values tagged ``name``, saved on device."""
  return [aval for aval, desc in residuals if f"named '{name}'" in desc]


def _on_host(aval):
  """Whether a residual's aval lives in host memory."""
  space = getattr(aval, "memory_space", None)
  return "host" in str(space).lower() or "<host>" in str(aval)


def _step(carry, x):
  """A loop step with two tagged internals, 'pre' and 'other'."""
  pre = st.checkpoint_name(carry["h"] * x, "pre")
  other = st.checkpoint_name(jnp.sin(pre), "other")
  return {"h": jnp.tanh(other) * pre}


def _step_residuals(policy):
  """What the backward pass of ``policy.checkpoint_step(_step)`` keeps."""
  wrapped = policy.checkpoint_step(_step)
  carry = {"h": jnp.linspace(0.1, 0.9, 5)}
  x = jnp.linspace(-1.0, 1.0, 5)
  return saved_residuals(lambda c, x: jnp.sum(wrapped(c, x)["h"]), carry, x)


# ---------------------------------------------------------------------------
# from_remat.


@pytest.mark.parametrize("remat", [False, None, "none"])
def test_from_remat_no_checkpointing(remat):
  policy = st.CheckpointPolicy.from_remat(remat)
  assert policy.disable is True
  assert policy == st.CheckpointPolicy(disable=True)


@pytest.mark.parametrize("remat", [True, "full"])
def test_from_remat_full_is_default_policy(remat):
  policy = st.CheckpointPolicy.from_remat(remat)
  assert policy == st.CheckpointPolicy()
  assert policy.disable is False
  assert policy.nested is False
  assert policy.save_carries is True
  assert policy.save_block_internals is False


def test_from_remat_nested():
  policy = st.CheckpointPolicy.from_remat("nested")
  assert policy == st.CheckpointPolicy(nested=True)
  assert policy.nested is True
  assert policy.disable is False


def test_from_remat_offload():
  policy = st.CheckpointPolicy.from_remat("offload")
  assert policy.save_carries == "offload"
  # The per-layer inputs (the stacked parameters, most often) are on device
  # for the whole step anyway: a host copy would only add transfers.
  assert policy.save_inputs is False
  assert policy.nested is False
  assert policy.offloads_anything
  assert policy == st.CheckpointPolicy(save_carries="offload")


def test_from_remat_save_all():
  policy = st.CheckpointPolicy.from_remat("save_all")
  assert policy.save_block_internals is True
  assert policy.save_carries is True
  assert policy.save_inputs is True
  assert policy.disable is False


def test_from_remat_policy_passes_through():
  policy = st.CheckpointPolicy(save_block_internals=["attn"], nested=3)
  assert st.CheckpointPolicy.from_remat(policy) is policy


@pytest.mark.parametrize("remat", ["fulll", 3, "nest", "", 0, 1, 1.0, "True"])
def test_from_remat_rejects_unknown(remat):
  with pytest.raises(ValueError, match=re.escape(f"remat={remat!r}")) as info:
    st.CheckpointPolicy.from_remat(remat)
  message = str(info.value)
  for alias in ALIAS_REPRS:
    assert alias in message, (alias, message)


# ---------------------------------------------------------------------------
# Invalid policies.


@pytest.mark.parametrize("offload", [
    dict(save_carries="offload"),
    dict(save_inputs="offload"),
    dict(offload_block_internals=["pre"]),
])
def test_save_everything_cannot_offload(offload):
  with pytest.raises(ValueError, match=r"save_block_internals=True.*offload"):
    st.CheckpointPolicy(save_block_internals=True, **offload)


def test_name_both_saved_and_offloaded():
  with pytest.raises(ValueError, match=r"\['pre'\] in both save_block_internals"):
    st.CheckpointPolicy(save_block_internals=["pre", "a"],
                        offload_block_internals=["b", "pre"])


@pytest.mark.parametrize("field, value", [
    ("nested", True),
    ("nested", 4),
    ("save_block_internals", ["pre"]),
    ("save_block_internals", True),
    ("offload_block_internals", ["pre"]),
    ("save_carries", "offload"),
])
def test_disable_with_other_fields(field, value):
  with pytest.raises(ValueError, match=rf"disable=True.*{field}"):
    st.CheckpointPolicy(disable=True, **{field: value})


def test_disable_with_prevent_cse_is_fine():
  policy = st.CheckpointPolicy(disable=True, prevent_cse=True)
  assert policy.disable and policy.prevent_cse


@pytest.mark.parametrize("field", ["save_carries", "save_inputs"])
@pytest.mark.parametrize("value", ["host", 1, None, "Offload"])
def test_bad_save_option(field, value):
  with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
    st.CheckpointPolicy(**{field: value})


@pytest.mark.parametrize("nested", [0, -1])
def test_nested_must_be_positive(nested):
  with pytest.raises(ValueError, match=rf"nested={nested}\).*>= 1"):
    st.CheckpointPolicy(nested=nested)


@pytest.mark.parametrize("nested", [1.5, "yes", None])
def test_nested_must_be_bool_or_int(nested):
  with pytest.raises(TypeError, match=r"nested=.*bool or a positive int"):
    st.CheckpointPolicy(nested=nested)


@pytest.mark.parametrize("nested", [(), (2, 1.5), (True, 2), [2, "x"]])
def test_nested_levels_must_be_ints(nested):
  with pytest.raises(TypeError, match=r"or a tuple of ints .* nested=\(4, 4\)"):
    st.CheckpointPolicy(nested=nested)


def test_nested_levels_must_be_positive_and_on_device():
  with pytest.raises(ValueError, match=r"nested=\(2, 0\)\).*>= 1"):
    st.CheckpointPolicy(nested=(2, 0))
  with pytest.raises(ValueError, match=r"two levels only"):
    st.CheckpointPolicy(nested=(2, 2), save_carries="offload")
  assert st.CheckpointPolicy(nested=[np.int64(3), 2]).nested == (3, 2)
  assert st.CheckpointPolicy(nested=(5,)).nested == 5


def test_nested_numpy_int_becomes_int():
  policy = st.CheckpointPolicy(nested=np.int64(4))
  assert policy.nested == 4 and type(policy.nested) is int


def test_an_outer_size_larger_than_the_loop_is_an_error():
  # Once silently clamped; now each loop says its length and the range.
  policy = st.CheckpointPolicy(nested=100)
  with pytest.raises(ValueError, match=r"nested=100\) asks for 100 outer chunks, "
                     r"but the loop has only 5 steps.*between 1 and 5"):
    st.fold(lambda c, x: c + x, remat=policy)(jnp.zeros(3), jnp.ones((5, 3)))
  for cls in (st.Stacked, st.BlockSeq):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: CheckpointPolicy"
                       r"\(nested=7\).*only 2 steps"):
      hk.transform(lambda x, cls=cls: cls(
          lambda: (lambda x: x + hk.Linear(3)(x)), 2,
          remat=st.CheckpointPolicy(nested=7)).fold(x)).init(
              jax.random.PRNGKey(0), jnp.ones((1, 3)))
  with pytest.raises(ValueError, match=r"between 1 and 5"):
    st.CheckpointPolicy(nested=6).nested_split(5)
  # The outer size equal to the length is fine: one step per chunk.
  assert st.CheckpointPolicy(nested=5).nested_split(5) == (5, 1, 0)


@pytest.mark.parametrize("field", ["save_block_internals",
                                   "offload_block_internals"])
@pytest.mark.parametrize("name", ["stacktools_carry", "stacktools_input"])
def test_reserved_names_rejected(field, name):
  with pytest.raises(ValueError, match=rf"{name}.*reserves"):
    st.CheckpointPolicy(**{field: ["ok", name]})


@pytest.mark.parametrize("field", ["save_block_internals",
                                   "offload_block_internals"])
def test_non_string_names_rejected(field):
  with pytest.raises(TypeError, match=r"holds 3, which is not a string"):
    st.CheckpointPolicy(**{field: ["ok", 3]})


@pytest.mark.parametrize("field", ["save_block_internals",
                                   "offload_block_internals"])
def test_non_sequence_names_rejected(field):
  with pytest.raises(TypeError, match=rf"{field}=5\) must be a sequence"):
    st.CheckpointPolicy(**{field: 5})


def test_names_normalised_to_tuples():
  policy = st.CheckpointPolicy(save_block_internals=["a", "b"],
                               offload_block_internals="c")
  assert policy.save_block_internals == ("a", "b")
  assert policy.offload_block_internals == ("c",)
  hash(policy)  # Frozen and hashable once the lists are tuples.


# ---------------------------------------------------------------------------
# checkpoint_name.


def _name_equations(jaxpr):
  return [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "name"]


def test_checkpoint_name_tags_every_array_leaf():
  a = jnp.arange(3.0)
  b = np.ones((2, 2), np.float32)
  c = jnp.arange(4, dtype=jnp.int32)

  def tag(a, b, c):
    return st.checkpoint_name({"a": a, "b": (b, None, 3.0), "c": [c]}, "foo")

  jaxpr = jax.make_jaxpr(tag)(a, b, c)
  eqns = _name_equations(jaxpr)
  assert len(eqns) == 3
  assert all(e.params["name"] == "foo" for e in eqns)
  # One equation per array leaf, each applied to that leaf.
  assert {e.invars[0] for e in eqns} == set(jaxpr.jaxpr.invars)


def test_checkpoint_name_tags_numpy_leaves_when_traced():
  b = np.ones((2, 2), np.float32)
  jaxpr = jax.make_jaxpr(lambda: st.checkpoint_name({"b": b}, "bar"))()
  eqns = _name_equations(jaxpr)
  assert [e.params["name"] for e in eqns] == ["bar"]


def test_checkpoint_name_keeps_values_and_non_arrays():
  tree = {"a": jnp.arange(3.0), "b": (np.full((2,), 7.0, np.float32), None, 3.0),
          "c": [jnp.arange(4, dtype=jnp.int32), 5]}
  out = st.checkpoint_name(tree, "foo")
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
  assert out["b"][1] is None
  assert out["b"][2] == 3.0 and type(out["b"][2]) is float
  assert out["c"][1] == 5 and type(out["c"][1]) is int
  np.testing.assert_array_equal(out["a"], np.arange(3.0))
  np.testing.assert_array_equal(out["b"][0], np.full((2,), 7.0))
  np.testing.assert_array_equal(out["c"][0], np.arange(4))
  assert out["c"][0].dtype == jnp.int32


def test_checkpoint_name_values_under_jit_and_grad():
  x = jnp.linspace(-1.0, 1.0, 6)
  f = lambda x: jnp.sum(jnp.sin(st.checkpoint_name(x * x, "sq")))
  g = lambda x: jnp.sum(jnp.sin(x * x))
  np.testing.assert_allclose(jax.jit(f)(x), g(x), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), rtol=1e-6)


@pytest.mark.parametrize("name", ["", 3, None])
def test_checkpoint_name_needs_string(name):
  with pytest.raises(TypeError, match="non-empty string name"):
    st.checkpoint_name(jnp.ones(2), name)


# ---------------------------------------------------------------------------
# jax_policy / checkpoint_step: what the backward pass keeps.


@pytest.mark.parametrize("listed", [
    (), ("pre",), ("other",), ("pre", "other"),
])
def test_named_internal_saved_exactly_when_listed(listed):
  policy = st.CheckpointPolicy(save_block_internals=list(listed))
  residuals = _step_residuals(policy)
  for name in ("pre", "other"):
    expected = 1 if name in listed else 0
    assert len(_named(residuals, name)) == expected, (name, residuals)
  # Nothing unnamed from inside the block: the rest is recomputed.
  assert not [d for _, d in residuals if "output of" in d], residuals


def test_name_the_step_does_not_tag_is_an_error():
  policy = st.CheckpointPolicy(save_block_internals=["other", "unused"])
  with pytest.raises(ValueError, match=r"\['unused'\], but no block tags a value "
                     r"with that name.*The block tags \['other', 'pre'\]"):
    _step_residuals(policy)


@pytest.mark.parametrize("value", ["a string", 0.5])
def test_a_name_on_no_array_is_refused_as_untagged(value):
  # Once recorded as tagged: the policy passed the check and saved nothing.
  def step(c, w):
    st.checkpoint_name(value, "meta")
    return jnp.tanh(c @ w)

  policy = st.CheckpointPolicy(save_block_internals=["meta"])
  with pytest.raises(ValueError, match=r"\['meta'\], but no block tags a value "
                     r"with that name.*The block tags no names"):
    jax.grad(lambda c, ws: jnp.sum(st.fold(step, remat=policy)(c, ws)))(
        jnp.ones((2, 4)), jnp.ones((3, 4, 4)))


def test_default_policy_keeps_only_carry_and_input():
  residuals = _step_residuals(st.CheckpointPolicy())
  assert len(residuals) == 2, residuals
  # Both are the step's own inputs, kept as they are: no named copy (which
  # would cost a buffer and reduce-precision ops).
  assert not _named(residuals, policy_lib.CARRY_NAME)
  assert all("from the argument" in d for _, d in residuals), residuals


def test_save_everything_keeps_unnamed_internals():
  listed = _step_residuals(st.CheckpointPolicy(save_block_internals=["pre"]))
  everything = _step_residuals(st.CheckpointPolicy(save_block_internals=True))
  unchecked = saved_residuals(
      lambda c, x: jnp.sum(_step(c, x)["h"]), {"h": jnp.ones(5)}, jnp.ones(5))
  assert len(everything) > len(listed)
  assert [d for _, d in everything if "output of" in d]
  # As many residuals as no checkpointing at all (one per saved value; the
  # unchecked function's carry and input are not copied through names).
  assert len(everything) >= len(unchecked)


def test_offloaded_internal_lives_in_host_memory():
  residuals = _step_residuals(
      st.CheckpointPolicy(offload_block_internals=["pre"]))
  host = [aval for aval, _ in residuals if _on_host(aval)]
  assert len(host) == 1, residuals
  assert host[0].shape == (5,)
  assert not _named(residuals, "pre")


def test_offloaded_carry_lives_in_host_memory():
  residuals = _step_residuals(st.CheckpointPolicy(save_carries="offload"))
  assert sum(_on_host(aval) for aval, _ in residuals) == 1, residuals
  assert not _named(residuals, policy_lib.CARRY_NAME)


def test_offload_alias_moves_the_carry_to_host_and_leaves_the_input():
  residuals = _step_residuals(st.CheckpointPolicy.from_remat("offload"))
  on_host = [aval for aval, _ in residuals if _on_host(aval)]
  assert len(on_host) == 1, residuals
  # Both inputs are the same shape; the input is kept where it is (a step's
  # slice of the loop's inputs is read from them), only the carry moves.
  assert [d for aval, d in residuals if not _on_host(aval)] == ["from the argument x"], residuals


def test_disabled_policy_does_not_wrap_a_step_outside_a_loop():
  assert st.CheckpointPolicy(disable=True).checkpoint_step(_step, looped=False) is _step


def test_checkpoint_step_values_and_grads_match_step():
  carry = {"h": jnp.linspace(0.1, 0.9, 5)}
  x = jnp.linspace(-1.0, 1.0, 5)
  loss = lambda step: lambda c, x: jnp.sum(step(c, x)["h"] ** 2)
  want = jax.grad(loss(_step), argnums=(0, 1))(carry, x)
  for remat in [False, True, "offload", "save_all",
                st.CheckpointPolicy(save_block_internals=["pre"],
                                    offload_block_internals=["other"])]:
    wrapped = st.CheckpointPolicy.from_remat(remat).checkpoint_step(_step)
    np.testing.assert_allclose(wrapped(carry, x)["h"], _step(carry, x)["h"],
                               rtol=1e-6)
    got = jax.grad(loss(wrapped), argnums=(0, 1))(carry, x)
    np.testing.assert_allclose(got[0]["h"], want[0]["h"], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


# ---------------------------------------------------------------------------
# st.per_depth's string form: the separator is a comma.


@pytest.mark.parametrize("spec,sep,fixed", [
    ("none:2;full:2", ";", "none:2,full:2"),
    ("none:2 full:2", " ", "none:2,full:2"),
    ("none:1 / full:2/nested:1", "/", "none:1,full:2,nested:1"),
])
def test_per_depth_with_another_separator_shows_the_spec_with_commas(spec, sep, fixed):
  # Once reported as an unknown policy.
  with pytest.raises(ValueError, match=None) as info:
    st.per_depth(spec)
  message = str(info.value)
  assert message.startswith(f"st.per_depth({spec!r}): segments are separated by "
                            f"commas, not {sep!r}: write {fixed!r}"), message
  assert str(st.per_depth(fixed)) == fixed


def test_per_depth_unknown_alias_is_still_named():
  with pytest.raises(ValueError, match=r"'bogus' is not a checkpoint policy"):
    st.per_depth("none:2,bogus:2")
