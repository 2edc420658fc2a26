"""Remat chosen for the user under a memory budget: ``st.plan_remat``.

:func:`plan_remat` compiles every candidate plan through
:func:`stacktools.report.remat_report` and keeps the fastest (or the one with
the fewest FLOPs) whose compiled temp memory fits the budget. The
:class:`RematPlan` it returns answers ``remat="auto"`` while a step is
traced under it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

from stacktools import _checks
from stacktools import report as report_lib
from stacktools import segments as segments_lib


class RematPlan:
  """The chosen remat for every ``remat="auto"`` stack of a step.

  Use it as a context while the step is traced, or wrap the step (as in
  :func:`plan_remat`'s example): ``with plan: jax.jit(step_fn).lower(*args)``,
  or ``jax.jit(plan.wrap(step_fn))``, which applies the plan whenever traced.

  Attributes:
    choice: stack key -> remat value.
    labels: stack key -> candidate label.
    report: the report the plan was chosen from.
  """

  def __init__(self, choice: Mapping[str, Any], labels: Mapping[str, str],
               report: report_lib.RematReport):
    self.choice = dict(choice)
    self.labels = dict(labels)
    self.report = report
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
    """The plan :func:`plan_remat` would choose from an existing report.

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
                               only=["full", "nested"])
      plan = RematPlan.from_report(report, budget="48MiB")

    Args:
      report: from :func:`stacktools.remat_report`.
      budget: the most compiled temp memory, as bytes or e.g. ``"48MiB"``.
      by_time: choose the fastest measured plan (the report must be
        measured); otherwise the one with the fewest FLOPs.

    Returns:
      The plan.

    Raises:
      ValueError: when no candidate fits: names the smallest achievable
        temp memory and its plan.
    """
    budget_bytes = report_lib.parse_bytes(budget)
    fits = [r for r in report.rows if r.temp_bytes <= budget_bytes]
    if not fits:
      smallest = min(report.rows, key=lambda r: r.temp_bytes)
      raise ValueError(
          f"No remat plan fits budget={budget!r} "
          f"({report_lib.format_bytes(budget_bytes)}): the smallest compiled temp "
          f"memory is {report_lib.format_bytes(smallest.temp_bytes)} "
          f"({smallest.temp_bytes} bytes), with plan {smallest.plan_text()}. "
          "Raise the budget to at least that, or make the step smaller (batch, "
          "width).")
    if by_time:
      if any(r.step_time_s is None for r in fits):
        raise ValueError("by_time=True needs a measured report: "
                         "st.remat_report(..., measure=True), or by_time=False.")
      best = min(fits, key=lambda r: (r.step_time_s, r.temp_bytes))
    else:
      best = min(fits, key=lambda r: (r.flops, r.temp_bytes))
    report = dataclasses.replace(report, budget=budget_bytes, chosen=best)
    choice = {k: report.remats[k][label] for k, label in best.plan.items()}
    return cls(choice, best.plan, report)

  def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` running under this plan whenever it is called or traced."""
    return report_lib.under(report_lib.Fixed(self.choice), fn)

  def __repr__(self) -> str:
    return f"RematPlan({self.labels})"

  def to_json(self) -> dict[str, Any]:
    return {"plan": self.labels, "report": self.report.to_json()}


def plan_remat(step_fn: Callable[..., Any], *args: Any, budget: Union[int, str],
               measure: bool = True, repeats: int = 5,
               offload: Optional[bool] = None,
               only: Optional[Sequence[str]] = None) -> RematPlan:
  """Chooses the remat of every ``remat="auto"`` stack under a memory budget.

  Compiles the step once per candidate plan (see :func:`stacktools.remat_report`) and
  picks, among the plans whose compiled temp memory fits ``budget``, the one
  with the lowest median step time (``measure=True``) or the fewest FLOPs
  (``measure=False``; ties go to less memory). Several stacks are planned
  jointly: the budget is for the whole step.

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
    measure: choose by measured step time rather than FLOPs.
    repeats: timed runs per candidate.
    offload: as in :func:`stacktools.remat_report`.
    only: as in :func:`stacktools.remat_report`.

  Returns:
    The plan: a context manager, with ``plan.report``.

  Raises:
    ValueError: when no candidate fits: names the smallest achievable temp
      memory and its plan; for a label in ``only`` that is no stack's
      candidate; for ``measure=True`` with ``jax.ShapeDtypeStruct``
      arguments (checked before anything is compiled).
  """
  with _checks.subject("st.plan_remat"):
    report = report_lib.build(step_fn, *args, measure=measure, repeats=repeats,
                              offload=offload, only=only, budget=budget)
  return RematPlan.from_report(report, budget=budget, by_time=measure)
