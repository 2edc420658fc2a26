"""Mixed-layer stacks: which kind of block each layer is, and regrouping by kind.

Vocabulary:

* a *kind* names one block factory: ``{"local": make_local, "global":
  make_global}``;
* the *pattern* is the kinds of one *period*, repeated over the stack; a depth
  that the period does not divide ends with a partial period, the pattern's
  prefix;
* a *run* is a stretch of consecutive layers of one kind inside one period;
* *kind order* lists one kind's layers in layer order, with a leading axis of
  that kind's count: its parameters (``h/<kind>/...``), its per-kind inputs
  (``per_kind``) and its per-kind outputs;
* *layer order* has a leading axis of ``num_layers`` (:func:`per_layer`).

For ``num_layers=8`` and ``pattern=("L", "L", "G")``::

  layer  0 1 2 3 4 5 6 7
  kind   L L G L L G L L
  rank   0 1 0 2 3 1 4 5      (the layer's index among its kind's layers)
  a period's runs: (L, 2 layers), (G, 1 layer); the partial period: (L, 2)

This module is the layout and its checks (no Haiku, no loops); ``_loops.py``
runs the layers, ``_stack_module.py`` builds one :class:`Pattern` per
stack; the :func:`per_kind` marker is in ``_arguments.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from stacktools.core import _checks

PyTree = Any
EXAMPLE = "e.g. pattern=('local',) * 5 + ('global',)"


#: The kind of every layer of a stack or loop of one block (no ``pattern=``):
#: its pattern is this one kind, period 1.
ONE_KIND = "block"


class Run(NamedTuple):
  """Consecutive layers of one kind: ``length`` layers from ``start``."""

  kind: str
  start: int    # the first layer's index (in the stack, or in its period)
  rank: int     # its index among the layers of its kind
  length: int


@dataclasses.dataclass(frozen=True)
class Pattern:
  """The layout of a mixed-layer stack.

  Attributes:
    factories: each kind's block factory.
    kinds: the kind of each layer of one period.
    num_layers: the stack's depth.
    ys_by_kind: how scan outputs come back (see :meth:`outputs`).
  """

  factories: Mapping[str, Callable[[], Callable[..., Any]]]
  kinds: tuple[str, ...]
  num_layers: int
  ys_by_kind: Optional[bool] = None

  @classmethod
  def build(cls, make_block: Any, pattern: Any, num_layers: int,
            ys_by_kind: Optional[bool]) -> Optional["Pattern"]:
    """The stack's pattern, or ``None`` for a stack of one block (checked)."""
    if pattern is None and not hasattr(make_block, "items"):
      _checks.check_factory(make_block)
      if ys_by_kind is not None:
        raise ValueError(f"{_checks.where()}ys_by_kind= is for a mixed-layer stack "
                         f"(pattern=...); drop it, or give a pattern, {EXAMPLE}.")
      return None
    kinds = check_kinds(make_block, pattern)
    if ys_by_kind not in (None, True, False):
      raise ValueError(f"{_checks.where()}ys_by_kind={ys_by_kind!r}: use None (per kind "
                       "only when the kinds' outputs differ), True or False.")
    layout = cls(dict(make_block), kinds, num_layers, ys_by_kind)
    check_every_kind_has_layers(layout)
    return layout

  @classmethod
  def uniform(cls, num_layers: int, kind: str = "") -> "Pattern":
    """The layout of a loop of one kind: period 1, every layer ``kind``
    (:data:`ONE_KIND` unless named)."""
    kind = kind or ONE_KIND
    return cls({kind: None}, (kind,), num_layers)

  @property
  def is_plain(self) -> bool:
    """Whether this is a stack of one block (made by :meth:`uniform`)."""
    return all(factory is None for factory in self.factories.values())

  @property
  def is_uniform(self) -> bool:
    """Whether every layer is of one kind."""
    return len(set(self.kinds)) == 1

  # Where each layer sits.

  @property
  def period(self) -> int:
    return len(self.kinds)

  def kind_of(self, layer: int) -> str:
    return self.kinds[layer % self.period]

  @functools.cached_property
  def _ranks(self) -> np.ndarray:
    seen: dict[str, int] = {}
    ranks = []
    for i in range(self.num_layers):
      kind = self.kind_of(i)
      ranks.append(seen.get(kind, 0))
      seen[kind] = ranks[-1] + 1
    return np.asarray(ranks, np.int64)

  def rank(self, layer: int) -> int:
    """The layer's index among its kind's layers."""
    return int(self._ranks[layer])

  def rank_at(self, layer: jax.Array) -> jax.Array:
    """:meth:`rank` of a traced layer index (int32)."""
    return jnp.asarray(self._ranks, jnp.int32)[layer]

  @property
  def names(self) -> tuple[str, ...]:
    """The kinds that have layers, in order of first appearance."""
    return tuple(dict.fromkeys(self.kind_of(i) for i in range(
        min(self.num_layers, self.period))))

  @property
  def counts(self) -> dict[str, int]:
    """Every kind's number of layers (0 for a kind with no layers here)."""
    counts = {kind: 0 for kind in self.factories}
    for i in range(self.num_layers):
      counts[self.kind_of(i)] += 1
    return counts

  def per_period(self, kind: str) -> int:
    return self.kinds.count(kind)

  def layer_ids(self, kind: str) -> np.ndarray:
    """The indices of ``kind``'s layers, in layer order."""
    return np.asarray([i for i in range(self.num_layers) if self.kind_of(i) == kind],
                      np.int32)

  def runs(self, start: int, stop: int) -> list[Run]:
    """The runs of layers ``[start, stop)``, never crossing a period's end."""
    runs: list[Run] = []
    for i in range(start, stop):
      kind = self.kind_of(i)
      last = runs[-1] if runs else None
      if last and last.kind == kind and i % self.period:
        runs[-1] = last._replace(length=last.length + 1)
      else:
        runs.append(Run(kind, i, self.rank(i), 1))
    return runs

  # Blocks and their inputs.

  def block_call(self, kind: str, mode: str) -> Callable[..., Any]:
    """Calls ``kind``'s block in ``mode`` (fold or scan); the loop's step
    checks that it keeps the carry (``check_block_carry``, with its kind)."""
    factory = self.factories[kind]

    def call(x, *args, **kwargs):
      return factory()(x, *args, **kwargs)

    return call

  def kind_inputs(self, sliced: Mapping[str, PyTree],
                  by_kind: Mapping[str, Mapping[str, PyTree]],
                  kind: str) -> dict[str, PyTree]:
    """Per-layer and per-kind arguments of ``kind``'s layers, in kind order."""
    ids = self.layer_ids(kind)
    if self.is_uniform:   # every layer, in order: no gather
      out = dict(sliced)
    else:
      out = {key: jax.tree_util.tree_map(lambda a: a[ids], value)
             for key, value in sliced.items()}
    out.update({key: trees[kind] for key, trees in by_kind.items()})
    return out

  def layer_inputs(self, sliced: Mapping[str, PyTree],
                   by_kind: Mapping[str, Mapping[str, PyTree]],
                   layer: int) -> dict[str, PyTree]:
    """Per-layer and per-kind arguments of one layer."""
    kind, rank = self.kind_of(layer), self.rank(layer)
    out = {key: jax.tree_util.tree_map(lambda a: a[layer], value)
           for key, value in sliced.items()}
    out.update({key: jax.tree_util.tree_map(lambda a: a[rank], trees[kind])
                for key, trees in by_kind.items()})
    return out

  # Outputs.

  def outputs(self, ys: Mapping[str, PyTree]) -> PyTree:
    """Scan outputs from each kind's, in kind order, to what the stack returns.

    In layer order (a leading ``num_layers`` axis) when every kind's outputs
    agree in structure, shapes and dtypes, per kind (``{kind: ys}``)
    otherwise; ``ys_by_kind=True`` asks for per kind always, ``False`` for
    layer order always.
    """
    names = [kind for kind in self.names if kind in ys]
    if self.ys_by_kind:
      return {kind: ys[kind] for kind in names}
    if self.is_uniform:   # already in layer order
      return ys[names[0]]
    signatures = {kind: jax.tree_util.tree_map(_layer_signature, ys[kind])
                  for kind in names}
    differ = [kind for kind in names if signatures[kind] != signatures[names[0]]]
    if differ:
      if self.ys_by_kind is False:
        raise ValueError(
            f"{_checks.who()}.scan: the {names[0]!r} and {differ[0]!r} blocks return "
            f"outputs of different shapes ({signatures[names[0]]} and "
            f"{signatures[differ[0]]} per layer), so they cannot be stacked in "
            "layer order; drop ys_by_kind=False to get them per kind.")
      return {kind: ys[kind] for kind in names}
    order = np.concatenate([self.layer_ids(kind) for kind in names])
    where = np.argsort(order)
    return jax.tree_util.tree_map(
        lambda *parts: jnp.concatenate(parts)[where], *[ys[kind] for kind in names])

  def collect(self, ys: Sequence[PyTree]) -> PyTree:
    """:meth:`outputs` from a list of each layer's output, in layer order."""
    by_kind = {kind: jax.tree_util.tree_map(
        lambda *a: jnp.stack(a), *[ys[i] for i in self.layer_ids(kind)])
               for kind in self.names}
    return self.outputs(by_kind)


