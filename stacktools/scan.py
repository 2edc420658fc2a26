"""Loops over a leading axis with a checkpoint policy: fold, scan and map.

Pure JAX (no Haiku): research code can use these alone. Each is curried like
Haliax's: configure first, then call with the initial carry and the inputs::

  carry = st.fold(step, remat="nested")(init, xs)
  carry, ys = st.scan(step, remat=True)(init, xs)
  ys = st.map(fn)(xs)

``"nested"`` runs a two-level loop: an outer ``lax.scan`` whose every step is
checkpointed as a whole and runs an inner ``lax.scan`` over a chunk of the
layers. Only the outer carries are kept, and one chunk's carries while that
chunk is differentiated, so memory grows like ``2*sqrt(N)`` carries. A length
that does not factor well (a prime) gets one more, shorter, checkpointed chunk
at the end rather than a worse split.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Callable
from typing import Any, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
from jax import lax

from stacktools import policy as policy_lib

Carry = TypeVar("Carry")
Y = TypeVar("Y")
PyTree = Any

OUTER_CARRY_NAME = policy_lib.OUTER_CARRY_NAME


def fold(f: Callable[[Carry, Any], Carry], *, length: Optional[int] = None,
         remat: policy_lib.RematSpec = False, unroll: Union[int, bool] = 1,
         reverse: bool = False) -> Callable[..., Carry]:
  """A loop that threads a carry through ``f`` once per element of ``xs``.

  The moral equivalent of::

    for x in xs:
      carry = f(carry, x)

  Example::

    def layer(h, w):
      return jnp.tanh(h @ w)

    h = st.fold(layer, remat="nested")(h0, ws)   # ws: [num_layers, d, d]

  Args:
    f: ``f(carry, x) -> carry``; the carry keeps its structure, shapes and
      dtypes.
    length: the number of steps; needed when ``xs`` is ``None``, checked
      against the leading axis of ``xs`` otherwise.
    remat: a checkpoint policy or alias (see :class:`CheckpointPolicy`).
    unroll: steps per rolled loop iteration (>= 1), or ``True`` to unroll
      fully, as in ``jax.lax.scan``.
    reverse: run from the last element of ``xs`` to the first.

  Returns:
    ``run(init, xs=None) -> carry``.
  """
  policy = policy_lib.CheckpointPolicy.from_remat(remat)
  unroll = _check_unroll(unroll)

  def step(carry, x):
    new_carry = f(carry, x)
    check_fold_output(carry, new_carry)
    return new_carry, None

  def run(init: Carry, xs: PyTree = None) -> Carry:
    n = _loop_length(xs, length)
    carry, _ = _loop(step, init, xs, n, policy, unroll, reverse)
    return carry

  return run


def scan(f: Callable[[Carry, Any], tuple[Carry, Y]], *,
         length: Optional[int] = None, remat: policy_lib.RematSpec = False,
         unroll: Union[int, bool] = 1,
         reverse: bool = False) -> Callable[..., tuple[Carry, Y]]:
  """Like :func:`fold`, but ``f`` also returns a per-step output, stacked.

  The moral equivalent of::

    ys = []
    for x in xs:
      carry, y = f(carry, x)
      ys.append(y)
    return carry, stack(ys)

  Example::

    def layer(h, w):
      h = jnp.tanh(h @ w)
      return h, jnp.linalg.norm(h)

    h, norms = st.scan(layer, remat=True)(h0, ws)   # norms: [num_layers]

  Args:
    f: ``f(carry, x) -> (carry, y)``.
    length: as in :func:`fold`.
    remat: as in :func:`fold`.
    unroll: as in :func:`fold`.
    reverse: as in :func:`fold`; ``ys`` stays in the order of ``xs``.

  Returns:
    ``run(init, xs=None) -> (carry, ys)``, every leaf of ``ys`` with a leading
    axis of the loop length.
  """
  policy = policy_lib.CheckpointPolicy.from_remat(remat)
  unroll = _check_unroll(unroll)

  def step(carry, x):
    out = f(carry, x)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
      raise TypeError(
          "A scan body must return a pair (new_carry, y), but it returned "
          f"{_describe(out)}. A body that returns only the new carry is a fold: "
          "use st.fold.")
    new_carry, y = out
    check_carry(carry, new_carry)
    return new_carry, y

  def run(init: Carry, xs: PyTree = None) -> tuple[Carry, Y]:
    n = _loop_length(xs, length)
    return _loop(step, init, xs, n, policy, unroll, reverse)

  return run


def map(f: Callable[[Any], Y], *,  # pylint: disable=redefined-builtin
        remat: policy_lib.RematSpec = False) -> Callable[[PyTree], Y]:
  """Applies ``f`` to each element along the leading axis of ``xs`` in a loop.

  Uses less memory than ``jax.vmap`` (one element at a time), like
  ``jax.lax.map``, and takes a checkpoint policy.

  Example::

    ys = st.map(lambda x: jnp.sort(x))(xs)

  Args:
    f: ``f(x) -> y``.
    remat: as in :func:`fold`.

  Returns:
    ``run(xs) -> ys``.
  """
  scan_f = scan(lambda carry, x: (carry, f(x)), remat=remat)

  def run(xs: PyTree) -> Y:
    if not jax.tree_util.tree_leaves(xs):
      raise ValueError("st.map needs xs with at least one array to map over; "
                       f"got {_describe(xs)}.")
    _, ys = scan_f(None, xs)
    return ys

  return run


def nested_split(length: int, nested: Union[bool, int], *, carry_bytes: float = 1.0,
                 layer_bytes: float = 0.0,
                 largest_leaf_bytes: float = 0.0) -> tuple[int, int, int]:
  """How a nested loop of ``length`` steps is split.

  Example::

    nested_split(61, True)   # (8, 7, 5): 8 chunks of 7 steps, then 5 steps

  With ``nested=True`` the split minimises an estimate of the bytes the
  backward pass holds at its peak:

  * the carries: one per outer chunk, plus the ``inner`` carries of the
    chunk being differentiated;
  * the chunk's slice of ``xs`` and its gradient, ``2 * inner * layer_bytes``
    (this is what makes nested worse than full when a layer's parameters are
    much larger than its carry, unless chunks are kept short);
  * with a remainder, the gradient of its slice of ``xs`` is padded to the
    full length one leaf at a time: ``length * largest_leaf_bytes``.

  With the default sizes this counts carries alone.

  Args:
    length: the number of steps.
    nested: ``True`` to choose the split, or an int number of full outer
      chunks.
    carry_bytes: the size of the carry.
    layer_bytes: the size of one step's slice of ``xs``.
    largest_leaf_bytes: the size of the largest leaf of one step's slice.

  Returns:
    ``(outer, inner, remainder)`` with ``outer * inner + remainder == length``:
    ``outer`` chunks of ``inner`` steps, then one chunk of ``remainder``
    steps when ``remainder > 0``.
  """
  if length < 1:
    raise ValueError(f"A nested loop needs length >= 1, got {length}.")
  if nested is True:
    def peak_bytes(inner):
      outer, remainder = divmod(length, inner)
      has_rem = remainder > 0
      estimate = (carry_bytes * (outer + has_rem + inner) +
                  2 * layer_bytes * max(inner, remainder) +
                  has_rem * length * largest_leaf_bytes)
      return estimate, has_rem, abs(inner - outer)
    inner = min(range(1, length + 1), key=peak_bytes)
    outer, remainder = divmod(length, inner)
    return outer, inner, remainder
  outer = min(int(nested), length)
  inner, remainder = divmod(length, outer)
  return outer, inner, remainder


# ---------------------------------------------------------------------------
# The loop itself.


def _loop(step, init, xs, n, policy, unroll, reverse):
  if policy.disable or n == 0:
    return lax.scan(step, init, xs, length=n, reverse=reverse, unroll=unroll)
  if not policy.nested:
    return lax.scan(policy.checkpoint_step(step), init, xs, length=n,
                    reverse=reverse, unroll=unroll)
  return _nested_loop(step, init, xs, n, policy, unroll, reverse)


def _outer_checkpoint(policy, fn):
  """Checkpoints one outer chunk as a whole: only its input carry is kept."""
  if policy.save_carries == "offload":
    jax_policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[OUTER_CARRY_NAME],
        offload_src="device", offload_dst="pinned_host")
  else:
    jax_policy = jax.checkpoint_policies.nothing_saveable

  def named(carry, x):
    return fn(policy_lib.checkpoint_name(carry, OUTER_CARRY_NAME), x)

  return jax.checkpoint(named, policy=jax_policy, prevent_cse=policy.prevent_cse)


def _nested_loop(step, init, xs, n, policy, unroll, reverse):
  def nbytes(leaf, skip_leading=False):
    shape = jnp.shape(leaf)[1 if skip_leading else 0:]
    return math.prod(shape) * jnp.dtype(jnp.result_type(leaf)).itemsize

  layer_leaf_bytes = [nbytes(a, True) for a in jax.tree_util.tree_leaves(xs)]
  outer, inner, remainder = nested_split(
      n, policy.nested,
      carry_bytes=sum(nbytes(c) for c in jax.tree_util.tree_leaves(init)) or 1,
      layer_bytes=sum(layer_leaf_bytes), largest_leaf_bytes=max(layer_leaf_bytes, default=0))
  inner_step = policy.inner().checkpoint_step(step)

  def run_chunk(carry, chunk_xs, size):
    return lax.scan(inner_step, carry, chunk_xs, length=size, reverse=reverse,
                    unroll=unroll)

  # Each chunk is cut from the full xs inside the outer loop (a dynamic
  # slice), rather than reshaping or splitting xs up front: a split copy of
  # xs, and of its gradient, would cost as much memory as the carries saved.
  def outer_step(carry, chunk_index):
    start = chunk_index * inner
    chunk_xs = jax.tree_util.tree_map(
        lambda a: lax.dynamic_slice_in_dim(a, start, inner, axis=0), xs)
    return run_chunk(carry, chunk_xs, inner)

  def main_part(carry):
    carry, ys = lax.scan(_outer_checkpoint(policy, outer_step), carry,
                         jnp.arange(outer), reverse=reverse)
    return carry, jax.tree_util.tree_map(
        lambda y: y.reshape((outer * inner,) + y.shape[2:]), ys)

  def remainder_part(carry):
    rem_xs = jax.tree_util.tree_map(lambda a: a[outer * inner:], xs)
    return _outer_checkpoint(policy, lambda c, x: run_chunk(c, x, remainder))(
        carry, rem_xs)

  if not remainder:
    return main_part(init)
  if reverse:
    carry, ys_rem = remainder_part(init)
    carry, ys_main = main_part(carry)
  else:
    carry, ys_main = main_part(init)
    carry, ys_rem = remainder_part(carry)
  ys = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b], axis=0),
                              ys_main, ys_rem)
  return carry, ys


# ---------------------------------------------------------------------------
# Checks, all at trace time.


def _as_int(value) -> Optional[int]:
  """``value`` as an int when it is an integer (numpy ones too), else None."""
  if isinstance(value, bool):
    return None
  try:
    return operator.index(value)
  except TypeError:
    return None


def _check_unroll(unroll):
  if isinstance(unroll, bool):
    return unroll
  as_int = _as_int(unroll)
  if as_int is None or as_int < 1:
    raise ValueError(f"unroll={unroll!r} is not accepted: use an int >= 1 (steps "
                     "per rolled loop iteration) or True to unroll fully.")
  return as_int


def _path(prefix, path):
  return prefix + jax.tree_util.keystr(path)


def _loop_length(xs, length) -> int:
  """The number of steps, checked against every leaf of ``xs``."""
  if length is not None:
    as_int = _as_int(length)
    if as_int is None or as_int < 0:
      raise ValueError(f"length={length!r} must be a non-negative int.")
    length = as_int
  leaves = jax.tree_util.tree_flatten_with_path(xs)[0]
  if not leaves:
    if length is None:
      raise ValueError(
          f"xs is {_describe(xs)}, so the number of steps is unknown: pass "
          "length=N, or xs with a leading axis of N.")
    return length
  first_path = None
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if not shape:
      raise ValueError(
          f"{_path('xs', path)} is a scalar; every leaf of xs needs a leading "
          "axis to loop over. Broadcast values belong in the carry or a closure.")
    if length is None:
      length, first_path = shape[0], path
    elif shape[0] != length:
      if first_path is None:
        raise ValueError(
            f"{_path('xs', path)} has a leading axis of {shape[0]}, but "
            f"length={length}; the leading axis of every leaf of xs must equal "
            "the loop length.")
      raise ValueError(
          f"{_path('xs', path)} has a leading axis of {shape[0]}, but "
          f"{_path('xs', first_path)} has {length}; every leaf of xs needs the "
          "same leading axis (the loop length).")
  return length


def _describe(value) -> str:
  if isinstance(value, (tuple, list)):
    return f"a {type(value).__name__} of {len(value)}"
  if value is None:
    return "None"
  shape = getattr(value, "shape", None)
  if shape is not None:
    return f"an array of shape {tuple(shape)}"
  return f"a {type(value).__name__}"


def _signature(leaf):
  return tuple(jnp.shape(leaf)), jnp.result_type(leaf)


def check_fold_output(carry, new_carry):
  in_tree = jax.tree_util.tree_structure(carry)
  if (jax.tree_util.tree_structure(new_carry) != in_tree and
      isinstance(new_carry, tuple) and len(new_carry) == 2 and
      jax.tree_util.tree_structure(new_carry[0]) == in_tree):
    raise TypeError(
        "A fold body must return only the new carry, but it returned a pair "
        "(carry, y). For per-step outputs use st.scan, which stacks the ys.")
  check_carry(carry, new_carry)


def check_carry(carry, new_carry):
  """The carry a step returns must match the one it was given, leaf by leaf."""
  in_leaves, in_tree = jax.tree_util.tree_flatten_with_path(carry)
  out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(new_carry)
  if in_tree != out_tree:
    raise TypeError(
        "The loop body changed the structure of the carry: it was given "
        f"{in_tree} and returned {out_tree}. A step must return a carry with "
        "the same structure, shapes and dtypes as the one it was given.")
  for (path, a), (_, b) in builtins.zip(in_leaves, out_leaves):
    (shape_a, dtype_a), (shape_b, dtype_b) = _signature(a), _signature(b)
    if shape_a != shape_b or dtype_a != dtype_b:
      raise TypeError(
          f"The loop body changed {_path('carry', path)} from "
          f"{dtype_a}{list(shape_a)} to {dtype_b}{list(shape_b)}. A step must "
          "return a carry with the same structure, shapes and dtypes as the "
          "one it was given.")
