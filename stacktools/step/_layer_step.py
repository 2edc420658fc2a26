"""One layer of a stack: its transform, keys, parameters, slice and step.

Used alike by ``Stacked``, ``BlockSeq`` and the pipeline stages.

Vocabulary, as in the loops:

* the *carry* ``x`` is what flows from layer to layer (the residual stream);
* the *per-layer arguments* are sliced along a leading Layers axis, one slice
  per layer (``st.per_layer``); every other argument is broadcast;
* the *mode* is fold or scan: a fold block returns the new ``x``; a scan
  block returns ``(x, y)`` and the stack returns every layer's ``y`` stacked
  on a Layers axis;
* a *kind* is an entry of a mixed-layer stack's pattern; a stack of one
  block has one kind, ``_pattern.ONE_KIND``.

In pseudo-code, both stacks compute::

  inner = hk.transform_with_state(lambda x, sliced: make_block()(x, *args(sliced)))
  params, state = [inner.init(init_keys[i], x, sliced[i]) for i in layers]
  for i in layers:                     # reversed when reverse=True
    with at_layer(i):
      out, state[i] = inner.apply(params[i], state[i], apply_keys[i], x, sliced[i])
    x, ys[i] = split_block_output(out)

``_stack_module.StackModule`` owns the constructor checks and
``fold``/``scan``; ``Stacked`` runs the layers with one ``jax.vmap`` per kind
and the engine, ``BlockSeq`` walks the same loop plan with a Python loop, and
a pipeline stage runs its share of the layers on the engine: each with
:func:`checked_step` as the body.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional

import haiku as hk
import jax
import numpy as np

from stacktools.core import _checks
from stacktools.core import _jaxpr
from stacktools.step import _arguments
from stacktools.step import _block_output
from stacktools.step import _in_place
from stacktools.step import _pattern

PyTree = Any


# ---------------------------------------------------------------------------
# The inner transform.


def make_inner(block_call: Callable[..., Any], arguments: _arguments.BlockArguments,
               kind: Optional[str] = None) -> hk.TransformedWithState:
  """The inner transform: one layer (of ``kind``), ``(x, sliced) -> block output``."""

  def one_layer(x, sliced):
    args, kwargs = arguments.bind(sliced, kind)
    return block_call(x, *args, **kwargs)

  return hk.transform_with_state(one_layer)


# ---------------------------------------------------------------------------
# What travels through the loop over layers.


class LayerKeys(NamedTuple):
  """One init key and one apply key per layer (``None`` without an rng)."""

  init: Optional[jax.Array]
  apply: Optional[jax.Array]


def draw_layer_keys(num_layers: int) -> LayerKeys:
  """Per-layer keys from the outer transform's rng.

  Two keys are drawn, at init and at apply alike, so the apply keys are the
  same draw in both (as in ``hk.layer_stack``); each is split per layer.
  Stacked and BlockSeq draw them the same way, which is what lets a BlockSeq
  reproduce a Stacked exactly, dropout included.
  """
  init_key = hk.maybe_next_rng_key()
  apply_key = hk.maybe_next_rng_key()
  init_keys = None
  if init_key is not None and hk.running_init():
    init_keys = jax.random.split(init_key, num_layers)
  apply_keys = None if apply_key is None else jax.random.split(apply_key, num_layers)
  return LayerKeys(init_keys, apply_keys)


def init_at(inner: hk.TransformedWithState, index: Any) -> Callable[..., Any]:
  """``inner.init(key, x, sliced)`` with ``layer_index() == index``."""
  def init(key, x, sliced):
    with _arguments.at_layer(jax.numpy.asarray(index, jax.numpy.int32)):
      return inner.init(key, x, sliced)
  return init


def init_layers(inner: hk.TransformedWithState, init_keys: Optional[jax.Array],
                x: PyTree, sliced: PyTree, indices: jax.Array) -> tuple[PyTree, PyTree]:
  """``(params, state)`` of ``len(indices)`` layers, from one ``jax.vmap`` of
  ``inner.init`` (every leaf has a leading axis of ``len(indices)``).

  Layer ``j`` is initialised from ``init_keys[j]`` on ``x`` and its slice of
  ``sliced``, with ``layer_index() == indices[j]``. One vmapped init is one
  random draw per parameter for all layers: a program whose size (and
  compile time) does not grow with the depth.
  """
  def init_one(key, layer_sliced, index):
    return init_at(inner, index)(key, x, layer_sliced)
  return jax.vmap(init_one, in_axes=(None if init_keys is None else 0, 0, 0),
                  axis_size=len(indices))(init_keys, sliced, indices)


def lift_layers(inner: hk.TransformedWithState, init_keys: Optional[jax.Array],
                x: PyTree, sliced: PyTree, indices: jax.Array):
  """The layers' parameters and state (:func:`init_layers`), lifted into the
  current module.

  Returns:
    ``(params, state, updater)``: the lift's updater takes the new state.
  """
  params_and_state, updater = hk.transparent_lift_with_state(
      lambda init_keys, x, sliced: init_layers(inner, init_keys, x, sliced, indices),
      allow_reuse=True)
  params, state = params_and_state(init_keys, x, sliced)
  return params, state, updater


def lift_layer(initial: Optional[tuple[PyTree, PyTree]]):
  """One layer's parameters and state (``BlockSeq``'s), lifted into the
  current module with no Layers axis.

  Args:
    initial: at init, the layer's ``(params, state)``, its row of one
      :func:`init_layers` over the stack (so an unrolled stack's init is as
      small a program as a scanned one's: on a TPU v5e, GPT-2-medium's took
      80 s to compile with an init per layer); at apply, ``None``.

  Returns:
    ``(params, state, updater)``, as :func:`lift_layers`.
  """
  params_and_state, updater = hk.transparent_lift_with_state(lambda: initial,
                                                             allow_reuse=True)
  params, state = params_and_state()
  return params, state, updater


class LayerSlice(NamedTuple):
  """One layer's share of a stack: what each step of the loop reads."""

  params: PyTree
  state: PyTree
  rng: Optional[jax.Array]
  sliced: PyTree       # the per-layer arguments, by BlockArguments key
  index: jax.Array     # int32: what layer_index() returns


