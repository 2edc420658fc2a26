"""Haiku: a repeated block's parameters stacked on a Layers axis, one scan.

``Stacked`` and ``layer_stack`` run a block through the same machinery:

1. The block is wrapped in an inner ``hk.transform_with_state``.
2. Init is ``jax.vmap(inner.init)`` over one key per layer, lifted into the
   outer transform with ``hk.transparent_lift_with_state``, so that every
   parameter and state leaf gains a leading ``num_layers`` axis.
3. Apply is :func:`stacktools.scan` over (params, state, rng, per-layer
   arguments, layer index) with ``inner.apply`` as the body and the chosen
   checkpoint policy.
4. The per-layer state that comes out of the scan goes back to Haiku through
   the lift's state updater, which knows the module's unique name (so two
   stacks with the same requested name keep their state apart).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import haiku as hk
import jax
import jax.numpy as jnp

from stacktools import policy as policy_lib
from stacktools.scan import scan as _scan

PyTree = Any


# ---------------------------------------------------------------------------
# Per-layer arguments and the layer index.


@dataclasses.dataclass(frozen=True)
class PerLayer:
  """An argument to slice along its leading (Layers) axis; see :func:`per_layer`."""

  value: PyTree


def per_layer(tree: PyTree) -> PerLayer:
  """Marks an argument of ``Stacked.fold``/``scan`` to be sliced per layer.

  Every leaf of ``tree`` must have a leading axis of ``num_layers``; layer
  ``i`` receives ``tree`` with every leaf indexed at ``i``. Arguments that are
  not marked are given whole to every layer.

  Example::

    x, new_cache = blocks.scan(x, mask, st.per_layer(kv_cache))

  Args:
    tree: a pytree of arrays with a leading ``num_layers`` axis.

  Returns:
    A marker that the stack unwraps.
  """
  if isinstance(tree, PerLayer):
    return tree
  return PerLayer(tree)


_local = threading.local()


def _index_stack() -> list[jax.Array]:
  if not hasattr(_local, "indices"):
    _local.indices = []
  return _local.indices


@contextlib.contextmanager
def at_layer(index: jax.Array) -> Iterator[None]:
  """Makes ``index`` what :func:`layer_index` returns inside the block."""
  stack = _index_stack()
  stack.append(index)
  try:
    yield
  finally:
    stack.pop()


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

  Returns:
    A scalar int32 array (a tracer inside the loop).

  Raises:
    RuntimeError: when called outside a stacked block.
  """
  stack = _index_stack()
  if not stack:
    raise RuntimeError(
        "st.layer_index() was called outside a stacked block. Call it inside "
        "the block function of st.Stacked, st.BlockSeq or st.layer_stack.")
  return stack[-1]


# ---------------------------------------------------------------------------
# One call of a stack: which arguments are broadcast, which sliced.


