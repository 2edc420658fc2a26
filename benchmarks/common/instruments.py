"""The instruments every benchmark measures with: memory, clocks, statistics.

* Memory is the compiled program's ``memory_analysis().temp_size_in_bytes``:
  deterministic, read from a lowered and compiled program that never runs, so
  it does not depend on the machine's load.
* Time is read on two clocks at once (:func:`clocks`): the wall clock (what a
  user waits) and this process's CPU time (all threads), which a busy machine
  disturbs less.
* Repeats are summarised by their minimum (:func:`fastest`, the least
  disturbed measurement) or their :func:`median`; a trend over depth by a
  least-squares line (:func:`fit_line`).

Nothing here knows what is measured: a function, a lowered program, numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
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
