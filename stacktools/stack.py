"""Haiku: a repeated block's parameters stacked on a Layers axis, one scan.

``Stacked`` and ``layer_stack`` run a block through the same machinery:

1. The block is wrapped in an inner ``hk.transform_with_state``.
2. Init is ``jax.vmap(inner.init)`` over one key per layer, lifted into the
   outer transform with ``hk.transparent_lift_with_state``, so that every
   parameter and state leaf gains a leading ``num_layers`` axis.
3. Apply is :func:`stacktools.loops.scan` over :class:`LayerSlice` (params,
   state, rng, per-layer arguments, layer index) with ``inner.apply`` as the
   body and the chosen checkpoint policy.
4. The per-layer state that comes out of the scan goes back to Haiku through
   the lift's state updater, which knows the module's unique name (so two
   stacks with the same requested name keep their state apart).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import haiku as hk
import jax.numpy as jnp

from stacktools import _checks
from stacktools import _layers
from stacktools import loops
from stacktools import periods
from stacktools import pipeline as pipeline_lib
from stacktools import policy as policy_lib
from stacktools import segments as segments_lib

PyTree = Any


def run_stacked(inner: hk.TransformedWithState, x: PyTree,
                arguments: _layers.BlockArguments, *, num_layers: int, kind: str,
                remat: segments_lib.Remat, unroll: Union[int, bool],
                reverse: bool, owner: str,
                pipeline: Optional[pipeline_lib.Pipeline] = None) -> tuple[PyTree, PyTree]:
  """Inits (vmapped) and applies (scanned) a stack; call inside a module.

  With a ``pipeline`` and a mesh whose pipe axis is larger than 1, apply runs
  the layers as that pipeline; init (never differentiated, never split) runs
  them as a plain scan.
  """
  keys = _layers.draw_layer_keys(num_layers)
  indices = jnp.arange(num_layers, dtype=jnp.int32)
  params, state, updater = _layers.lift_layers(inner, keys.init, x,
                                               arguments.sliced, indices)

  def body(carry, layer: _layers.LayerSlice):
    return _layers.apply_layer(inner, carry, layer, kind=kind, owner=owner)

  layers = _layers.LayerSlice(params=params, state=state, rng=keys.apply,
                              sliced=arguments.sliced, index=indices)
  stages = pipeline.stages() if pipeline is not None else 1
  if stages > 1 and not hk.running_init():
    pipeline.check(num_layers, stages, owner)
    segments = segments_lib.segments_for(remat, num_layers, owner=owner)
    if len(segments) > 1:
      raise ValueError(
          f"{owner}: a pipelined stack runs every stage with one checkpoint "
          f"policy, but remat gives {len(segments)} per-depth segments. Pass one "
          "policy (e.g. remat='full' or 'nested'), or run without a pipeline.")
    x, ys, new_state = pipeline_lib.run(
        body, x, pipeline_lib.StageLayers(*layers), _layers.LayerSlice,
        pipeline=pipeline, stages=stages, policy=segments[0].policy,
        unroll=unroll, owner=owner)
    updater.update(new_state)
    return x, ys
  x, results = loops.scan(body, length=num_layers, remat=remat, unroll=unroll,
                          reverse=reverse)(x, layers)
  updater.update(results.state)
  return x, results.y


# ---------------------------------------------------------------------------
# Stacked.


class Stacked(_layers.StackModule):
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

  A mixed-layer stack takes one factory per kind and the ``pattern`` of
  kinds that repeats (a depth the period does not divide ends with the
  pattern's prefix). Each kind's parameters are stacked under
  ``h/<kind>/...`` with a leading axis of that kind's count; the layers run
  as one loop over periods, each run of one kind an inner scan, each layer
  checkpointed by itself::

    blocks = st.Stacked({"local": lambda: Block(window=128),
                         "global": lambda: Block(window=None)},
                        num_layers=26, pattern=("local",) * 5 + ("global",),
                        remat="full", name="h")
    x = blocks.fold(x, mask)
    x, caches = blocks.scan(x, st.per_kind({"local": lc, "global": gc}))

  Args:
    make_block: a callable, called inside the stack, that returns the block
      (an ``hk.Module`` or any function ``block(x, *args, **kwargs)``); or,
      with ``pattern``, a mapping from each kind's name to such a callable.
    num_layers: how many times the block is repeated (>= 1).
    remat: a checkpoint policy or alias (see :class:`CheckpointPolicy`),
      :func:`per_depth` segments, or ``"auto"`` (see :func:`plan_remat`).
      With a pattern, ``nested`` splits the loop over whole periods.
    unroll: layers per rolled loop iteration, or ``True`` to unroll fully
      (with a pattern: periods per rolled iteration of the period loop).
    reverse: apply the layers from the last to the first.
    pattern: the kinds of one period, e.g. ``("local",) * 5 + ("global",)``;
      a string is read one kind per letter (``"LLLG"``).
    ys_by_kind: with a pattern, how ``scan`` returns the blocks' outputs:
      ``None`` in layer order when every kind's agree in shapes and dtypes
      and per kind (``{kind: ys}``, each in kind order) otherwise; ``True``
      always per kind (e.g. caches that go back in through
      :func:`per_kind`); ``False`` always in layer order.
    pipeline: an :class:`st.Pipeline`: under a mesh with its axis (size P >
      1), the layers run as P pipeline stages over microbatches of the
      batch; without one, as a plain stack. The parameters are the plain
      stack's either way.
    name: the module name.
  """

  def __init__(self, make_block: Any, num_layers: int,
               *, remat: policy_lib.RematSpec = False, unroll: Union[int, bool] = 1,
               reverse: bool = False, pattern: Optional[Sequence[str]] = None,
               ys_by_kind: Optional[bool] = None,
               pipeline: Optional[pipeline_lib.Pipeline] = None,
               name: Optional[str] = None):
    super().__init__(make_block, num_layers, remat=remat, reverse=reverse,
                     pattern=pattern, ys_by_kind=ys_by_kind, name=name)
    self.unroll = _checks.check_unroll(unroll, type(self).__name__)
    self.pipeline = _check_pipeline(pipeline, pattern, reverse)

  @_layers.StackModule.layer_scope
  def run_layers(self, inner: hk.TransformedWithState, x: PyTree,
                 arguments: _layers.BlockArguments, kind: str) -> tuple[PyTree, PyTree]:
    if self.pattern is not None:
      return periods.run_patterned(
          inner, x, arguments, pattern=self.pattern, kind=kind,
          remat=self.remat_now(), unroll=self.unroll, reverse=self.reverse,
          owner=type(self).__name__)
    return run_stacked(inner, x, arguments, num_layers=self.num_layers,
                       kind=kind, remat=self.remat_now(), unroll=self.unroll,
                       reverse=self.reverse, owner=type(self).__name__,
                       pipeline=self.pipeline)