def lift_kinds(inners: Mapping[str, hk.TransformedWithState], x: PyTree,
               arguments: _arguments.BlockArguments, pattern: _pattern.Pattern,
               keys: LayerKeys, lift_of: Callable[[str], Callable[..., Any]]
               ) -> tuple[dict[str, LayerSlice], dict[str, Any]]:
  """Every kind's layers lifted (:func:`lift_layers`) and sliced for the loop.

  ``lift_of(kind)`` is the lift to run for ``kind`` (in the scope its
  parameters live in). At apply, the parameters and state given are checked
  to have a row per layer of the kind.

  Returns:
    ``({kind: LayerSlice of all its layers}, {kind: the lift's state updater})``.
  """
  n = pattern.num_layers
  xs, updaters = {}, {}
  for kind in pattern.names:
    ids = pattern.layer_ids(kind)
    if len(ids) == n:   # every layer, in order
      init_keys, apply_keys = keys.init, keys.apply
      indices = jax.numpy.arange(n, dtype=jax.numpy.int32)
    else:
      init_keys = None if keys.init is None else keys.init[ids]
      apply_keys = None if keys.apply is None else keys.apply[ids]
      indices = jax.numpy.asarray(ids, jax.numpy.int32)
    sliced = pattern.kind_inputs(arguments.sliced, arguments.by_kind, kind)
    params, state, updaters[kind] = lift_of(kind)(inners[kind], init_keys, x, sliced, indices)
    if not hk.running_init():   # init made them; apply was given them
      _checks.check_layer_rows(
          params, state, len(ids), stack=hk.experimental.current_name(),
          num_layers=n, kind=None if pattern.is_plain else kind,
          pattern=None if pattern.is_plain else pattern.kinds,
          nested=bool(_arguments.LAYER_INDICES))
    xs[kind] = LayerSlice(params=params, state=state, rng=apply_keys, sliced=sliced,
                          index=indices)
  return xs, updaters


