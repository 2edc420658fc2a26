"""Haiku: BlockSeq, the unrolled twin of Stacked.

Same constructor, same ``fold``/``scan`` and the same checkpoint policy
(applied to each block), but a Python loop with per-layer parameter names
(``h/layer_0/block/linear``, ``h/layer_1/...``). Use it to debug a block, or
to compare compile time and memory against :class:`Stacked`;
:func:`unstack_params` and :func:`stack_params` convert parameters between
the two layouts.

Layer ``i`` is initialised as Stacked initialises it (one vmapped init over
the layers, from the same per-layer keys, on the stack's input) and applied
with the same per-layer rng, so a BlockSeq's parameters are Stacked's,
unstacked, and given them it reproduces Stacked exactly, dropout included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import haiku as hk
import jax
import jax.numpy as jnp

from stacktools.remat import _policy
from stacktools.remat import _segments
from stacktools.stacks import _stack_module
from stacktools.step import _arguments
from stacktools.step import _layer_step
from stacktools.step import _pattern

PyTree = Any


class _Layer(hk.Module):
  """The scope of one layer's parameters: ``<seq name>/layer_<i>``."""

  def __call__(self, x, sliced, *, initial, index, rng, step, policy):
    params, state, updater = _layer_step.lift_layer(initial)
    layer = _layer_step.LayerSlice(params=params, state=state, rng=rng,
                                   sliced=sliced, index=index)
    x, result = policy.checkpoint_step(step, looped=False)(x, layer)
    updater.update(result.state)
    return x, result.y, result.writes


class BlockSeq(_stack_module.StackModule):
  """A block repeated ``num_layers`` times in a Python loop.

  The interface of :class:`Stacked`; parameters live under
  ``<name>/layer_<i>/`` instead of on a stacked axis. The loop is unrolled
  by construction, so there is no ``unroll=``.

  Example::

    class Block(hk.Module):
      def __call__(self, x, mask):
        return x + mask * jnp.tanh(hk.Linear(x.shape[-1])(x))

    seq = st.BlockSeq(Block, num_layers=12, remat="full", name="h")
    x = seq.fold(jnp.ones((2, 8)), jnp.ones((2, 8)))   # params: h/layer_<i>/...

  With ``pattern=`` it is the twin of a mixed-layer :class:`Stacked`: layer
  ``i`` is of kind ``pattern[i % len(pattern)]`` and lives under
  ``h/layer_<i>/``, the layout :func:`unstack_params` gives with the same
  pattern::

    seq = st.BlockSeq({"local": make_local, "global": make_global},
                      num_layers=26, pattern=("local",) * 5 + ("global",),
                      name="h")

  Args:
    make_block: a callable, called once per layer, that returns the block;
      or, with ``pattern``, a mapping from each kind's name to one.
    num_layers: how many blocks (>= 1).
    remat: a checkpoint policy or alias, applied to each block (``nested``
      has nothing to split in a single block and acts like ``full``), or
      :func:`per_depth` segments, or ``"auto"``.
    reverse: apply the layers from the last to the first.
    pattern: the kinds of one period, as in :class:`Stacked`.
    ys_by_kind: as in :class:`Stacked`.
    layer_drop: stochastic depth, as in :class:`Stacked`: the same layers
      are dropped, drawn from the same per-layer keys.
    name: the module name.
  """

  def __init__(self, make_block: Any, num_layers: int,
               *, remat: _policy.RematSpec = False, reverse: bool = False,
               pattern: Optional[Sequence[str]] = None,
               ys_by_kind: Optional[bool] = None,
               layer_drop: Union[None, float, Sequence[float]] = None,
               name: Optional[str] = None):
    super().__init__(make_block, num_layers, remat=remat, reverse=reverse,
                     pattern=pattern, ys_by_kind=ys_by_kind,
                     layer_drop=layer_drop, name=name)

  @_stack_module.StackModule.layer_scope
  def run_layers(self, inners: Mapping[str, hk.TransformedWithState], x: PyTree,
                 arguments: _arguments.BlockArguments, pattern: _pattern.Pattern,
                 mode: str) -> tuple[PyTree, PyTree]:
    n = self.num_layers
    # The same draws, in the same order, as Stacked.
    keys = _layer_step.draw_layer_keys(n)
    rates = _layer_step.drop_rates(self.layer_drop, keys)
    steps = {kind: _layer_step.droppable(
        _layer_step.checked_step(inners[kind], mode, arguments,
                                 None if pattern.is_plain else kind), rates)
             for kind in pattern.names}
    # The loop plan Stacked would run, walked one layer at a time.
    plan = _segments.plan_loop(
        self.remat, n, kinds=pattern.names, period=pattern.period,
        reverse=self.reverse, init=hk.running_init(),
        probe=lambda: _layer_step.names_tagged_in_steps(
            steps, inners, x, arguments, pattern, keys),
        tags=lambda: _layer_step.kind_tags(pattern, inners, x, arguments), looped=False)
    initial = _initial_layers(inners, x, arguments, pattern, keys) if hk.running_init() else None
    ys, writes = [None] * n, [None] * n
    for segment in plan.in_order():
      layers = range(segment.start, segment.start + segment.length)
      for i in (reversed(layers) if self.reverse else layers):
        kind = pattern.kind_of(i)
        x, ys[i], writes[i] = _Layer(name=f"layer_{i}")(
            x, pattern.layer_inputs(arguments.sliced, arguments.by_kind, i),
            initial=None if initial is None else jax.tree_util.tree_map(
                lambda a, rank=pattern.rank(i): a[rank], initial[kind]),
            index=jnp.asarray(i, jnp.int32),
            rng=None if keys.apply is None else keys.apply[i], step=steps[kind],
            policy=segment.steps[kind].outside_loop())
    if mode == "fold":
      return x, None
    ys = pattern.collect(ys)
    if arguments.in_place:
      # Every layer read its row of the array it was given; the writes go in
      # after the last layer, as in Stacked. (Written after each layer, into
      # the array the next layer reads, XLA copied the whole array per layer:
      # a layer's new keys need not wait for its read of the old ones.)
      ys = arguments.with_writes(ys, {
          kind: jax.tree_util.tree_map(lambda *w: jnp.stack(w),
                                       *[writes[i] for i in pattern.layer_ids(kind)])
          for kind in pattern.names}, pattern)
    return x, ys


def _initial_layers(inners: Mapping[str, hk.TransformedWithState], x: PyTree,
                    arguments: _arguments.BlockArguments, pattern: _pattern.Pattern,
                    keys: _layer_step.LayerKeys) -> dict[str, tuple[PyTree, PyTree]]:
  """``{kind: (params, state)}`` of each kind's layers, stacked in kind order,
  from one vmapped init per kind, exactly as :class:`Stacked` initialises
  them (the same keys, each layer on the stack's input ``x``)."""
  initial = {}
  for kind in pattern.names:
    ids = pattern.layer_ids(kind)
    initial[kind] = _layer_step.init_layers(
        inners[kind], None if keys.init is None else keys.init[ids], x,
        pattern.kind_inputs(arguments.sliced, arguments.by_kind, kind),
        jnp.asarray(ids, jnp.int32))
  # Drawn whole, then sliced: without the barrier XLA fuses each layer's
  # slice into the draw and may round a value differently from Stacked's.
  return jax.lax.optimization_barrier(initial)
