"""Trace-time checks shared by every module, and their wording.

Each check is one small function that raises a ``TypeError`` or
``ValueError`` saying what was wrong, what is accepted and how to fix it.
Keeping them here means ``st.fold``, ``Stacked``, ``BlockSeq``,
``layer_stack`` and the parameter rewrites accept the same values and say the
same thing about the same mistake.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import numbers
import operator
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from stacktools.core import _context

PyTree = Any


# ---------------------------------------------------------------------------
# Who is speaking: the public entry point that was called.

_SUBJECTS = _context.ContextStack[str]()


def subject(name: str) -> contextlib.AbstractContextManager[str]:
  """Makes ``name`` (``"Stacked"``, ``"layer_stack"``) the subject of errors.

  A public entry point sets it once; every check below reads it with
  :func:`where`, so no helper has to be told who called it.
  """
  return _SUBJECTS.push(name)


def who() -> str:
  """The innermost public entry point being run (``""`` outside one)."""
  return _SUBJECTS.innermost("")


def where() -> str:
  """``"Stacked: "``, the prefix of an error message, or ``""``."""
  return f"{who()}: " if who() else ""


# ---------------------------------------------------------------------------
# Describing values in messages.


def describe(value: Any) -> str:
  """A short phrase for ``value`` in an error message: "a tuple of 3"."""
  if isinstance(value, (tuple, list)):
    return f"a {type(value).__name__} of {len(value)}"
  if value is None:
    return "None"
  shape = getattr(value, "shape", None)
  if shape is not None:
    return f"an array of shape {tuple(shape)}"
  return f"a {type(value).__name__}"


def show(value: Any) -> str:
  """``value`` as an error message shows it: the value itself (``0``,
  ``''``, ``1.5``) for a string, number or None, else :func:`describe`."""
  if value is None or isinstance(value, (str, numbers.Number)):
    return repr(value)
  return describe(value)


def dtype_of(leaf: Any) -> Any:
  """The dtype of an array-like leaf, typed PRNG keys (``key<fry>``) included.

  ``jnp.result_type`` refuses key dtypes, so an array's own ``dtype`` comes
  first; Python scalars fall back to ``jnp.result_type``.
  """
  dtype = getattr(leaf, "dtype", None)
  return jnp.result_type(leaf) if dtype is None else dtype


def nbytes(leaf: Any, skip_leading: bool = False) -> int:
  """Bytes of an array-like leaf (without its leading axis if asked)."""
  shape = jnp.shape(leaf)[1 if skip_leading else 0:]
  return math.prod(shape) * dtype_of(leaf).itemsize


def signature(leaf: Any) -> tuple[tuple[int, ...], Any]:
  """``(shape, dtype)`` of an array-like leaf."""
  return tuple(jnp.shape(leaf)), dtype_of(leaf)


def path_str(prefix: str, path: Any) -> str:
  """``prefix`` followed by a pytree key path, e.g. ``xs['w'][0]``."""
  return prefix + jax.tree_util.keystr(path)


# ---------------------------------------------------------------------------
# Integers.


def as_int(value: Any) -> Optional[int]:
  """``value`` as an int when it is an integer (numpy ones too), else None.

  ``True`` and ``False`` are not integers here: ``num_layers=True`` is a
  mistake, not a stack of one.
  """
  if isinstance(value, bool):
    return None
  try:
    return operator.index(value)
  except TypeError:
    return None


def check_num_layers(num_layers: Any) -> int:
  """An int (numpy ints too) >= 1, returned as a Python int."""
  value = as_int(num_layers)
  if value is None:
    raise TypeError(f"{where()}num_layers must be an int >= 1, got {num_layers!r}.")
  if value < 1:
    raise ValueError(f"{where()}num_layers must be >= 1, got {value}.")
  return value


def check_unroll(unroll: Any) -> Union[int, bool]:
  """An int >= 1 (numpy ints too), or a bool as ``jax.lax.scan`` takes it."""
  if isinstance(unroll, bool):
    return unroll
  else:
    value = as_int(unroll)
    if value is not None and value >= 1:
      return value
  raise ValueError(f"{where()}unroll={unroll!r} is not accepted: use an int >= 1 "
                   "(steps per rolled loop iteration) or True to unroll fully.")


def check_layer_drop(layer_drop: Any, num_layers: int) -> Optional[Any]:
  """Per-layer drop rates as a float64 numpy array, or None when nothing drops.

  A rate is a probability in ``[0, 1)``; one float applies to every layer.
  All zeros is the same as None: the stack then runs exactly as without.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  if layer_drop is None:
    return None
  fix = ("Pass a float in [0, 1) for every layer, or one per layer, e.g. "
         f"layer_drop=[0.1 * (i + 1) / {num_layers} for i in range({num_layers})].")
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(layer_drop)):
    raise TypeError(
        f"{where()}layer_drop= was given a traced value ({describe(layer_drop)} "
        "computed or passed in under jax.jit or a transformation), but the rates "
        "are fixed when the stack is built, so they must be concrete: Python "
        "floats or a numpy array, closed over rather than passed to the jitted "
        f"function (or passed as a static argument). {fix}")
  try:
    rates = np.asarray(layer_drop, np.float64)
  except (TypeError, ValueError):
    rates = None
  if rates is None or isinstance(layer_drop, (bool, str)) or rates.ndim > 1:
    raise TypeError(f"{where()}layer_drop={layer_drop!r} is not a rate. {fix}")
  if rates.ndim == 1 and rates.shape[0] != num_layers:
    raise ValueError(f"{where()}layer_drop= has {rates.shape[0]} rates, but the stack "
                     f"has num_layers={num_layers}. {fix}")
  if not np.all((rates >= 0) & (rates < 1)):
    raise ValueError(f"{where()}layer_drop={layer_drop!r} has a rate outside [0, 1) "
                     f"(a rate of 1 would scale the kept update by 1/0). {fix}")
  rates = np.broadcast_to(rates, (num_layers,)).copy()
  return rates if rates.any() else None


