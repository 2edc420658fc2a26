"""The Haiku plumbing that Stacked and BlockSeq share.

Vocabulary, as in the loops:

* the *carry* ``x`` is what flows from layer to layer (the residual stream);
* the *per-layer arguments* are sliced along a leading Layers axis, one slice
  per layer (:func:`per_layer`); every other argument is broadcast;
* the *mode* is fold or scan: a fold block returns the new ``x``; a scan
  block returns ``(x, y)`` and the stack returns every layer's ``y`` stacked
  on a Layers axis;
* a *kind* is an entry of a mixed-layer stack's pattern; a stack of one
  block has one kind, :data:`BLOCK`.

In pseudo-code, both stacks compute::

  inner = hk.transform_with_state(lambda x, sliced: make_block()(x, *args(sliced)))
  params, state = [inner.init(init_keys[i], x, sliced[i]) for i in layers]
  for i in layers:                     # reversed when reverse=True
    with at_layer(i):
      out, state[i] = inner.apply(params[i], state[i], apply_keys[i], x, sliced[i])
    x, ys[i] = split_block_output(out)

:class:`StackModule` owns the constructor checks and ``fold``/``scan``; a
subclass overrides :meth:`StackModule.run_layers` with how the layers run
(one ``jax.vmap`` per kind and the engine in ``Stacked``, the same loop plan
walked by a Python loop in ``BlockSeq``). Errors name the public entry point
that was called (``Stacked: ...``) through :func:`stacktools._checks.subject`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Optional

import haiku as hk
import jax
import numpy as np

from stacktools import _checks
from stacktools import _context
from stacktools import _in_place
from stacktools import _kinds
from stacktools import policy as policy_lib
from stacktools import segments as segments_lib

PyTree = Any


# ---------------------------------------------------------------------------
# Per-layer arguments and the layer index.


@dataclasses.dataclass(frozen=True)
class PerLayer:
  """An argument to slice along its leading (Layers) axis; see :func:`per_layer`."""

  value: PyTree
  in_place: bool = False


def per_layer(tree: PyTree, *, in_place: bool = False) -> PerLayer:
  """Marks an argument of ``Stacked.fold``/``scan`` to be sliced per layer.

  Every leaf of ``tree`` must have a leading axis of ``num_layers``; layer
  ``i`` receives ``tree`` with every leaf indexed at ``i``. Arguments that are
  not marked are given whole to every layer.

  With ``in_place=True`` layer ``i`` receives a view of its row instead
  (``view.read()``, ``view = view.write(update, at=...)``); a scan block
  returns the view among its outputs, and the stack returns the whole array
  there with every layer's writes applied in place: no slice is copied out
  and no new ``[num_layers, ...]`` array is stacked, so a KV cache given to a
  ``jax.jit`` with ``donate_argnums`` is updated where it lies. Use it when
  a layer changes a few positions of its row (a decode step); use the plain
  form when a layer replaces its row, or when the old array must survive.

  Example::

    class Gated(hk.Module):          # layer i is given gates[i]
      def __call__(self, x, gate):
        return x + gate * hk.Linear(x.shape[-1])(x)

    gates = jnp.linspace(0.0, 1.0, 4)[:, None]         # [num_layers, 1]
    x = st.Stacked(Gated, num_layers=4, name="g").fold(
        jnp.ones((2, 16)), st.per_layer(gates))

    class Block(hk.Module):          # the in-place form
      def __call__(self, x, cache, pos):               # x: [B, D]
        cache = cache.write({"k": hk.Linear(x.shape[-1])(x)[:, None]},
                            at=(0, pos))               # row: [B, T, D]
        keys = cache.read()["k"]
        return x + jnp.einsum("bd,btd->bd", x, keys), cache

    kv_cache = {"k": jnp.zeros((4, 2, 8, 16))}         # [num_layers, B, T, D]
    blocks = st.Stacked(Block, num_layers=4, name="h")
    x, kv_cache = blocks.scan(x, st.per_layer(kv_cache, in_place=True), 3)

  Args:
    tree: a pytree of arrays with a leading ``num_layers`` axis.
    in_place: give each layer a view of its row that it reads and writes
      (see above), rather than a slice.

  Returns:
    A marker that the stack unwraps.
  """
  _checks.check_in_place(in_place, "st.per_layer")
  if isinstance(tree, PerLayer):
    return tree if not in_place else PerLayer(tree.value, True)
  return PerLayer(tree, in_place)


#: The index of the layer being applied, per stack being run (innermost last).
LAYER_INDICES = _context.ContextStack[jax.Array]()


def at_layer(index: jax.Array) -> contextlib.AbstractContextManager[jax.Array]:
  """Makes ``index`` what :func:`layer_index` returns inside the block."""
  return LAYER_INDICES.push(index)


def layer_index() -> jax.Array:
  """The int32 index of the layer being applied, inside a stacked block.

  Works inside a block of :class:`Stacked`, :class:`BlockSeq` or
  :func:`layer_stack`, at init and at apply; in nested stacks it is the index
  in the innermost stack.

  Example::

    class Block(hk.Module):
      def __call__(self, x):
        scale = 1.0 / jnp.sqrt(2.0 * (st.layer_index() + 1))
        return x + scale * hk.Linear(x.shape[-1])(x)

    x = st.Stacked(Block, num_layers=6, name="h").fold(jnp.ones((2, 8)))

  Returns:
    A scalar int32 array (a tracer inside the loop).

  Raises:
    RuntimeError: when called outside a stacked block.
  """
  if not LAYER_INDICES:
    raise RuntimeError(
        "st.layer_index() was called outside a stacked block. Call it inside "
        "the block function of st.Stacked, st.BlockSeq or st.layer_stack.")
  return LAYER_INDICES.innermost()


# ---------------------------------------------------------------------------
# One call of a stack: which arguments are broadcast, which sliced.


class BlockArguments:
  """Splits a call's arguments into broadcast, per-layer and per-kind ones.

  ``sliced`` holds the per-layer ones (layer order); ``by_kind`` the
  :func:`per_kind` ones of a mixed-layer stack (``{kind: tree}``);
  ``in_place`` those marked ``in_place=True`` (either), which are never
  sliced: :meth:`bind` gives each layer a :class:`LayerView` of its row.
  """

  def __init__(self, args: Sequence[Any], kwargs: Mapping[str, Any],
               num_layers: int, pattern: Optional[_kinds.Pattern] = None):
    self._args = tuple(args)
    self._kwargs = dict(kwargs)
    self._pattern = pattern
    self.sliced: dict[str, PyTree] = {}
    self.by_kind: dict[str, Mapping[str, PyTree]] = {}
    self.in_place: dict[str, InPlaceArgument] = {}
    # The views the last bind gave a layer: {key: (view, kind or None)}.
    self.views: dict[str, tuple[_in_place.LayerView, Optional[str]]] = {}
    marked = [(f"arg{i}", a) for i, a in enumerate(self._args)]
    marked += [(f"kw_{k}", a) for k, a in self._kwargs.items()]
    for key, arg in marked:
      label = (f"positional argument {key[3:]}" if key.startswith("arg")
               else f"keyword argument {key[3:]!r}")
      if isinstance(arg, PerLayer):
        _checks.check_leading_axis(arg.value, num_layers,
                                   f"{_checks.where()}per_layer {label}")
        if arg.in_place:
          self.in_place[key] = InPlaceArgument(
              arg.value, f"{_checks.where()}per_layer(in_place=True) {label}", False)
        else:
          self.sliced[key] = arg.value
      elif isinstance(arg, _kinds.PerKind):
        if pattern is None:
          raise TypeError(
              f"{_checks.where()}st.per_kind marks {label} per kind of a pattern, but "
              "this stack has no pattern=; use st.per_layer for a per-layer "
              "input of a stack of one block.")
        _kinds.check_per_kind(arg.value, pattern.counts,
                              f"{_checks.where()}per_kind {label}")
        if arg.in_place:
          self.in_place[key] = InPlaceArgument(
              arg.value, f"{_checks.where()}per_kind(in_place=True) {label}", True)
        else:
          self.by_kind[key] = arg.value

  @property
  def broadcast(self) -> dict[str, PyTree]:
    """The arguments every layer gets whole, by key (``arg0``, ``kw_mask``)."""
    marker = (PerLayer, _kinds.PerKind)
    out = {f"arg{i}": a for i, a in enumerate(self._args) if not isinstance(a, marker)}
    out.update({f"kw_{k}": a for k, a in self._kwargs.items()
                if not isinstance(a, marker)})
    return out

  @contextlib.contextmanager
  def broadcast_as(self, values: Mapping[str, PyTree]) -> Iterator[None]:
    """Layers bound inside see ``values`` (keys of :attr:`broadcast`) instead.

    A 1F1B pipeline differentiates its stages itself: the broadcast
    arguments must be inputs of the function it differentiates, not values
    its layers close over.
    """
    saved = self._args, self._kwargs
    self._args = tuple(values.get(f"arg{i}", a) for i, a in enumerate(self._args))
    self._kwargs = {k: values.get(f"kw_{k}", a) for k, a in self._kwargs.items()}
    try:
      yield
    finally:
      self._args, self._kwargs = saved

  def bind(self, sliced: Mapping[str, PyTree],
           kind: Optional[str] = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with per-layer ones replaced by one layer's slice.

    In-place ones become a view of the row of the layer being applied
    (:func:`layer_index`; for a per-kind one, the layer's rank in ``kind``).
    """
    layer = dict(sliced)
    self.views = {}
    for key, arg in self.in_place.items():
      if arg.per_kind:
        whole, row = arg.value[kind], self._pattern.rank_at(layer_index())
      else:
        whole, row = arg.value, layer_index()
      view = _in_place.LayerView(whole, row, _in_place.Lineage(arg.label))
      self.views[key] = (view, kind if arg.per_kind else None)
      layer[key] = view
    marker = (PerLayer, _kinds.PerKind)
    args = tuple(layer[f"arg{i}"] if isinstance(a, marker) else a
                 for i, a in enumerate(self._args))
    kwargs = {k: layer[f"kw_{k}"] if isinstance(a, marker) else a
              for k, a in self._kwargs.items()}
    return args, kwargs

  def written(self, writes: Mapping[str, Mapping[str, Sequence[Any]]],
              pattern: _kinds.Pattern) -> dict[str, PyTree]:
    """Every in-place argument with the layers' writes applied.

    Args:
      writes: each kind's writes by argument key, in kind order (a leading
        axis of the kind's count).
      pattern: the layout.

    Returns:
      ``{key: tree}`` (a per-kind argument's tree is ``{kind: tree}``).
    """
    out = {}
    for key, arg in self.in_place.items():
      if arg.per_kind:   # a kind's rows are its ranks
        out[key] = {kind: _in_place.write_rows(tree, np.arange(pattern.counts[kind]),
                                               writes[kind][key])
                    if kind in writes else tree for kind, tree in arg.value.items()}
      else:              # a kind's rows are its layers
        whole = arg.value
        for kind in pattern.names:
          whole = _in_place.write_rows(whole, pattern.layer_ids(kind), writes[kind][key])
        out[key] = whole
    return out


