"""Compiling and timing candidate plans, and the record of both (``Candidates``).

A candidate plan is compiled with every auto stack answered by its choice
(:func:`compile_plan`, under ``_stack_info.Fixed``); a plan too big for
the device (XLA refuses it, ``RESOURCE_EXHAUSTED``) is recorded as
:data:`OUT_OF_MEMORY`, not raised (:func:`exhausted`). Executables are timed
side by side, interleaved (:func:`time_runs`).

:class:`Candidates` is the working state of a report or a planning: every joint
plan of a step, predicted once from the trace, then compiled and timed as
the caller asks; the first program compiled calibrates every prediction (it
tells what the step holds besides its stacks). The entry points
(``_remat_report.py``, ``_plan_remat.py``) build it from the step's trace;
``_remat_report.py`` compiles the reference or every plan through it; under
a budget, both hand it to ``_choose.py``, which compiles a few; then
:meth:`Candidates.report` freezes it into a ``RematReport``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp

from stacktools.planner import _cost_model
from stacktools.planner import _results
from stacktools.planner import _search
from stacktools.planner import _stack_info

@dataclasses.dataclass
class Compiled:
  """A plan compiled: the executable and what XLA says of it."""

  executable: Any
  temp_bytes: int
  xla_flops: float
  bytes_accessed: float
  out_of_memory: bool = False


def exhausted(error: BaseException) -> bool:
  """Whether ``error`` says the device's memory ran out: XLA refuses to
  compile a program that cannot fit (on a TPU, "Ran out of memory in memory
  space hbm"), or to allocate its buffers (``RESOURCE_EXHAUSTED``)."""
  return bool(re.search(r"RESOURCE_EXHAUSTED|out of memory", str(error), re.I))


#: What a plan that XLA could not fit in the device's memory is recorded as.
OUT_OF_MEMORY = Compiled(None, sys.maxsize, 0.0, 0.0, out_of_memory=True)


#: Compiler options for a compile that only reads the memory: buffer
#: assignment, which decides the temp bytes, runs before code generation, so
#: the backend's optimisation of the generated code can be skipped (about
#: half the compile time on a CPU; the executable is not timed).
MEMORY_ONLY = {"xla_backend_optimization_level": 0,
               "xla_llvm_disable_expensive_passes": True}


def compile_plan(step_fn: Callable[..., Any], args: Sequence[Any],
                 choice: Mapping[str, Any], *, memory_only: bool = False,
                 donate_argnums: Sequence[int] = ()) -> Compiled:
  """Compiles ``step_fn`` with its stacks running ``choice`` (and the
  arguments ``donate_argnums`` donated, as the step that runs donates them)."""
  lowered = jax.jit(_results.under(_stack_info.Fixed(choice), step_fn),
                    donate_argnums=tuple(donate_argnums)).lower(*args)
  compiled = None
  if memory_only:
    try:
      compiled = lowered.compile(MEMORY_ONLY)
    except Exception:  # pylint: disable=broad-except
      compiled = None   # a backend without the option: compile as usual
  if compiled is None:
    compiled = lowered.compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):   # older JAX: one dict per program
    cost = cost[0] if cost else {}
  cost = cost or {}
  return Compiled(compiled, int(compiled.memory_analysis().temp_size_in_bytes),
                  float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)))


def time_runs(executables: Sequence[Any], args: Sequence[Any], repeats: int,
              donate_argnums: Sequence[int] = ()) -> list[list[float]]:
  """Seconds per run of each executable, ``repeats`` rounds, interleaved.

  Each round runs every executable once, the order reversed every other
  round, so that a drift in the machine's load falls on all of them. An
  executable that donates arguments consumes them: each run gets its own
  copies of those, made before its clock starts. One that the device cannot
  load beside them (``RESOURCE_EXHAUSTED``) gets no runs.
  """
  runs: list[list[float]] = [[] for _ in executables]
  order = list(range(len(executables)))
  refused = set()
  for r in range(repeats):
    for i in (order if r % 2 == 0 else order[::-1]):
      if i in refused:
        continue
      call_args = [jax.tree_util.tree_map(jnp.copy, a) if n in donate_argnums else a
                   for n, a in enumerate(args)]
      jax.block_until_ready(call_args)
      start = time.perf_counter()
      try:
        jax.block_until_ready(executables[i](*call_args))
      except Exception as e:  # pylint: disable=broad-except
        # The device could not hold the program beside the arguments and
        # the copies of the donated ones: it is not timed (no runs).
        if not exhausted(e):
          raise
        refused.add(i)
        continue
      runs[i].append(time.perf_counter() - start)
  return runs


