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

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
from jax import lax

from stacktools.core import _checks
from stacktools.remat import _nested_scan
from stacktools.remat import _policy
from stacktools.remat import _segments
from stacktools.remat import _unrolled_scan
from stacktools.remat._unrolled_scan import rows as _rows
from stacktools.step import _pattern

Carry = TypeVar("Carry")
Y = TypeVar("Y")
PyTree = Any
Step = Callable[[PyTree, Any], tuple[PyTree, Any]]


def fold(f: Callable[[Carry, Any], Carry], *, length: Optional[int] = None,
         remat: _policy.RematSpec = False, unroll: Union[int, bool] = 1,
         reverse: bool = False) -> Callable[..., Carry]:
  """A loop that threads a carry through ``f`` once per element of ``xs``.

  The moral equivalent of::

    for x in xs:
      carry = f(carry, x)

  Example::

    def layer(h, w):
      return jnp.tanh(h @ w)

    h0, ws = jnp.ones((2, 8)), jnp.full((12, 8, 8), 0.1)
    h = st.fold(layer, remat="nested")(h0, ws)   # ws: [num_layers, d, d]

  Args:
    f: ``f(carry, x) -> carry``; the carry keeps its structure, shapes and
      dtypes.
    length: the number of steps; needed when ``xs`` is ``None``, checked
      against the leading axis of ``xs`` otherwise.
    remat: a checkpoint policy or alias (see :class:`CheckpointPolicy`),
      :func:`per_depth` segments, or ``"auto"`` (see :func:`plan_remat`).
    unroll: steps per rolled loop iteration (>= 1), or ``True`` to unroll
      fully, as in ``jax.lax.scan``.
    reverse: run from the last element of ``xs`` to the first.

  Returns:
    ``run(init, xs=None) -> carry``.
  """
  remat = _segments.as_remat(remat)
  unroll = _checks.check_unroll(unroll)

  def step(carry, x):
    new_carry = f(carry, x)
    _checks.check_fold_output(carry, new_carry)
    return new_carry, None

  def run(init: Carry, xs: PyTree = None) -> Carry:
    with _checks.subject("st.fold"):
      n = _checks.loop_length(xs, length)
      carry, _ = loop(step, init, xs, n, remat, unroll, reverse)
    return carry

  return run


