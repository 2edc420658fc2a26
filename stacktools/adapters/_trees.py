"""Adapter trees: split from the base, joined back, stacked, merged into it.

A Haiku params tree with adapters (``{module: {"w", "b", "lora_a",
"lora_b"}}``) is two trees of the same module paths: the *base* (every other
leaf, exactly the tree a model without adapters has) and the *adapters*
(``lora_a``/``lora_b`` only). Training differentiates the adapters alone, so
an optimizer initialised on them holds no state for the base; a checkpoint
of the adapters is a few MB beside a base of GBs.

Shapes: a weight ``w`` is ``[*lead, d_in, d_out]`` (``lead`` is ``()`` or a
stack's Layers axis), its adapter ``[*lead, d_in, r]`` and ``[*lead, r,
d_out]``, or with an adapter axis ``[*lead, n, d_in, r]`` and ``[*lead, n,
r, d_out]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp

from stacktools.adapters import _lora

Params = Mapping[str, Mapping[str, Any]]
_NAMES = (_lora.LORA_A, _lora.LORA_B)


def split(params: Params) -> tuple[dict, dict]:
  """``(base, adapters)``: the adapters' leaves, and all the others.

  Example::

    params = {"h/fc": {"w": jnp.ones([2, 4, 4]), "lora_a": jnp.ones([2, 4, 1]),
                       "lora_b": jnp.zeros([2, 1, 4])}}
    base, adapters = st.adapters.split(params)
    assert list(base["h/fc"]) == ["w"] and set(adapters["h/fc"]) == {"lora_a", "lora_b"}
    assert st.adapters.join(base, adapters) == params

  Args:
    params: a Haiku params tree, with or without adapters.

  Returns:
    The base tree (the same structure as the model without adapters) and the
    adapters tree (only the modules that have adapters).

  See also: :func:`join`, :func:`merge`.
  """
  base, adapters = {}, {}
  for module, bundle in params.items():
    rest = {n: v for n, v in bundle.items() if n not in _NAMES}
    mine = {n: v for n, v in bundle.items() if n in _NAMES}
    if rest:
      base[module] = rest
    if mine:
      adapters[module] = mine
  return base, adapters


def _describe(w: Any, lead: int) -> str:
  shape = tuple(w.shape)
  return f"{list(shape[-2:])}" + (f" over leading axes {list(shape[:lead])}" if lead else "")


def check_adapters(base: Params, adapters: Params, *, who: str = "join") -> None:
  """Raises a one-line ``ValueError`` unless ``adapters`` fit ``base``: every
  adapted module is a Linear of the base, with the same leading axes and
  widths (an adapter axis allowed)."""
  for module, bundle in adapters.items():
    if set(bundle) != set(_NAMES):
      raise ValueError(
          f"st.adapters.{who}: the adapters of {module} are {sorted(bundle)}; an "
          f"adapter is {list(_NAMES)} (the adapters tree from st.adapters.split).")
    w = base.get(module, {}).get("w")
    if w is None:
      raise ValueError(
          f"st.adapters.{who}: the adapters adapt {module}, which the base has no "
          "weight 'w' of; these adapters were trained on another model.")
    a, b = bundle[_lora.LORA_A], bundle[_lora.LORA_B]
    lead = w.ndim - _lora.MATRIX_AXES
    extra = a.ndim - w.ndim   # 1 with an adapter axis
    fits = (extra in (0, 1) and b.ndim == a.ndim and a.shape[:lead] == w.shape[:lead]
            and b.shape[:lead] == w.shape[:lead] and a.shape[-2] == w.shape[-2]
            and b.shape[-1] == w.shape[-1] and a.shape[-1] == b.shape[-2]
            and a.shape[lead:-2] == b.shape[lead:-2])
    if not fits:
      raise ValueError(
          f"st.adapters.{who}: the adapter of {module} (lora_a {list(a.shape)}, lora_b "
          f"{list(b.shape)}) does not fit the base's weight {_describe(w, lead)}; these "
          "adapters were trained on a base of another shape.")


def join(base: Params, adapters: Params) -> dict:
  """The params tree a model with adapters takes: ``base`` and ``adapters``.

  Example::

    base = {"fc": {"w": jnp.ones([4, 4]), "b": jnp.zeros([4])}}
    adapters = {"fc": {"lora_a": jnp.ones([4, 2]), "lora_b": jnp.zeros([2, 4])}}
    assert set(st.adapters.join(base, adapters)["fc"]) == {"w", "b", "lora_a", "lora_b"}

  Args:
    base: the base tree (:func:`split`'s first, or a model's without adapters).
    adapters: the adapters tree (:func:`split`'s second, or :func:`stack`'s).

  Returns:
    One tree, each adapted module's bundle holding both.

  Raises:
    ValueError: an adapter that does not fit its base (another model, another
      width or depth), in one line.
  """
  check_adapters(base, adapters)
  joined = {m: dict(b) for m, b in base.items()}
  for module, bundle in adapters.items():
    joined[module].update(bundle)
  return joined


def stack(adapters: Sequence[Params]) -> dict:
  """Many adapters trees of one base on an adapter axis (``count`` of them).

  The axis goes just before each parameter's two matrix axes, after any
  Layers axis, where ``st.adapters.lora(..., count=n)`` reads it.

  Example::

    one = {"fc": {"lora_a": jnp.ones([4, 2]), "lora_b": jnp.zeros([2, 4])}}
    both = st.adapters.stack([one, one])
    assert both["fc"]["lora_a"].shape == (2, 4, 2)

  Args:
    adapters: adapters trees (:func:`split`'s second) of the same targets,
      rank and base.

  Returns:
    One adapters tree, adapter ``i`` at index ``i`` of the new axis.

  Raises:
    ValueError: trees of other modules or shapes (other targets, ranks or
      bases), in one line.
  """
  if not adapters:
    raise ValueError("st.adapters.stack: no adapters given; pass a list of adapters "
                     "trees (st.adapters.split's second).")
  first = jax.tree.map(lambda a: (a.shape, a.dtype), adapters[0])
  for i, tree in enumerate(adapters[1:], 1):
    other = jax.tree.map(lambda a: (a.shape, a.dtype), tree)
    if other != first:
      raise ValueError(
          f"st.adapters.stack: adapters {i} differ from adapters 0 in their modules or "
          "shapes; adapters served together share the targets, rank and base.")
  return jax.tree.map(lambda *a: jnp.stack(a, axis=a[0].ndim - _lora.MATRIX_AXES),
                      *adapters)


def merge(params: Params, *, alpha: Optional[float] = None,
          adapter: Optional[int] = None) -> dict:
  """A plain checkpoint of the base's structure, with the adapters folded in.

  ``w + (alpha / rank) * lora_a @ lora_b`` for each adapted module, layer by
  layer (the product is formed here, once, for export, never in a step).

  Example::

    params = {"fc": {"w": jnp.zeros([3, 3]), "lora_a": jnp.ones([3, 1]),
                     "lora_b": jnp.ones([1, 3])}}
    merged = st.adapters.merge(params, alpha=2.0)
    assert list(merged["fc"]) == ["w"] and float(merged["fc"]["w"][0, 0]) == 2.0

  Args:
    params: a tree with adapters (:func:`join`'s, or a model's own).
    alpha: the ``alpha`` the adapters were trained with (``None``: the rank).
    adapter: with an adapter axis, which adapter to fold in.

  Returns:
    The base tree with each adapted ``w`` replaced by the merged weight.

  Raises:
    ValueError: an adapter axis without ``adapter``, or adapters that do not
      fit the base.
  """
  base, adapters = split(params)
  check_adapters(base, adapters, who="merge")
  merged = {m: dict(b) for m, b in base.items()}
  for module, bundle in adapters.items():
    w, a, b = base[module]["w"], bundle[_lora.LORA_A], bundle[_lora.LORA_B]
    if a.ndim > w.ndim:
      if adapter is None:
        raise ValueError(
            f"st.adapters.merge: {module} has {a.shape[-3]} adapters on an adapter "
            "axis; say which to fold in with adapter=i.")
      a, b = jnp.take(a, adapter, axis=-3), jnp.take(b, adapter, axis=-3)
    scale = (a.shape[-1] if alpha is None else alpha) / a.shape[-1]
    delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))
    merged[module]["w"] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
  return merged
