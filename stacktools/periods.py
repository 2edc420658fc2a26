"""Mixed-layer stacks as one loop over periods, each run of a kind a scan.

A stack with ``pattern=`` keeps one parameter stack per kind (``h/<kind>/...``,
each leaf with a leading axis of that kind's count, see ``_kinds.py``) and
applies its layers as::

  for period in periods:                         # one lax.scan (rolled)
    for kind, layers in runs(period):            # e.g. 5 local, then 1 global
      for layer in layers:                       # one lax.scan per run
        x, y[layer] = checkpoint(step[kind])(x, slice[kind][layer])

Every layer is checkpointed by itself with the stack's policy. A depth that
the period does not divide ends with a partial period; ``per_depth`` segments
may start and end anywhere. So a range of layers runs as a partial period
(static runs), the whole periods inside it (the loop) and a partial period
again; the program holds one period's runs at most three times, whatever the
depth. ``nested`` splits the loop over periods into checkpointed chunks.

The period loop reads each kind's arrays reshaped to ``[periods, per period,
...]``, a free reshape when the kind's count is a whole number of periods;
otherwise (a partial period, or a ``per_depth`` boundary inside a period)
the slice the loop reads is a copy of that kind's arrays.

:func:`loop_kinds` is pure JAX; :func:`run_patterned` is the Haiku half that
``Stacked`` calls.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import haiku as hk
import jax
import jax.numpy as jnp
from jax import lax

from stacktools import _checks
from stacktools import _kinds
from stacktools import _layers
from stacktools import policy as policy_lib
from stacktools import segments as segments_lib

PyTree = Any
Step = Callable[[PyTree, Any], tuple[PyTree, Any]]


def _rows(tree: PyTree, start: int, stop: int) -> PyTree:
  """Every leaf's rows ``[start, stop)`` (no slice when that is all of it)."""
  def cut(a):
    return a if (start, stop) == (0, a.shape[0]) else a[start:stop]
  return jax.tree_util.tree_map(cut, tree)