def check_in_place(in_place: Any, owner: str) -> None:
  """``in_place=`` of ``st.per_layer``/``st.per_kind``: a bool."""
  if not isinstance(in_place, (bool, np.bool_)):
    raise TypeError(f"{owner}: in_place={in_place!r} must be True or False.")


def check_length(length: Any) -> int:
  """A loop length: an int >= 0 (numpy ints too)."""
  value = as_int(length)
  if value is None or value < 0:
    raise ValueError(f"length={length!r} must be a non-negative int.")
  return value


def check_factory(make_block: Any) -> None:
  """``make_block`` must be a factory, not a block instance."""
  owner = who()
  # Imported here so that the pure-JAX loops, which share this module, do not
  # pull in Haiku.
  import haiku as hk  # pylint: disable=g-import-not-at-top
  if isinstance(make_block, hk.Module):
    raise TypeError(
        f"{owner} got a module instance, {type(make_block).__name__}, as "
        "make_block, but it needs a factory that makes the block inside the "
        f"stack: pass a factory (a class or a lambda), e.g. {owner}("
        f"lambda: {type(make_block).__name__}(...), ...), not the module itself.")
  if not callable(make_block):
    raise TypeError(
        f"{owner} needs make_block, a factory (a class or a lambda) that returns "
        f"the block, e.g. lambda: Block(cfg); got {make_block!r}.")


# ---------------------------------------------------------------------------
# Leading (Layers) axes.


def loop_length(xs: PyTree, length: Any) -> int:
  """The number of steps of a loop over ``xs``, checked against every leaf."""
  if length is not None:
    length = check_length(length)
  leaves = jax.tree_util.tree_flatten_with_path(xs)[0]
  if not leaves:
    if length is None:
      raise ValueError(
          f"xs is {describe(xs)}, so the number of steps is unknown: pass "
          "length=N, or xs with a leading axis of N.")
    return length
  first_path = None
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if not shape:
      raise ValueError(
          f"{path_str('xs', path)} is a scalar; every leaf of xs needs a leading "
          "axis to loop over. Broadcast values belong in the carry or a closure.")
    if length is None:
      length, first_path = shape[0], path
    elif shape[0] != length:
      if first_path is None:
        raise ValueError(
            f"{path_str('xs', path)} has a leading axis of {shape[0]}, but "
            f"length={length}; the leading axis of every leaf of xs must equal "
            "the loop length.")
      raise ValueError(
          f"{path_str('xs', path)} has a leading axis of {shape[0]}, but "
          f"{path_str('xs', first_path)} has {length}; every leaf of xs needs the "
          "same leading axis (the loop length).")
  return length


