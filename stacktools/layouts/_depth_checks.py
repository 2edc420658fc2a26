"""The checks of ``take_layers``: names, indices, patterns and fresh layers.

Each raises the ``ValueError``/``TypeError`` that says what was wrong with
an edit of :func:`stacktools.take_layers` and what is accepted;
:class:`Zero` tracks which ``zero=`` entries named a leaf.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from stacktools.core import _checks
from stacktools.layouts import _stack_params
from stacktools.step import _pattern

Bundle = Mapping[str, Mapping[str, Any]]

def check_name(name: Any) -> str:
  if not isinstance(name, str) or not name or name.endswith("/"):
    raise ValueError(f"take_layers: name={name!r} must be the stack's full module "
                     "name, such as 'model/h' (no trailing '/').")
  return name


def stack_modules(params: Any, prefix: str, arg: str) -> dict[str, Mapping[str, Any]]:
  """The modules of ``params`` under ``prefix``; one line if there are none."""
  if not isinstance(params, Mapping):
    raise ValueError(f"take_layers: {arg} must be Haiku params or state, "
                     f"{{module: {{name: array}}}}; got {_checks.describe(params)}.")
  inside = {k: v for k, v in params.items() if _stack_params.under(k, prefix)}
  if not inside:
    modules = sorted(params)
    raise ValueError(
        f"take_layers: no module of {arg} is named {prefix!r} or lies under it; its "
        f"modules are {modules[:6]}{f' ... ({len(modules)} in all)' if len(modules) > 6 else ''}. "
        "Pass the stack's full module name.")
  return inside


def check_indices(indices: Any) -> list[Optional[int]]:
  if isinstance(indices, (str, bytes)) or not isinstance(indices, (Sequence, np.ndarray, range)):
    raise ValueError(f"take_layers: indices must be a list of layer indices (ints, "
                     f"None for a fresh layer); got {_checks.describe(indices)}.")
  picks = []
  for p, i in enumerate(indices):
    value = None if i is None else _checks.as_int(i)
    if i is not None and value is None:
      raise ValueError(f"take_layers: indices[{p}]={i!r} is not a layer index; each "
                       "entry is an int (an old layer) or None (a fresh layer).")
    picks.append(value)
  if not picks:
    raise ValueError("take_layers: indices is empty; a stack keeps at least one layer.")
  return picks


def check_zero(zero: Any) -> tuple[str, ...]:
  names = (zero,) if isinstance(zero, str) else tuple(zero)
  for entry in names:
    if not isinstance(entry, str) or not entry or entry.startswith("/") or entry.endswith("/"):
      raise ValueError(f"take_layers: zero= entry {entry!r} must name leaves by the end "
                       "of their path inside a layer, e.g. 'attn/proj' or 'attn/proj/w'.")
  return names


def check_range(picks: list[Optional[int]], depth: int, prefix: str) -> None:
  for p, i in enumerate(picks):
    if i is not None and not 0 <= i < depth:
      raise ValueError(
          f"take_layers: indices[{p}]={i} is out of range: {prefix!r} has {depth} "
          f"layers (0 to {depth - 1}); use None for a fresh layer from new=.")


def check_not_kinds(inside: Bundle, prefix: str) -> None:
  """Without ``pattern=``, refuses modules laid out as a mixed-layer stack's kinds.

  A mixed-layer stack keeps each kind under ``<prefix>/<kind>/...`` with a
  Layers axis of its own; read as a stack of one block, the indices would
  pick each kind's rows (``[0, 1]`` of a 4-layer ``"AB"`` stack keeps all 4).
  """
  rests = [key[len(prefix) + 1:] for key in inside]
  if any("/" not in rest for rest in rests):
    return     # a module directly under the stack: not a kind
  scopes = sorted({rest.split("/")[0] for rest in rests})
  if len(scopes) < 2:
    return
  raise ValueError(
      f"take_layers: the modules under {prefix!r} lie under {scopes}, as the kinds of "
      f"a mixed-layer stack do ({prefix}/<kind>/..., each kind its own Layers axis), "
      "and without pattern= the indices would pick each kind's rows, not the "
      "stack's layers. Pass the pattern the stack was built with as pattern= (the "
      f"kinds of one period, in layer order); if {prefix!r} is a stack of one block "
      "whose modules lie so, edit one at a time: take_layers(params, "
      f"'{prefix}/{scopes[0]}', indices), then '{prefix}/{scopes[1]}', ....")


def check_kinds(picks: list[Optional[int]], layout: Optional[_pattern.Pattern]) -> None:
  """Refuses an edit that moves a layer to a position of another kind."""
  if layout is None:
    return
  for p, i in enumerate(picks):
    if i is not None and layout.kind_of(i) != layout.kind_of(p):
      raise ValueError(
          f"take_layers: indices[{p}]={i} puts layer {i}, of kind {layout.kind_of(i)!r}, "
          f"at position {p}, which pattern {layout.kinds} gives kind "
          f"{layout.kind_of(p)!r}; every position "
          f"keeps its kind (pattern[p % {layout.period}]): take a layer of that kind, "
          "or None for a fresh one.")


def check_fresh(picks: list[Optional[int]], fresh: Any, fresh_depth: Optional[int],
                 prefix: str) -> None:
  if None in picks and fresh is False:
    raise ValueError(
        f"take_layers: indices[{picks.index(None)}] is None, a fresh layer, but no "
        f"new= was given; pass the params of {prefix!r} at depth {len(picks)} from "
        "a fresh init.")
  if fresh is not False and fresh_depth != len(picks):
    raise ValueError(
        f"take_layers: new= holds {fresh_depth} layers of {prefix!r}, but indices "
        f"make {len(picks)}; fresh layer p is layer p of new=, so pass the stack "
        f"at depth {len(picks)}.")


def check_same(key: str, name: str, got: Any, want: Any, leading: int) -> None:
  """A leaf of ``new`` must have the old leaf's shape past the Layers axes."""
  got_sig, want_sig = _checks.signature(got), _checks.signature(want)
  if got_sig[0][leading:] != want_sig[0][leading:] or got_sig[1] != want_sig[1]:
    raise ValueError(
        f"take_layers: new= {key}/{name} is {got_sig[1]}{list(got_sig[0][leading:])} "
        f"per layer but params' is {want_sig[1]}{list(want_sig[0][leading:])}; new= "
        "must come from the same model at another depth.")


class Zero:
  """Which leaves ``zero=`` names; remembers which entries named something."""

  def __init__(self, names: tuple[str, ...]):
    self.names = names
    self.used: set[str] = set()

  def __call__(self, rest: str, name: str) -> bool:
    """Whether the leaf ``name`` of module ``<layer>/<rest>`` is named."""
    hit = False
    for entry in self.names:
      for path in (f"{rest}/{name}", rest):
        if path == entry or path.endswith("/" + entry):
          self.used.add(entry)
          hit = True
    return hit

  def check_used(self, prefix: str, rests: set[str]) -> None:
    unused = [e for e in self.names if e not in self.used]
    if unused:
      raise ValueError(
          f"take_layers: zero={unused} names no leaf of a layer of {prefix!r}; its "
          f"layers hold the modules {sorted(rests)[:8]}. Name a module or leaf by "
          "the end of its path, e.g. 'attn/proj'.")
