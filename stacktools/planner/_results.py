"""What planning gives back: the report of every candidate plan, and the plan chosen.

:class:`RematReport` (``st.RematReport``) is a table of rows
(:class:`ReportRow`), one per joint plan: predicted, and compiled and timed
where the planner did so. :class:`RematPlan` (``st.RematPlan``) holds the
chosen candidate of every stack and answers ``remat="auto"`` while a step is
traced under it. Each leads to the other (``report.plan(budget=...)``,
``plan.report``), so both live here, below the planner that fills them
(``_compile.py``, ``_choose.py``); ``_remat_report.py`` and ``_plan_remat.py``
give them their public addresses. :func:`under` runs a function under such a
context (``plan.wrap``'s); the planner traces (``_trace.py``) and compiles
(``_compile.py``) its candidates through it too. This module speaks of stacks
and budgets in the planner's shared terms (``_stack_info.py``,
``_budget.py``) and imports nothing else of it.

The rule that picks a row under a budget is here too: a row fits by its
compiled temp memory, or where not compiled by its prediction with
:data:`MARGIN` to spare; timings within :data:`TIE` are a tie, which goes to
fewer FLOPs, then less memory.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, Optional, Union

from stacktools.planner import _budget
from stacktools.planner import _stack_info
from stacktools.remat import _segments

#: The cost model's error on temp bytes that the planner allows for: a plan
#: predicted within this fraction of the budget is compiled before it is
#: trusted to fit (the model is within 7% on the benchmarks' candidates,
#: 12% for save_all, mostly on the side of more memory; a mixed-precision
#: step on a CPU within 5% below). The plan returned is compiled either way.
MARGIN = 0.10
#: Timings closer than this fraction are a tie (the spread of repeated runs
#: of one program, where it is larger, up to twice this). On a shared CPU
#: the fastest of two runs of one program varies by about this much from
#: one planning to the next; a tie goes to fewer FLOPs, so that the same
#: inputs give the same plan.
TIE = 0.05


@dataclasses.dataclass(frozen=True)
class ReportRow:
  """One candidate plan: predicted, and compiled where the planner compiled it.

  Attributes:
    plan: stack key -> candidate label.
    predicted_temp_bytes: compiled temp memory as the cost model predicts it.
    saved_bytes: bytes the step keeps for its backward passes (residuals,
      carries, copies at seams; offloaded ones included), predicted.
    flops: FLOPs of the step, recomputation included, predicted from the
      FLOPs of one layer (counted from its jaxpr) times the layers.
    temp_bytes: ``memory_analysis().temp_size_in_bytes`` of the step, where
      compiled (else ``None``).
    xla_flops: ``cost_analysis()["flops"]`` where compiled; it counts a loop
      body once whatever its trip count (so it undercounts deep stacks).
    bytes_accessed: ``cost_analysis()["bytes accessed"]``, likewise.
    step_time_s: the fastest of the timed runs, where timed.
    out_of_memory: XLA refused to compile the plan: it does not fit in the
      device's memory (beside the step's arguments).
  """

  plan: Mapping[str, str]
  predicted_temp_bytes: int
  saved_bytes: int
  flops: float
  temp_bytes: Optional[int] = None
  xla_flops: Optional[float] = None
  bytes_accessed: Optional[float] = None
  step_time_s: Optional[float] = None
  out_of_memory: bool = False

  def plan_text(self) -> str:
    if len(self.plan) == 1:
      return next(iter(self.plan.values()))
    return "; ".join(f"{k}={v}" for k, v in self.plan.items())

  @property
  def compiled(self) -> bool:
    return self.temp_bytes is not None

  @property
  def memory(self) -> int:
    """Compiled temp bytes where known, else the predicted ones (more than
    any budget where the plan does not fit the device)."""
    if self.out_of_memory:
      return sys.maxsize
    return self.temp_bytes if self.compiled else self.predicted_temp_bytes

  @property
  def temp_error(self) -> Optional[float]:
    """``predicted / compiled - 1`` where compiled."""
    if not self.compiled:
      return None
    return self.predicted_temp_bytes / max(self.temp_bytes, 1) - 1


@dataclasses.dataclass(frozen=True)
class RematReport:
  """Every candidate plan of a step: predicted, and compiled where it was.

  ``str(report)`` is a table, one row per candidate, smallest memory first;
  a per-depth mix that needs more temp memory than each of its policies
  (each seam copies the per-layer inputs it slices) is marked ``above none
  and full``.

  Attributes:
    stacks: the auto stacks.
    rows: one per candidate plan.
    compile_seconds: seconds spent compiling (and timing).
    remats: stack key -> label -> remat value.
    budget: the budget the report was made for, if any.
    chosen: the row chosen under ``budget``, if any.
    compiles: how many plans were compiled.
    rest_bytes: what the step holds besides its stacks, read from the
      compiled reference plan; every prediction includes it.
    seconds: the report's wall time, tracing included.
    decision: how the chosen row was chosen, in words.
  """

  stacks: tuple[_stack_info.StackInfo, ...]
  rows: tuple[ReportRow, ...]
  compile_seconds: float
  remats: Mapping[str, Mapping[str, Any]] = dataclasses.field(
      default_factory=dict, repr=False)   # stack key -> label -> remat value
  budget: Optional[int] = None
  chosen: Optional[ReportRow] = None
  compiles: int = 0
  rest_bytes: int = 0
  seconds: float = 0.0
  decision: str = ""

  def __str__(self) -> str:
    timed = any(r.step_time_s is not None for r in self.rows)
    xla = any(r.xla_flops is not None for r in self.rows)
    header = (["plan", "predicted MiB", "compiled MiB", "error", "saved MiB",
               "GFLOPs"] + (["XLA GFLOPs", "XLA GB accessed"] if xla else []) +
              (["step ms"] if timed else []))
    opt = lambda v, fmt: "" if v is None else fmt(v)
    lines = []
    for row in sorted(self.rows, key=lambda r: (r.memory, r.flops)):
      cells = [row.plan_text(), f"{row.predicted_temp_bytes / 2**20:.2f}",
               "out of memory" if row.out_of_memory else
               opt(row.temp_bytes, lambda v: f"{v / 2**20:.2f}"),
               opt(row.temp_error, lambda v: f"{100 * v:+.1f}%"),
               f"{row.saved_bytes / 2**20:.2f}", f"{row.flops / 1e9:.3f}"]
      if xla:
        cells += [opt(row.xla_flops, lambda v: f"{v / 1e9:.3f}"),
                  opt(row.bytes_accessed, lambda v: f"{v / 1e9:.3f}")]
      if timed:
        cells.append(opt(row.step_time_s, lambda v: f"{1e3 * v:.2f}"))
      marks = [f"above {' and '.join(names)}" for names in self._above_its_policies(row)]
      if self.budget is not None and row.memory > self.budget and not row.out_of_memory:
        marks.append("over budget")
      if row is self.chosen:
        marks.append("<- chosen")
      lines.append(cells + [" ".join(marks)])
    header.append("")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    title = (f"remat report: {len(self.rows)} candidate plans predicted, "
             f"{self.compiles} compiled ({self.compile_seconds:.1f} s compiling and "
             f"timing, {self.seconds:.1f} s in all)")
    if self.budget is not None:
      title += f"; budget {_budget.format_bytes(self.budget)}"
    out = [title, fmt(header)] + [fmt(c) for c in lines]
    if self.decision:
      out.append(f"chosen: {self.decision}")
    return "\n".join(out)

  def _above_its_policies(self, row: ReportRow) -> list[tuple[str, ...]]:
    """For each per-depth mix in ``row``'s plan whose policies' rows are here
    (the same plan with one of them in its place) and all need less temp
    memory: the mix's policies. A seam copies the per-layer inputs it
    slices, which can put a mix above both of its policies; the report
    says so rather than the reader assuming a mix lies between them."""
    by_plan = {tuple(sorted(r.plan.items())): r for r in self.rows}
    above = []
    for key, label in row.plan.items():
      parts = [part.rpartition(":") for part in label.split(",")]
      if len(parts) < 2 or not all(sep and count.isdigit() for _, sep, count in parts):
        continue
      names = tuple(dict.fromkeys(name for name, _, _ in parts))
      others = [by_plan.get(tuple(sorted({**row.plan, key: name}.items()))) for name in names]
      if all(o is not None and o.memory < row.memory for o in others):
        above.append(names)
    return above

  def plan(self, *, budget: Union[int, str], by_time: bool = True) -> Any:
    """The plan :meth:`stacktools.RematPlan.from_report` chooses from this report.

    ``report.plan(budget="48MiB")`` is ``RematPlan.from_report(report,
    budget="48MiB")``; see its example.

    Args:
      budget: the most compiled temp memory, as bytes or e.g. ``"48MiB"``.
      by_time: choose the fastest timed plan (ties within the timing noise
        go to fewer FLOPs, then less memory); otherwise the one with the
        fewest FLOPs.

    Returns:
      The :class:`stacktools.RematPlan`.

    Raises:
      ValueError: when no candidate fits: names the smallest temp memory and
        its plan.
    """
    return RematPlan.from_report(self, budget=budget, by_time=by_time)

  def to_json(self) -> dict[str, Any]:
    return {"budget_bytes": self.budget,
            "compile_seconds": self.compile_seconds,
            "compiles": self.compiles,
            "rest_bytes": self.rest_bytes,
            "seconds": self.seconds,
            "decision": self.decision,
            "stacks": [dataclasses.asdict(s) for s in self.stacks],
            "chosen": None if self.chosen is None else dataclasses.asdict(self.chosen),
            "rows": [dataclasses.asdict(r) for r in self.rows]}

  @classmethod
  def from_json(cls, data: Mapping[str, Any],
                remats: Mapping[str, Mapping[str, Any]]) -> "RematReport":
    """The report :meth:`to_json` wrote (``remats`` are not written)."""
    rows = tuple(ReportRow(**r) for r in data["rows"])
    chosen = data.get("chosen")
    chosen_row = None if chosen is None else next(
        r for r in rows if dict(r.plan) == chosen["plan"])
    stacks = tuple(_stack_info.StackInfo(s["key"], s["num_layers"],
                                         tuple(s["tagged_names"]), s.get("period", 1))
                   for s in data["stacks"])
    return cls(stacks=stacks, rows=rows, compile_seconds=data["compile_seconds"],
               remats=remats, budget=data["budget_bytes"], chosen=chosen_row,
               compiles=data["compiles"], rest_bytes=data["rest_bytes"],
               seconds=data["seconds"], decision=data["decision"])


class RematPlan:
  """The chosen remat for every ``remat="auto"`` stack of a step.

  Use it as a context while the step is traced, or wrap the step (as in
  :func:`stacktools.plan_remat`'s example): ``with plan: jax.jit(step_fn).lower(*args)``,
  or ``jax.jit(plan.wrap(step_fn))``, which applies the plan whenever traced.

  Attributes:
    choice: stack key -> remat value.
    labels: stack key -> candidate label.
    report: the report the plan was chosen from.
    reused: whether the plan was read back from the cache folder.
    cache_path: the file the plan is remembered in, if any.
    seconds: how long :func:`stacktools.plan_remat` took.
  """

  def __init__(self, choice: Mapping[str, Any], labels: Mapping[str, str],
               report: RematReport, *, reused: bool = False,
               cache_path: Optional[str] = None, seconds: float = 0.0):
    self.choice = dict(choice)
    self.labels = dict(labels)
    self.report = report
    self.reused = reused
    self.cache_path = cache_path
    self.seconds = seconds
    self._contexts: list[Any] = []

  def __enter__(self) -> "RematPlan":
    context = _segments.plan_context(_stack_info.Fixed(self.choice))
    context.__enter__()
    self._contexts.append(context)
    return self

  def __exit__(self, *exc) -> None:
    self._contexts.pop().__exit__(*exc)

  @classmethod
  def from_report(cls, report: RematReport, *, budget: Union[int, str],
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
    budget_bytes = _budget.parse_bytes(budget)
    fits = [r for r in report.rows if _fits(r, budget_bytes)]
    if not fits:
      no_fit(report.rows, budget, budget_bytes)
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
    return cls(choice_of(report, best.plan), best.plan, report)

  def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` running under this plan whenever it is called or traced."""
    return under(_stack_info.Fixed(self.choice), fn)

  def __repr__(self) -> str:
    return f"RematPlan({self.labels})"

  def to_json(self) -> dict[str, Any]:
    return {"plan": self.labels, "reused": self.reused, "cache_path": self.cache_path,
            "seconds": self.seconds, "report": self.report.to_json()}


def under(context, fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` that runs under ``context``, whenever it is called or traced."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with _segments.plan_context(context):
      return fn(*args, **kwargs)
  return wrapped


def choice_of(report: RematReport, labels: Mapping[str, str]) -> dict[str, Any]:
  """Stack key -> remat value of the plan ``labels`` (stack key -> label)."""
  return {k: report.remats[k][label] for k, label in labels.items()}


def _fits(row: ReportRow, budget: int) -> bool:
  """Whether ``row`` fits ``budget``: compiled, or predicted with MARGIN to spare."""
  if row.compiled:
    return row.temp_bytes <= budget
  return row.predicted_temp_bytes <= budget * (1 - MARGIN)


def no_fit(rows: Sequence[ReportRow], budget: Any, budget_bytes: int) -> NoReturn:
  """Raises the error of a budget that no row fits, naming the smallest."""
  smallest = min(rows, key=lambda r: r.memory)
  how = "compiled" if smallest.compiled else "predicted"
  raise ValueError(
      f"No remat plan fits budget={budget!r} "
      f"({_budget.format_bytes(budget_bytes)}): the smallest {how} temp "
      f"memory is {_budget.format_bytes(smallest.memory)} "
      f"({smallest.memory} bytes), with plan {smallest.plan_text()}. "
      "Raise the budget to at least that, or make the step smaller (batch, "
      "width).")