def check_leading_axis(tree: PyTree, num_layers: int, label: str) -> None:
  """Raises a ValueError unless every leaf of ``tree`` leads with ``num_layers``."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = jnp.shape(leaf)
    where = path_str(label, path)
    if not shape:
      raise ValueError(
          f"{where} is a scalar, but a per-layer argument needs a leading axis "
          f"of num_layers={num_layers}. Pass it unmarked to broadcast it.")
    if shape[0] != num_layers:
      raise ValueError(
          f"{where} has a leading axis of {shape[0]}, but the stack has "
          f"num_layers={num_layers}; a per-layer argument needs one slice per "
          "layer on its leading axis.")


def check_layer_rows(params: PyTree, state: PyTree, rows: int, *, stack: str,
                     num_layers: int, kind: Optional[str] = None,
                     pattern: Optional[tuple[str, ...]] = None,
                     nested: bool = False) -> None:
  """Every stacked parameter and state leaf has one row per layer (of ``kind``).

  Called where a stack's apply reads them (``Stacked``, ``layer_stack``, each
  kind of a mixed stack, a stack nested in another), as ``hk.layer_stack``'s
  scan refuses: the first rows of deeper parameters would otherwise run
  silently, and shallower ones fail inside ``lax.scan`` without a name.
  A ``nested`` stack (inside another's block) is named relative to that
  block, and its parameters have the outer Layers axis too: no
  ``take_layers`` advice.
  """
  scope = stack if kind is None else f"{stack}/{kind}"
  for what, tree in (("parameter", params), ("state", state)):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      shape = jnp.shape(leaf)
      if shape and shape[0] == rows:
        continue
      name = "/".join(str(getattr(k, "key", k)) for k in path)
      got = f"{shape[0]} rows" if shape else "no rows (it is a scalar)"
      if kind is None:
        need = f"the stack has num_layers={num_layers}"
        fix = (f"build the stack with num_layers={shape[0]}, the depth they were made "
               "for, or " if shape else "")
        edit = f"st.take_layers(params, {stack!r}, indices)"
      else:
        need = (f"pattern={pattern} gives the kind {kind!r} {rows} of the stack's "
                f"num_layers={num_layers}")
        fix = "build the stack with the num_layers and pattern they were made for, or "
        edit = f"st.take_layers(params, {stack!r}, indices, pattern={pattern})"
      if nested:
        fix = fix[:-len(", or ")] + "." if fix else "give it one row per layer."
      else:
        fix += f"change their depth first with {edit}."
      raise ValueError(
          f"{where()}the {what} {scope}/{name} has {got} on its leading (Layers) "
          f"axis, but {need}, and a stack reads one row per layer: {fix}")


# ---------------------------------------------------------------------------
# What a loop body returns.


def returned_a_pair_for_a_fold(carry: PyTree, out: Any) -> bool:
  """Whether a fold body returned ``(carry, y)`` instead of the carry."""
  in_tree = jax.tree_util.tree_structure(carry)
  return (jax.tree_util.tree_structure(out) != in_tree and
          isinstance(out, tuple) and len(out) == 2 and
          jax.tree_util.tree_structure(out[0]) == in_tree)


def is_pair(out: Any) -> bool:
  return isinstance(out, (tuple, list)) and len(out) == 2


def check_fold_output(carry: PyTree, new_carry: PyTree) -> None:
  """A fold body returns only the new carry, like the one it was given."""
  if returned_a_pair_for_a_fold(carry, new_carry):
    raise TypeError(
        "A fold body must return only the new carry, but it returned a pair "
        "(carry, y). For per-step outputs use st.scan, which stacks the ys.")
  check_carry(carry, new_carry)


def check_scan_output(out: Any) -> None:
  """A scan body returns a pair ``(new_carry, y)``."""
  if not is_pair(out):
    raise TypeError(
        "A scan body must return a pair (new_carry, y), but it returned "
        f"{describe(out)}. A body that returns only the new carry is a fold: "
        "use st.fold.")


def check_carry(carry: PyTree, new_carry: PyTree) -> None:
  """The carry a step returns must match the one it was given, leaf by leaf."""
  in_leaves, in_tree = jax.tree_util.tree_flatten_with_path(carry)
  out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(new_carry)
  if in_tree != out_tree:
    raise TypeError(
        "The loop body changed the structure of the carry: it was given "
        f"{in_tree} and returned {out_tree}. A step must return a carry with "
        "the same structure, shapes and dtypes as the one it was given.")
  for (path, a), (_, b) in builtins.zip(in_leaves, out_leaves):
    (shape_a, dtype_a), (shape_b, dtype_b) = signature(a), signature(b)
    if shape_a != shape_b or dtype_a != dtype_b:
      raise TypeError(
          f"The loop body changed {path_str('carry', path)} from "
          f"{dtype_a}{list(shape_a)} to {dtype_b}{list(shape_b)}. A step must "
          "return a carry with the same structure, shapes and dtypes as the "
          "one it was given.")


# ---------------------------------------------------------------------------
# Names a checkpoint policy refers to.
