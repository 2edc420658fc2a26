"""The instruments every benchmark measures with: memory, clocks, statistics.

* Memory is the compiled program's ``memory_analysis().temp_size_in_bytes``:
  deterministic, read from a lowered and compiled program that never runs, so
  it does not depend on the machine's load.
* Time is read on two clocks at once (:func:`clocks`): the wall clock (what a
  user waits) and this process's CPU time (all threads), which a busy machine
  disturbs less.
* Programs compared for speed run side by side (:func:`alternating_rounds`:
  every program once a round, the order reversed every round), their times
  compared round by round (:func:`paired_ratio`); the machine's
  :func:`load_average` is stated beside them.
* Repeats are summarised by their minimum (:func:`fastest`, the least
  disturbed measurement) or their :func:`median`; a trend over depth by a
  least-squares line (:func:`fit_line`).
* Two programs' numbers are compared leaf by leaf: :func:`max_rel_diff` (each
  leaf on its own scale), :func:`max_error_over_rtol` (as ``assert_allclose``
  judges).

Nothing here knows what is measured: a function, a lowered program, numbers.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional

import jax
import numpy as np

PyTree = Any


def temp_bytes(lowered: jax.stages.Lowered,
               compiler_options: Optional[dict[str, Any]] = None) -> int:
  """Compiled temp memory of a lowered program (compiled, never run)."""
  compiled = lowered.compile(compiler_options=compiler_options)
  return int(compiled.memory_analysis().temp_size_in_bytes)


def block(tree: PyTree) -> PyTree:
  """``jax.block_until_ready`` on every leaf; returns ``tree``."""
  return jax.block_until_ready(tree)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  """Seconds that ``fn()`` takes until its result is ready, and the result."""
  start = time.perf_counter()
  out = block(fn())
  return time.perf_counter() - start, out


def clocks() -> tuple[float, float]:
  """``(wall, cpu)`` seconds now: ``time.perf_counter`` and this process's CPU
  time (all threads, ``time.process_time``), which a busy machine disturbs less."""
  return time.perf_counter(), time.process_time()


def fastest(repeats: Sequence[dict[str, float]]) -> dict[str, float]:
  """Each quantity's minimum over repeats (the least disturbed measurement)."""
  return {key: min(r[key] for r in repeats) for key in repeats[0]}


def median(values: Iterable[float]) -> float:
  """The median of ``values``, as a Python float."""
  return float(statistics.median(list(values)))


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
  """Least-squares ``(intercept, slope)`` of ``ys`` against ``xs``."""
  slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
  return float(intercept), float(slope)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
  """The median over rounds of ``a[r] / b[r]``: two programs timed in the same
  rounds, so that a slow drift in the machine's load cancels."""
  return float(np.median(np.asarray(a) / np.asarray(b)))


def alternating_rounds(
    programs: Mapping[str, Callable[[], Any]], rounds: int, warmup_rounds: int = 0,
    after_round: Optional[Callable[[int, dict[str, list[float]]], None]] = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
  """Wall and CPU seconds of each program, timed side by side in rounds.

  A round runs every program once, until its result is ready, in an order
  that reverses from one round to the next; ``warmup_rounds`` rounds run
  first, untimed (the first timed round runs in the given order).

  Args:
    programs: each program by its name, called with no arguments.
    rounds: the timed rounds.
    warmup_rounds: untimed rounds before them.
    after_round: called after each timed round with its index and the wall
      seconds so far (to log it).

  Returns:
    ``(wall, cpu)``: for each name, its seconds in each timed round.
  """
  names = list(programs)
  wall: dict[str, list[float]] = {n: [] for n in names}
  cpu: dict[str, list[float]] = {n: [] for n in names}
  for r in range(-warmup_rounds, rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      wall_start, cpu_start = clocks()
      block(programs[name]())
      wall_end, cpu_end = clocks()
      if r >= 0:
        wall[name].append(wall_end - wall_start)
        cpu[name].append(cpu_end - cpu_start)
    if r >= 0 and after_round is not None:
      after_round(r, wall)
  return wall, cpu


def load_average() -> list[float]:
  """The machine's 1, 5 and 15 minute load averages, rounded (none where the
  system does not say)."""
  try:
    return [round(v, 2) for v in os.getloadavg()]
  except OSError:
    return []


def max_rel_diff(tree: PyTree, ref: PyTree) -> float:
  """The largest ``|a - b| / max|b|`` over the leaves (each leaf's own scale)."""
  out = 0.0
  for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(ref)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out = max(out, float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)))
  return out


def max_error_over_rtol(actual: PyTree, expected: PyTree, rtol: float) -> float:
  """``max |a - e| / (rtol + |e|)`` over the leaves: at most 1 passes
  ``assert_allclose(a, e, rtol, atol=rtol)``. In numpy: no op-by-op compiles."""
  def error(a, e):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.max(np.abs(a - e) / (rtol + np.abs(e))))
  return max(jax.tree.leaves(jax.tree.map(error, actual, expected)))