def _check_pipeline(pipeline: Any, pattern: Any,
                    reverse: bool) -> Optional[pipeline_lib.Pipeline]:
  if pipeline is None:
    return None
  if not isinstance(pipeline, pipeline_lib.Pipeline):
    raise TypeError(
        f"Stacked: pipeline must be an st.Pipeline, got {_checks.describe(pipeline)}; "
        "e.g. pipeline=st.Pipeline(axis='pipe', microbatches=8).")
  if pattern is not None:
    raise ValueError(
        "Stacked: a stack with pattern= cannot be pipelined yet (its kinds have "
        "different parameter trees, and a stage holds one tree). Pipeline a "
        "stack of one block, or drop pipeline=.")
  if reverse:
    raise ValueError(
        "Stacked: reverse=True cannot be pipelined: the stages run the layers "
        "first to last. Reverse the block order yourself, or drop pipeline=.")
  return pipeline


# ---------------------------------------------------------------------------
# layer_stack: a drop-in for hk.layer_stack.


class _LayerStackScope(hk.Module):
  """The module hk.layer_stack's parameters live under; runs one call."""

  def __call__(self, block_call, x, arguments, **config):
    if isinstance(config["remat"], segments_lib.AutoRemat):
      # A plan tells stacks apart by their unique module name; init needs
      # no plan (see StackModule.remat_now).
      config["remat"] = segments_lib.AutoRemat(self.module_name)
      if hk.running_init() and not segments_lib.plan_active():
        config["remat"] = policy_lib.REMAT_ALIASES["none"]
    return run_stacked(_layers.make_inner(block_call, arguments), x, arguments,
                       **config)


def _check_no_varargs(f: Callable[..., Any]) -> None:
  params = list(inspect.signature(f).parameters.values())
  if params and params[0].kind == inspect.Parameter.VAR_POSITIONAL:
    name = getattr(f, "__qualname__", None) or f"{type(f).__qualname__}.__call__"
    # Starts with hk.layer_stack's own wording (its `f` is the parameter's
    # name, whatever the function), so code that matches Haiku's error keeps
    # working.
    raise ValueError(
        "layer_stack: The function `f` should not have any `varargs` (that is "
        f"*args) argument. `{name.split('.<locals>.')[-1]}` must not take "
        "*args: name its positional arguments explicitly (def f(x, y): ...), "
        "as hk.layer_stack requires.")


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
    remat: as in :class:`Stacked`.
    name: the module name; defaults to hk.layer_stack's.

  Returns:
    A decorator: ``layer_stack(...)(f)`` is the stacked function, called with
    ``f``'s arguments and an optional ``reverse=`` keyword.
  """
  num_layers = _checks.check_num_layers(num_layers, "layer_stack")
  remat = segments_lib.as_remat(remat)
  unroll = _checks.check_unroll(unroll, "layer_stack")
  if not name:
    name = ("__layer_stack_with_per_layer" if with_per_layer_inputs
            else "__layer_stack_no_per_layer")
  config = dict(num_layers=num_layers, remat=remat, unroll=unroll,
                owner="layer_stack")

  def iterate(f):
    if with_per_layer_inputs:
      @functools.wraps(f)
      def wrapped(x, *ys, reverse: bool = False):
        kw = {"reverse": reverse} if pass_reverse_to_layer_fn else {}
        arguments = _layers.BlockArguments(
            [_layers.PerLayer(y) for y in ys], {}, num_layers, "layer_stack")

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
          block_call, tuple(args), _layers.BlockArguments((), {}, num_layers, "layer_stack"),
          kind="fold", reverse=reverse, **config)
      return carry[0] if len(args) == 1 else carry

    return wrapped

  return iterate
