"""The parts around a stack that a loss-computing pipeline runs per microbatch.

The ``1f1b``, ``interleaved`` and ``zb`` schedules run ``embed`` on their
first stage and ``head`` on their last, one microbatch at a time, inside
their tick loop (``_run_with_loss.py``). :func:`prepare_ends` turns
``Stacked.loss``'s parts into what that loop runs, :class:`Ends`: pure
functions of parameters looked up once, by name, so that the parameter tree
is the same with or without a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp

from stacktools.core import _checks
from stacktools.pipelines import _pipeline
from stacktools.step import _arguments

PyTree = Any


class Ends(NamedTuple):
  """The parts around a stack that a 1F1B pipeline runs per microbatch.

  ``embed(embed_params, inputs) -> x`` runs on the first stage and
  ``head(head_params, x, targets) -> loss`` (a scalar: the microbatch's mean)
  on the last; both are pure. ``broadcast`` holds the block's broadcast
  arguments and ``with_broadcast(values)`` a context in which the block
  sees ``values`` instead, so that their gradients come out too.
  """

  embed: Callable[..., PyTree]
  head: Callable[..., jax.Array]
  embed_params: PyTree
  head_params: PyTree
  inputs: PyTree
  targets: PyTree
  broadcast: PyTree
  with_broadcast: Callable[[PyTree], Any]


def prepare_ends(pipeline: _pipeline.Pipeline, ends: Optional[tuple[Any, ...]],
                 arguments: _arguments.BlockArguments) -> tuple[PyTree, Ends]:
  """The carry's shape, and ``Stacked.loss``'s parts as a loss pipeline runs them.

  Called before the stack's layers are lifted: they and the loop plan read
  the carry. ``embed`` and ``head`` become pure functions of their
  parameters, which are looked up once, here.

  Args:
    pipeline: a configuration whose schedule computes the loss.
    ends: ``(embed, head, inputs, targets)`` as ``Stacked.loss`` gives them.
    arguments: the call's arguments, whose broadcast ones get gradients.

  Returns:
    Zeros shaped as the whole batch's carry (the pipeline embeds each
    microbatch itself), and the parts as :class:`Ends`.

  Raises:
    ValueError: without ``ends``: such a pipeline needs the loss inside.
  """
  if ends is None:
    raise ValueError(
        f"{_checks.where()}schedule={pipeline.schedule!r} computes the loss inside the "
        "pipeline, so "
        "the stack must be called with the parts around it: "
        "blocks.loss(embed, head, inputs, targets) (or scan_loss), not fold or "
        "scan; or use schedule='gpipe'.")
  embed, head, inputs, targets = ends
  micro = pipeline.microbatches
  first = lambda t: jax.tree_util.tree_map(lambda a: a[::micro], t)  # noqa: E731
  embed, embed_params = _explicit_params(embed, "embed", first(inputs))
  x_micro = jax.eval_shape(embed, embed_params, first(inputs))
  head, head_params = _explicit_params(head, "head", x_micro, first(targets))
  x = jax.tree_util.tree_map(
      lambda s: jnp.zeros((s.shape[0] * micro,) + s.shape[1:], s.dtype), x_micro)
  return x, Ends(embed, head, embed_params, head_params, inputs, targets,
                arguments.broadcast, arguments.broadcast_as)


def _explicit_params(fn: Callable[..., Any], role: str,
                     *example: Any) -> tuple[Callable[..., Any], dict[str, jax.Array]]:
  """``fn`` (Haiku code) as ``fn(params, *args)``, and the params it reads.

  The parameters are looked up by full name in the transform's own (a
  ``hk.custom_getter`` records them, then substitutes the values given), so
  ``fn``'s parameters keep their names: the same tree with or without a
  pipeline.
  """
  def names():
    seen = {}

    def record(next_getter, value, context):
      seen[context.full_name] = value
      return next_getter(value)

    with hk.custom_getter(record):
      jax.eval_shape(lambda *a: fn(*a), *example)   # a fresh trace each time
    return seen

  params = names()
  try:
    again = names()
  except ValueError:   # Haiku's: a module built anew has no parameters
    again = None
  if again is None or set(again) != set(params):
    raise ValueError(
        f"{_checks.where()}Stacked.loss: {role} creates new Haiku modules each time it "
        f"is called (its parameters were {sorted(params)} the first time), but a "
        "1f1b, interleaved or zb pipeline calls it once per microbatch. Construct "
        "its modules "
        "before blocks.loss and call them inside (e.g. proj = hk.Linear(n); "
        "head = lambda x, t: loss(proj(x), t)).")

  def explicit(values, *args):
    def substitute(next_getter, value, context):
      del value
      return next_getter(values[context.full_name])

    with hk.custom_getter(substitute):
      return fn(*args)

  return explicit, params