class LayerResult(NamedTuple):
  """What each step of the loop gives back besides the carry."""

  y: PyTree            # the block's per-layer output (None for a fold)
  state: PyTree        # the layer's new Haiku state
  writes: PyTree = None  # {key: writes} to each in-place argument's row


def apply_layer(inner: hk.TransformedWithState, x: PyTree, layer: LayerSlice, *,
                mode: str, arguments: Optional[_arguments.BlockArguments] = None
                ) -> tuple[PyTree, LayerResult]:
  """Applies one layer to the carry: the body of every stack's loop.

  With in-place ``arguments``, the views the block returns become
  :class:`stacktools.step._in_place.Written` markers in ``y`` and their writes
  come back in the result's ``writes``.
  """
  with _arguments.at_layer(layer.index):
    out, new_state = inner.apply(layer.params, layer.state, layer.rng, x,
                                 layer.sliced)
  new_x, y = _block_output.split_block_output(out, x, mode)
  writes = None
  if arguments is not None and arguments.in_place:
    y, writes = _in_place.settle(y, arguments.views, mode)
  return new_x, LayerResult(y, new_state, writes)


def checked_step(inner: hk.TransformedWithState, mode: str,
                 arguments: _arguments.BlockArguments, kind: Optional[str] = None
                 ) -> Callable[[PyTree, LayerSlice], tuple[PyTree, LayerResult]]:
  """The step every stack's loop runs: :func:`apply_layer`, then a check that
  the block (of ``kind``, in a mixed-layer stack) gave back a carry of the
  same structure, shapes and dtypes."""
  # Read here, in the stack's own module scope (the block runs in its own).
  stack = hk.experimental.current_name()

  def step(carry: PyTree, layer: LayerSlice) -> tuple[PyTree, LayerResult]:
    new_carry, result = apply_layer(inner, carry, layer, mode=mode, arguments=arguments)
    _block_output.check_block_carry(carry, new_carry, stack, kind)
    return new_carry, result

  return step


# ---------------------------------------------------------------------------
# Stochastic depth: skipping layers at random.

#: Folded into a layer's apply key to draw whether the layer is dropped, so
#: that the draw is independent of the block's own randomness (the block
#: still gets the layer's key itself).
DROP_SALT = 0x1D


def drop_rates(rates: Optional[np.ndarray], keys: LayerKeys) -> Optional[np.ndarray]:
  """The drop rates a stack applies in this call: none at init (whose outputs
  Haiku discards); at apply they need an rng."""
  if rates is None or hk.running_init():
    return None
  if keys.apply is None:
    raise ValueError(
        f"{_checks.where()}layer_drop= skips layers at random, which needs an rng, "
        "but apply was called without one. Pass a key to apply when training "
        "(transformed.apply(params, key, ...)); to evaluate, build the stack "
        "with layer_drop=None, which runs every layer.")
  return rates


