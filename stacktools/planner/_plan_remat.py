"""Remat chosen for the user under a memory budget: ``st.plan_remat``.

:func:`plan_remat` predicts every candidate plan from one trace of the step
and compiles only what the prediction cannot settle: at most
``MAX_COMPILES`` = 3 (the reference, ``"full"``, which calibrates the
predictions; a challenger with fewer FLOPs, timed against it; one check of a
plan at the budget's edge). ``_choose.py`` holds that procedure and
why, shared with ``st.remat_report(..., budget=...)``; this module traces the
step (``_trace.py``), builds the candidates from the trace
(``_compile.Candidates``) and hands them to it.

The :class:`RematPlan` returned answers ``remat="auto"`` while a step is
traced under it, and is remembered in a cache folder (``cache_dir=`` or
``$STACKTOOLS_PLAN_CACHE``, ``_cache.py``) under a key of everything it
depends on, so the same step and budget plan again in the time of one trace.
This module is the public entry; it does not import ``_remat_report.py``, nor that
module this one (see its docstring for the layering).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import jax
import numpy as np

from stacktools.core import _checks
from stacktools.planner import _budget
from stacktools.planner import _cache
from stacktools.planner import _choose
from stacktools.planner import _compile
from stacktools.planner import _cost_model
from stacktools.planner import _results
from stacktools.planner import _search
from stacktools.planner import _trace
# The plan's class, at its public address (st.RematPlan); it lives with the
# report it is chosen from (RematPlan.from_report, report.plan(...)).
from stacktools.planner._results import RematPlan


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
  ``measure=False`` takes the fewest FLOPs that fit. Several stacks are
  planned jointly: the budget is for the whole step.

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
    The plan: a context manager, with ``plan.report``. In a run of several
    processes, every process gets process 0's choice.

  Raises:
    ValueError: when no candidate fits: names the smallest temp memory and
      its plan; for a label in ``only`` that is no stack's candidate; for
      ``measure=True`` with ``jax.ShapeDtypeStruct`` arguments (checked
      before anything is compiled).
  """
  start = time.perf_counter()
  with _checks.subject("st.plan_remat"):
    budget = _budget.parse_budget(budget)
    if measure:
      _search.check_measurable(args)
    traced = _trace.trace(step_fn, *args)
    if offload is None:
      offload = _search.host_memory_available()
    cache = _cache.PlanCache.at(cache_dir)
    key = None
    if cache is not None:
      key = _cache.key(traced.text(), args, {
          "budget": budget.bytes, "measure": measure, "offload": offload,
          "only": None if only is None else [only] if isinstance(only, str) else list(only),
          "donate_argnums": list(_search.donated(donate_argnums, len(args)))})
      plan = _remembered(cache, key, traced, offload=offload, only=only)
      if plan is not None:
        plan.seconds = time.perf_counter() - start
        return _process_zeros(plan)
    # The same order as st.remat_report's (_remat_report.py): room, candidates, choice.
    _choose.check_room(budget.given, budget.bytes, args, donate_argnums)
    plans = _compile.Candidates(step_fn, args, traced, offload=offload, only=only,
                                donate_argnums=donate_argnums)
    report = _choose.choose(plans, budget=budget, measure=measure, repeats=repeats,
                            start=start)
  labels = dict(report.chosen.plan)
  path = None if cache is None else cache.store(key, {
      "labels": labels, "report": report.to_json()})
  return _process_zeros(RematPlan(_results.choice_of(report, labels), labels, report,
                                  cache_path=path, seconds=time.perf_counter() - start))


def _process_zeros(plan: RematPlan) -> RematPlan:
  """Process 0's plan, in every process of a run of several.

  Each process plans (or reads a remembered plan) itself, and timing can call
  a close race either way; but every process must trace the same program.
  The candidates come in the same order everywhere (one trace of the same
  step), so process 0 sends the index of its choice.
  """
  if jax.process_count() == 1:
    return plan
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  plans = [dict(row.plan) for row in plan.report.rows]
  labels = plans[int(multihost_utils.broadcast_one_to_all(
      np.int32(plans.index(plan.labels))))]
  if labels == plan.labels:
    return plan
  return RematPlan(_results.choice_of(plan.report, labels), labels, plan.report,
                   reused=plan.reused, cache_path=plan.cache_path, seconds=plan.seconds)


def _remembered(cache: _cache.PlanCache, key: Mapping[str, Any],
                traced: _cost_model.Traced, *, offload: bool,
                only: Optional[Sequence[str]]) -> Optional[RematPlan]:
  """The plan stored under ``key``, or None (a miss, or a file not usable)."""
  entry = cache.load(key)
  if entry is None:
    return None
  remats = {s.key: _search.restrict(
      _search.candidates(s, offload=offload), only, s.key) for s in traced.stacks}
  labels = entry["labels"]
  try:
    choice = {k: remats[k][label] for k, label in labels.items()}
    if set(choice) != set(remats):
      raise KeyError(sorted(set(remats) ^ set(choice)))
    report = _results.RematReport.from_json(entry["report"], remats)
  except (KeyError, TypeError, ValueError, StopIteration) as e:
    cache.warn(cache.path(key), f"its plan does not match this step: {e!r}")
    return None
  return RematPlan(choice, labels, report, reused=True, cache_path=cache.path(key))