class BlockArguments:
  """Splits a call's arguments into broadcast ones and per-layer ones."""

  def __init__(self, args: Sequence[Any], kwargs: Mapping[str, Any],
               num_layers: int, owner: str):
    self._args = tuple(args)
    self._kwargs = dict(kwargs)
    self.sliced: dict[str, PyTree] = {}
    for i, arg in enumerate(self._args):
      if isinstance(arg, PerLayer):
        self.sliced[f"arg{i}"] = arg.value
    for key, arg in self._kwargs.items():
      if isinstance(arg, PerLayer):
        self.sliced[f"kw_{key}"] = arg.value
    for key, value in self.sliced.items():
      label = (f"positional argument {key[3:]}" if key.startswith("arg")
               else f"keyword argument {key[3:]!r}")
      check_leading_axis(value, num_layers, f"{owner}: per_layer {label}")

  def bind(self, sliced: Mapping[str, PyTree]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with per-layer ones replaced by one layer's slice."""
    args = tuple(sliced[f"arg{i}"] if isinstance(a, PerLayer) else a
                 for i, a in enumerate(self._args))
    kwargs = {k: sliced[f"kw_{k}"] if isinstance(a, PerLayer) else a
              for k, a in self._kwargs.items()}
    return args, kwargs


def check_leading_axis(tree: PyTree, num_layers: int, label: str) -> None:
  """Raises a ValueError unless every leaf of ``tree`` leads with ``num_layers``."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = jnp.shape(leaf)
    where = label + jax.tree_util.keystr(path)
    if not shape:
      raise ValueError(
          f"{where} is a scalar, but a per-layer argument needs a leading axis "
          f"of num_layers={num_layers}. Pass it unmarked to broadcast it.")
    if shape[0] != num_layers:
      raise ValueError(
          f"{where} has a leading axis of {shape[0]}, but the stack has "
          f"num_layers={num_layers}; a per-layer argument needs one slice per "
          "layer on its leading axis.")


def check_num_layers(num_layers: Any, owner: str) -> int:
  if isinstance(num_layers, bool) or not isinstance(num_layers, int):
    raise TypeError(f"{owner}: num_layers must be an int >= 1, got {num_layers!r}.")
  if num_layers < 1:
    raise ValueError(f"{owner}: num_layers must be >= 1, got {num_layers}.")
  return num_layers


def configure_stack(module: hk.Module, make_block: Any, num_layers: Any,
                    remat: policy_lib.RematSpec, unroll: Any, reverse: bool) -> None:
  """Checks a Stacked/BlockSeq constructor's arguments and stores them."""
  owner = type(module).__name__
  if not callable(make_block):
    raise TypeError(
        f"{owner} needs make_block, a callable that returns the block (e.g. "
        f"lambda: Block(cfg)), got {make_block!r}.")
  if not isinstance(unroll, bool) and (not isinstance(unroll, int) or unroll < 1):
    raise ValueError(f"{owner}: unroll={unroll!r} must be an int >= 1 or True.")
  module.make_block = make_block
  module.num_layers = check_num_layers(num_layers, owner)
  module.policy = policy_lib.CheckpointPolicy.from_remat(remat)
  module.unroll = unroll
  module.reverse = reverse


def split_block_output(out: Any, x: Any, kind: str, owner: str) -> tuple[Any, Any]:
  """``(new_x, y)`` from a block's output, checked against the fold/scan kind."""
  x_tree = jax.tree_util.tree_structure(x)
  if kind == "fold":
    if (jax.tree_util.tree_structure(out) != x_tree and
        isinstance(out, tuple) and len(out) == 2 and
        jax.tree_util.tree_structure(out[0]) == x_tree):
      raise TypeError(
          f"{owner}.fold: the block returned a pair (x, y), but a fold block "
          f"returns only the new x. Use {owner}.scan to collect per-layer "
          "outputs.")
    return out, None
  if not isinstance(out, (tuple, list)) or len(out) != 2:
    if owner == "layer_stack":
      raise TypeError(
          "layer_stack(with_per_layer_inputs=True): the function must return a "
          f"pair (x, z), but it returned {_describe(out)}. For a function that "
          "returns only x, use with_per_layer_inputs=False.")
    raise TypeError(
        f"{owner}.scan: a scan block must return a pair (x, y), but it "
        f"returned {_describe(out)}. A block that returns only x is a fold "
        f"block: use {owner}.fold.")
  return out[0], out[1]


def _describe(value: Any) -> str:
  if isinstance(value, (tuple, list)):
    return f"a {type(value).__name__} of {len(value)}"
  shape = getattr(value, "shape", None)
  if shape is not None:
    return f"an array of shape {tuple(shape)}"
  return f"a {type(value).__name__}"


def make_inner(block_call: Callable[..., Any],
               arguments: BlockArguments) -> hk.TransformedWithState:
  """The inner transform: one layer, ``(x, sliced) -> block output``."""

  def one_layer(x, sliced):
    args, kwargs = arguments.bind(sliced)
    return block_call(x, *args, **kwargs)

  return hk.transform_with_state(one_layer)


def layer_keys(num_layers: int) -> Optional[jax.Array]:
  """One key per layer from the outer transform's rng, or ``None`` without one."""
  key = hk.maybe_next_rng_key()
  return None if key is None else jax.random.split(key, num_layers)


def _run_stack(block_call: Callable[..., Any], x: PyTree, arguments: BlockArguments, *,
               num_layers: int, kind: str, policy: policy_lib.CheckpointPolicy,
               unroll: Union[int, bool], reverse: bool,
               owner: str) -> tuple[PyTree, PyTree]:
  """Inits (vmapped) and applies (scanned) a stack; call inside a module."""
  inner = make_inner(block_call, arguments)
  # Drawn at init and at apply alike, so the apply keys below are the same
  # draw in both (as in hk.layer_stack).
  init_key = hk.maybe_next_rng_key()
  init_keys = None
  if init_key is not None and hk.running_init():
    init_keys = jax.random.split(init_key, num_layers)

  def init_all_layers(keys, x, sliced):
    def init_one(key, layer_sliced, index):
      with at_layer(index):
        return inner.init(key, x, layer_sliced)
    return jax.vmap(init_one, in_axes=(None if keys is None else 0, 0, 0),
                    axis_size=num_layers)(
                        keys, sliced, jnp.arange(num_layers, dtype=jnp.int32))

  params_and_state, updater = hk.transparent_lift_with_state(
      init_all_layers, allow_reuse=True)
  params, state = params_and_state(init_keys, x, arguments.sliced)

  def body(carry, layer):
    layer_params, layer_state, rng, sliced, index = layer
    with at_layer(index):
      out, new_state = inner.apply(layer_params, layer_state, rng, carry, sliced)
    new_carry, y = split_block_output(out, carry, kind, owner)
    return new_carry, (y, new_state)

  layers = (params, state, layer_keys(num_layers), arguments.sliced,
            jnp.arange(num_layers, dtype=jnp.int32))
  x, (ys, states) = _scan(body, length=num_layers, remat=policy, unroll=unroll,
                          reverse=reverse)(x, layers)
  updater.update(states)
  return x, ys


# ---------------------------------------------------------------------------
# Stacked.


class Stacked(hk.Module):
  """A block repeated ``num_layers`` times: parameters stacked, one scan.

  Parameters and state of the block gain a leading ``num_layers`` axis and
  live under this module's name (``h/block/linear`` with ``w`` of shape
  ``[num_layers, ...]``). All layers are initialised independently, from one
  key each, by a single ``jax.vmap`` of the block's init.

  Example::

    blocks = st.Stacked(lambda: Block(cfg), num_layers=12, remat="nested",
                        name="h")
    x = blocks.fold(x, mask)                    # fold block: returns x
    x, ys = blocks.scan(x, st.per_layer(cache)) # scan block: returns (x, y)

  Args:
    make_block: a callable, called inside the stack, that returns the block
      (an ``hk.Module`` or any function ``block(x, *args, **kwargs)``).
    num_layers: how many times the block is repeated (>= 1).
    remat: a checkpoint policy or alias (see :class:`CheckpointPolicy`).
    unroll: layers per rolled loop iteration, or ``True`` to unroll fully.
    reverse: apply the layers from the last to the first.
    name: the module name.
  """

  def __init__(self, make_block: Callable[[], Callable[..., Any]], num_layers: int,
               *, remat: policy_lib.RematSpec = False, unroll: Union[int, bool] = 1,
               reverse: bool = False, name: Optional[str] = None):
    super().__init__(name=name)
    configure_stack(self, make_block, num_layers, remat, unroll, reverse)

  def fold(self, x: PyTree, *args: Any, **kwargs: Any) -> PyTree:
    """Applies every layer to the carry ``x``; the block returns the new ``x``.

    Args:
      x: the carry (the residual stream), any pytree of arrays.
      *args: further block arguments; broadcast to every layer unless wrapped
        in :func:`per_layer`.
      **kwargs: likewise.

    Returns:
      ``x`` after the last layer.
    """
    x, _ = self._apply(x, args, kwargs, kind="fold")
    return x

  def scan(self, x: PyTree, *args: Any, **kwargs: Any) -> tuple[PyTree, PyTree]:
    """Like :meth:`fold` for a block that returns ``(x, y)``.

    Args:
      x: the carry.
      *args: as in :meth:`fold`.
      **kwargs: as in :meth:`fold`.

    Returns:
      ``(x, ys)``: ``x`` after the last layer and every layer's ``y`` stacked
      on a leading ``num_layers`` axis.
    """
    return self._apply(x, args, kwargs, kind="scan")

  # Named like __call__ so that fold and scan create the same parameter names
  # (Haiku would otherwise scope modules made inside fold under "~fold").
  @hk.experimental.name_like("__call__")
  def _apply(self, x, args, kwargs, *, kind):
    owner = type(self).__name__
    if isinstance(x, PerLayer):
      raise TypeError(f"{owner}.{kind}: the carry x cannot be per_layer; only "
                      "the arguments after it can be.")
    arguments = BlockArguments(args, kwargs, self.num_layers, owner)

    def block_call(x, *a, **k):
      return self.make_block()(x, *a, **k)

    return _run_stack(block_call, x, arguments, num_layers=self.num_layers,
                      kind=kind, policy=self.policy, unroll=self.unroll,
                      reverse=self.reverse, owner=owner)


# ---------------------------------------------------------------------------
# layer_stack: a drop-in for hk.layer_stack.


class _LayerStackScope(hk.Module):
  """The module hk.layer_stack's parameters live under; runs one call."""

  def __call__(self, block_call, x, arguments, **config):
    return _run_stack(block_call, x, arguments, **config)


def _check_no_varargs(f: Callable[..., Any]) -> None:
  params = list(inspect.signature(f).parameters.values())
  if params and params[0].kind == inspect.Parameter.VAR_POSITIONAL:
    raise ValueError(
        "layer_stack: the function must not take *args; name its positional "
        "arguments explicitly (def f(x, y): ...), as hk.layer_stack requires.")


def layer_stack(num_layers: int, with_per_layer_inputs: bool = False,
                unroll: Union[int, bool] = 1, pass_reverse_to_layer_fn: bool = False,
                *, remat: policy_lib.RematSpec = False,
                name: Optional[str] = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """A drop-in for ``hk.layer_stack``, with a vmapped init and ``remat=``.

  Same calling conventions and the same parameter and state names, structure
  and shapes as ``hk.layer_stack``; given the same parameters the outputs are
  equal. Differences: every layer is initialised independently by one
  ``jax.vmap`` (on the same input), the initial state is the block's own
  initial state, and ``remat=`` takes a checkpoint policy.

  Example::

    def f(x):
      return jax.nn.relu(hk.Linear(64)(x))

    x = st.layer_stack(12, remat="full")(f)(x)

    def g(x, y):          # with_per_layer_inputs=True: (x, *ys) -> (x, z)
      return x + y, jnp.sum(x)

    x, zs = st.layer_stack(12, with_per_layer_inputs=True)(g)(x, ys)

  Args:
    num_layers: how many times ``f`` is applied, each with its own parameters.
    with_per_layer_inputs: ``f(x, *ys) -> (x, z)`` with ``ys`` sliced per
      layer and ``z`` stacked; otherwise ``f(*args) -> args``.
    unroll: layers per rolled loop iteration.
    pass_reverse_to_layer_fn: pass the call's ``reverse`` to ``f`` as a
      keyword argument.
    remat: a checkpoint policy or alias (see :class:`CheckpointPolicy`).
    name: the module name; defaults to hk.layer_stack's.

  Returns:
    A decorator: ``layer_stack(...)(f)`` is the stacked function, called with
    ``f``'s arguments and an optional ``reverse=`` keyword.
  """
  num_layers = check_num_layers(num_layers, "layer_stack")
  policy = policy_lib.CheckpointPolicy.from_remat(remat)
  if not isinstance(unroll, bool) and (not isinstance(unroll, int) or unroll < 1):
    raise ValueError(f"layer_stack: unroll={unroll!r} must be an int >= 1 or True.")
  if not name:
    name = ("__layer_stack_with_per_layer" if with_per_layer_inputs
            else "__layer_stack_no_per_layer")
  config = dict(num_layers=num_layers, policy=policy, unroll=unroll,
                owner="layer_stack")

  def iterate(f):
    if with_per_layer_inputs:
      @functools.wraps(f)
      def wrapped(x, *ys, reverse: bool = False):
        kw = {"reverse": reverse} if pass_reverse_to_layer_fn else {}
        arguments = BlockArguments([PerLayer(y) for y in ys], {}, num_layers,
                               "layer_stack")

        def block_call(x, *layer_ys):
          return f(x, *layer_ys, **kw)

        return _LayerStackScope(name=name)(block_call, x, arguments, kind="scan",
                                           reverse=reverse, **config)
      return wrapped

    _check_no_varargs(f)

    @functools.wraps(f)
    def wrapped(*args, reverse: bool = False):
      kw = {"reverse": reverse} if pass_reverse_to_layer_fn else {}

      def block_call(carry):
        out = f(*carry, **kw)
        # A one-argument f returns a value, not a 1-tuple (as hk.layer_stack).
        return (out,) if len(carry) == 1 else out

      carry, _ = _LayerStackScope(name=name)(
          block_call, tuple(args), BlockArguments((), {}, num_layers, "layer_stack"),
          kind="fold", reverse=reverse, **config)
      return carry[0] if len(args) == 1 else carry

    return wrapped

  return iterate
