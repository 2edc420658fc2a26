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
from typing import Any, Optional, Union

import haiku as hk
import jax
import jax.numpy as jnp

from stacktools import policy as policy_lib
from stacktools import stack as stack_lib
from stacktools.scan import check_carry

PyTree = Any


class _Layer(hk.Module):
  """The scope of one layer's parameters: ``<seq name>/layer_<i>``."""

  def __call__(self, inner, x, sliced, *, index, init_key, rng, kind, policy, owner):
    def init(key, x, sliced):
      with stack_lib.at_layer(index):
        return inner.init(key, x, sliced)

    params_and_state, updater = hk.transparent_lift_with_state(
        init, allow_reuse=True)
    params, state = params_and_state(init_key, x, sliced)

    def step(carry, layer):
      layer_params, layer_state, layer_rng, layer_sliced = layer
      with stack_lib.at_layer(index):
        out, new_state = inner.apply(layer_params, layer_state, layer_rng,
                                     carry, layer_sliced)
      new_carry, y = stack_lib.split_block_output(out, carry, kind, owner)
      check_carry(carry, new_carry)
      return new_carry, (y, new_state)

    x, (y, new_state) = policy.checkpoint_step(step)(
        x, (params, state, rng, sliced))
    updater.update(new_state)
    return x, y


class BlockSeq(hk.Module):
  """A block repeated ``num_layers`` times in a Python loop.

  The interface of :class:`Stacked`; parameters live under
  ``<name>/layer_<i>/`` instead of on a stacked axis.

  Example::

    seq = st.BlockSeq(lambda: Block(cfg), num_layers=12, remat="full", name="h")
    x = seq.fold(x, mask)

  Args:
    make_block: a callable, called once per layer, that returns the block.
    num_layers: how many blocks (>= 1).
    remat: a checkpoint policy or alias, applied to each block (``nested``
      has nothing to split in a single block and acts like ``full``).
    unroll: accepted for interface parity with Stacked; the loop is unrolled.
    reverse: apply the layers from the last to the first.
    name: the module name.
  """

  def __init__(self, make_block: Callable[[], Callable[..., Any]], num_layers: int,
               *, remat: policy_lib.RematSpec = False, unroll: Union[int, bool] = 1,
               reverse: bool = False, name: Optional[str] = None):
    super().__init__(name=name)
    stack_lib.configure_stack(self, make_block, num_layers, remat, unroll, reverse)

  def fold(self, x: PyTree, *args: Any, **kwargs: Any) -> PyTree:
    """Applies every block to ``x``; see :meth:`Stacked.fold`."""
    x, _ = self._apply(x, args, kwargs, kind="fold")
    return x

  def scan(self, x: PyTree, *args: Any, **kwargs: Any) -> tuple[PyTree, PyTree]:
    """Applies every block to ``x`` and stacks the ys; see :meth:`Stacked.scan`."""
    return self._apply(x, args, kwargs, kind="scan")

  @hk.experimental.name_like("__call__")
  def _apply(self, x, args, kwargs, *, kind):
    if isinstance(x, stack_lib.PerLayer):
      raise TypeError(f"BlockSeq.{kind}: the carry x cannot be per_layer; only "
                      "the arguments after it can be.")
    n = self.num_layers
    arguments = stack_lib.BlockArguments(args, kwargs, n, "BlockSeq")

    def block_call(x, *a, **k):
      return self.make_block()(x, *a, **k)

    inner = stack_lib.make_inner(block_call, arguments)
    # The same draws, in the same order, as Stacked.
    init_key = hk.maybe_next_rng_key()
    init_keys = None
    if init_key is not None and hk.running_init():
      init_keys = jax.random.split(init_key, n)
    apply_keys = stack_lib.layer_keys(n)
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
          init_key=None if init_keys is None else init_keys[i],
          rng=None if apply_keys is None else apply_keys[i],
          kind=kind, policy=step_policy, owner="BlockSeq")
    if kind == "fold":
      return x, None
    return x, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)
