"""Parameter (and state) layouts: Stacked <-> BlockSeq, by key rewrites.

A :class:`Stacked` named ``model/h`` keeps a parameter as
``{"model/h/block/linear": {"w": [N, d, d]}}``; the matching
:class:`BlockSeq` keeps it as ``{"model/h/layer_<i>/block/linear": {"w":
[d, d]}}`` for ``i`` in ``0..N-1``. These functions rewrite one layout into
the other. Haiku state has the same two-level shape, so they convert state
too. Nothing outside ``prefix`` is touched.

A mixed-layer stack (``pattern=``) keeps each kind's stack under
``model/h/<kind>/...``, with a leading axis of that kind's count; given the
same ``pattern``, these functions rewrite it into the per-layer layout
``model/h/layer_<i>/...`` in layer order (the layout of a ``BlockSeq`` with
that pattern) and back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from stacktools.core import _checks
from stacktools.step import _pattern

Bundle = Mapping[str, Mapping[str, Any]]


def under(key: str, prefix: str) -> bool:
  return key == prefix or key.startswith(prefix + "/")


def _check_prefix(prefix: str) -> str:
  if not isinstance(prefix, str) or not prefix or prefix.endswith("/"):
    raise ValueError(f"prefix={prefix!r} must be a module name such as 'model/h' "
                     "(no trailing '/').")
  return prefix


def unstack_params(params: Bundle, prefix: str, *,
                   pattern: Optional[Sequence[str]] = None) -> dict[str, dict[str, Any]]:
  """Stacked layout -> BlockSeq layout, for every module under ``prefix``.

  Example::

    params = {"model/h/block/linear": {"w": jnp.ones((4, 8, 8))}}
    seq_params = st.unstack_params(params, "model/h")
    # {"model/h/layer_0/block/linear": {"w": [8, 8]}, ..., "model/h/layer_3/..."}

    params = {"model/h/local/block/linear": {"w": jnp.ones((5, 8, 8))},
              "model/h/global/block/linear": {"w": jnp.ones((1, 8, 8))}}
    seq_params = st.unstack_params(params, "model/h", pattern=("local",) * 5 + ("global",))
    # model/h/local/... and model/h/global/... -> model/h/layer_<i>/...

  Args:
    params: Haiku params or state, ``{module: {name: array}}``.
    prefix: the Stacked module's full name.
    pattern: the mixed-layer stack's pattern, for params laid out per kind.

  Returns:
    A new dict; modules under ``prefix`` are split along their leading axis.

  Raises:
    ValueError: when nothing lies under ``prefix``, the leading axes differ,
      the modules under ``prefix`` are already in the BlockSeq layout, or
      (with ``pattern``) a module lies under no kind of the pattern or the
      kinds' counts are not the pattern's.
  """
  _check_prefix(prefix)
  stacked = {k: v for k, v in params.items() if under(k, prefix)}
  if not stacked:
    raise ValueError(
        f"unstack_params: no module is named {prefix!r} or lies under it; the "
        f"modules are {sorted(params)}. Pass the Stacked module's full name.")
  _check_not_unstacked(stacked, prefix)
  out = {k: dict(v) for k, v in params.items() if not under(k, prefix)}
  with _checks.subject("unstack_params"):
    groups = layer_groups(stacked, prefix, pattern)
  for scope, (modules, layer_ids) in groups.items():
    for key, bundle in modules.items():
      rest = key[len(scope):]
      for rank, i in enumerate(layer_ids):
        out[f"{prefix}/layer_{i}{rest}"] = {name: value[rank]
                                            for name, value in bundle.items()}
  return out


def layer_groups(stacked: Bundle, prefix: str, pattern: Optional[Sequence[str]]
                 ) -> dict[str, tuple[Bundle, np.ndarray]]:
  """A stack's modules grouped by the Layers axis they share, with its layers.

  ``{scope: (modules, layer ids)}``: one group, ``prefix``, for a stack of one
  block; one per kind, ``prefix/<kind>``, for a mixed-layer stack. Row ``j``
  of a group's leaves is layer ``layer_ids[j]`` of the stack. Errors start
  with the subject of the public entry point that asks.

  Args:
    stacked: the modules under ``prefix``, ``{module: {name: array}}`` (only
      shapes are read).
    prefix: the stack's full name.
    pattern: the mixed-layer stack's pattern, or ``None``.
  """
  if pattern is None:
    return {prefix: (stacked, np.arange(_common_leading_axis(stacked, prefix)))}
  return _kind_groups(stacked, prefix, pattern)


def kinds_of(pattern: Any) -> tuple[str, ...]:
  kinds = tuple(pattern)
  if not kinds or not all(isinstance(k, str) and k for k in kinds):
    raise ValueError(f"{_checks.where()}pattern={pattern!r} must be the stack's pattern, a "
                     "non-empty sequence of kind names.")
  return kinds


def _kind_groups(stacked: Bundle, prefix: str, pattern: Any):
  """``{prefix/kind: (modules, layer ids)}`` of a mixed-layer stack's params."""
  kinds = kinds_of(pattern)
  modules: dict[str, dict[str, Any]] = {}
  for key, bundle in stacked.items():
    kind = key[len(prefix) + 1:].split("/")[0]
    if kind not in kinds:
      raise ValueError(
          f"{_checks.where()}{key!r} lies under no kind of pattern {kinds}; a "
          f"mixed-layer stack keeps each kind under {prefix}/<kind>/. Pass the "
          "stack's own pattern, or no pattern for a stack of one block.")
    modules.setdefault(kind, {})[key] = bundle
  counts = {kind: _common_leading_axis(modules[kind], f"{prefix}/{kind}")
            for kind in dict.fromkeys(kinds) if kind in modules}
  layout = _pattern.Pattern(dict.fromkeys(kinds), kinds, sum(counts.values()))
  expected = {k: c for k, c in layout.counts.items() if c}
  if counts != expected:
    raise ValueError(
        f"{_checks.where()}the kinds under {prefix!r} hold {counts} layers, but "
        f"pattern {kinds} over {layout.num_layers} layers has {expected}. Pass "
        "the pattern the stack was built with.")
  return {f"{prefix}/{kind}": (group, layout.layer_ids(kind))
          for kind, group in modules.items()}


