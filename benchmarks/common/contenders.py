"""The contenders: the ways of applying a block N times, and the policies.

A benchmark applies a block of :mod:`benchmarks.models` ``num_layers`` times
in one of four ways (a *contender*):

* ``stacked``: ``st.Stacked(...).fold`` with ``remat=<policy>``.
* ``blockseq``: ``st.BlockSeq(...).fold``, the unrolled Python loop.
* ``hk_layer_stack``: ``hk.layer_stack`` over the block wrapped in
  ``hk.remat(policy=...)``, as a Haiku user writes it by hand (``nested``:
  an ``hk.layer_stack`` of remat-ed ``hk.layer_stack`` chunks).
* ``lax_scan``: a hand-written ``jax.lax.scan(jax.checkpoint(body,
  policy=...))`` over parameters stacked with ``jax.vmap(init)``
  (``nested``: a scan of checkpointed scans over reshaped parameters).

with one of the :data:`POLICIES`: stacktools' remat aliases, taken as
``remat=`` by the stacktools contenders and written as the equivalent
``jax.checkpoint_policies`` entry by the hand-written ones.

A *gradient step* is ``jax.jit(jax.value_and_grad(loss))(params, x)`` with
``loss = mean(stack(x) ** 2)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp

import stacktools as st
from benchmarks.common import models

PyTree = Any

#: The policies every benchmark knows, in display order: stacktools' remat
#: aliases, then ``save_named``, which keeps the one internal named by
#: ``--save_name`` (default ``mlp_hidden``).
POLICIES = tuple(st.CheckpointPolicy.ALIASES) + ("save_named",)
#: The ways of applying a block N times, in display order.
IMPLS = ("stacked", "blockseq", "hk_layer_stack", "lax_scan")
IMPL_LABELS = {
    "stacked": "st.Stacked",
    "blockseq": "st.BlockSeq (Python loop)",
    "hk_layer_stack": "hk.layer_stack + hk.remat",
    "lax_scan": "lax.scan + jax.checkpoint",
}
#: The name the hand-written contenders give the carry (and per-layer
#: parameters) so that an offloading jax policy can refer to them.
HAND_CARRY = "hand_carry"
HAND_INPUT = "hand_input"
#: The ``nested`` alias's policy, whose ``nested_split`` the hand-written
#: nested contenders follow (the same outer and inner sizes as stacktools').
NESTED = st.CheckpointPolicy(nested=True)


# ---------------------------------------------------------------------------
# Policies, as stacktools takes them and as a user writes them in JAX.


def st_remat(policy: str, save_name: str = "mlp_hidden") -> st.CheckpointPolicy:
  """The ``remat=`` value stacktools takes for a benchmark policy name."""
  if policy == "save_named":
    return st.CheckpointPolicy(save_block_internals=[save_name])
  return st.CheckpointPolicy.from_remat(policy)


def jax_policy(policy: str, save_name: str = "mlp_hidden") -> Optional[Callable[..., Any]]:
  """The ``jax.checkpoint_policies`` entry a user writes for a policy name.

  ``None`` for ``"none"`` (no checkpoint at all). ``"full"`` and ``"nested"``
  keep nothing but the checkpointed function's inputs; ``"offload"`` moves
  the values tagged :data:`HAND_CARRY` and :data:`HAND_INPUT` to host memory.
  """
  cp = jax.checkpoint_policies
  if policy == "none":
    return None
  if policy in ("full", "nested"):
    return cp.nothing_saveable
  if policy == "save_all":
    return cp.everything_saveable
  if policy == "save_named":
    return cp.save_only_these_names(save_name)
  if policy == "offload":
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[HAND_CARRY, HAND_INPUT],
        offload_src="device", offload_dst="pinned_host")
  raise ValueError(f"Unknown policy {policy!r}; expected one of {POLICIES}.")


def supports(impl: str, policy: str, num_layers: int) -> bool:
  """Whether ``impl`` can express ``policy`` at this depth.

  ``hk_layer_stack`` writes ``nested`` as a layer_stack of layer_stacks, so
  only when ``st.CheckpointPolicy(nested=True).nested_split`` divides the
  depth exactly.
  """
  if impl == "hk_layer_stack" and policy == "nested":
    return NESTED.nested_split(num_layers)[2] == 0
  return impl in IMPLS and policy in POLICIES


# ---------------------------------------------------------------------------
# Contenders: (loss(params, x), params) for an implementation and a policy.


@dataclasses.dataclass
class Contender:
  """One way of computing the loss of an N-layer stack.

  Attributes:
    name: ``"<impl>/<policy>"``.
    impl: one of :data:`IMPLS`.
    policy: one of :data:`POLICIES`.
    loss: ``loss(params, x) -> scalar``.
    init: ``init(key, x) -> params``.
  """

  name: str
  impl: str
  policy: str
  loss: Callable[[PyTree, jax.Array], jax.Array]
  init: Callable[[jax.Array, jax.Array], PyTree]

  def grad_step(self) -> Callable[[PyTree, jax.Array], tuple[jax.Array, PyTree]]:
    """A fresh (never traced) jitted gradient step."""
    return jax.jit(jax.value_and_grad(self.loss))

  def abstract_params(self, x: jax.Array) -> PyTree:
    """The parameters' shapes and dtypes, without running init."""
    return jax.eval_shape(self.init, jax.random.PRNGKey(0), x)

  def lowered_step(self, x: jax.Array) -> jax.stages.Lowered:
    """A fresh gradient step lowered for the parameters' shapes and ``x``.

    Nothing is initialised, compiled or run; ``.compile()`` it, e.g. to read
    its memory analysis.
    """
    return self.grad_step().lower(self.abstract_params(x), x)

  def synthetic_params(self, x: jax.Array, seed: int = 0) -> PyTree:
    """Parameters of the right shapes without compiling the init.

    For timing only: LayerNorm scales are ones, offsets and biases zeros, and
    weights ``normal / sqrt(fan_in)``. Leaves are drawn one by one, eagerly,
    so each distinct shape compiles a tiny random op once, shared by every
    contender, instead of one init program per contender.
    """
    abstract = self.abstract_params(x)
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    values = []
    for key, (path, leaf) in zip(keys, leaves):
      last = jax.tree_util.keystr(path[-1:])
      if "scale" in last:
        values.append(jnp.ones(leaf.shape, leaf.dtype))
      elif "offset" in last or "'b'" in last:
        values.append(jnp.zeros(leaf.shape, leaf.dtype))
      else:
        fan_in = leaf.shape[-2] if len(leaf.shape) >= 2 else 1
        values.append(jax.random.normal(key, leaf.shape, leaf.dtype) / math.sqrt(fan_in))
    return jax.tree_util.tree_unflatten(tree, values)


