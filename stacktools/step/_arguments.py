"""What a stack's call gives its layers: markers, their binding, in-place rows.

The arguments after the carry ``x`` are *broadcast* (every layer gets them
whole), *per layer* (:func:`per_layer`: sliced along a leading Layers axis)
or *per kind* (:func:`per_kind`: one tree per kind of a mixed-layer stack,
sliced along that kind's count). Marked ``in_place=True``, either kind of
per-layer argument is never sliced: each layer gets a view of its row
(:class:`stacktools.step._in_place.LayerView`), and :meth:`BlockArguments.with_writes`
puts every layer's writes into the whole array after the loop. So in-place
writes pass through this module, ``_layer_step.py`` (a step's writes) and
``_in_place.py`` (the view and the write-back), nothing else.

:func:`layer_index` is the index of the layer being applied, set by the
layer step (:func:`at_layer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from stacktools.core import _checks
from stacktools.core import _context
from stacktools.step import _in_place
from stacktools.step import _pattern

PyTree = Any


# ---------------------------------------------------------------------------
# Per-layer and per-kind arguments, and the layer index.


@dataclasses.dataclass(frozen=True)
class Marked:
  """An argument marked to be given a slice per layer, not whole."""

  value: PyTree
  in_place: bool = False

  @classmethod
  def mark(cls, tree: PyTree, in_place: bool, who: str) -> "Marked":
    """``tree`` marked as ``cls`` (a marked one kept, ``in_place`` added)."""
    _checks.check_in_place(in_place, who)
    if isinstance(tree, cls):
      return tree if not in_place else cls(tree.value, True)
    return cls(tree, in_place)


class PerLayer(Marked):
  """An argument to slice along its leading (Layers) axis; see :func:`per_layer`."""


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
  return PerLayer.mark(tree, in_place, "st.per_layer")


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


class PerKind(Marked):
  """Arguments given per kind (``value``: ``{kind: tree}``); see :func:`per_kind`."""


def per_kind(trees: Mapping[str, PyTree], *, in_place: bool = False) -> PerKind:
  """Marks an argument of a mixed-layer stack's ``fold``/``scan`` as per kind.

  ``trees[kind]`` has a leading axis of that kind's layer count, in layer
  order; each layer of the kind receives its own slice. Use it for inputs
  whose shapes differ by kind (a local layer's KV cache is its window long, a
  global layer's the whole sequence); inputs that every kind takes with the
  same shapes can go in :func:`per_layer` (leading axis ``num_layers``).

  Example::

    class Block(hk.Module):
      def __call__(self, x, cache):      # cache: [B, S, D], S by kind
        return x + hk.Linear(x.shape[-1])(cache.mean(axis=1)), cache

    blocks = st.Stacked({"local": Block, "global": Block}, num_layers=26,
                        pattern=("local",) * 5 + ("global",), name="h")
    caches = {"local": jnp.ones((22, 2, 4, 8)),    # leading axis 22 (local layers)
              "global": jnp.ones((4, 2, 16, 8))}   # leading axis 4
    x, new_caches = blocks.scan(jnp.ones((2, 8)), st.per_kind(caches))

  ``in_place=True`` gives each layer a view of its row to read and write, as
  :func:`per_layer` does; a block that returns the view gets its kind's
  whole tree back, updated in place (with ``ys_by_kind=True``,
  ``{kind: tree}`` as it was given)::

    x, caches = blocks.scan(x, st.per_kind(caches, in_place=True), pos)

  Args:
    trees: a mapping from each kind to a pytree of arrays.
    in_place: give each layer a view of its row (see :func:`per_layer`).

  Returns:
    A marker that the stack unwraps.
  """
  return PerKind.mark(trees, in_place, "st.per_kind")



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
               num_layers: int, pattern: Optional[_pattern.Pattern] = None):
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
      elif isinstance(arg, PerKind):
        if pattern is None:
          raise TypeError(
              f"{_checks.where()}st.per_kind marks {label} per kind of a pattern, but "
              "this stack has no pattern=; use st.per_layer for a per-layer "
              "input of a stack of one block.")
        _pattern.check_per_kind(arg.value, pattern.counts,
                              f"{_checks.where()}per_kind {label}")
        if arg.in_place:
          self.in_place[key] = InPlaceArgument(
              arg.value, f"{_checks.where()}per_kind(in_place=True) {label}", True)
        else:
          self.by_kind[key] = arg.value

  @property
  def broadcast(self) -> dict[str, PyTree]:
    """The arguments every layer gets whole, by key (``arg0``, ``kw_mask``)."""
    out = {f"arg{i}": a for i, a in enumerate(self._args) if not isinstance(a, Marked)}
    out.update({f"kw_{k}": a for k, a in self._kwargs.items()
                if not isinstance(a, Marked)})
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
    args = tuple(layer[f"arg{i}"] if isinstance(a, Marked) else a
                 for i, a in enumerate(self._args))
    kwargs = {k: layer[f"kw_{k}"] if isinstance(a, Marked) else a
              for k, a in self._kwargs.items()}
    return args, kwargs

  def written(self, writes: Mapping[str, Mapping[str, Sequence[Any]]],
              pattern: _pattern.Pattern) -> dict[str, PyTree]:
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


  def with_writes(self, ys: PyTree, writes: Mapping[str, Mapping[str, Sequence[Any]]],
                  pattern: _pattern.Pattern) -> PyTree:
    """``ys`` with each in-place argument's place in it (where the block
    returned its view) filled by the whole array, every layer's writes applied
    (see :meth:`written`); ``ys`` as they are without in-place arguments."""
    if not self.in_place:
      return ys
    return _in_place.fill(ys, self.written(writes, pattern))


class InPlaceArgument(NamedTuple):
  """An argument marked ``in_place=True``: its whole tree, and how to name it."""

  value: PyTree        # [num_layers, ...], or {kind: [count, ...]} per kind
  label: str
  per_kind: bool


