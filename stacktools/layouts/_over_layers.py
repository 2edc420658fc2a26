"""Optax on stacked parameters: one optimizer per layer, and rules by depth.

A stacked parameter is ``[num_layers, ...]``. An elementwise optimizer (Adam,
SGD) treats it correctly, but one that reads a parameter's *shape* does not:
Muon orthogonalizes the matrix it is given, Adafactor factors the second
moment over the two largest axes, and a stacked ``[L, in, out]`` weight is
neither one matrix nor ``L`` of them to them. :func:`over_layers` gives such
an optimizer each layer's own matrix.

Vocabulary:

* a *group* is the leaves that share one Layers axis: a stack of one block's
  (``h/...``), or one kind's of a mixed-layer stack (``h/<kind>/...``); its
  *rows* are its layers, each with its *global* layer index (a kind's rows
  follow the pattern: ``Pattern.layer_ids(kind)``);
* the *rest* is the leaves under no stack.

In pseudo-code, ``over_layers(tx, stacked=..., scale=s, frozen=F)`` is::

  state[g] = vmap(tx.init)(params[g])              # each group, per row
  u[g], new = vmap(tx.update)(grads[g], state[g], params[g])
  u[g][r] *= s(index[r])                           # rows by global index
  u[g][r], new[r] = 0, state[g][r]   for r in F    # frozen rows
  u[rest], state[rest] = tx.update(grads[rest], state[rest], params[rest])

Leaves are matched to stacks as :func:`stacked_partition_specs` matches them
(by the Haiku module name in a leaf's path), so the same ``stacked=`` list
serves both, for parameters and for the optimizer states that hold them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stacktools.core import _checks
from stacktools.layouts import _partition_specs
from stacktools.layouts import _stack_params

PyTree = Any
Scale = Union[Callable[[int], float], Sequence[float], np.ndarray]
_REST = None   # the group key of the leaves under no stack


class OverLayersState(NamedTuple):
  """The state of :func:`over_layers`.

  Attributes:
    layers: each group's inner state (``{"h": ..., "h/local": ...}``), every
      leaf with the group's leading Layers axis: per-layer moments, counts
      and statistics.
    rest: the inner state of the leaves under no stack (``None`` when every
      leaf is stacked).
  """

  layers: dict[str, PyTree]
  rest: PyTree


class _Group(NamedTuple):
  axes: int          # leading Layers axes, each vmapped over
  ids: np.ndarray    # the global layer index of each row (the first axis)
  stack: str         # the stack the rows are layers of
  depth: int         # that stack's number of layers


class _Layout:
  """Which group each leaf of a tree is in, from its paths and shapes."""

  def __init__(self, tree: PyTree, stacks: Mapping[str, Optional[tuple[str, ...]]]):
    flat, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = list(stacks)
    _partition_specs.check_stacks_exist(tree, names)
    modules = [_partition_specs.module_of(path) for path, _ in flat]
    bundles: dict[str, dict[str, dict[str, Any]]] = {s: {} for s in names}
    for (path, leaf), module in zip(flat, modules):
      for s in names:
        if _partition_specs.num_layer_axes(module, [s]):
          bundles[s].setdefault(module, {})[str(getattr(path[-1], "key", path[-1]))] = leaf
    # Each module's scope (the stack, or its kind) and that scope's rows.
    scope_of: dict[str, tuple[str, np.ndarray, str, int]] = {}
    for s in names:
      _check_stacked_layout(bundles[s], s)
      groups = _stack_params.layer_groups(bundles[s], s, stacks[s])
      depth = sum(len(ids) for _, ids in groups.values())
      for scope, (group_modules, ids) in groups.items():
        for module in group_modules:
          # The outermost stack numbers the rows; an inner one adds an axis.
          if module not in scope_of or len(s) < len(scope_of[module][2]):
            scope_of[module] = (scope, ids, s, depth)
    self.keys: list[Optional[str]] = []
    self.groups: dict[str, _Group] = {}
    for module in modules:
      axes = _partition_specs.num_layer_axes(module, names)
      if not axes:
        self.keys.append(_REST)
        continue
      scope, ids, stack, depth = scope_of[module]
      inner = max((s for s in names if _partition_specs.num_layer_axes(module, [s])), key=len)
      key = scope if axes == 1 else inner
      self.keys.append(key)
      self.groups[key] = _Group(axes, ids, stack, depth)
    self.has_rest = _REST in self.keys

  def part(self, tree: PyTree, key: Optional[str]) -> PyTree:
    """``tree`` with every leaf outside group ``key`` masked out."""
    leaves = self.treedef.flatten_up_to(tree)
    return self.treedef.unflatten([x if k == key else optax.MaskedNode()
                                   for x, k in zip(leaves, self.keys)])

  def merge(self, parts: Mapping[Optional[str], PyTree]) -> PyTree:
    """One tree from each group's part (the inverse of :meth:`part`)."""
    flat = {k: self.treedef.flatten_up_to(t) for k, t in parts.items()}
    return self.treedef.unflatten([flat[k][i] for i, k in enumerate(self.keys)])