def _fold_rows(tree: PyTree, outer: int) -> PyTree:
  """``[outer * inner, ...]`` -> ``[outer, inner, ...]`` on every leaf."""
  return jax.tree_util.tree_map(
      lambda a: a.reshape((outer, a.shape[0] // outer) + a.shape[1:]), tree)


def _flat_rows(tree: PyTree) -> PyTree:
  """``[outer, inner, ...]`` -> ``[outer * inner, ...]`` on every leaf."""
  return jax.tree_util.tree_map(
      lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), tree)


def _concat(parts: Sequence[PyTree]) -> PyTree:
  if len(parts) == 1:
    return parts[0]
  return jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *parts)


def kind_tags(pattern: _kinds.Pattern, inners: Mapping[str, hk.TransformedWithState],
              x: PyTree, arguments: _layers.BlockArguments) -> dict[str, set[str]]:
  """The names each kind's block tags with ``checkpoint_name``.

  Traced from the block's init at the kind's first layer (never run), so it
  needs no parameters: ``BlockSeq`` asks before any exist.
  """
  tags = {}
  for kind in pattern.names:
    first = int(pattern.layer_ids(kind)[0])

    def init(x, sliced, inner=inners[kind], first=first):
      with _layers.at_layer(jnp.asarray(first, jnp.int32)):
        return inner.init(jax.random.PRNGKey(0), x, sliced)

    tags[kind] = _checks.names_tagged_in(
        init, x, pattern.layer_inputs(arguments.sliced, arguments.by_kind, first))
  return tags


def kind_policy(policy: Any, kind: str,
                tags: Optional[Mapping[str, set[str]]]) -> Any:
  """``policy`` for ``kind``'s layers: it saves (or offloads) the named
  internals that this kind tags. A name that no kind tags is left in, so
  that the policy's own check names it."""
  wanted = policy.named_internals()
  if not wanted or tags is None or not set(wanted) <= set().union(*tags.values()):
    return policy

  def keep(names):
    return tuple(n for n in names if n in tags[kind])

  saved = policy.save_block_internals
  return dataclasses.replace(
      policy, save_block_internals=saved if isinstance(saved, bool) else keep(saved),
      offload_block_internals=keep(policy.offload_block_internals))


def needs_tags(segments: Sequence[segments_lib.Segment]) -> bool:
  """Whether a policy of ``segments`` saves or offloads named internals."""
  return any(segment.policy.named_internals() for segment in segments)


class _Runner:
  """Runs layer ranges of one stack; gathers each kind's results by rank."""

  def __init__(self, steps: Mapping[str, Step], xs: Mapping[str, PyTree],
               pattern: _kinds.Pattern, unroll: Union[int, bool], reverse: bool,
               tags: Optional[Mapping[str, set[str]]]):
    self.steps, self.xs, self.pattern = steps, xs, pattern
    self.unroll, self.reverse = unroll, reverse
    self.pieces: dict[str, list[tuple[int, PyTree]]] = {k: [] for k in xs}
    self.tags = tags

  def _order(self, items):
    return list(reversed(items)) if self.reverse else list(items)

  def _run(self, x, kind, run_xs, length, policy, in_loop):
    """One run: a scan over ``length`` consecutive layers of one kind.

    ``run_xs`` leads with ``length``; for a run of one layer it is that
    layer's own slice, applied directly (no loop: it compiles faster).
    Outside the period loop that layer's recomputation could then be merged
    with the forward pass (common subexpression elimination), so there it
    prevents that.
    """
    policy = kind_policy(policy.inner(), kind, self.tags)
    if length > 1:
      return lax.scan(policy.checkpoint_step(self.steps[kind]), x, run_xs,
                      reverse=self.reverse, unroll=self.unroll is True or 1)
    if not in_loop and not policy.disable:
      policy = dataclasses.replace(policy, prevent_cse=True)
    return policy.checkpoint_step(self.steps[kind])(x, run_xs)

  def runs(self, x, runs, policy):
    """Runs at the stack's own indices (a partial period): static slices."""
    for run in self._order(runs):
      rows = self.xs[run.kind]
      if run.length == 1:
        x, out = self._run(x, run.kind, jax.tree_util.tree_map(lambda a: a[run.rank], rows),  # pylint: disable=cell-var-from-loop
                           1, policy, in_loop=False)
        out = jax.tree_util.tree_map(lambda a: a[None], out)
      else:
        x, out = self._run(x, run.kind, _rows(rows, run.rank, run.rank + run.length),
                           run.length, policy, in_loop=False)
      self.pieces[run.kind].append((run.rank, out))
    return x

  def periods(self, x, first, stop, policy, owner):
    """Whole periods ``[first, stop)``: one loop, nested when asked.

    The loop reads each run's own rows of its kind's arrays, ``[periods,
    run length, ...]`` (``[periods, ...]`` for a run of one layer): a free
    reshape when the kind has one run per period. The body then reads its
    slice of the loop's inputs unchanged, so the backward pass reads it from
    those inputs instead of saving a copy of it per period.
    """
    count, pattern = stop - first, self.pattern
    per = {k: pattern.per_period(k) for k in self.xs if pattern.per_period(k)}
    runs = pattern.runs(0, pattern.period)   # start/rank within one period

    def run_rows(run, a):
      c = per[run.kind]
      a = a[first * c:stop * c] if (first, stop * c) != (0, a.shape[0]) else a
      if run.length == c:    # the kind's one run of the period
        return a if c == 1 else a.reshape((count, c) + a.shape[1:])
      a = a.reshape((count, c) + a.shape[1:])
      return a[:, run.rank] if run.length == 1 else a[:, run.rank:run.rank + run.length]

    period_xs = [jax.tree_util.tree_map(functools.partial(run_rows, run), self.xs[run.kind])
                 for run in runs]

    def one_period(x, xs):
      outs = [None] * len(runs)
      for j in self._order(range(len(runs))):
        x, outs[j] = self._run(x, runs[j].kind, xs[j], runs[j].length, policy,
                               in_loop=True)
      return x, outs

    if policy.disable or not policy.nested:
      x, outs = lax.scan(one_period, x, period_xs, reverse=self.reverse,
                         unroll=self.unroll)
    else:
      x, outs = self._nested(x, one_period, period_xs, count, policy, owner)
    for kind, c in per.items():
      mine = [(run, out) for run, out in zip(runs, outs) if run.kind == kind]
      if len(mine) == 1:
        out = mine[0][1]
        out = out if c == 1 else _flat_rows(out)
      else:   # [periods, run length, ...] side by side, in rank order
        parts = [jax.tree_util.tree_map(lambda a: a[:, None], o) if run.length == 1 else o  # pylint: disable=cell-var-from-loop
                 for run, o in mine]
        out = _flat_rows(jax.tree_util.tree_map(
            lambda *a: jnp.concatenate(a, axis=1), *parts))
      self.pieces[kind].append((first * c, out))
    return x

  def _nested(self, x, one_period, period_xs, count, policy, owner):
    """Periods in checkpointed chunks: keeps ~2*sqrt(periods) carries."""
    if policy.nested is not True and policy.nested > count:
      raise ValueError(
          f"{owner}: CheckpointPolicy(nested={policy.nested}) asks for "
          f"{policy.nested} outer chunks of whole periods, but the stack (or this "
          f"per_depth segment) has {count} whole periods of "
          f"{self.pattern.period} layers. Use nested=True, or an outer size "
          f"between 1 and {count}.")
    outer, inner, remainder = policy_lib.split_nested(
        count, policy.nested,
        carry_bytes=sum(_checks.nbytes(c) for c in jax.tree_util.tree_leaves(x)) or 1,
        layer_bytes=sum(_checks.nbytes(a, skip_leading=True)
                        for a in jax.tree_util.tree_leaves(period_xs)))

    def chunk(carry, chunk_xs):
      return lax.scan(one_period, carry, chunk_xs, reverse=self.reverse,
                      unroll=self.unroll)

    chunk = policy.checkpoint_chunk(chunk)

    def main(carry):
      main_xs = _fold_rows(_rows(period_xs, 0, outer * inner), outer)
      carry, ys = lax.scan(chunk, carry, main_xs, reverse=self.reverse)
      return carry, _flat_rows(ys)

    def rest(carry):
      return chunk(carry, _rows(period_xs, outer * inner, count))

    if not remainder:
      return main(x)
    parts = [main, rest]
    outs = []
    for part in self._order(parts):
      x, out = part(x)
      outs.append(out)
    return x, _concat(self._order(outs))

  def layers(self, x, start, stop, policy, owner):
    """Layers ``[start, stop)``: a partial period, whole periods, a partial."""
    p = self.pattern.period
    first, last = -(-start // p), stop // p    # whole periods [first, last)
    if first >= last:
      return self.runs(x, self.pattern.runs(start, stop), policy)
    parts = [lambda x: self.runs(x, self.pattern.runs(start, first * p), policy),
             lambda x: self.periods(x, first, last, policy, owner),
             lambda x: self.runs(x, self.pattern.runs(last * p, stop), policy)]
    for part in self._order(parts):
      x = part(x)
    return x

  def results(self) -> dict[str, PyTree]:
    return {k: _concat([out for _, out in sorted(v, key=lambda p: p[0])])
            for k, v in self.pieces.items() if v}


def loop_kinds(steps: Mapping[str, Step], x: PyTree, xs: Mapping[str, PyTree],
               pattern: _kinds.Pattern, segments: Sequence[segments_lib.Segment],
               *, unroll: Union[int, bool] = 1, reverse: bool = False,
               tags: Optional[Mapping[str, set[str]]] = None,
               owner: str = "Stacked") -> tuple[PyTree, dict[str, PyTree]]:
  """Applies a mixed-layer stack's layers to ``x``; pure JAX.

  Args:
    steps: each kind's ``step(x, layer_slice) -> (x, out)``.
    x: the carry.
    xs: each kind's inputs, in kind order (leading axis: the kind's count).
    pattern: the layout.
    segments: consecutive layer ranges and their policies, in layer order.
    unroll: periods per rolled iteration of the period loop; ``True``
      unrolls every loop.
    reverse: apply the layers from the last to the first.
    tags: the names each kind's block tags (see :func:`kind_policy`); needed
      when a policy saves or offloads named internals.
    owner: who asks, for error messages.

  Returns:
    ``(x, {kind: outs})``, each kind's outputs in kind order.
  """
  runner = _Runner(steps, xs, pattern, unroll, reverse, tags)
  for segment in (reversed(segments) if reverse else segments):
    x = runner.layers(x, segment.start, segment.start + segment.length,
                      segment.policy, owner)
  return x, runner.results()


class _KindParams(hk.Module):
  """The scope of one kind's parameters and state: ``<stack>/<kind>/...``."""

  def __call__(self, inner, init_keys, x, sliced, indices):
    return _layers.lift_layers(inner, init_keys, x, sliced, indices)


def run_patterned(inners: Mapping[str, hk.TransformedWithState], x: PyTree,
                  arguments: _layers.BlockArguments, *, pattern: _kinds.Pattern,
                  kind: str, remat: segments_lib.Remat, unroll: Union[int, bool],
                  reverse: bool, owner: str) -> tuple[PyTree, PyTree]:
  """Inits (vmapped, per kind) and applies (one loop over periods) a stack.

  Call inside the stack's module. Layer ``i`` gets the ``i``-th of the stack's
  per-layer keys at init and at apply, as in ``BlockSeq``.
  """
  keys = _layers.draw_layer_keys(pattern.num_layers)
  xs, updaters = {}, {}
  for name in pattern.names:
    ids = pattern.layer_ids(name)
    sliced = pattern.kind_inputs(arguments.sliced, arguments.by_kind, name)
    indices = jnp.asarray(ids, jnp.int32)
    params, state, updaters[name] = _KindParams(name=name)(
        inners[name], None if keys.init is None else keys.init[ids], x, sliced,
        indices)
    xs[name] = _layers.LayerSlice(
        params=params, state=state,
        rng=None if keys.apply is None else keys.apply[ids],
        sliced=sliced, index=indices)

  def step_of(name):
    def step(carry, layer: _layers.LayerSlice):
      return _layers.apply_layer(inners[name], carry, layer, kind=kind, owner=owner)
    return step

  steps = {name: step_of(name) for name in pattern.names}

  def probe():   # the names the blocks tag, for a plan that discovers loops
    return set().union(*(_checks.names_tagged_in(
        steps[k], x, jax.tree_util.tree_map(lambda a: a[0], xs[k])) for k in steps))

  segments = segments_lib.segments_for(remat, pattern.num_layers, owner=owner,
                                       probe=probe)
  tags = kind_tags(pattern, inners, x, arguments) if needs_tags(segments) else None
  x, results = loop_kinds(steps, x, xs, pattern, segments, unroll=unroll,
                          reverse=reverse, tags=tags, owner=owner)
  for name in pattern.names:
    updaters[name].update(results[name].state)
  if kind == "fold":
    return x, None
  return x, pattern.outputs({k: r.y for k, r in results.items()}, owner)
