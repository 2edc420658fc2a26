"""The module both stacks are: constructor checks and ``fold``/``scan``.

:class:`StackModule` checks what ``Stacked`` and ``BlockSeq`` are built with
and turns a call into one inner transform per kind
(:func:`stacktools.step._layer_step.make_inner`) and its
:class:`stacktools.step._arguments.BlockArguments`; a subclass says how the
layers run (:meth:`StackModule.run_layers`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import haiku as hk

from stacktools.core import _checks
from stacktools.remat import _policy
from stacktools.remat import _segments
from stacktools.step import _arguments
from stacktools.step import _layer_step
from stacktools.step import _pattern

PyTree = Any




class StackModule(hk.Module):
  """A block repeated ``num_layers`` times; subclasses say how the layers run.

  Owns the constructor's checks and the public ``fold``/``scan``; a subclass
  implements :meth:`run_layers`.
  """

  def __init__(self, make_block: Any, num_layers: int,
               *, remat: _policy.RematSpec = False, reverse: bool = False,
               pattern: Optional[Sequence[str]] = None,
               ys_by_kind: Optional[bool] = None, layer_drop: Any = None,
               name: Optional[str] = None):
    super().__init__(name=name)
    with _checks.subject(type(self).__name__):
      self.num_layers = _checks.check_num_layers(num_layers)
      # None when no layer is ever dropped (rate 0 everywhere included).
      self.layer_drop = _checks.check_layer_drop(layer_drop, self.num_layers)
      # None for a stack of one block; a mixed-layer stack's kinds otherwise.
      self.pattern = _pattern.Pattern.build(make_block, pattern, self.num_layers,
                                          ys_by_kind)
      # "auto" is keyed by this module's unique name, so that a plan tells
      # several stacks apart.
      self.remat = _segments.as_remat(remat, key=self.module_name)
    self.make_block = make_block
    self.reverse = reverse

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
    x, _ = self._apply(x, args, kwargs, mode="fold")
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
    return self._apply(x, args, kwargs, mode="scan")

  def run_layers(self, inners: Mapping[str, hk.TransformedWithState], x: PyTree,
                 arguments: _arguments.BlockArguments, pattern: _pattern.Pattern,
                 mode: str) -> tuple[PyTree, PyTree]:
    """Inits and applies every layer; returns ``(x, ys)`` (``ys`` None for a fold).

    ``inners`` holds one transform per kind of ``pattern``; a stack of one
    block has the pattern of one kind, ``_pattern.ONE_KIND``, period 1.

    Haiku scopes the modules a method creates under ``~<method>``, so an
    override is decorated with ``@StackModule.layer_scope`` to keep the
    block's parameters directly under the stack's name.
    """
    raise NotImplementedError

  #: Decorates :meth:`run_layers`: names it like ``__call__`` for Haiku.
  layer_scope = staticmethod(hk.experimental.name_like("__call__"))

  # Named like __call__ so that fold and scan create the same parameter names
  # (Haiku would otherwise scope modules made inside fold under "~fold").
  @hk.experimental.name_like("__call__")
  def _apply(self, x, args, kwargs, *, mode, ends=None):
    owner = type(self).__name__
    with _checks.subject(owner):
      if isinstance(x, _arguments.Marked):
        raise TypeError(f"{owner}.{mode}: the carry x cannot be per_layer; only "
                        "the arguments after it can be.")
      arguments = _arguments.BlockArguments(args, kwargs, self.num_layers, self.pattern)
      if self.pattern is not None:   # one inner transform per kind
        inners = {name: _layer_step.make_inner(self.pattern.block_call(name, mode), arguments, name)
                  for name in self.pattern.names}
        return self.run_layers(inners, x, arguments, self.pattern, mode,
                               **({} if ends is None else {"ends": ends}))

      def block_call(x, *a, **k):
        return self.make_block()(x, *a, **k)

      return self.run_layers({_pattern.ONE_KIND: _layer_step.make_inner(block_call, arguments)},
                             x, arguments, _pattern.Pattern.uniform(self.num_layers), mode,
                             **({} if ends is None else {"ends": ends}))