def scan(f: Callable[[Carry, Any], tuple[Carry, Y]], *,
         length: Optional[int] = None, remat: _policy.RematSpec = False,
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

    h0, ws = jnp.ones((2, 8)), jnp.full((12, 8, 8), 0.1)
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
  remat = _segments.as_remat(remat)
  unroll = _checks.check_unroll(unroll)

  def step(carry, x):
    out = f(carry, x)
    _checks.check_scan_output(out)
    new_carry, y = out
    _checks.check_carry(carry, new_carry)
    return new_carry, y

  def run(init: Carry, xs: PyTree = None) -> tuple[Carry, Y]:
    with _checks.subject("st.scan"):
      n = _checks.loop_length(xs, length)
      return loop(step, init, xs, n, remat, unroll, reverse)

  return run


def map(f: Callable[[Any], Y], *,  # pylint: disable=redefined-builtin
        remat: _policy.RematSpec = False) -> Callable[[PyTree], Y]:
  """Applies ``f`` to each element along the leading axis of ``xs`` in a loop.

  Uses less memory than ``jax.vmap`` (one element at a time), like
  ``jax.lax.map``, and takes a checkpoint policy.

  Example::

    xs = jnp.array([[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]])
    ys = st.map(lambda x: jnp.sort(x))(xs)    # [[1, 2, 3], [0, 4, 5]]

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
                       f"got {_checks.describe(xs)}.")
    _, ys = scan_f(None, xs)
    return ys

  return run


# ---------------------------------------------------------------------------
# The engine: every loop over layers runs here.

def _single(length: int) -> _pattern.Pattern:
  return _pattern.Pattern.uniform(length)


def loop(step: Step, init: PyTree, xs: PyTree, n: int, remat: Any,
         unroll: Union[int, bool] = 1, reverse: bool = False) -> tuple[PyTree, PyTree]:
  """A loop of one kind, ``n`` steps, through the engine: ``(carry, ys)``.

  What ``st.fold``/``st.scan`` and each pipeline stage run.
  """
  if n == 0:
    return lax.scan(step, init, xs, length=n, reverse=reverse, unroll=unroll)
  pattern, steps, kind_xs = _single(n), {_pattern.ONE_KIND: step}, {_pattern.ONE_KIND: xs}
  plan = _segments.plan_for(steps, init, kind_xs, pattern, remat, reverse=reverse)
  carry, ys = run(steps, init, kind_xs, pattern, plan, unroll=unroll)
  return carry, ys[_pattern.ONE_KIND]


def run(steps: Mapping[str, Step], x: PyTree, xs: Mapping[str, PyTree],
        pattern: _pattern.Pattern, plan: _segments.LoopPlan, *,
        unroll: Union[int, bool] = 1) -> tuple[PyTree, dict[str, PyTree]]:
  """Runs every layer of a loop plan; pure JAX.

  A segment's layers run as a partial period (static runs), its whole
  periods (one ``lax.scan``, or a nested loop of checkpointed chunks) and a
  partial period again; inside a period each run of one kind is a
  ``lax.scan`` (a run of one layer is applied directly). The program holds
  one period's runs at most three times per segment, whatever the depth. A
  loop of one kind has period 1: each segment is one scan over its layers.

  Args:
    steps: each kind's ``step(x, layer_slice) -> (x, out)``.
    x: the carry.
    xs: each kind's inputs, in kind order (leading axis: the kind's count).
    pattern: the layout.
    plan: from :func:`stacktools.remat._segments.plan_for`.
    unroll: periods per rolled iteration of the period loop; ``True``
      unrolls every loop.

  Returns:
    ``(x, {kind: outs})``, each kind's outputs in kind order.
  """
  runner = _Runner(steps, xs, pattern, unroll, plan.reverse)
  for segment in plan.in_order():
    x = runner.layers(x, segment)
  return x, runner.results()


def _flat_rows(tree: PyTree) -> PyTree:
  """``[outer, inner, ...]`` -> ``[outer * inner, ...]`` on every leaf."""
  return jax.tree_util.tree_map(
      lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), tree)


def _concat(parts: Sequence[PyTree]) -> PyTree:
  if len(parts) == 1:
    return parts[0]
  return jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *parts)


class _Runner:
  """Runs the segments of one loop; gathers each kind's outputs by rank."""

  def __init__(self, steps: Mapping[str, Step], xs: Mapping[str, PyTree],
               pattern: _pattern.Pattern, unroll: Union[int, bool], reverse: bool):
    self.steps, self.xs, self.pattern = steps, xs, pattern
    self.unroll, self.reverse = unroll, reverse
    self.pieces: dict[str, list[tuple[int, PyTree]]] = {k: [] for k in xs}

  def _order(self, items):
    return list(reversed(items)) if self.reverse else list(items)

  def _run(self, x, kind, run_xs, length, segment, looped, row=None):
    """One run: a scan over ``length`` consecutive layers of one kind.

    ``run_xs`` leads with ``length``; for a run of one layer it is that
    layer's own slice, applied directly (no loop: it compiles faster), or,
    given ``row``, a slab of an unrolled loop whose row ``row`` it is.
    """
    looped = looped or length > 1
    policy = segment.steps[kind] if looped else segment.steps[kind].outside_loop()
    kind_step = self.steps[kind]
    if row is not None and length == 1 and policy.save_inputs != "offload":
      # The row is cut inside the checkpoint, so that the backward pass cuts
      # it again from the loop's inputs instead of keeping a copy of it.
      kind_step = lambda x, slab: self.steps[kind](  # noqa: E731
          x, jax.tree_util.tree_map(lambda a: a[row], slab))
    elif row is not None:
      run_xs = jax.tree_util.tree_map(lambda a: a[row], run_xs)
    step = policy.checkpoint_step(kind_step, looped=looped)
    if length > 1:
      return lax.scan(step, x, run_xs, length=length, reverse=self.reverse,
                      unroll=self.unroll is True or 1)
    return step(x, run_xs)

  def runs(self, x, runs, segment):
    """Runs at the loop's own indices (a partial period): static slices."""
    for run in self._order(runs):
      rows = self.xs[run.kind]
      if run.length == 1:
        x, out = self._run(x, run.kind, jax.tree_util.tree_map(lambda a: a[run.rank], rows),  # pylint: disable=cell-var-from-loop
                           1, segment, looped=False)
        out = jax.tree_util.tree_map(lambda a: a[None], out)
      else:
        x, out = self._run(x, run.kind, _rows(rows, run.rank, run.rank + run.length),
                           run.length, segment, looped=False)
      self.pieces[run.kind].append((run.rank, out))
    return x

  def periods(self, x, first, stop, segment):
    """Whole periods ``[first, stop)``: one loop, nested when the plan says.

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

    def one_period(x, xs, row=None):
      outs = [None] * len(runs)
      for j in self._order(range(len(runs))):
        x, outs[j] = self._run(x, runs[j].kind, xs[j], runs[j].length,
                               segment, looped=True, row=row)
      return x, outs

    if segment.split is None:
      x, outs = _unrolled_scan.scan(one_period, x, period_xs, count,
                                    unroll=self.unroll, reverse=self.reverse)
    else:
      x, outs = self._nested(x, one_period, period_xs, segment)
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

  def _nested(self, x, one_period, period_xs, segment):
    """Periods in checkpointed chunks: keeps ~2*sqrt(periods) carries.

    The chunks' backward pass is written by hand (:mod:`_nested`), so that
    no chunk copies its slice of the inputs or of their gradient. Only
    carries offloaded to host memory take ``jax.checkpoint``'s path, which
    is what moves them there.
    """
    policy = segment.policy
    if policy.save_carries != "offload":
      return _nested_scan.scan(one_period, x, period_xs, split=segment.split,
                          reverse=self.reverse, unroll=self.unroll)
    outer, inner, remainder = segment.split

    def run_chunk(carry, chunk_xs, size):
      return lax.scan(one_period, carry, chunk_xs, length=size, reverse=self.reverse,
                      unroll=self.unroll)

    # Each chunk is cut from the whole period_xs inside the outer loop (a
    # dynamic slice), rather than reshaping or splitting them up front: a
    # split copy of the inputs, and of their gradient, would cost as much
    # memory as the carries saved.
    def outer_step(carry, chunk_index):
      start = chunk_index * inner
      chunk_xs = jax.tree_util.tree_map(
          lambda a: lax.dynamic_slice_in_dim(a, start, inner, axis=0), period_xs)
      return run_chunk(carry, chunk_xs, inner)

    def main_part(carry):
      carry, ys = lax.scan(policy.checkpoint_chunk(outer_step), carry,
                           jnp.arange(outer), reverse=self.reverse)
      return carry, _flat_rows(ys)

    def remainder_part(carry):
      rem_xs = jax.tree_util.tree_map(lambda a: a[outer * inner:], period_xs)
      return policy.checkpoint_chunk(lambda c, x: run_chunk(c, x, remainder))(
          carry, rem_xs)

    if not remainder:
      return main_part(x)
    outs = []
    for part in self._order([main_part, remainder_part]):
      x, out = part(x)
      outs.append(out)
    return x, jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b], axis=0),
                                     *self._order(outs))

  def layers(self, x, segment):
    """A segment's layers: a partial period, whole periods, a partial."""
    start, stop = segment.start, segment.start + segment.length
    p = self.pattern.period
    first, last = -(-start // p), stop // p    # whole periods [first, last)
    if first >= last:
      return self.runs(x, self.pattern.runs(start, stop), segment)
    parts = [lambda x: self.runs(x, self.pattern.runs(start, first * p), segment),
             lambda x: self.periods(x, first, last, segment),
             lambda x: self.runs(x, self.pattern.runs(last * p, stop), segment)]
    for part in self._order(parts):
      x = part(x)
    return x

  def results(self) -> dict[str, PyTree]:
    return {k: _concat([out for _, out in sorted(v, key=lambda p: p[0])])
            for k, v in self.pieces.items() if v}
