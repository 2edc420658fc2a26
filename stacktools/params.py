"""Parameter (and state) layouts: Stacked <-> BlockSeq, by key rewrites.

A :class:`Stacked` named ``model/h`` keeps a parameter as
``{"model/h/block/linear": {"w": [N, d, d]}}``; the matching
:class:`BlockSeq` keeps it as ``{"model/h/layer_<i>/block/linear": {"w":
[d, d]}}`` for ``i`` in ``0..N-1``. These functions rewrite one layout into
the other. Haiku state has the same two-level shape, so they convert state
too. Nothing outside ``prefix`` is touched.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from stacktools import _checks

Bundle = Mapping[str, Mapping[str, Any]]


def _under(key: str, prefix: str) -> bool:
  return key == prefix or key.startswith(prefix + "/")


def _check_prefix(prefix: str) -> str:
  if not isinstance(prefix, str) or not prefix or prefix.endswith("/"):
    raise ValueError(f"prefix={prefix!r} must be a module name such as 'model/h' "
                     "(no trailing '/').")
  return prefix


def unstack_params(params: Bundle, prefix: str) -> dict[str, dict[str, Any]]:
  """Stacked layout -> BlockSeq layout, for every module under ``prefix``.

  Example::

    seq_params = st.unstack_params(params, "model/h")
    # {"model/h/layer_0/block/linear": {"w": [d, d], ...}, ...}

  Args:
    params: Haiku params or state, ``{module: {name: array}}``.
    prefix: the Stacked module's full name.

  Returns:
    A new dict; modules under ``prefix`` are split along their leading axis.

  Raises:
    ValueError: when nothing lies under ``prefix``, the leading axes differ,
      or the modules under ``prefix`` are already in the BlockSeq layout.
  """
  _check_prefix(prefix)
  stacked = {k: v for k, v in params.items() if _under(k, prefix)}
  if not stacked:
    raise ValueError(
        f"unstack_params: no module is named {prefix!r} or lies under it; the "
        f"modules are {sorted(params)}. Pass the Stacked module's full name.")
  _check_not_unstacked(stacked, prefix)
  num_layers = _common_leading_axis(stacked, prefix)
  out = {k: dict(v) for k, v in params.items() if not _under(k, prefix)}
  for key, bundle in stacked.items():
    rest = key[len(prefix):]
    for i in range(num_layers):
      out[f"{prefix}/layer_{i}{rest}"] = {name: value[i] for name, value in bundle.items()}
  return out


def stack_params(params: Bundle, prefix: str) -> dict[str, dict[str, Any]]:
  """BlockSeq layout -> Stacked layout: the exact inverse of :func:`unstack_params`.

  Example::

    params = st.stack_params(st.unstack_params(params, "model/h"), "model/h")

  Args:
    params: Haiku params or state with modules ``<prefix>/layer_<i>/...``.
    prefix: the BlockSeq module's full name.

  Returns:
    A new dict with each per-layer module stacked on a new leading axis.

  Raises:
    ValueError: when no ``layer_<i>`` module lies under ``prefix``, or the
      layers do not all hold the same modules and names for ``i = 0..N-1``.
  """
  _check_prefix(prefix)
  pattern = _layer_pattern(prefix)
  layers: dict[str, dict[int, Mapping[str, Any]]] = {}
  out = {}
  for key, bundle in params.items():
    match = pattern.match(key)
    if match is None:
      out[key] = dict(bundle)
      continue
    layers.setdefault(match.group(2) or "", {})[int(match.group(1))] = bundle
  if not layers:
    raise ValueError(
        f"stack_params: no module named {prefix}/layer_<i>/...; the modules are "
        f"{sorted(params)}. Pass the BlockSeq module's full name.")
  num_layers = max(max(by_index) for by_index in layers.values()) + 1
  for rest, by_index in layers.items():
    missing = sorted(set(range(num_layers)) - set(by_index))
    if missing:
      raise ValueError(
          f"stack_params: {prefix}/layer_<i>{rest} is missing for layers "
          f"{missing} of 0..{num_layers - 1}; every layer needs the same modules.")
    names = set(by_index[0])
    for i, bundle in sorted(by_index.items()):
      if set(bundle) != names:
        raise ValueError(
            f"stack_params: {prefix}/layer_{i}{rest} holds {sorted(bundle)} but "
            f"layer_0 holds {sorted(names)}; every layer needs the same names.")
      for name in names:
        got, want = _checks.signature(bundle[name]), _checks.signature(by_index[0][name])
        if got != want:
          raise ValueError(
              f"stack_params: {prefix}/layer_{i}{rest}/{name} is {got[1]}"
              f"{list(got[0])} but layer_0's is {want[1]}{list(want[0])}; "
              "layers can only be stacked when their shapes and dtypes agree.")
    out[prefix + rest] = {
        name: _stack([by_index[i][name] for i in range(num_layers)])
        for name in sorted(names)}
  return out


def _layer_pattern(prefix: str) -> re.Pattern[str]:
  """Matches ``<prefix>/layer_<i>[/...]``, capturing ``i`` and the rest."""
  return re.compile(re.escape(prefix) + r"/layer_(\d+)(/.*)?$")


def _check_not_unstacked(stacked: Bundle, prefix: str) -> None:
  """Refuses params whose every module under ``prefix`` is ``layer_<i>``.

  Unstacking them again would split each layer's own leading axis (a square
  weight's rows) into ``layer_<i>/layer_<j>`` modules: a wrong tree, silently.
  """
  pattern = _layer_pattern(prefix)
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
        raise ValueError(f"unstack_params: {key}/{name} is a scalar; every leaf "
                         f"under {prefix!r} needs a leading Layers axis.")
      sizes[f"{key}/{name}"] = shape[0]
  if len(set(sizes.values())) != 1:
    raise ValueError(f"unstack_params: the leaves under {prefix!r} disagree on "
                     f"the Layers axis: {sizes}.")
  return next(iter(sizes.values()))