def _mean_square(y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.square(y))


def _haiku_contender(name, impl, policy, forward) -> Contender:
  model = hk.without_apply_rng(hk.transform(lambda x: _mean_square(forward(x))))
  return Contender(name, impl, policy, model.apply, model.init)


def _hk_remat(f, policy: str, save_name: str):
  """``f`` wrapped in ``hk.remat`` as a Haiku user writes it (default prevent_cse)."""
  if policy == "none":
    return f
  if policy == "offload":
    return hk.remat(lambda x: f(jax.ad_checkpoint.checkpoint_name(x, HAND_CARRY)),
                    policy=jax_policy(policy))
  return hk.remat(f, policy=jax_policy(policy, save_name))


def _lax_scan_contender(cfg, policy, num_layers, save_name, name) -> Contender:
  block = hk.without_apply_rng(hk.transform(lambda x: models.make_block(cfg)()(x)))
  name_ = jax.ad_checkpoint.checkpoint_name

  def body(x, p):
    if policy == "offload":
      x, p = name_(x, HAND_CARRY), jax.tree_util.tree_map(lambda a: name_(a, HAND_INPUT), p)
    return block.apply(p, x), None

  def checkpointed(f):
    if policy == "none":
      return f
    # The JAX docs' advice inside scan: prevent_cse=False.
    return jax.checkpoint(f, policy=jax_policy(policy, save_name), prevent_cse=False)

  def forward(params, x):
    if policy != "nested":
      return jax.lax.scan(checkpointed(body), x, params)[0]
    outer, inner, remainder = NESTED.nested_split(num_layers)
    step = checkpointed(body)

    def chunk(x, p):
      return jax.lax.scan(step, x, p)[0], None

    main = jax.tree_util.tree_map(
        lambda a: a[:outer * inner].reshape((outer, inner) + a.shape[1:]), params)
    x = jax.lax.scan(checkpointed(chunk), x, main)[0]
    if remainder:
      rest = jax.tree_util.tree_map(lambda a: a[outer * inner:], params)
      x = checkpointed(chunk)(x, rest)[0]
    return x

  def init(key, x):
    return jax.vmap(block.init, in_axes=(0, None))(jax.random.split(key, num_layers), x)

  return Contender(name, "lax_scan", policy,
                   lambda p, x: _mean_square(forward(p, x)), init)


def build(impl: str, policy: str, cfg: models.ModelConfig, num_layers: int, *,
          save_name: str = "mlp_hidden") -> Contender:
  """The contender ``impl`` with ``policy`` on an N-layer stack of ``cfg``."""
  if not supports(impl, policy, num_layers):
    raise ValueError(f"{impl} cannot express policy {policy!r} at {num_layers} layers.")
  name = f"{impl}/{policy}"
  block = models.make_block(cfg)
  if impl == "stacked":
    remat = st_remat(policy, save_name)
    return _haiku_contender(name, impl, policy, lambda x: st.Stacked(
        block, num_layers, remat=remat, name="h").fold(x))
  if impl == "blockseq":
    remat = st_remat(policy, save_name)
    return _haiku_contender(name, impl, policy, lambda x: st.BlockSeq(
        block, num_layers, remat=remat, name="h").fold(x))
  if impl == "hk_layer_stack":
    def forward(x):
      layer = _hk_remat(lambda x: block()(x), policy if policy != "nested" else "full",
                        save_name)
      if policy != "nested":
        return hk.layer_stack(num_layers, name="h")(layer)(x)
      outer, inner, _ = NESTED.nested_split(num_layers)
      chunk = hk.remat(lambda x: hk.layer_stack(inner, name="inner")(layer)(x),
                       policy=jax.checkpoint_policies.nothing_saveable)
      return hk.layer_stack(outer, name="h")(chunk)(x)
    return _haiku_contender(name, impl, policy, forward)
  return _lax_scan_contender(cfg, policy, num_layers, save_name, name)