def droppable(step: Callable[..., Any], rates: Optional[np.ndarray]) -> Callable[..., Any]:
  """``step``, made to skip layer ``i`` with probability ``rates[i]``.

  Layer ``i`` is dropped when ``jax.random.bernoulli(jax.random.fold_in(
  apply_key[i], DROP_SALT), rates[i])``. A dropped layer costs no matmuls (a
  ``lax.cond``): the carry passes unchanged, the Haiku state stays, and a scan
  block's ``y`` is zeros. A kept layer's update is scaled by ``1 / (1 -
  rate)`` (the carry becomes ``x + (f(x) - x) / (1 - rate)``), so that its
  expectation is the full update and evaluation needs no rescaling.
  """
  if rates is None:
    return step
  table = np.asarray(rates, np.float32)

  def step_or_skip(x, layer: LayerSlice):
    rate = jax.numpy.asarray(table)[layer.index]
    dropped = jax.random.bernoulli(jax.random.fold_in(layer.rng, DROP_SALT), rate)

    def keep(x, layer):
      new_x, result = step(x, layer)
      return jax.tree_util.tree_map(lambda a, b: _kept(a, b, rate), x, new_x), result

    kept_shapes = jax.eval_shape(keep, x, layer)[1]
    if kept_shapes.writes is not None:
      # A dropped layer would have to write its rows unchanged; not built yet.
      raise ValueError(
          f"{_checks.where()}layer_drop= cannot be combined with in_place=True "
          "arguments yet: pass the cache as st.per_layer(cache) (xs/ys) with "
          "layer_drop=, or drop layer_drop= when decoding.")
    y_shapes = kept_shapes.y
    for path, leaf in jax.tree_util.tree_flatten_with_path(y_shapes)[0]:
      if not (jax.numpy.issubdtype(leaf.dtype, jax.numpy.number)
              or jax.numpy.issubdtype(leaf.dtype, jax.numpy.bool_)):
        raise TypeError(
            f"{_checks.where()}layer_drop= gives a dropped layer's scan output zeros, "
            f"but {_checks.path_str('y', path)} is {leaf.dtype}, which has none. "
            "Return numbers from the block (or fold it), or drop layer_drop=.")

    def skip(x, layer):
      y = jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, s.dtype), y_shapes)
      return x, LayerResult(y, layer.state)

    return jax.lax.cond(dropped, skip, keep, x, layer)

  return step_or_skip


def _kept(x: jax.Array, new_x: jax.Array, rate: jax.Array) -> jax.Array:
  """A kept layer's carry: its update scaled by ``1 / (1 - rate)``."""
  if not jax.numpy.issubdtype(jax.numpy.result_type(new_x), jax.numpy.inexact):
    return new_x
  scaled = x + (new_x - x) / (1 - rate)
  return jax.numpy.where(rate > 0, scaled, new_x).astype(new_x.dtype)


# ---------------------------------------------------------------------------
# The module both stacks are.


def kind_tags(pattern: _pattern.Pattern, inners: Mapping[str, hk.TransformedWithState],
              x: PyTree, arguments: _arguments.BlockArguments) -> dict[str, set[str]]:
  """The names each kind's block tags with ``checkpoint_name``.

  Traced from the block's init at the kind's first layer (never run), so it
  needs no parameters: ``BlockSeq`` asks before any exist.
  """
  tags = {}
  for kind in pattern.names:
    first = int(pattern.layer_ids(kind)[0])
    tags[kind] = _jaxpr.names_tagged_in(
        functools.partial(init_at(inners[kind], first), jax.random.PRNGKey(0)), x,
        pattern.layer_inputs(arguments.sliced, arguments.by_kind, first))
  return tags


def names_tagged_in_steps(steps: Mapping[str, Callable[..., Any]],
                          inners: Mapping[str, hk.TransformedWithState], x: PyTree,
                          arguments: _arguments.BlockArguments, pattern: _pattern.Pattern,
                          keys: LayerKeys) -> set[str]:
  """The names ``BlockSeq``'s steps tag, each kind's traced at its first layer.

  What ``Stacked``'s loop gives the remat planner (``_segments.plan_for``'s
  probe), for unrolled layers: each trace is recorded for the planner to
  cost the candidates from. The parameters and state are their shapes, from
  ``inner.init`` traced (never run), so it needs no parameters of its own.
  """
  names: set[str] = set()
  for kind in pattern.names:
    first = int(pattern.layer_ids(kind)[0])
    sliced = pattern.layer_inputs(arguments.sliced, arguments.by_kind, first)
    params, state = jax.eval_shape(init_at(inners[kind], first), jax.random.PRNGKey(0),
                                   x, sliced)
    layer = LayerSlice(params=params, state=state,
                       rng=None if keys.apply is None else keys.apply[first],
                       sliced=sliced, index=jax.numpy.asarray(first, jax.numpy.int32))
    names |= _jaxpr.names_tagged_in(steps[kind], x, layer)
  return names