class InPlaceArgument(NamedTuple):
  """An argument marked ``in_place=True``: its whole tree, and how to name it."""

  value: PyTree        # [num_layers, ...], or {kind: [count, ...]} per kind
  label: str
  per_kind: bool


def make_inner(block_call: Callable[..., Any], arguments: BlockArguments,
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


def lift_layers(inner: hk.TransformedWithState, init_keys: Optional[jax.Array],
                x: PyTree, sliced: PyTree, indices: jax.Array):
  """The layers' parameters and state, from one ``jax.vmap`` of ``inner.init``.

  Lifted into the current module (every leaf gains a leading axis of
  ``len(indices)``); layer ``j`` is initialised from ``init_keys[j]`` on
  ``x`` and its slice of ``sliced``, with ``layer_index() == indices[j]``.

  Returns:
    ``(params, state, updater)``: the lift's updater takes the new state.
  """

  def init_all_layers(init_keys, x, sliced):
    def init_one(key, layer_sliced, index):
      with at_layer(index):
        return inner.init(key, x, layer_sliced)
    return jax.vmap(init_one, in_axes=(None if init_keys is None else 0, 0, 0),
                    axis_size=len(indices))(init_keys, sliced, indices)

  params_and_state, updater = hk.transparent_lift_with_state(
      init_all_layers, allow_reuse=True)
  params, state = params_and_state(init_keys, x, sliced)
  return params, state, updater


class LayerSlice(NamedTuple):
  """One layer's share of a stack: what each step of the loop reads."""

  params: PyTree
  state: PyTree
  rng: Optional[jax.Array]
  sliced: PyTree       # the per-layer arguments, by BlockArguments key
  index: jax.Array     # int32: what layer_index() returns


class LayerResult(NamedTuple):
  """What each step of the loop gives back besides the carry."""

  y: PyTree            # the block's per-layer output (None for a fold)
  state: PyTree        # the layer's new Haiku state
  writes: PyTree = None  # {key: writes} to each in-place argument's row


def apply_layer(inner: hk.TransformedWithState, x: PyTree, layer: LayerSlice, *,
                mode: str, arguments: Optional[BlockArguments] = None
                ) -> tuple[PyTree, LayerResult]:
  """Applies one layer to the carry: the body of every stack's loop.

  With in-place ``arguments``, the views the block returns become
  :class:`stacktools._in_place.Written` markers in ``y`` and their writes
  come back in the result's ``writes``.
  """
  with at_layer(layer.index):
    out, new_state = inner.apply(layer.params, layer.state, layer.rng, x,
                                 layer.sliced)
  new_x, y = _checks.split_block_output(out, x, mode)
  writes = None
  if arguments is not None and arguments.in_place:
    y, writes = _in_place.settle(y, arguments.views, mode)
  return new_x, LayerResult(y, new_state, writes)


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


def kind_tags(pattern: _kinds.Pattern, inners: Mapping[str, hk.TransformedWithState],
              x: PyTree, arguments: BlockArguments) -> dict[str, set[str]]:
  """The names each kind's block tags with ``checkpoint_name``.

  Traced from the block's init at the kind's first layer (never run), so it
  needs no parameters: ``BlockSeq`` asks before any exist.
  """
  tags = {}
  for kind in pattern.names:
    first = int(pattern.layer_ids(kind)[0])

    def init(x, sliced, inner=inners[kind], first=first):
      with at_layer(jax.numpy.asarray(first, jax.numpy.int32)):
        return inner.init(jax.random.PRNGKey(0), x, sliced)

    tags[kind] = _checks.names_tagged_in(
        init, x, pattern.layer_inputs(arguments.sliced, arguments.by_kind, first))
  return tags


# ---------------------------------------------------------------------------
# The module both stacks are.

#: The kind of every layer of a stack of one block: its pattern is this one
#: kind, period 1.
BLOCK = "block"


class StackModule(hk.Module):
  """A block repeated ``num_layers`` times; subclasses say how the layers run.

  Owns the constructor's checks and the public ``fold``/``scan``; a subclass
  implements :meth:`run_layers`.
  """

  def __init__(self, make_block: Any, num_layers: int,
               *, remat: policy_lib.RematSpec = False, reverse: bool = False,
               pattern: Optional[Sequence[str]] = None,
               ys_by_kind: Optional[bool] = None, layer_drop: Any = None,
               name: Optional[str] = None):
    super().__init__(name=name)
    with _checks.subject(type(self).__name__):
      self.num_layers = _checks.check_num_layers(num_layers)
      # None when no layer is ever dropped (rate 0 everywhere included).
      self.layer_drop = _checks.check_layer_drop(layer_drop, self.num_layers)
      # None for a stack of one block; a mixed-layer stack's kinds otherwise.
      self.pattern = _kinds.Pattern.build(make_block, pattern, self.num_layers,
                                          ys_by_kind)
      # "auto" is keyed by this module's unique name, so that a plan tells
      # several stacks apart.
      self.remat = segments_lib.as_remat(remat, key=self.module_name)
    self.make_block = make_block
    self.reverse = reverse

  def fold(self, x: PyTree, *args: Any, **kwargs: Any) -> PyTree:
    """Applies every layer to the carry ``x``; the block returns the new ``x``.

    Args:
      x: the carry (the residual stream), any pytree of arrays.
      *args: further block arguments; broadcast to every layer unless wrapped
        in :func:`per_layer`.
      **kwargs: likewise.

    Returns:
      ``x`` after the last layer.
    """
    x, _ = self._apply(x, args, kwargs, mode="fold")
    return x

  def scan(self, x: PyTree, *args: Any, **kwargs: Any) -> tuple[PyTree, PyTree]:
    """Like :meth:`fold` for a block that returns ``(x, y)``.

    Args:
      x: the carry.
      *args: as in :meth:`fold`.
      **kwargs: as in :meth:`fold`.

    Returns:
      ``(x, ys)``: ``x`` after the last layer and every layer's ``y`` stacked
      on a leading ``num_layers`` axis.
    """
    return self._apply(x, args, kwargs, mode="scan")

  def run_layers(self, inners: Mapping[str, hk.TransformedWithState], x: PyTree,
                 arguments: BlockArguments, pattern: _kinds.Pattern,
                 mode: str) -> tuple[PyTree, PyTree]:
    """Inits and applies every layer; returns ``(x, ys)`` (``ys`` None for a fold).

    ``inners`` holds one transform per kind of ``pattern``; a stack of one
    block has the pattern of one kind, :data:`BLOCK`, period 1.

    Haiku scopes the modules a method creates under ``~<method>``, so an
    override is decorated with ``@StackModule.layer_scope`` to keep the
    block's parameters directly under the stack's name.
    """
    raise NotImplementedError

  #: Decorates :meth:`run_layers`: names it like ``__call__`` for Haiku.
  layer_scope = staticmethod(hk.experimental.name_like("__call__"))

  # Named like __call__ so that fold and scan create the same parameter names
  # (Haiku would otherwise scope modules made inside fold under "~fold").
  @hk.experimental.name_like("__call__")
  def _apply(self, x, args, kwargs, *, mode, ends=None):
    owner = type(self).__name__
    with _checks.subject(owner):
      if isinstance(x, (PerLayer, _kinds.PerKind)):
        raise TypeError(f"{owner}.{mode}: the carry x cannot be per_layer; only "
                        "the arguments after it can be.")
      arguments = BlockArguments(args, kwargs, self.num_layers, self.pattern)
      if self.pattern is not None:   # one inner transform per kind
        inners = {name: make_inner(self.pattern.block_call(name, mode), arguments, name)
                  for name in self.pattern.names}
        return self.run_layers(inners, x, arguments, self.pattern, mode,
                               **({} if ends is None else {"ends": ends}))

      def block_call(x, *a, **k):
        return self.make_block()(x, *a, **k)

      return self.run_layers({BLOCK: make_inner(block_call, arguments)}, x, arguments,
                             _kinds.Pattern.uniform(self.num_layers, BLOCK), mode,
                             **({} if ends is None else {"ends": ends}))