def _layer_signature(leaf: Any) -> str:
  """One layer's shape and dtype of a leaf with a leading Layers axis."""
  shape, dtype = _checks.signature(leaf)
  return f"{dtype}{list(shape[1:])}"


# ---------------------------------------------------------------------------
# Checks. The pattern's own live here, beside the layout they check.


def check_kinds(make_block: Any, pattern: Any) -> tuple[str, ...]:
  """The pattern as a tuple of kinds, each with a factory in ``make_block``."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  if not hasattr(make_block, "items") or pattern is None:
    given = ("no pattern=" if pattern is None else
             f"make_block={_checks.describe(make_block)}")
    raise TypeError(
        f"{_checks.where()}a mixed-layer stack needs both make_block as a mapping from "
        "each kind's name to its factory ({'local': make_local, 'global': "
        f"make_global}}) and pattern=, the kinds of one period ({EXAMPLE}); "
        f"got {given}.")
  for kind, factory in make_block.items():
    if not isinstance(kind, str) or not kind.isidentifier() or (
        kind.startswith("layer_") and kind[6:].isdigit()):
      raise ValueError(
          f"{_checks.where()}the kind {kind!r} cannot name a module: a kind is a Python "
          "identifier (its parameters live under <stack>/<kind>/), and not "
          "layer_<i>, which names a layer of the per-layer layout.")
    if isinstance(factory, hk.Module) or not callable(factory):
      raise TypeError(
          f"{_checks.where()}make_block[{kind!r}] is {_checks.describe(factory)}; each "
          "kind needs a factory (a class or a lambda) that makes its block "
          f"inside the stack, e.g. {{{kind!r}: lambda: Block(...)}}.")
  if isinstance(pattern, str) and pattern in make_block and len(pattern) > 1:
    raise ValueError(
        f"{_checks.where()}pattern={pattern!r} is a string, read as one kind per letter; "
        f"for a period of one {pattern!r} layer write pattern=({pattern!r},).")
  try:
    kinds = tuple(pattern)
  except TypeError:
    raise TypeError(f"{_checks.where()}pattern={pattern!r} must be a sequence of kinds, "
                    f"{EXAMPLE}.") from None
  if not kinds:
    raise ValueError(f"{_checks.where()}pattern= is empty; give the kinds of one period, "
                     f"{EXAMPLE}.")
  for kind in kinds:
    if kind not in make_block:
      close = difflib.get_close_matches(str(kind), [str(k) for k in make_block], n=1)
      hint = f" Did you mean {close[0]!r}?" if close else ""
      raise ValueError(
          f"{_checks.where()}pattern= names the kind {kind!r}, which has no factory; "
          f"make_block has {sorted(make_block)}.{hint} Add a factory for it or "
          "fix the pattern.")
  return kinds


def check_every_kind_has_layers(layout: Pattern) -> None:
  """Every factory is a kind of the pattern, and every kind has a layer.

  A kind without layers would have no parameters and never run: a factory
  the pattern forgot, or a depth that ends before the kind's first layer.
  """
  counts = layout.counts
  for kind, count in counts.items():
    if count:
      continue
    if kind not in layout.kinds:
      raise ValueError(
          f"{_checks.where()}make_block[{kind!r}] is the factory of a kind that "
          f"pattern={layout.kinds} never names, so it has 0 layers (layer counts: "
          f"{counts}). Add {kind!r} to the pattern, or drop its factory.")
    first = layout.kinds.index(kind)
    raise ValueError(
        f"{_checks.where()}num_layers={layout.num_layers} ends before the first "
        f"{kind!r} layer of pattern={layout.kinds}, so the kind {kind!r} has 0 "
        f"layers (layer counts: {counts}). Use num_layers >= {first + 1}, or a "
        f"pattern whose kinds all fit in {layout.num_layers} layers.")


def check_per_kind(trees: Any, counts: Mapping[str, int], label: str) -> None:
  """A per-kind input: ``{kind: tree}``, each leaf leading with that kind's count."""
  if not hasattr(trees, "items"):
    raise TypeError(f"{label} is {_checks.describe(trees)}; st.per_kind takes a "
                    "mapping from each kind to its tree, e.g. {'local': ..., "
                    "'global': ...}.")
  for kind in trees:
    if kind not in counts:
      raise ValueError(f"{label} has the kind {kind!r}, but the stack's kinds are "
                       f"{sorted(counts)}.")
  for kind, count in counts.items():
    if kind not in trees:
      if count:
        raise ValueError(
            f"{label} has no entry for the kind {kind!r}, which has {count} "
            f"layers; give every kind of the pattern its tree ({sorted(counts)}).")
      continue
    for path, leaf in jax.tree_util.tree_flatten_with_path(trees[kind])[0]:
      shape = jnp.shape(leaf)
      if not shape or shape[0] != count:
        got = "is a scalar" if not shape else f"has a leading axis of {shape[0]}"
        raise ValueError(
            f"{_checks.path_str(f'{label}[{kind!r}]', path)} {got}, but the stack "
            f"has {count} {kind!r} layers; a per-kind input needs one slice per "
            "layer of its kind on its leading axis, in layer order.")
