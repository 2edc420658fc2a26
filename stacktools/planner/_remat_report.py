"""The cost of every remat candidate of a step: ``st.remat_report``.

A *stack* is a loop built with ``remat="auto"``, a *candidate* one remat
value for it, a *plan* a candidate for every stack (``_search.py``
says more). Every plan is predicted from one trace of the step
(``_trace.py``), without compiling it (``_cost_model.py``: what the loops keep
per layer and the FLOPs of a layer, times counts, plus carries, seams and
nested splits). One compile, of the plan that runs every stack ``"full"``,
tells what the step holds besides its stacks, which every prediction then
adds. In pseudo-code::

  traced = trace(step_fn, *args)              # stacks, each layer's trace
  rows = [predict(plan) for plan in plans]     # no compile
  rest = temp(compile(all "full")) - predict(all "full")
  with a budget: compile a few more and choose (_choose.py)
  compile_all=True: compile (and time) every plan, beside its prediction

This module is the public entry; the machinery is below it, shared with
``_plan_remat.py`` (which this module does not import, nor it this one), and its
modules import one another in one direction only::

  _remat_report.py, _plan_remat.py   trace, build the Candidates, choose
    -> _trace.py     one trace: the stacks, each one's cost model
       _compile.py   compiling and timing plans; Candidates, the record
       _choose.py    the few compiles and the choice, over the candidates it
                     is handed (it does not import _compile.py)
    -> _results.py   ReportRow, RematReport, RematPlan
       _search.py    each stack's candidates, the joint plans
       _cost_model.py  what a candidate costs; Traced, a step's model
    -> _stack_info.py, _budget.py   the shared terms: a stack, a fixed plan,
                     bytes and budgets
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from stacktools.core import _checks
from stacktools.planner import _budget
from stacktools.planner import _choose
from stacktools.planner import _compile
from stacktools.planner import _search
from stacktools.planner import _trace
# The report's classes, at their public address (st.RematReport); they live
# with RematPlan, which they lead to (report.plan(...)).
from stacktools.planner._results import RematReport
from stacktools.planner._results import ReportRow


def remat_report(step_fn: Callable[..., Any], *args: Any, measure: bool = False,
                 repeats: int = 3, offload: Optional[bool] = None,
                 only: Optional[Sequence[str]] = None,
                 budget: Union[int, str, None] = None,
                 compile_all: bool = False,
                 donate_argnums: Sequence[int] = ()) -> RematReport:
  """Predicts every candidate plan's cost; compiles one, or a few, or all.

  ``step_fn``'s stacks are built with ``remat="auto"``; they are found by
  tracing it, with the names their blocks tag. Every plan's temp memory,
  saved bytes and FLOPs are predicted from that trace; the plan that runs
  every stack ``"full"`` is compiled to learn what the step holds besides
  its stacks. With a ``budget``, the plans :func:`stacktools.plan_remat`
  would compile and time are compiled and timed too, and its choice is
  marked. The table shows predicted and compiled temp memory side by side,
  with the prediction's error.

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

    report = st.remat_report(train_step, params, batch,
                             only=["full", "nested", "save:mlp_hidden"])  # or every candidate
    print(report)        # plan, predicted and compiled MiB, error, GFLOPs

  Args:
    step_fn: the function to plan, e.g. a training step (not jitted, or
      jitted: it is traced again under each plan).
    *args: its arguments: arrays, or ``jax.ShapeDtypeStruct`` when
      ``measure=False``.
    measure: time the plans compiled to be timed (all of them with
      ``compile_all=True``, within ``budget`` if given): the fastest of
      ``repeats`` runs.
    repeats: timed runs per timed plan.
    offload: include ``"offload"``; by default where the backend has pinned
      host memory.
    only: consider only the candidates with these labels (``"full"``,
      ``"save:mlp_hidden"``, ``"none:16,full:48"``, ...).
    budget: bytes or e.g. ``"48MiB"``: rows over it are marked, and the plan
      :func:`stacktools.plan_remat` chooses under it is made and marked.
    compile_all: compile every plan (and with ``measure=True`` time those
      within ``budget``), to check the predictions: one compile per plan.
    donate_argnums: the arguments the step that runs donates (``jax.jit``'s
      ``donate_argnums``; a train step's parameters and optimizer state):
      every plan is compiled donating them too, so that its temp memory is
      the one that step has, and each timed run gets copies of them.

  Returns:
    The report.

  Raises:
    ValueError: for a label in ``only`` that is no stack's candidate, for
      ``measure=True`` with ``jax.ShapeDtypeStruct`` arguments, or for a
      ``donate_argnums`` that names no argument.
  """
  with _checks.subject("st.remat_report"):
    budget = None if budget is None else _budget.parse_budget(budget)
    if budget is not None and not compile_all:
      start = time.perf_counter()
      # The same order as st.plan_remat's (_plan_remat.py): room, candidates, choice.
      _choose.check_room(budget.given, budget.bytes, args, donate_argnums)
      plans = _candidate_plans(step_fn, args, measure=measure, offload=offload, only=only,
                               donate_argnums=donate_argnums)
      return _choose.choose(plans, budget=budget, measure=measure, repeats=repeats,
                            start=start)
    return build(step_fn, *args, measure=measure, repeats=repeats, offload=offload,
                 only=only, budget=budget, compile_all=compile_all,
                 donate_argnums=donate_argnums)


def build(step_fn: Callable[..., Any], *args: Any, measure: bool, repeats: int,
          offload: Optional[bool], only: Optional[Sequence[str]],
          budget: Optional[_budget.Budget], compile_all: bool,
          donate_argnums: Sequence[int] = ()) -> RematReport:
  """:func:`remat_report` without a choice, its mistakes named after the
  caller's subject: the reference compiled, or every plan."""
  start = time.perf_counter()
  plans = _candidate_plans(step_fn, args, measure=measure, offload=offload, only=only,
                           donate_argnums=donate_argnums)
  budget_bytes = None if budget is None else budget.bytes
  order = [plans.reference()]
  if compile_all:
    order += [i for i in range(len(plans.plans)) if i != order[0]]
  for i in order:
    compiled = plans.compile(i)
    if measure and (budget_bytes is None or compiled.temp_bytes <= budget_bytes):
      plans.time([i], repeats)
  return plans.report(budget=budget_bytes, seconds=time.perf_counter() - start)


def _candidate_plans(step_fn: Callable[..., Any], args: Sequence[Any], *, measure: bool,
                     offload: Optional[bool], only: Optional[Sequence[str]],
                     donate_argnums: Sequence[int] = ()) -> _compile.Candidates:
  """Every plan of ``step_fn(*args)``, predicted from one trace of it; with
  ``measure``, the arguments are checked first to be arrays it can run."""
  if measure:
    _search.check_measurable(args)
  return _compile.Candidates(step_fn, args, _trace.trace(step_fn, *args),
                             offload=offload, only=only, donate_argnums=donate_argnums)
