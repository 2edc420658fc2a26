"""Remat chosen for the user under a memory budget: ``st.plan_remat``.

:func:`plan_remat` predicts every candidate plan from one trace of the step
(see :mod:`stacktools.report`) and compiles only what the prediction cannot
settle. In pseudo-code::

  rows = predict every plan; compile "full" (the reference: calibrates rows)
  fits(plan) = compiled temp <= budget where compiled; else the prediction,
               compiled to check when within MARGIN of the budget
  measure=False: the plan with the fewest FLOPs that fits
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
segment (twice the time). That makes at most ``MAX_COMPILES`` = 3 compiles:
the reference, the challenger, and one check of a plan the model puts
within ``MARGIN`` of the budget (the challenger itself, usually). When that
check is refused (the plan does not fit), the third compile goes to the
plan with the fewest FLOPs that the model puts surely within the budget: a
plan at the edge is never checked at the cost of one that fits. Why not
fewer: the reference is the one compile that tells what the step holds
besides its stacks, and the two sides of the trade need a timing each. Why
not more: on the benchmarks the model's error on temp bytes is within the
margin, so one check settles the budget's edge; each further compile would
add a whole compile's time to planning.

The :class:`RematPlan` returned answers ``remat="auto"`` while a step is
traced under it, and is remembered in a cache folder (``cache_dir=`` or
``$STACKTOOLS_PLAN_CACHE``) under a key of everything it depends on, so the
same step and budget plan again in the time of one trace.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import jax

from stacktools import _checks
from stacktools import _model
from stacktools import _plan_cache
from stacktools import report as report_lib
from stacktools import segments as segments_lib

#: The cost model's error on temp bytes that the planner allows for: a plan
#: predicted within this fraction of the budget is compiled before it is
#: trusted to fit (the model is within 7% on the benchmarks' candidates,
#: 12% for save_all, and errs on the side of more memory).
MARGIN = 0.10
#: Compiles at most, the reference included (see the module docstring).
MAX_COMPILES = 3
#: Timings closer than this fraction are a tie (the spread of repeated runs
#: of one program, where it is larger, up to twice this). On a shared CPU
#: the fastest of two runs of one program varies by about this much from
#: one planning to the next; a tie goes to fewer FLOPs, so that the same
#: inputs give the same plan.
TIE = 0.05
#: The timed runs take at most this share of one compile's time (and at
#: least two rounds), so that timing a slow step cannot make planning dearer
#: than the compiles it saves.
TIMING_SHARE = 0.5


class RematPlan:
  """The chosen remat for every ``remat="auto"`` stack of a step.

  Use it as a context while the step is traced, or wrap the step (as in
  :func:`plan_remat`'s example): ``with plan: jax.jit(step_fn).lower(*args)``,
  or ``jax.jit(plan.wrap(step_fn))``, which applies the plan whenever traced.

  Attributes:
    choice: stack key -> remat value.
    labels: stack key -> candidate label.
    report: the report the plan was chosen from.
    reused: whether the plan was read back from the cache folder.
    cache_path: the file the plan is remembered in, if any.
    seconds: how long :func:`plan_remat` took.
  """

  def __init__(self, choice: Mapping[str, Any], labels: Mapping[str, str],
               report: report_lib.RematReport, *, reused: bool = False,
               cache_path: Optional[str] = None, seconds: float = 0.0):
    self.choice = dict(choice)
    self.labels = dict(labels)
    self.report = report
    self.reused = reused
    self.cache_path = cache_path
    self.seconds = seconds
    self._contexts: list[Any] = []

  def __enter__(self) -> "RematPlan":
    context = segments_lib.plan_context(report_lib.Fixed(self.choice))
    context.__enter__()
    self._contexts.append(context)
    return self

  def __exit__(self, *exc) -> None:
    self._contexts.pop().__exit__(*exc)

  @classmethod
  def from_report(cls, report: report_lib.RematReport, *, budget: Union[int, str],
                  by_time: bool = True) -> "RematPlan":
    """The plan chosen from an existing report, e.g. one that compiled all.

    A row fits by its compiled temp memory, or where not compiled by its
    prediction with :data:`MARGIN` to spare.

    Example::

      class Block(hk.Module):
        def __call__(self, x):
          h = st.checkpoint_name(jax.nn.gelu(hk.Linear(32)(x)), "mlp_hidden")
          return x + hk.Linear(x.shape[-1])(h)

      net = hk.without_apply_rng(hk.transform(
          lambda x: st.Stacked(Block, num_layers=4, remat="auto", name="h").fold(x)))
      batch = jnp.ones((8, 16))
      params = net.init(jax.random.PRNGKey(0), batch)
      train_step = jax.grad(lambda params, batch: jnp.mean(net.apply(params, batch) ** 2))

      report = st.remat_report(train_step, params, batch, measure=True,
                               only=["full", "nested"], compile_all=True)
      plan = RematPlan.from_report(report, budget="48MiB")

    Args:
      report: from :func:`stacktools.remat_report`.
      budget: the most compiled temp memory, as bytes or e.g. ``"48MiB"``.
      by_time: choose the fastest timed plan, ties within the timing noise
        broken by fewer FLOPs then less memory (the report must have timed
        a plan that fits); otherwise the one with the fewest FLOPs.

    Returns:
      The plan.

    Raises:
      ValueError: when no candidate fits: names the smallest temp memory
        and its plan.
    """
    budget_bytes = report_lib.parse_bytes(budget)
    fits = [r for r in report.rows if _fits(r, budget_bytes)]
    if not fits:
      _no_fit(report.rows, budget, budget_bytes)
    by_flops = lambda r: (r.flops, r.memory)
    if by_time:
      timed = [r for r in fits if r.step_time_s is not None]
      if not timed:
        raise ValueError("by_time=True needs a report that timed a plan within the "
                         "budget: st.remat_report(..., measure=True, compile_all=True), "
                         "or by_time=False.")
      fastest = min(r.step_time_s for r in timed)
      best = min((r for r in timed if r.step_time_s <= fastest * (1 + TIE)), key=by_flops)
    else:
      best = min(fits, key=by_flops)
    report = dataclasses.replace(report, budget=budget_bytes, chosen=best)
    return cls(_choice(report, best.plan), best.plan, report)

  def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` running under this plan whenever it is called or traced."""
    return report_lib.under(report_lib.Fixed(self.choice), fn)

  def __repr__(self) -> str:
    return f"RematPlan({self.labels})"

  def to_json(self) -> dict[str, Any]:
    return {"plan": self.labels, "reused": self.reused, "cache_path": self.cache_path,
            "seconds": self.seconds, "report": self.report.to_json()}


def _choice(report: report_lib.RematReport, labels: Mapping[str, str]) -> dict[str, Any]:
  return {k: report.remats[k][label] for k, label in labels.items()}


def _fits(row: report_lib.ReportRow, budget: int) -> bool:
  if row.compiled:
    return row.temp_bytes <= budget
  return row.predicted_temp_bytes <= budget * (1 - MARGIN)


def _no_fit(rows: Sequence[report_lib.ReportRow], budget: Any, budget_bytes: int):
  smallest = min(rows, key=lambda r: r.memory)
  how = "compiled" if smallest.compiled else "predicted"
  raise ValueError(
      f"No remat plan fits budget={budget!r} "
      f"({report_lib.format_bytes(budget_bytes)}): the smallest {how} temp "
      f"memory is {report_lib.format_bytes(smallest.memory)} "
      f"({smallest.memory} bytes), with plan {smallest.plan_text()}. "
      "Raise the budget to at least that, or make the step smaller (batch, "
      "width).")


def device_bytes() -> Optional[int]:
  """The memory of the first local device, where it tells (not a CPU's)."""
  stats = jax.local_devices()[0].memory_stats()
  return stats.get("bytes_limit") if stats else None


def _check_room(budget: Any, budget_bytes: int, args: Sequence[Any]) -> None:
  """Refuses a budget that cannot fit beside the step's own arguments."""
  limit = device_bytes()
  if limit is None:
    return
  device = jax.local_devices()[0]
  held = sum(shard.data.nbytes for leaf in jax.tree_util.tree_leaves(args)
             if isinstance(leaf, jax.Array)
             for shard in leaf.addressable_shards if shard.device == device)
  if budget_bytes + held > limit:
    raise ValueError(
        f"budget={budget!r} ({report_lib.format_bytes(budget_bytes)}) of temp memory "
        f"does not fit beside the step's arguments: they hold "
        f"{report_lib.format_bytes(held)} of the device's "
        f"{report_lib.format_bytes(limit)}, which leaves "
        f"{report_lib.format_bytes(limit - held)} for the step. Pass a budget of at "
        "most that, or make the step smaller (batch, width).")


def _fastest(reference: Sequence[float],
             challenger: Sequence[float]) -> tuple[float, float, float]:
  """The fastest run of each, and the timing noise: the spread of each
  plan's runs after its first (which warms up), between :data:`TIE` and
  twice it."""
  spreads = [max(r[1:]) / min(r[1:]) - 1 for r in (reference, challenger) if len(r) > 2]
  return min(reference), min(challenger), min(max([TIE] + spreads), 2 * TIE)


def choose(step_fn: Callable[..., Any], *args: Any, budget: Union[int, str],
           measure: bool, repeats: int, offload: Optional[bool],
           only: Optional[Sequence[str]],
           traced: Optional[report_lib.Traced] = None,
           donate_argnums: Sequence[int] = ()) -> report_lib.RematReport:
  """The report of :func:`plan_remat`'s few compiles, its choice marked.

  See the module docstring for the procedure.
  """
  start = time.perf_counter()
  budget_bytes = report_lib.parse_bytes(budget)
  _check_room(budget, budget_bytes, args)
  if measure:
    report_lib._check_measurable(args)  # pylint: disable=protected-access
  plans = report_lib.Plans(step_fn, args, traced or report_lib.trace(step_fn, *args),
                           offload=offload, only=only, donate_argnums=donate_argnums)
  predicted = plans.predicted
  names = lambda i: plans.row(i).plan_text()
  reference = plans.reference()
  plans.compile(reference, memory_only=not measure)   # calibrates the rest

  edge_checks = []   # the plans compiled to settle the budget's edge

  def fits(i: int, timed: bool = False) -> bool:
    """Whether plan ``i`` fits; ``timed``: and it compiles to be timed (a
    program the device cannot hold is refused there, and does not fit)."""
    known = plans.compiled.get(i)
    if known is None:
      estimate = plans.temp(i)
      if estimate > budget_bytes * (1 + MARGIN):
        return False
      sure = estimate <= budget_bytes * (1 - MARGIN)
      if sure and not timed:
        return True
      if len(plans.compiled) >= MAX_COMPILES:
        return False
      if not sure:
        # One check of the edge, and only while a compile is left for a plan
        # that surely fits: a refused check must not cost the challenger.
        if edge_checks or len(plans.compiled) >= MAX_COMPILES - 1:
          return False
        edge_checks.append(i)
    elif plans.temp(i) > budget_bytes:
      return False
    if known is None or (timed and known.executable is None):
      plans.compile(i, memory_only=not timed)
    return plans.temp(i) <= budget_bytes

  def fewest_flops(indices, timed=False) -> Optional[int]:
    ranked = sorted(indices, key=lambda i: (predicted[i].flops, plans.temp(i), i))
    return next((i for i in ranked if fits(i, timed)), None)

  everything = range(len(plans.plans))
  pick = None
  if not measure or not fits(reference):
    pick = fewest_flops(everything)
    decision = "the fewest predicted FLOPs that fit"
  else:
    cheaper = [i for i in everything if predicted[i].flops < predicted[reference].flops]
    one_loop = [i for i in cheaper if all(
        _model.single_loop(r) for r in plans.choice(plans.plans[i]).values())]
    challenger = fewest_flops(one_loop, timed=True)
    if challenger is None:
      challenger = fewest_flops(cheaper, timed=True)
    if challenger is None:
      pick, decision = reference, "no plan with fewer FLOPs fits"
    else:
      pair = [reference, challenger]
      plans.time(pair, 1)
      if plans.unrunnable & set(pair):
        return _untimed(plans, budget_bytes, start, reference, challenger)
      per_round = plans.times[reference][0] + plans.times[challenger][0]
      rounds = max(2, min(2 * repeats, int(
          TIMING_SHARE * plans.compile_times[reference] / per_round)))
      plans.time(pair, min(repeats, rounds) - 1)
      t_ref, t_new, noise = _fastest(plans.times[reference], plans.times[challenger])
      if noise < abs(t_new / t_ref - 1) <= 2 * noise and rounds > repeats:
        # Close to the noise: time as much again, so that the same plans
        # are not chosen one way in one run and the other in the next.
        plans.time(pair, rounds - repeats)
        t_ref, t_new, noise = _fastest(plans.times[reference], plans.times[challenger])
      timing = (f"{names(challenger)} {1e3 * t_new:.1f} ms against {names(reference)} "
                f"{1e3 * t_ref:.1f} ms (noise {100 * noise:.1f}%)")
      if t_new * (1 + noise) < t_ref:
        pick, decision = challenger, f"{timing}: recomputing costs more than keeping here"
      elif t_ref * (1 + noise) < t_new:
        pick, decision = reference, f"{timing}: keeping costs more than recomputing here"
      else:
        pick, decision = challenger, f"{timing}: a tie, so the fewer FLOPs"
  report = plans.report(budget=budget_bytes, chosen=pick, decision=decision,
                        seconds=time.perf_counter() - start)
  if pick is None:
    _no_fit(report.rows, budget, budget_bytes)
  return report


def _untimed(plans: report_lib.Plans, budget_bytes: int, start: float,
             reference: int, challenger: int) -> report_lib.RematReport:
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


def plan_remat(step_fn: Callable[..., Any], *args: Any, budget: Union[int, str],
               measure: bool = True, repeats: int = 3,
               offload: Optional[bool] = None,
               only: Optional[Sequence[str]] = None,
               cache_dir: Optional[str] = None,
               donate_argnums: Sequence[int] = ()) -> RematPlan:
  """Chooses the remat of every ``remat="auto"`` stack under a memory budget.

  Predicts every candidate plan's temp memory and FLOPs from one trace of
  the step, compiles the reference plan (every stack ``"full"``) to calibrate
  the predictions, and compiles at most two more: with ``measure=True`` the
  plan with the fewest FLOPs among those that run each stack as one loop, to
  time it against the reference; the faster is chosen, and a tie, within the
  timing noise, goes to fewer FLOPs, then less memory. A plan predicted
  within 10% of the budget is compiled before it is trusted to fit.
  ``measure=False`` takes the fewest FLOPs that fit. Several stacks are planned jointly: the budget is for the whole step.

  With a cache folder the plan is remembered under a key of the step's
  jaxpr, its arguments' shapes, dtypes and shardings, the budget and these
  options, the backend and the versions of JAX and stacktools; the same
  call then returns the same plan after one trace (``plan.reused``).

  Example::

    class Block(hk.Module):
      def __call__(self, x):
        h = st.checkpoint_name(jax.nn.gelu(hk.Linear(32)(x)), "mlp_hidden")
        return x + hk.Linear(x.shape[-1])(h)

    net = hk.without_apply_rng(hk.transform(
        lambda x: st.Stacked(Block, num_layers=4, remat="auto", name="h").fold(x)))
    batch = jnp.ones((8, 16))
    params = net.init(jax.random.PRNGKey(0), batch)
    train_step = jax.grad(lambda params, batch: jnp.mean(net.apply(params, batch) ** 2))

    plan = st.plan_remat(train_step, params, batch, budget="48MiB",
                         only=["full", "nested", "save:mlp_hidden"])
    with plan:                                # trace inside the plan ...
      step = jax.jit(train_step).lower(params, batch).compile()
    step = jax.jit(plan.wrap(train_step))    # ... or wrap the step
    print(plan.report)

  Args:
    step_fn: the function whose stacks use ``remat="auto"``.
    *args: its arguments (arrays; ``jax.ShapeDtypeStruct`` too when
      ``measure=False``).
    budget: the most compiled temp memory, as bytes or e.g. ``"48MiB"``.
    measure: time two plans to learn what recomputation costs here, rather
      than choose by FLOPs alone.
    repeats: timed runs of each of the two (the fastest counts), fewer
      where they would take more than half a compile's time (at least 2),
      as many again for a close call where there is time.
    offload: as in :func:`stacktools.remat_report`.
    only: as in :func:`stacktools.remat_report`.
    cache_dir: where plans are remembered; default
      ``$STACKTOOLS_PLAN_CACHE``, and none when that is unset.
    donate_argnums: the arguments the step that runs donates, as given to
      ``jax.jit`` (a train step's parameters and optimizer state): the
      candidates are compiled donating them too, so that the budget is met
      by the temp memory of that step. Timed runs get copies of them.

  Returns:
    The plan: a context manager, with ``plan.report``.

  Raises:
    ValueError: when no candidate fits: names the smallest temp memory and
      its plan; for a label in ``only`` that is no stack's candidate; for
      ``measure=True`` with ``jax.ShapeDtypeStruct`` arguments (checked
      before anything is compiled).
  """
  start = time.perf_counter()
  with _checks.subject("st.plan_remat"):
    budget_bytes = report_lib.parse_bytes(budget)
    if measure:
      report_lib._check_measurable(args)  # pylint: disable=protected-access
    traced = report_lib.trace(step_fn, *args)
    if offload is None:
      offload = report_lib.host_memory_available()
    cache = _plan_cache.PlanCache.at(cache_dir)
    key = None
    if cache is not None:
      key = _plan_cache.key(traced.text(), args, {
          "budget": budget_bytes, "measure": measure, "offload": offload,
          "only": None if only is None else [only] if isinstance(only, str) else list(only),
          "donate_argnums": list(report_lib._donated(  # pylint: disable=protected-access
              donate_argnums, len(args)))})
      plan = _remembered(cache, key, traced, offload=offload, only=only)
      if plan is not None:
        plan.seconds = time.perf_counter() - start
        return plan
    report = choose(step_fn, *args, budget=budget, measure=measure,
                    repeats=repeats, offload=offload, only=only, traced=traced,
                    donate_argnums=donate_argnums)
    report = dataclasses.replace(report, seconds=time.perf_counter() - start)
  labels = dict(report.chosen.plan)
  path = None if cache is None else cache.store(key, {
      "labels": labels, "report": report.to_json()})
  return RematPlan(_choice(report, labels), labels, report, cache_path=path,
                   seconds=time.perf_counter() - start)


def _remembered(cache: _plan_cache.PlanCache, key: Mapping[str, Any],
                traced: report_lib.Traced, *, offload: bool,
                only: Optional[Sequence[str]]) -> Optional[RematPlan]:
  """The plan stored under ``key``, or None (a miss, or a file not usable)."""
  entry = cache.load(key)
  if entry is None:
    return None
  remats = {s.key: report_lib._restrict(  # pylint: disable=protected-access
      report_lib.candidates(s, offload=offload), only, s.key) for s in traced.stacks}
  labels = entry["labels"]
  try:
    choice = {k: remats[k][label] for k, label in labels.items()}
    if set(choice) != set(remats):
      raise KeyError(sorted(set(remats) ^ set(choice)))
    report = report_lib.RematReport.from_json(entry["report"], remats)
  except (KeyError, TypeError, ValueError, StopIteration) as e:
    cache.warn(cache.path(key), f"its plan does not match this step: {e!r}")
    return None
  return RematPlan(choice, labels, report, reused=True, cache_path=cache.path(key))