class Candidates:
  """Every joint plan of a step, predicted, and compiled where asked.

  The working state of a report: the entry points build it from the step's
  trace; ``_remat_report.py`` and the planner (``_choose.py``) compile and
  time plans through it, then :meth:`report` freezes it.
  """

  def __init__(self, step_fn: Callable[..., Any], args: Sequence[Any],
               traced: _cost_model.Traced, *, offload: Optional[bool],
               only: Optional[Sequence[str]], donate_argnums: Sequence[int] = ()):
    self.step_fn, self.args, self.traced = step_fn, tuple(args), traced
    self.donate_argnums = _search.donated(donate_argnums, len(self.args))
    if offload is None:
      offload = _search.host_memory_available()
    found = {s.key: _search.candidates(s, offload=offload) for s in traced.stacks}
    self.remats = {key: _search.restrict(f, only, key) for key, f in found.items()}
    _search.check_known(only, found)
    self.plans = _search.joint_plans(self.remats)
    self.compiled: dict[int, Compiled] = {}
    self.compile_times: dict[int, float] = {}
    self.times: dict[int, list[float]] = {}
    # Plans that compiled within the budget but that the device could not
    # run beside the step's arguments and the copies timing makes of them.
    self.unrunnable: set[int] = set()
    self.rest = 0
    self.compile_seconds = 0.0
    host_is_device = jax.default_backend() == "cpu"
    self.predicted = [
        _cost_model.predict(traced.models, self.choice(plan), step_flops=traced.step_flops,
                       host_is_device=host_is_device) for plan in self.plans]

  def _all_full(self) -> Optional[int]:
    for i, plan in enumerate(self.plans):
      if all(label == _search.REFERENCE for label in plan.values()):
        return i
    return None

  def choice(self, plan: Mapping[str, str]) -> dict[str, Any]:
    """Stack key -> remat value of ``plan`` (stack key -> label)."""
    return {k: self.remats[k][label] for k, label in plan.items()}

  def reference(self) -> int:
    """The plan compiled first: every stack ``"full"`` where a candidate,
    else the plan predicted to keep the fewest bytes."""
    full = self._all_full()
    if full is not None:
      return full
    return min(range(len(self.plans)),
               key=lambda i: (self.predicted[i].saved_bytes, self.predicted[i].flops, i))

  def temp(self, i: int) -> int:
    """Plan ``i``'s compiled temp bytes, else the calibrated prediction
    (``sys.maxsize`` for a plan that does not fit the device)."""
    if i in self.compiled:
      return self.compiled[i].temp_bytes
    return self.predicted[i].temp_bytes + self.rest

  def compile(self, i: int, *, memory_only: bool = False) -> Compiled:
    """Compiles plan ``i`` (once; a memory-only compile is redone to time it)."""
    known = self.compiled.get(i)
    if known is not None and (memory_only or known.executable is not None
                              or known.out_of_memory):
      return known
    start = time.perf_counter()
    try:
      compiled = compile_plan(self.step_fn, self.args, self.choice(self.plans[i]),
                              memory_only=memory_only, donate_argnums=self.donate_argnums)
    except Exception as e:  # pylint: disable=broad-except
      # A candidate too big for the device is one that does not fit, not the
      # end of the planning (on a TPU, XLA refuses to compile it).
      if not exhausted(e):
        raise
      compiled = OUT_OF_MEMORY
    if memory_only and not compiled.out_of_memory:
      compiled.executable = None   # not to be timed
    self.compile_times[i] = time.perf_counter() - start
    self.compile_seconds += self.compile_times[i]
    if not compiled.out_of_memory and all(c.out_of_memory for c in self.compiled.values()):
      # The first program compiled calibrates every prediction.
      self.rest = compiled.temp_bytes - self.predicted[i].temp_bytes
    self.compiled[i] = compiled
    return compiled

  def time(self, indices: Sequence[int], repeats: int) -> None:
    """Times plans (compiling them for speed first), interleaved."""
    executables = [self.compile(i).executable for i in indices]
    start = time.perf_counter()
    for i, runs in zip(indices, time_runs(executables, self.args, repeats,
                                          self.donate_argnums)):
      if runs:
        self.times[i] = self.times.get(i, []) + runs
      else:
        self.unrunnable.add(i)
    self.compile_seconds += time.perf_counter() - start

  def row(self, i: int) -> _results.ReportRow:
    """Plan ``i`` as a report row: predicted, and compiled and timed if so."""
    p, c = self.predicted[i], self.compiled.get(i)
    return _results.ReportRow(
        plan=self.plans[i], predicted_temp_bytes=p.temp_bytes + self.rest,
        saved_bytes=p.saved_bytes, flops=p.flops,
        temp_bytes=None if c is None or c.out_of_memory else c.temp_bytes,
        out_of_memory=c is not None and c.out_of_memory,
        xla_flops=None if c is None or c.out_of_memory else c.xla_flops,
        bytes_accessed=None if c is None or c.out_of_memory else c.bytes_accessed,
        step_time_s=min(self.times[i]) if i in self.times else None)

  def report(self, *, budget: Optional[int], chosen: Optional[int] = None,
             decision: str = "", seconds: float = 0.0) -> _results.RematReport:
    """The report of every plan so far, row ``chosen`` marked as chosen."""
    rows = tuple(self.row(i) for i in range(len(self.plans)))
    return _results.RematReport(
        stacks=self.traced.stacks, rows=rows, compile_seconds=self.compile_seconds,
        remats=self.remats, budget=budget,
        chosen=None if chosen is None else rows[chosen], compiles=len(self.compiled),
        rest_bytes=self.rest, seconds=seconds, decision=decision)