def _check_stacked_layout(bundle: Mapping[str, Any], stack: str) -> None:
  """Refuses a stack whose parameters are in the BlockSeq layout."""
  layer = _stack_params.layer_pattern(stack)
  if bundle and all(layer.match(m) for m in bundle):
    raise ValueError(
        f"{_checks.where()}the parameters under {stack!r} are in the BlockSeq "
        f"layout ({stack}/layer_<i>/...), which has no Layers axis to run the "
        f"optimizer over. Drop {stack!r} from stacked= (each layer's leaves are "
        "already separate), or st.stack_params them first.")


def _as_stacks(stacked: Any) -> dict[str, Optional[tuple[str, ...]]]:
  """``stacked=`` as ``{stack: pattern or None}``."""
  if isinstance(stacked, str):
    stacked = [stacked]
  items = stacked.items() if hasattr(stacked, "items") else [(s, None) for s in stacked]
  out = {}
  for name, pattern in items:
    if not isinstance(name, str) or not name or name.endswith("/"):
      raise ValueError(
          f"over_layers: stacked= names {name!r}; each entry is a stack's full "
          "module name such as 'model/h' (no trailing '/'), e.g. "
          "stacked=['model/h'], or {'model/h': pattern} for a mixed-layer stack.")
    out[name] = None if pattern is None else tuple(pattern)
  if not out:
    raise ValueError(
        "over_layers: stacked= is empty, so no leaf would be run per layer; name "
        "the stacks, e.g. stacked=['model/h'] (or use the transformation itself).")
  return out


def _check_scale(scale: Any) -> Optional[Scale]:
  if scale is None or callable(scale):
    return scale
  try:
    values = np.asarray(scale, np.float64)
  except (TypeError, ValueError):
    values = None
  if values is None or values.ndim != 1 or not np.all(np.isfinite(values)):
    raise TypeError(
        f"over_layers: scale={scale!r} must be a function of the global layer "
        "index (e.g. lambda i: 0.8 ** (L - 1 - i)) or a sequence of one finite "
        "number per layer.")
  return values


def _check_frozen(frozen: Any) -> frozenset[int]:
  if frozen is None:
    return frozenset()
  items = [frozen] if isinstance(frozen, (int, np.integer)) else frozen
  try:
    values = [_checks.as_int(i) for i in items]
  except TypeError:
    values = [None]
  if any(v is None or v < 0 for v in values):
    raise TypeError(
        f"over_layers: frozen={frozen!r} must be layer indices: a range, set or "
        "sequence of ints >= 0, e.g. frozen=range(0, 2).")
  return frozenset(values)