def stack_params(params: Bundle, prefix: str, *,
                 pattern: Optional[Sequence[str]] = None) -> dict[str, dict[str, Any]]:
  """BlockSeq layout -> Stacked layout: the exact inverse of :func:`unstack_params`.

  Example::

    params = {"model/h/block/linear": {"w": jnp.ones((4, 8, 8))}}
    params = st.stack_params(st.unstack_params(params, "model/h"), "model/h")
    seq_params = {f"model/h/layer_{i}/block/linear": {"w": jnp.ones((8, 8))}
                  for i in range(4)}
    params = st.stack_params(seq_params, "model/h", pattern="LLLG")  # -> h/L, h/G

  Args:
    params: Haiku params or state with modules ``<prefix>/layer_<i>/...``.
    prefix: the BlockSeq module's full name.
    pattern: the pattern of a mixed-layer stack: layer ``i`` goes to the
      stack of kind ``pattern[i % len(pattern)]``, ``<prefix>/<kind>/...``.

  Returns:
    A new dict with each per-layer module stacked on a new leading axis.

  Raises:
    ValueError: when no ``layer_<i>`` module lies under ``prefix``, or the
      layers (of each kind, with ``pattern``) do not all hold the same
      modules and names.
  """
  _check_prefix(prefix)
  layer_re = layer_pattern(prefix)
  layers: dict[str, dict[int, Mapping[str, Any]]] = {}
  out = {}
  for key, bundle in params.items():
    match = layer_re.match(key)
    if match is None:
      out[key] = dict(bundle)
      continue
    layers.setdefault(match.group(2) or "", {})[int(match.group(1))] = bundle
  if not layers:
    raise ValueError(
        f"stack_params: no module named {prefix}/layer_<i>/...; the modules are "
        f"{sorted(params)}. Pass the BlockSeq module's full name.")
  num_layers = max(max(by_index) for by_index in layers.values()) + 1
  if pattern is None:
    scope_of, ids_of, what = (lambda i: prefix), (lambda i: range(num_layers)), "layer"
  else:
    with _checks.subject("stack_params"):
      kinds = kinds_of(pattern)
    layout = _pattern.Pattern(dict.fromkeys(kinds), kinds, num_layers)
    scope_of = lambda i: f"{prefix}/{layout.kind_of(i)}"  # pylint: disable=unnecessary-lambda-assignment
    ids_of = lambda i: layout.layer_ids(layout.kind_of(i)).tolist()  # pylint: disable=unnecessary-lambda-assignment
    what = "layer of its kind"
  for rest, by_index in layers.items():
    for scope in dict.fromkeys(scope_of(i) for i in sorted(by_index)):
      ids = next(ids_of(i) for i in sorted(by_index) if scope_of(i) == scope)
      missing = sorted(set(ids) - set(by_index))
      if missing:
        hint = ""
        if pattern is not None:   # most often the pattern is not the stack's
          hint = (f" pattern={kinds} makes layers {ids} "
                  f"{layout.kind_of(ids[0])!r} layers. If the layers were built "
                  "with another pattern, pass that one.")
        raise ValueError(
            f"stack_params: {prefix}/layer_<i>{rest} is missing for layers "
            f"{missing} of 0..{num_layers - 1}; every {what} needs the same "
            f"modules.{hint}")
      out[scope + rest] = _stack_layers({i: by_index[i] for i in ids}, prefix, rest)
  return out


def _stack_layers(by_index: Mapping[int, Mapping[str, Any]], prefix: str,
                  rest: str) -> dict[str, Any]:
  """One module's bundles of layers ``i`` (in order), stacked on a new axis."""
  first = min(by_index)
  names = set(by_index[first])
  for i, bundle in sorted(by_index.items()):
    if set(bundle) != names:
      raise ValueError(
          f"stack_params: {prefix}/layer_{i}{rest} holds {sorted(bundle)} but "
          f"layer_{first} holds {sorted(names)}; every layer needs the same names.")
    for name in names:
      got, want = _checks.signature(bundle[name]), _checks.signature(by_index[first][name])
      if got != want:
        raise ValueError(
            f"stack_params: {prefix}/layer_{i}{rest}/{name} is {got[1]}"
            f"{list(got[0])} but layer_{first}'s is {want[1]}{list(want[0])}; "
            "layers can only be stacked when their shapes and dtypes agree.")
  return {name: _stack([by_index[i][name] for i in sorted(by_index)])
          for name in sorted(names)}


