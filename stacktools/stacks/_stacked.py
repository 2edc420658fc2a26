"""``Stacked``: a repeated block's parameters stacked on a Layers axis, one scan.

Holds the module a model writes (``loss`` and ``scan_loss`` its own,
``fold`` and ``scan`` those of ``_stack_module.StackModule``) and the checks
of its ``pipeline=`` at construction. Its layers run through
``_run_stacked.run_stacked``, as ``layer_stack``'s do (``_layer_stack.py``):
one vmapped init per kind, then the engine's loop, or a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import haiku as hk
import jax

from stacktools.core import _checks
from stacktools.pipelines import _pipeline
from stacktools.remat import _policy
from stacktools.stacks import _run_stacked
from stacktools.stacks import _stack_module
from stacktools.step import _arguments
from stacktools.step import _pattern

PyTree = Any


class Stacked(_stack_module.StackModule):
  """A block repeated ``num_layers`` times: parameters stacked, one scan.

  Parameters and state of the block gain a leading ``num_layers`` axis and
  live under this module's name (``h/block/linear`` with ``w`` of shape
  ``[num_layers, ...]``). All layers are initialised independently, from one
  key each, by a single ``jax.vmap`` of the block's init.

  Example::

    class Block(hk.Module):
      def __init__(self, width, name=None):
        super().__init__(name=name)
        self.width = width

      def __call__(self, x, mask):             # a fold block returns x
        return x + mask * hk.Linear(self.width)(x)

    blocks = st.Stacked(lambda: Block(8), num_layers=12, remat="nested",
                        name="h")
    x = blocks.fold(jnp.ones((2, 8)), jnp.ones((2, 8)))   # mask: broadcast

    class Cached(hk.Module):                   # a scan block returns (x, y)
      def __call__(self, x, cache):
        return x + hk.Linear(8)(cache), x

    cache = jnp.ones((12, 2, 8))                # [num_layers, ...]
    x, ys = st.Stacked(Cached, 12, name="c").scan(x, st.per_layer(cache))

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
      Each unrolled layer keeps its values in buffers of its own, as with
      ``unroll=1``; on a TPU v5e ``2`` and ``4`` were still 1.05x and 1.07x
      the step of ``1`` (``docs/benchmarks/scan_gap.md``).
    reverse: apply the layers from the last to the first.
    pattern: the kinds of one period, e.g. ``("local",) * 5 + ("global",)``;
      a string is read one kind per letter (``"LLLG"``).
    layer_drop: stochastic depth (Huang et al. 2016): while training, skip
      layer ``i`` with probability ``layer_drop[i]`` (one float: every
      layer), drawn from the layer's own key; a skipped layer costs no
      matmuls. A kept layer's update is scaled by ``1 / (1 - rate)`` (the
      "inverted" form of the paper's test-time rescaling), so evaluation is
      the plain stack: build it with ``layer_drop=None`` (e.g.
      ``layer_drop=rates if is_training else None``); the parameters are the
      same. Apply needs an rng while rates are given. A dropped scan
      block's ``y`` is zeros. Rates of 0 everywhere are the plain stack.
    ys_by_kind: with a pattern, how ``scan`` returns the blocks' outputs:
      ``None`` in layer order when every kind's agree in shapes and dtypes
      and per kind (``{kind: ys}``, each in kind order) otherwise; ``True``
      always per kind (e.g. caches that go back in through
      :func:`per_kind`); ``False`` always in layer order.
    pipeline: an :class:`st.Pipeline`: under a mesh with its axis (size P >
      1), the layers run as P pipeline stages over microbatches of the
      batch; with no mesh, or an axis of size 1, as a plain stack; under a
      mesh without that axis, an error. The parameters are the plain
      stack's either way.
    name: the module name.
  """

  def __init__(self, make_block: Any, num_layers: int,
               *, remat: _policy.RematSpec = False, unroll: Union[int, bool] = 1,
               reverse: bool = False, pattern: Optional[Sequence[str]] = None,
               ys_by_kind: Optional[bool] = None,
               pipeline: Optional[_pipeline.Pipeline] = None,
               layer_drop: Union[None, float, Sequence[float]] = None,
               name: Optional[str] = None):
    super().__init__(make_block, num_layers, remat=remat, reverse=reverse,
                     pattern=pattern, ys_by_kind=ys_by_kind,
                     layer_drop=layer_drop, name=name)
    with _checks.subject(type(self).__name__):
      self.unroll = _checks.check_unroll(unroll)
      self.pipeline = _check_pipeline(pipeline, pattern, reverse)

  def loss(self, embed: Callable[..., PyTree], head: Callable[..., jax.Array],
           inputs: PyTree, targets: PyTree, *args: Any, **kwargs: Any) -> jax.Array:
    """``head(self.fold(embed(inputs), *args, **kwargs), targets)``, pipelinable.

    The form a ``1f1b`` pipeline needs: it runs ``embed`` on its first stage
    and ``head`` on its last, one microbatch at a time, and differentiates
    every stage itself, so the whole loss must be inside the stack's call.
    Without a pipeline (or with ``gpipe``/``circular``) it is the
    composition above. Either way ``jax.value_and_grad`` of the enclosing
    function gives the loss and every gradient (the stack's, ``embed``'s,
    ``head``'s, the block arguments'), so one train step serves all.

    Example::

      def f(tokens, targets):
        embed, proj = hk.Embed(32, 8, name="embed"), hk.Linear(32, name="out")
        block = lambda: (lambda x: x + jnp.tanh(hk.Linear(8)(x)))
        blocks = st.Stacked(block, 4, remat="full", name="h",
                            pipeline=st.Pipeline(microbatches=2, schedule="1f1b"))
        def head(x, t):   # a mean over the microbatch
          logits = proj(x)
          return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                               t[..., None], -1))
        return blocks.loss(embed, head, tokens, targets)

      f = hk.without_apply_rng(hk.transform(f))
      tokens = jnp.zeros((4, 8), jnp.int32)
      params = f.init(jax.random.PRNGKey(0), tokens, tokens)
      loss, grads = jax.value_and_grad(f.apply)(params, tokens, tokens)

    Args:
      embed: ``embed(inputs) -> x``, the part before the stack.
      head: ``head(x, targets) -> loss``, the part after: a scalar that is a
        mean over the batch (a pipeline averages it over microbatches).
      inputs: what ``embed`` takes, batch-major (no gradient).
      targets: what ``head`` takes besides ``x``, batch-major (no gradient).
      *args: the blocks' further arguments, as in :meth:`fold`.
      **kwargs: likewise.

    Under a ``1f1b`` pipeline, ``embed`` and ``head`` are called once per
    microbatch: they must call Haiku modules built outside (built inside,
    each call would make new ones), and may not use Haiku state or rng.

    Returns:
      The loss.
    """
    return self._apply(None, args, kwargs, mode="fold",
                       ends=(embed, head, inputs, targets))[0]

  def scan_loss(self, embed: Callable[..., PyTree], head: Callable[..., jax.Array],
                inputs: PyTree, targets: PyTree, *args: Any,
                **kwargs: Any) -> tuple[jax.Array, PyTree]:
    """:meth:`loss` for a scan block: ``(loss, ys)``, ``ys`` with no gradient.

    Args:
      embed: as in :meth:`loss`.
      head: as in :meth:`loss`.
      inputs: as in :meth:`loss`.
      targets: as in :meth:`loss`.
      *args: as in :meth:`loss`.
      **kwargs: as in :meth:`loss`.

    Returns:
      ``(loss, ys)``: every layer's ``y`` stacked, as :meth:`scan` gives them.
    """
    return self._apply(None, args, kwargs, mode="scan",
                       ends=(embed, head, inputs, targets))

  @_stack_module.StackModule.layer_scope
  def run_layers(self, inners: Mapping[str, hk.TransformedWithState], x: PyTree,
                 arguments: _arguments.BlockArguments, pattern: _pattern.Pattern,
                 mode: str, ends: Optional[tuple[Any, ...]] = None
                 ) -> tuple[PyTree, PyTree]:
    return _run_stacked.run_stacked(
        inners, x, arguments, pattern=pattern, mode=mode, remat=self.remat,
        unroll=self.unroll, reverse=self.reverse, pipeline=self.pipeline,
        layer_drop=self.layer_drop, ends=ends)


def _check_pipeline(pipeline: Any, pattern: Any,
                    reverse: bool) -> Optional[_pipeline.Pipeline]:
  if pipeline is None:
    return None
  if not isinstance(pipeline, _pipeline.Pipeline):
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