def _row_rules(group: _Group, scale: Optional[Scale], frozen: frozenset[int]
               ) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
  """Each row's update scale and frozen flag (``None`` when none applies)."""
  factors = None
  if callable(scale):
    factors = np.asarray([_scale_at(scale, int(i), group.stack) for i in group.ids],
                         np.float64)
    if not np.all(np.isfinite(factors)):
      raise ValueError(f"{_checks.where()}scale gave {factors.tolist()} for the layers "
                       f"{group.ids.tolist()} of {group.stack!r}; every scale must "
                       "be a finite number.")
  elif scale is not None:
    if len(scale) != group.depth:
      raise ValueError(
          f"{_checks.where()}scale= has {len(scale)} values, but the stack "
          f"{group.stack!r} has {group.depth} layers; give one per layer, or a "
          "function of the layer index.")
    factors = scale[group.ids]
  outside = sorted(i for i in frozen if i >= group.depth)
  if outside:
    raise ValueError(
        f"{_checks.where()}frozen= names the layers {outside}, but the stack "
        f"{group.stack!r} has layers 0..{group.depth - 1}.")
  flags = np.isin(group.ids, list(frozen)) if frozen else None
  return factors, (flags if flags is not None and flags.any() else None)


def _scale_at(scale: Callable[[int], Any], index: int, stack: str) -> float:
  """``scale(index)`` as a float; one line naming ``scale=`` if it is not a number."""
  value = scale(index)
  try:
    return float(value)
  except (TypeError, ValueError):
    pass
  example = "e.g. scale=lambda i: 0.8 ** (L - 1 - i)"
  if any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(value)):
    raise TypeError(
        f"{_checks.where()}scale= returned a traced value for layer {index} of "
        f"{stack!r}: it is called when the update is traced and must compute a "
        f"number from the layer index, not from an array under jax.jit, {example}.")
  raise TypeError(
      f"{_checks.where()}scale= returned {_checks.describe(value)} for layer {index} "
      f"of {stack!r}, not one number: it is called once per layer with the global "
      f"layer index and returns that layer's factor, {example}; to give every "
      "layer's factor at once, pass the sequence itself, scale=[...].")


def _rows(flags: np.ndarray, like: jax.Array) -> jax.Array:
  """A per-row array shaped to broadcast against ``like``'s leading axis."""
  return jnp.asarray(flags).reshape((-1,) + (1,) * (jnp.ndim(like) - 1))


