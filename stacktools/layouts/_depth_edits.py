"""Depth edits: select, reorder, repeat and add layers of a trained stack.

A stack's depth is the leading Layers axis of its parameters, so changing it
is an index list: ``indices[p]`` says which layer of the old stack becomes
layer ``p`` of the new one. :func:`take_layers` is the one verb; the helpers
below spell the usual growth schemes as index lists for it::

  repeat(2, 4)       -> [0, 0, 1, 1]           each layer twice (Gong et al. 2019)
  tile(2, 4)         -> [0, 1, 0, 1]           the stack again on top of itself
  insert_new(2, 4)   -> [0, None, 1, None]     a fresh layer after each old one
  [0, 1, 2, 5]                                 keep four layers (pruning, an encoder)
  [*range(0, 24), *range(8, 32)]               two overlapped copies (SOLAR's up-scaling)

``None`` is a fresh layer: layer ``p`` of ``new=``, the stack's params at the
new depth from a fresh init. With ``zero=`` naming a block's residual-branch
output layers, a fresh layer adds nothing to the stream and the grown model
computes exactly what the old one did (function-preserving growth).

Edits work on every layout of ``stacktools.params``: a plain stack
(``h/...``, leaves ``[L, ...]``), a mixed-layer stack (``h/<kind>/...``, with
its ``pattern=``) and a BlockSeq (``h/layer_<i>/...``); on params and on Haiku
state alike. They are gathers along the Layers axis: values are copied, never
computed, so an edit equals the same edit done on ``st.unstack_params``'
per-layer dict and stacked back, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from stacktools.core import _checks
from stacktools.layouts import _depth_checks
from stacktools.layouts import _stack_params
from stacktools.step import _pattern

Bundle = Mapping[str, Mapping[str, Any]]
Indices = Sequence[Optional[int]]

__all__ = ("insert_new", "repeat", "take_layers", "tile")


def take_layers(params: Bundle, name: str, indices: Indices, *,
                pattern: Optional[Sequence[str]] = None,
                new: Optional[Bundle] = None,
                zero: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
  """The stack ``name`` with layer ``p`` taken from old layer ``indices[p]``.

  Select, reorder, repeat or add layers: ``len(indices)`` is the new depth,
  an index may appear any number of times, and ``None`` is a fresh layer,
  layer ``p`` of ``new`` (the stack's params at the new depth, freshly
  initialised). Modules outside the stack are returned as they are.

  Example::

    from stacktools import depth

    def model_of(num_layers):   # a stack of residual blocks, named "h"
      block = lambda: hk.Sequential([hk.Linear(4, name="fc"), jnp.tanh,
                                     hk.Linear(4, name="out")])
      return hk.transform(lambda x: st.Stacked(
          lambda: lambda x: x + block()(x), num_layers, name="h").fold(x))

    x = jnp.ones((2, 4))
    params = model_of(6).init(jax.random.PRNGKey(0), x)
    pruned = st.take_layers(params, "h", [0, 1, 2, 5])           # keep 4 layers
    twice = st.take_layers(params, "h", depth.repeat(6, 12))     # 0 0 1 1 ...
    fresh = model_of(12).init(jax.random.PRNGKey(1), x)          # the new depth
    grown = st.take_layers(params, "h", depth.insert_new(6, 12),  # 0 None 1 ...
                           new=fresh, zero=("out",))
    assert jnp.allclose(model_of(12).apply(grown, None, x),
                        model_of(6).apply(params, None, x), atol=1e-6)

  The plain-Python equivalent (what the tests compare with)::

    layers = st.unstack_params(params, name, pattern=pattern)
    out = {k: v for k, v in layers.items() if not under(k, f"{name}/layer_")}
    for p, i in enumerate(indices):
      source = layers if i is not None else st.unstack_params(new, name, pattern=pattern)
      for rest, leaves in modules of layer (i if i is not None else p) in source:
        out[f"{name}/layer_{p}{rest}"] = zeroed(leaves) if i is None else leaves
    return st.stack_params(out, name, pattern=pattern)

  Args:
    params: Haiku params or state, ``{module: {name: array}}``.
    name: the stack's full module name, as in ``st.unstack_params``.
    indices: one entry per layer of the result: an old layer (``0`` to
      depth - 1) or ``None`` for a fresh one.
    pattern: a mixed-layer stack's pattern. Every layer keeps the kind the
      pattern gives its position, ``pattern[p % len(pattern)]``: an edit that
      moves a layer to a position of another kind is refused.
    new: the stack's params (or state) at depth ``len(indices)``, in the
      same layout, from a fresh init: where the ``None`` layers come from.
    zero: leaves set to zero in the fresh layers, each named by the end of
      its path inside a layer: ``"attn/proj"`` names every leaf of a module
      ``.../attn/proj`` (weight and bias), ``"attn/proj/w"`` one leaf. Name
      the layers whose output is added to the residual stream, and a fresh
      block is the identity. Each entry must name some leaf.

  Returns:
    A new dict; the arrays given are not changed. numpy in, numpy out.

  Raises:
    ValueError: a stack name no module lies under, an index out of range or
      not an int, an empty ``indices``, an edit that breaks the pattern, a
      ``None`` without ``new``, a ``new`` of another depth or shapes, or a
      ``zero`` entry that names no leaf.
  """
  with _checks.subject("take_layers"):
    prefix = _depth_checks.check_name(name)
    inside = _depth_checks.stack_modules(params, prefix, "params")
    out = {k: dict(v) for k, v in params.items() if not _stack_params.under(k, prefix)}
    picks = _depth_checks.check_indices(indices)
    fresh = new is not None and _depth_checks.stack_modules(new, prefix, "new")
    zero = _depth_checks.check_zero(zero)
    if zero and new is None:
      raise ValueError(f"take_layers: zero={list(zero)} zeroes leaves of the fresh "
                       "layers, which come from new=; pass new= (the stack at the "
                       "new depth from a fresh init) and None where they go.")
    if _is_blockseq(inside, prefix):
      out.update(_take_blockseq(inside, prefix, picks, pattern, fresh, zero))
    else:
      out.update(_take_stacked(inside, prefix, picks, pattern, fresh, zero))
  return out


def repeat(n: int, m: int, period: int = 1) -> list[int]:
  """Each layer repeated in place: ``repeat(2, 4) == [0, 0, 1, 1]``.

  Progressive stacking's growth (Gong et al. 2019). For ``m`` not a multiple
  of ``n`` the lower layers get the extra copies: ``repeat(2, 3) == [0, 0,
  1]``, ``repeat(4, 6) == [0, 0, 1, 1, 2, 3]`` (copies 2, 2, 1, 1).
  ``period`` repeats whole periods of a mixed-layer stack, keeping its
  pattern: ``repeat(4, 8, period=2) == [0, 1, 0, 1, 2, 3, 2, 3]``.

  Example::

    assert repeat(3, 6) == [0, 0, 1, 1, 2, 2]   # st.take_layers(params, "h", repeat(3, 6))
  """
  units, target = _units(n, m, period, "repeat")
  copies, extra = divmod(target, units)   # the first `extra` units get one more
  return _expand([u for u in range(units) for _ in range(copies + (u < extra))], period)


def tile(n: int, m: int, period: int = 1) -> list[int]:
  """The stack again on top of itself: ``tile(2, 4) == [0, 1, 0, 1]``.

  ``tile(2, 3) == [0, 1, 0]``. With ``period``, whole periods (a
  mixed-layer stack whose depth the pattern divides keeps its pattern with
  ``period=1`` too).

  Example::

    assert tile(3, 6) == [0, 1, 2, 0, 1, 2]     # st.take_layers(params, "h", tile(3, 6))
  """
  units, target = _units(n, m, period, "tile")
  return _expand([u % units for u in range(target)], period)


def insert_new(n: int, m: int, period: int = 1) -> list[Optional[int]]:
  """The old layers in order, with ``m - n`` fresh ones (``None``) spread between.

  Each old layer is followed by its share of the fresh ones:
  ``insert_new(2, 4) == [0, None, 1, None]``, ``insert_new(2, 3) == [0,
  None, 1]``, ``insert_new(3, 4) == [0, None, 1, 2]``. With ``period``, fresh
  whole periods after old ones, which keeps a mixed-layer stack's pattern.
  Pass ``new=`` and ``zero=`` to :func:`take_layers` for function-preserving
  growth.

  Example::

    assert insert_new(2, 4) == [0, None, 1, None]
    # st.take_layers(params, "h", insert_new(2, 4), new=fresh, zero=("attn/proj",))
  """
  units, target = _units(n, m, period, "insert_new")
  at = {-(-u * target // units): u for u in range(units)}   # ceil(u * m / n)
  return _expand([at.get(u) for u in range(target)], period)


# ---------------------------------------------------------------------------
# The two layouts.


def _xp(*leaves: Any) -> Any:
  """numpy when every leaf is a numpy array (host in, host out), else jnp."""
  return np if all(isinstance(x, np.ndarray) for x in leaves) else jnp


def _take_stacked(inside: Bundle, prefix: str, picks: list[Optional[int]],
                  pattern: Any, fresh: Any, zero: tuple[str, ...]):
  """Stacked layouts: one gather per leaf from ``[old rows; fresh rows]``."""
  groups = _stack_params.layer_groups(inside, prefix, pattern)
  if pattern is None:
    _depth_checks.check_not_kinds(inside, prefix)
  _depth_checks.check_range(picks, sum(len(ids) for _, ids in groups.values()), prefix)
  scope_of = lambda i: prefix  # pylint: disable=unnecessary-lambda-assignment
  if pattern is not None:
    kinds = tuple(pattern)    # layer_groups checked it
    layout = _pattern.Pattern(dict.fromkeys(kinds), kinds, len(picks))
    _depth_checks.check_kinds(picks, layout)
    scope_of = lambda i: f"{prefix}/{layout.kind_of(i)}"  # pylint: disable=unnecessary-lambda-assignment
  if fresh is not False and pattern is None and set(fresh) != set(inside):
    only = sorted(set(fresh) ^ set(inside))[0]
    raise ValueError(
        f"take_layers: {only} is in {'new=' if only in fresh else 'params'} but not in "
        f"{'params' if only in fresh else 'new='}; new= must be the same stack at "
        "another depth, in the same layout (pattern= for a mixed-layer stack).")
  fresh_groups = {} if fresh is False else _stack_params.layer_groups(fresh, prefix, pattern)
  _depth_checks.check_fresh(picks, fresh, sum(len(ids) for _, ids in fresh_groups.values()), prefix)
  # A layer's row in its scope's arrays, old and fresh.
  old_row = {int(i): r for _, ids in groups.values() for r, i in enumerate(ids)}
  new_row = {int(i): r for _, ids in fresh_groups.values() for r, i in enumerate(ids)}
  # Each scope's rows in the result, in layer order: (from old?, row).
  rows: dict[str, list[tuple[bool, int]]] = {}
  for p, i in enumerate(picks):
    rows.setdefault(scope_of(p), []).append(
        (False, new_row[p]) if i is None else (True, old_row[i]))
  named = _depth_checks.Zero(zero)
  out, rests = {}, set()
  for scope, scope_rows in rows.items():
    old = groups.get(scope, ({}, None))[0]
    new_modules = fresh_groups.get(scope, ({}, None))[0]
    for key, leaves in (old or new_modules).items():
      rest = key[len(scope) + 1:]
      rests.add(rest)
      out[key] = {}
      for name, leaf in leaves.items():
        new_leaf = new_modules.get(key, {}).get(name)
        if old and new_modules:
          if new_leaf is None:
            raise ValueError(f"take_layers: new= has no {key}/{name}; new= must come "
                             "from the same model at another depth.")
          _depth_checks.check_same(key, name, new_leaf, leaf, 1)
        out[key][name] = _gather(old.get(key, {}).get(name), new_leaf, scope_rows,
                                 named(rest, name))
  if fresh is not False:
    named.check_used(prefix, rests)
  return out


def _gather(old: Any, new: Any, rows: list[tuple[bool, int]], zeroed: bool) -> Any:
  """Rows of ``old`` and ``new`` (zeros when ``zeroed``), in the order ``rows`` gives."""
  if all(from_old for from_old, _ in rows):
    xp = _xp(old)
    return xp.take(old, np.asarray([r for _, r in rows], np.int32), axis=0)
  if new is not None and zeroed:
    new = _xp(new).zeros_like(new)
  if old is None:
    xp = _xp(new)
    return xp.take(new, np.asarray([r for _, r in rows], np.int32), axis=0)
  xp = _xp(old, new)
  both = xp.concatenate([old, new], axis=0)
  offset = old.shape[0]
  return xp.take(both, np.asarray([r if from_old else offset + r for from_old, r in rows],
                                  np.int32), axis=0)


def _is_blockseq(inside: Bundle, prefix: str) -> bool:
  layer_re = _stack_params.layer_pattern(prefix)
  return all(layer_re.match(key) for key in inside)


def _blockseq_layers(inside: Bundle, prefix: str) -> dict[int, dict[str, Mapping[str, Any]]]:
  """``{i: {rest: leaves}}`` of ``<prefix>/layer_<i><rest>`` modules."""
  layer_re = _stack_params.layer_pattern(prefix)
  layers: dict[int, dict[str, Mapping[str, Any]]] = {}
  for key, bundle in inside.items():
    match = layer_re.match(key)
    layers.setdefault(int(match.group(1)), {})[match.group(2) or ""] = bundle
  missing = sorted(set(range(max(layers) + 1)) - set(layers))
  if missing:
    raise ValueError(f"take_layers: {prefix!r} has no layer_{missing[0]} but has "
                     f"layer_{max(layers)}; a BlockSeq's layers are numbered 0 to depth - 1.")
  return layers


def _take_blockseq(inside: Bundle, prefix: str, picks: list[Optional[int]],
                   pattern: Any, fresh: Any, zero: tuple[str, ...]):
  """The BlockSeq layout: layer ``p`` is the renamed modules of its source layer."""
  layers = _blockseq_layers(inside, prefix)
  _depth_checks.check_range(picks, len(layers), prefix)
  if pattern is not None:
    kinds = _stack_params.kinds_of(pattern)
    _depth_checks.check_kinds(picks, _pattern.Pattern(dict.fromkeys(kinds), kinds, len(layers)))
  fresh_layers = {}
  if fresh is not False:
    if not _is_blockseq(fresh, prefix):
      raise ValueError(f"take_layers: params hold {prefix!r} as a BlockSeq "
                       f"({prefix}/layer_<i>/...) but new= does not; pass new= in "
                       "the same layout.")
    fresh_layers = _blockseq_layers(fresh, prefix)
  _depth_checks.check_fresh(picks, fresh, len(fresh_layers), prefix)
  named = _depth_checks.Zero(zero)
  for layer in fresh_layers.values():   # every entry must name some leaf
    for rest, bundle in layer.items():
      for name in bundle:
        named(rest.lstrip("/"), name)
  named.check_used(prefix, {rest.lstrip("/") for layer in fresh_layers.values()
                            for rest in layer})
  out = {}
  for p, i in enumerate(picks):
    modules = layers[i] if i is not None else fresh_layers[p]
    for rest, bundle in modules.items():
      key = f"{prefix}/layer_{p}{rest}"
      if i is not None:
        out[key] = dict(bundle)
        continue
      old = next((layer[rest] for layer in layers.values() if rest in layer), None)
      out[key] = {}
      for name, leaf in bundle.items():
        if old is not None and name in old:
          _depth_checks.check_same(key, name, leaf, old[name], 0)
        out[key][name] = _xp(leaf).zeros_like(leaf) if named(rest.lstrip("/"), name) else leaf
  return out


def _units(n: Any, m: Any, period: Any, helper: str) -> tuple[int, int]:
  """``(n, m)`` in periods, checked: positive, whole periods, ``m >= n``."""
  values = [_checks.as_int(v) for v in (n, m, period)]
  if any(v is None or v < 1 for v in values):
    raise ValueError(f"depth.{helper}(n={n!r}, m={m!r}, period={period!r}): each must be "
                     "a positive int (the old depth, the new one, layers per period).")
  n, m, period = values
  if n % period or m % period:
    raise ValueError(f"depth.{helper}: n={n} and m={m} must be whole periods of "
                     f"{period} layers, so that every layer keeps its kind.")
  if m < n:
    raise ValueError(f"depth.{helper}: m={m} is less than n={n}; it grows a stack. "
                     "To drop layers, list those to keep: take_layers(params, name, [0, 1, 3]).")
  return n // period, m // period


def _expand(units: list[Optional[int]], period: int) -> list[Optional[int]]:
  """Indices of periods -> indices of layers."""
  return [None if u is None else u * period + j for u in units for j in range(period)]
