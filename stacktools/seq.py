"""Haiku: BlockSeq, the unrolled twin of Stacked.

Same constructor, same ``fold``/``scan`` and the same checkpoint policy
(applied to each block), but a Python loop with per-layer parameter names
(``h/layer_0/block/linear``, ``h/layer_1/...``). Use it to debug a block, or
to compare compile time and memory against :class:`Stacked`;
:func:`unstack_params` and :func:`stack_params` convert parameters between
the two layouts.

Layer ``i`` is initialised from the ``i``-th of the same per-layer keys that
Stacked draws, and applied with the same per-layer rng, so a BlockSeq given
unstacked parameters reproduces Stacked exactly, dropout included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp

from stacktools import _checks
from stacktools import _layers
from stacktools import policy as policy_lib

PyTree = Any


class _Layer(hk.Module):
  """The scope of one layer's parameters: ``<seq name>/layer_<i>``."""

  def __call__(self, inner, x, sliced, *, index, init_key, rng, kind, policy, owner):
    def init(key, x, sliced):
      with _layers.at_layer(index):
        return inner.init(key, x, sliced)

    params_and_state, updater = hk.transparent_lift_with_state(
        init, allow_reuse=True)
    params, state = params_and_state(init_key, x, sliced)

    def step(carry, layer: _layers.LayerSlice):
      new_carry, result = _layers.apply_layer(inner, carry, layer, kind=kind,
                                              owner=owner)
      _checks.check_carry(carry, new_carry)
      return new_carry, result

    layer = _layers.LayerSlice(params=params, state=state, rng=rng,
                               sliced=sliced, index=index)
    x, result = policy.checkpoint_step(step)(x, layer)
    updater.update(result.state)
    return x, result.y


class BlockSeq(_layers.StackModule):
  """A block repeated ``num_layers`` times in a Python loop.

  The interface of :class:`Stacked`; parameters live under
  ``<name>/layer_<i>/`` instead of on a stacked axis. The loop is unrolled
  by construction, so there is no ``unroll=``.

  Example::

    seq = st.BlockSeq(lambda: Block(cfg), num_layers=12, remat="full", name="h")
    x = seq.fold(x, mask)

  Args:
    make_block: a callable, called once per layer, that returns the block.
    num_layers: how many blocks (>= 1).
    remat: a checkpoint policy or alias, applied to each block (``nested``
      has nothing to split in a single block and acts like ``full``).
    reverse: apply the layers from the last to the first.
    name: the module name.
  """

  def __init__(self, make_block: Callable[[], Callable[..., Any]], num_layers: int,
               *, remat: policy_lib.RematSpec = False, reverse: bool = False,
               name: Optional[str] = None):
    super().__init__(make_block, num_layers, remat=remat, reverse=reverse,
                     name=name)

  @_layers.StackModule.layer_scope
  def run_layers(self, inner: hk.TransformedWithState, x: PyTree,
                 arguments: _layers.BlockArguments, kind: str) -> tuple[PyTree, PyTree]:
    n = self.num_layers
    # The same draws, in the same order, as Stacked.
    keys = _layers.draw_layer_keys(n)
    step_policy = self.policy.inner()
    if not step_policy.disable:
      # Outside a loop XLA would merge the recomputation with the forward pass
      # (common subexpression elimination) and keep everything after all.
      step_policy = dataclasses.replace(step_policy, prevent_cse=True)

    ys = [None] * n
    for i in (reversed(range(n)) if self.reverse else range(n)):
      sliced = jax.tree_util.tree_map(lambda a: a[i], arguments.sliced)  # pylint: disable=cell-var-from-loop
      x, ys[i] = _Layer(name=f"layer_{i}")(
          inner, x, sliced, index=jnp.asarray(i, jnp.int32),
          init_key=None if keys.init is None else keys.init[i],
          rng=None if keys.apply is None else keys.apply[i],
          kind=kind, policy=step_policy, owner=type(self).__name__)
    if kind == "fold":
      return x, None
    return x, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)
