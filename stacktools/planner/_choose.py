"""The planner's choice under a memory budget, in few compiles: :func:`choose`.

Every candidate plan is predicted from one trace of the step (see
``_trace.py`` and ``_cost_model.py``); :func:`choose` compiles only what the
prediction cannot settle. In pseudo-code::

  rows = predict every plan; compile "full" (the reference: calibrates rows)
  fits(plan) = compiled temp <= budget where compiled; else the prediction,
               compiled to check when within MARGIN of the budget
  measure=False: the plan with the fewest FLOPs that fits, compiled to check
                 (the next such plan where the compile is over the budget)
  measure=True:  challenger = fewest FLOPs among one-loop plans that fit
                 (any plan with fewer FLOPs than the reference if none)
                 time reference and challenger, interleaved, in at most
                 TIMING_SHARE of one compile's time (more rounds when the
                 difference is within twice the noise)
                 the faster; within the noise, the challenger (fewer FLOPs)

A trace prices FLOPs and bytes but not what one costs against the other on
this machine (on a CPU keeping a layer's activations is slower than
recomputing them; on an accelerator the reverse is usual), so two plans are
timed, one from each side of that trade, and the pick is one of them: a
plan chosen by timing is always a plan that was timed. One-loop plans are
preferred as the challenger because a per-depth mix compiles a loop per
segment (twice the time); an unrolled stack's (``BlockSeq``) mix is one
program like any other, so there every plan counts as one loop. That makes
at most ``MAX_COMPILES`` = 3 compiles: the reference, the challenger, and
one check of a plan the model puts within ``MARGIN`` of the budget (the
challenger itself, usually). When that check is refused (the plan does not
fit), the third compile goes to the plan with the fewest FLOPs that the
model puts surely within the budget: a plan at the edge is never checked at the cost of one that fits. Why not
fewer: the reference is the one compile that tells what the step holds
besides its stacks, and the two sides of the trade need a timing each. Why
not more: on the benchmarks the model's error on temp bytes is within the
margin, so one check settles the budget's edge; each further compile would
add a whole compile's time to planning.

Both ``st.plan_remat`` (_plan_remat.py) and ``st.remat_report(..., budget=...)``
(_remat_report.py) choose here. Each checks the budget's room
(:func:`check_room`), builds the candidate plans from the step's trace
(``_compile.Candidates``) and hands them to :func:`choose`, which only calls
on them what :class:`CandidatePlans` lists: the choice is made over the
candidates, whoever built them, and so stands beside the compiling, not on
top of it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Protocol

import jax

from stacktools.planner import _budget
from stacktools.planner import _cost_model
from stacktools.planner import _results
from stacktools.planner import _search

#: Compiles at most, the reference included (see the module docstring).
MAX_COMPILES = 3
#: The timed runs take at most this share of one compile's time (and at
#: least two rounds), so that timing a slow step cannot make planning dearer
#: than the compiles it saves.
TIMING_SHARE = 0.5


def device_bytes() -> Optional[int]:
  """The memory of the first local device, where it tells (not a CPU's)."""
  stats = jax.local_devices()[0].memory_stats()
  return stats.get("bytes_limit") if stats else None


def check_room(budget: Any, budget_bytes: int, args: Sequence[Any],
               donate_argnums: Sequence[int] = ()) -> None:
  """Refuses a budget that cannot fit beside the step's own arguments.

  The arguments the step donates are not counted: their buffers become the
  step's outputs, and XLA's own check of a program against the device's
  memory leaves them out. (On a TPU v5e of 16126 MiB, a GPT train step of
  13572 MiB of temp memory ran beside 3475 MiB of donated parameters and
  optimizer state.) A plan that does not fit after all is refused by XLA
  when it is compiled, and the planner passes over it.
  """
  limit = device_bytes()
  if limit is None:
    return
  device = jax.local_devices()[0]
  donated = set(_search.donated(donate_argnums, len(args)))
  held = sum(shard.data.nbytes
             for i, arg in enumerate(args) if i not in donated
             for leaf in jax.tree_util.tree_leaves(arg) if isinstance(leaf, jax.Array)
             for shard in leaf.addressable_shards if shard.device == device)
  if budget_bytes + held > limit:
    format_bytes = _budget.format_bytes
    kept = "arguments it does not donate" if donated else "arguments"
    raise ValueError(
        f"budget={budget!r} ({format_bytes(budget_bytes)}) of temp memory "
        f"does not fit beside the step's {kept}: they hold "
        f"{format_bytes(held)} of the device's "
        f"{format_bytes(limit)}, which leaves "
        f"{format_bytes(limit - held)} for the step. Pass a budget of at "
        "most that, or make the step smaller (batch, width).")


class CandidatePlans(Protocol):
  """What :func:`choose` asks of the candidate plans it chooses among.

  ``_compile.Candidates`` is the one the entry points build and hand over:
  every joint plan of a step, predicted, compiled and timed as asked (see it
  for what each attribute and method means).
  """

  @property
  def plans(self) -> Sequence[Mapping[str, str]]: ...
  @property
  def predicted(self) -> Sequence[_cost_model.Prediction]: ...
  @property
  def traced(self) -> _cost_model.Traced: ...
  @property
  def compiled(self) -> Mapping[int, Any]: ...   # plan -> its compile (``.executable``)
  @property
  def compile_times(self) -> Mapping[int, float]: ...
  @property
  def times(self) -> Mapping[int, list[float]]: ...
  @property
  def unrunnable(self) -> set[int]: ...

  def choice(self, plan: Mapping[str, str]) -> dict[str, Any]: ...
  def reference(self) -> int: ...
  def temp(self, i: int) -> int: ...
  def compile(self, i: int, *, memory_only: bool = False) -> Any: ...
  def time(self, indices: Sequence[int], repeats: int) -> None: ...
  def row(self, i: int) -> _results.ReportRow: ...
  def report(self, *, budget: Optional[int], chosen: Optional[int] = None,
             decision: str = "", seconds: float = 0.0) -> _results.RematReport: ...


class _Fits:
  """Which plans fit the budget, compiling only what the prediction leaves open.

  A plan predicted more than ``MARGIN`` over the budget does not fit; one
  more than ``MARGIN`` under it fits without a compile (unless it is to be
  timed); one in between is compiled to check, once (the edge check), and
  only while a compile is left for a plan that surely fits.
  (``_results.MARGIN``: a report's rows are chosen by it too.)
  """

  def __init__(self, plans: CandidatePlans, budget_bytes: int):
    self.plans = plans
    self.budget_bytes = budget_bytes
    self.edge_checks: list[int] = []   # the plans compiled to settle the edge

  def fits(self, i: int, timed: bool = False) -> bool:
    """Whether plan ``i`` fits; ``timed``: and it compiles to be timed (a
    program the device cannot hold is refused there, and does not fit)."""
    plans, budget_bytes = self.plans, self.budget_bytes
    known = plans.compiled.get(i)
    if known is None:
      estimate = plans.temp(i)
      if estimate > budget_bytes * (1 + _results.MARGIN):
        return False
      sure = estimate <= budget_bytes * (1 - _results.MARGIN)
      if sure and not timed:
        return True
      if len(plans.compiled) >= MAX_COMPILES:
        return False
      if not sure:
        # One check of the edge, and only while a compile is left for a plan
        # that surely fits: a refused check must not cost the challenger.
        if self.edge_checks or len(plans.compiled) >= MAX_COMPILES - 1:
          return False
        self.edge_checks.append(i)
    elif plans.temp(i) > budget_bytes:
      return False
    if known is None or (timed and known.executable is None):
      plans.compile(i, memory_only=not timed)
    return plans.temp(i) <= budget_bytes

  def fewest_flops(self, indices: Sequence[int], timed: bool = False) -> Optional[int]:
    """The plan among ``indices`` with the fewest predicted FLOPs that fits."""
    plans = self.plans
    ranked = sorted(indices, key=lambda i: (plans.predicted[i].flops, plans.temp(i), i))
    return next((i for i in ranked if self.fits(i, timed)), None)


def _challenger(plans: CandidatePlans, fitting: _Fits,
                reference: int) -> Optional[int]:
  """The plan timed against the reference: the fewest FLOPs that fit among
  the one-loop plans with fewer FLOPs than it, else among any such plans."""
  predicted = plans.predicted
  cheaper = [i for i in range(len(plans.plans))
             if predicted[i].flops < predicted[reference].flops]
  # An unrolled stack (BlockSeq) compiles each of its plans as one program.
  looped = {stack.key: stack.looped for stack in plans.traced.stacks}
  one_loop = [i for i in cheaper if all(
      _cost_model.single_loop(r) or not looped[key]
      for key, r in plans.choice(plans.plans[i]).items())]
  challenger = fitting.fewest_flops(one_loop, timed=True)
  if challenger is None:
    challenger = fitting.fewest_flops(cheaper, timed=True)
  return challenger


def _fastest(reference: Sequence[float],
             challenger: Sequence[float]) -> tuple[float, float, float]:
  """The fastest run of each, and the timing noise: the spread of each
  plan's runs after its first (which warms up), between the report's tie
  (``_results.TIE``) and twice it."""
  spreads = [max(r[1:]) / min(r[1:]) - 1 for r in (reference, challenger) if len(r) > 2]
  tie = _results.TIE
  return min(reference), min(challenger), min(max([tie] + spreads), 2 * tie)


def _race(plans: CandidatePlans, reference: int, challenger: int,
          repeats: int) -> Optional[tuple[int, str]]:
  """Times the two plans, interleaved: the faster and the decision in
  words; None where the device could not run either."""
  pair = [reference, challenger]
  plans.time(pair, 1)
  if plans.unrunnable & set(pair):
    return None
  per_round = plans.times[reference][0] + plans.times[challenger][0]
  rounds = max(2, min(2 * repeats, int(
      TIMING_SHARE * plans.compile_times[reference] / per_round)))
  plans.time(pair, min(repeats, rounds) - 1)
  t_ref, t_new, noise = _fastest(plans.times[reference], plans.times[challenger])
  if noise < abs(t_new / t_ref - 1) <= 2 * noise and rounds > repeats:
    # Close to the noise: time as much again, so that the same plans are
    # not chosen one way in one run and the other in the next.
    plans.time(pair, rounds - repeats)
    t_ref, t_new, noise = _fastest(plans.times[reference], plans.times[challenger])
  names = lambda i: plans.row(i).plan_text()
  timing = (f"{names(challenger)} {1e3 * t_new:.1f} ms against {names(reference)} "
            f"{1e3 * t_ref:.1f} ms (noise {100 * noise:.1f}%)")
  if t_new * (1 + noise) < t_ref:
    return challenger, f"{timing}: recomputing costs more than keeping here"
  if t_ref * (1 + noise) < t_new:
    return reference, f"{timing}: keeping costs more than recomputing here"
  return challenger, f"{timing}: a tie, so the fewer FLOPs"


def choose(plans: CandidatePlans, *, budget: _budget.Budget, measure: bool,
           repeats: int, start: float) -> _results.RematReport:
  """The report of :func:`stacktools.plan_remat`'s few compiles, its choice marked.

  See the module docstring for the procedure. The public entry point that
  took the budget parsed it, checked its room (:func:`check_room`) and, for
  ``measure``, the arguments (``_search.check_measurable``), then built
  ``plans`` from the step's trace; ``start`` is when it began (the report's
  ``seconds`` count from there).
  """
  budget_bytes = budget.bytes
  reference = plans.reference()
  plans.compile(reference, memory_only=not measure)   # calibrates the rest
  fitting = _Fits(plans, budget_bytes)
  if not measure or not fitting.fits(reference):
    pick = _compiled_within(plans, fitting, fitting.fewest_flops(range(len(plans.plans))))
    decision = "the fewest predicted FLOPs that fit"
  else:
    challenger = _challenger(plans, fitting, reference)
    if challenger is None:
      pick, decision = reference, "no plan with fewer FLOPs fits"
    else:
      raced = _race(plans, reference, challenger, repeats)
      if raced is None:
        return _untimed(plans, budget_bytes, start, reference, challenger)
      pick, decision = raced
  report = plans.report(budget=budget_bytes, chosen=pick, decision=decision,
                        seconds=time.perf_counter() - start)
  if pick is None:
    _results.no_fit(report.rows, budget.given, budget_bytes)
  return report


def _compiled_within(plans: CandidatePlans, fitting: _Fits,
                     pick: Optional[int]) -> Optional[int]:
  """``pick``, compiled to check that it fits, else the next plan by FLOPs
  that does: a plan is never returned on its prediction alone.

  The prediction's error can exceed ``MARGIN`` (a mixed-precision GPT's
  ``none`` compiled 15% over its prediction on a CPU), and a plan returned
  over the budget is the one failure the budget is there to prevent. Each
  plan a compile shows over the budget no longer fits (``_Fits.fits``
  reads its compiled bytes), so the search moves on; the reference is
  compiled already, so it ends.
  """
  while pick is not None and pick not in plans.compiled:
    plans.compile(pick, memory_only=True)
    if plans.temp(pick) <= fitting.budget_bytes:
      return pick
    pick = fitting.fewest_flops(range(len(plans.plans)))
  return pick


def _untimed(plans: CandidatePlans, budget_bytes: int, start: float,
             reference: int, challenger: int) -> _results.RematReport:
  """The challenger, by its fewer FLOPs, when either plan could not be timed.

  Timing a step that donates arguments runs it on copies of them, beside
  the caller's own: the device may not hold a program that fits the budget
  beside both, although the step that runs (donating, with no copies) fits.
  Both plans fit the budget, so the choice falls back on the FLOPs, as with
  ``measure=False``.
  """
  names = [plans.row(i).plan_text() for i in (reference, challenger)]
  failed = " and ".join(n for i, n in zip((reference, challenger), names)
                        if i in plans.unrunnable)
  decision = (f"not timed: the device could not run {failed} beside copies of the "
              f"donated arguments; {names[1]} has the fewer FLOPs")
  return plans.report(budget=budget_bytes, chosen=challenger, decision=decision,
                      seconds=time.perf_counter() - start)
