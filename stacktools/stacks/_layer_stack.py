"""``layer_stack``: a drop-in for ``hk.layer_stack`` on the same engine.

Same calling conventions, parameter and state names as Haiku's; the layers
run through :func:`stacktools.stacks._run_stacked.run_stacked`, as ``Stacked``'s
do, as a stack of one block.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Optional, Union

import haiku as hk

from stacktools.core import _checks
from stacktools.remat import _policy
from stacktools.remat import _segments
from stacktools.stacks import _run_stacked
from stacktools.step import _arguments
from stacktools.step import _layer_step
from stacktools.step import _pattern


class _LayerStackScope(hk.Module):
  """The module hk.layer_stack's parameters live under; runs one call."""

  def __call__(self, block_call, x, arguments, *, remat, **config):
    if isinstance(remat, _segments.AutoRemat):
      # A plan tells stacks apart by their unique module name.
      remat = _segments.AutoRemat(self.module_name)
    with _checks.subject("layer_stack"):
      return _run_stacked.run_stacked(
          {_pattern.ONE_KIND: _layer_step.make_inner(block_call, arguments)},
          x, arguments, remat=remat, **config)


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
                *, remat: _policy.RematSpec = False,
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

    x = st.layer_stack(12, remat="full")(f)(jnp.ones((2, 64)))

    def g(x, y):          # with_per_layer_inputs=True: (x, *ys) -> (x, z)
      return x + y, jnp.sum(x)

    ys = jnp.ones((12, 64))
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
  with _checks.subject("layer_stack"):
    num_layers = _checks.check_num_layers(num_layers)
    remat = _segments.as_remat(remat)
    unroll = _checks.check_unroll(unroll)
  if not name:
    name = ("__layer_stack_with_per_layer" if with_per_layer_inputs
            else "__layer_stack_no_per_layer")
  config = dict(pattern=_pattern.Pattern.uniform(num_layers),
                remat=remat, unroll=unroll)

  def iterate(f):
    if with_per_layer_inputs:
      @functools.wraps(f)
      def wrapped(x, *ys, reverse: bool = False):
        kw = {"reverse": reverse} if pass_reverse_to_layer_fn else {}
        with _checks.subject("layer_stack"):
          arguments = _arguments.BlockArguments(
              [_arguments.PerLayer(y) for y in ys], {}, num_layers)

        def block_call(x, *layer_ys):
          return f(x, *layer_ys, **kw)

        return _LayerStackScope(name=name)(block_call, x, arguments, mode="scan",
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
          block_call, tuple(args), _arguments.BlockArguments((), {}, num_layers),
          mode="fold", reverse=reverse, **config)
      return carry[0] if len(args) == 1 else carry

    return wrapped

  return iterate