def over_layers(tx: optax.GradientTransformation, *,
                stacked: Union[str, Sequence[str], Mapping[str, Optional[Sequence[str]]]],
                scale: Optional[Scale] = None,
                frozen: Optional[Iterable[int]] = None
                ) -> optax.GradientTransformationExtraArgs:
  """Runs ``tx`` once per layer on stacked leaves, and as it is on the rest.

  Each stack's leaves go through ``jax.vmap(tx.init)`` and
  ``jax.vmap(tx.update)`` over their Layers axis, so ``tx`` sees one layer's
  ``[in, out]`` matrix at a time and keeps per-layer state (every state leaf
  of a stack leads with its layers). Muon orthogonalizes each layer's
  matrix, Adafactor factors each layer's own second moment, Adam and SGD are
  unchanged. The result equals ``tx`` applied to each layer of
  ``st.unstack_params(params, stack)`` separately. Leaves under no stack are
  given to one ``tx`` as they are.

  Example::

    L = 12
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),           # global: outside, over all
        st.over_layers(optax.contrib.muon(0.02), stacked=["model/h"],
                       scale=lambda i: 0.8 ** (L - 1 - i),  # layer-wise decay
                       frozen=range(0, 2)))                 # layers 0 and 1
    params = {"model/h/block/linear": {"w": jnp.ones((L, 8, 8))},
              "model/head": {"w": jnp.ones((8, 1))}}
    updates, state = tx.update(params, tx.init(params), params)

    # A mixed-layer stack: its pattern gives each kind's global indices.
    tx = st.over_layers(optax.adamw(1e-3),
                        stacked={"model/h": ("local",) * 5 + ("global",)})

  A transformation that reads every leaf together (``clip_by_global_norm``)
  sees one layer's leaves at a time inside ``over_layers``: chain it outside,
  as above. Composes with ``optax.chain``, ``optax.masked``,
  ``optax.partition`` and ``optax.MultiSteps``.

  Args:
    tx: any optax transformation.
    stacked: the full module names of the stacks (as in
      :func:`stacked_partition_specs`); or a mapping from each name to its
      mixed-layer pattern (``None`` for a stack of one block). A nested
      stack's leaves are vmapped over both Layers axes; the outer stack's
      layers are the rows that ``scale`` and ``frozen`` index. The
      parameters show each kind's count but not the order of the kinds, so
      only the counts are checked: a pattern with the right counts in
      another order (``("B", "A", "B")`` for ``("A", "B", "B")``) gives the
      rows other global indices, and ``scale`` and ``frozen`` then act on
      other layers. Pass the pattern the stack was built with.
    scale: multiplies each layer's update, weight decay included: a
      function of the global layer index (called once per layer, at trace
      time, returning a number) or one number per layer.
    frozen: global indices of layers that do not train (a ``range``, set or
      sequence): their rows get a zero update (so no weight decay either)
      and their optimizer state does not move. They still cost the memory
      of a trainable row: their gradient is computed and their optimizer
      state kept, because they are rows of the same stacked arrays as the
      trained layers, and cutting them out would copy those arrays every
      step. Leaves under no stack are never frozen by this.

  Returns:
    An optax transformation whose state is an :class:`OverLayersState`.
    ``init`` and ``update`` raise a ``ValueError`` for a name in ``stacked``
    that no leaf lies under, a stack in the BlockSeq layout, a pattern the
    kinds' counts contradict, or ``scale``/``frozen`` that do not fit a
    stack's depth.
  """
  stacks = _as_stacks(stacked)
  scale = _check_scale(scale)
  frozen = _check_frozen(frozen)
  tx = optax.with_extra_args_support(tx)

  def each_layer(fn, axes):
    for _ in range(axes):
      fn = jax.vmap(fn)
    return fn

  def layout_of(tree):
    with _checks.subject("over_layers"):
      layout = _Layout(tree, stacks)
      rules = {k: _row_rules(g, scale, frozen) for k, g in layout.groups.items()}
    return layout, rules

  def init_fn(params):
    layout, _ = layout_of(params)
    layers = {k: each_layer(tx.init, g.axes)(layout.part(params, k))
              for k, g in layout.groups.items()}
    rest = tx.init(layout.part(params, _REST)) if layout.has_rest else None
    return OverLayersState(layers, rest)

  def update_fn(updates, state, params=None, **extra_args):
    layout, rules = layout_of(updates)

    def update(u, s, p):
      return tx.update(u, s, p, **extra_args)

    parts, layers = {}, {}
    for key, group in layout.groups.items():
      p = None if params is None else layout.part(params, key)
      old = state.layers[key]
      u, new = each_layer(update, group.axes)(layout.part(updates, key), old, p)
      factors, flags = rules[key]
      if factors is not None:
        u = jax.tree_util.tree_map(
            lambda a: (a * _rows(factors, a)).astype(a.dtype), u)  # pylint: disable=cell-var-from-loop
      if flags is not None:
        u = jax.tree_util.tree_map(
            lambda a: jnp.where(_rows(flags, a), jnp.zeros_like(a), a), u)  # pylint: disable=cell-var-from-loop
        new = jax.tree_util.tree_map(
            lambda n, o: jnp.where(_rows(flags, n), o, n), new, old)  # pylint: disable=cell-var-from-loop
      parts[key], layers[key] = u, new
    rest = state.rest
    if layout.has_rest:
      p = None if params is None else layout.part(params, _REST)
      parts[_REST], rest = update(layout.part(updates, _REST), state.rest, p)
    return layout.merge(parts), OverLayersState(layers, rest)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