def layer_pattern(prefix: str) -> re.Pattern[str]:
  """Matches ``<prefix>/layer_<i>[/...]``, capturing ``i`` and the rest."""
  return re.compile(re.escape(prefix) + r"/layer_(\d+)(/.*)?$")


def _check_not_unstacked(stacked: Bundle, prefix: str) -> None:
  """Refuses params whose every module under ``prefix`` is ``layer_<i>``.

  Unstacking them again would split each layer's own leading axis (a square
  weight's rows) into ``layer_<i>/layer_<j>`` modules: a wrong tree, silently.
  """
  pattern = layer_pattern(prefix)
  indices = set()
  for key in stacked:
    match = pattern.match(key)
    if match is None:
      return
    indices.add(int(match.group(1)))
  if indices == set(range(len(indices))):
    raise ValueError(
        f"unstack_params: the params under {prefix!r} look unstacked already: "
        f"every module is {prefix}/layer_<i>/... for layers 0..{len(indices) - 1} "
        "(the BlockSeq layout). unstack_params takes the Stacked layout; use "
        f"st.stack_params(params, {prefix!r}) to go back to it, or pass them on "
        "as they are.")


def _stack(values):
  if all(isinstance(v, np.ndarray) for v in values):
    return np.stack(values)
  return jnp.stack(values)


def _common_leading_axis(stacked: Bundle, prefix: str) -> int:
  sizes = {}
  for key, bundle in stacked.items():
    for name, value in bundle.items():
      shape = jnp.shape(value)
      if not shape:
        raise ValueError(f"{_checks.where()}{key}/{name} is a scalar; every leaf "
                         f"under {prefix!r} needs a leading Layers axis.")
      sizes[f"{key}/{name}"] = shape[0]
  if len(set(sizes.values())) != 1:
    _check_is_a_stack(stacked, prefix)
    raise ValueError(f"{_checks.where()}the leaves under {prefix!r} disagree on "
                     f"the Layers axis: {sizes}.{_pass_the_pattern(stacked, prefix)}")
  return next(iter(sizes.values()))


#: How each entry point that reads a layout is told a stack's name and pattern.
_NAME_ARG = {"over_layers": "stacked=", "take_layers": "name=",
             "unstack_params": "prefix="}


def _check_is_a_stack(stacked: Bundle, prefix: str) -> None:
  """Refuses a module (or modules) whose own leaves differ on the leading axis.

  A stack's leaves all lead with its depth; ``w: [in, out]`` and ``b: [out]``
  of one module (a head) do not, so ``prefix`` names no stack.
  """
  for key, bundle in stacked.items():
    firsts = {name: jnp.shape(value)[0] for name, value in bundle.items()}
    if key == prefix or len(set(firsts.values())) > 1:
      (a, rows_a), (b, rows_b) = sorted(firsts.items())[0], sorted(firsts.items())[-1]
      if rows_a == rows_b:
        detail = f"{key}/{a} has {rows_a} rows"
      else:
        detail = f"{key}/{a} has {rows_a} rows and {key}/{b} {rows_b}"
      arg = _NAME_ARG.get(_checks.who(), "the name")
      fix = ("; leaves under no stack go to the optimizer as they are, so drop it "
             "from stacked=" if arg == "stacked=" else "")
      raise ValueError(
          f"{_checks.where()}{prefix!r} is not a stack: a stack's leaves all lead "
          f"with its Layers axis (num_layers), but {detail}. Pass as {arg} only "
          "the full name that a st.Stacked or st.layer_stack was given (e.g. "
          f"'model/h'){fix}.")


def _pass_the_pattern(stacked: Bundle, prefix: str) -> str:
  """The hint to pass a pattern, when each top-level scope under ``prefix``
  has a Layers axis of its own, as the kinds of a mixed-layer stack do."""
  counts: dict[str, set[int]] = {}
  for key, bundle in stacked.items():
    if "/" not in key[len(prefix) + 1:]:
      return ""           # a module directly under the stack: not a kind
    scope = key[len(prefix) + 1:].split("/")[0]
    counts.setdefault(scope, set()).update(jnp.shape(v)[0] for v in bundle.values())
  if len(counts) < 2 or any(len(c) != 1 for c in counts.values()):
    return ""
  arg = ("stacked={" + repr(prefix) + ": pattern}" if _checks.who() == "over_layers"
         else "pattern=")
  return (f" Each of {sorted(counts)} has a Layers axis of its own, as the kinds of a "
          f"mixed-layer stack ({prefix}/<kind>/...) do: pass the pattern the stack "
          f"was built with as {arg} (the kinds of one period, in layer order).")
