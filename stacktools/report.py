"""The cost of every remat candidate of a step, compiled: ``st.remat_report``.

Vocabulary:

* a *stack* is any loop built with ``remat="auto"`` (a ``Stacked``,
  ``BlockSeq`` or ``layer_stack`` named by its Haiku module name, or an
  ``st.fold``/``st.scan`` named by the order in which it is traced);
* a *candidate* is one remat value for one stack: each alias, each name the
  block tags with ``checkpoint_name`` (and all of them), and per-depth mixes
  of two policies at a few split points;
* a *plan* gives every stack a candidate; the report compiles the step once
  per plan and reads its temp memory and cost from the compiled program.

In pseudo-code::

  stacks = discover(step_fn, *args)                # one abstract trace
  for plan in product(candidates(s) for s in stacks):
    compiled = jit(step_fn under plan).lower(*args).compile()
    row = (plan, temp_bytes(compiled), flops(compiled), [median step time])
  chosen = fastest (or fewest FLOPs) row with temp_bytes <= budget   # plan.py
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import jax

from stacktools import _checks
from stacktools import _costs
from stacktools import policy as policy_lib
from stacktools import segments as segments_lib

#: How many joint plans are compiled at most before falling back to giving
#: every stack the same kind of candidate.
MAX_JOINT_PLANS = 64
#: The split points of per-depth mixes, as fractions of a stack's depth.
MIX_FRACTIONS = (0.25, 0.5, 0.75)
#: The pairs of policies mixed per depth: (first layers, remaining layers).
MIX_PAIRS = (("none", "full"), ("full", "nested"))

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(budget: Union[int, str]) -> int:
  """``"48MiB"`` -> 50331648; an int is returned as it is.

  Example::

    assert parse_bytes("1.5GiB") == 1610612736

  Args:
    budget: bytes as an int, or a number with a unit (B, KB, MB, GB, KiB,
      MiB, GiB).

  Returns:
    The number of bytes.
  """
  if isinstance(budget, bool):
    raise TypeError(f"budget={budget!r} is not a size; pass bytes or e.g. '48MiB'.")
  if isinstance(budget, int):
    if budget <= 0:
      raise ValueError(f"budget={budget} must be a positive number of bytes.")
    return budget
  match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(budget))
  if not match or match.group(2).lower() not in _UNITS:
    raise ValueError(
        f"budget={budget!r} is not a size: pass bytes as an int, or a number "
        "with a unit, e.g. '48MiB', '1.5GB' (units: B, KB, MB, GB, KiB, MiB, GiB).")
  value = float(match.group(1)) * _UNITS[match.group(2).lower()]
  if value < 1:
    raise ValueError(f"budget={budget!r} must be at least one byte.")
  return int(value)


def format_bytes(n: float) -> str:
  return f"{n / 2**20:.2f} MiB"


# ---------------------------------------------------------------------------
# Contexts that answer remat="auto" while a step is traced.


@dataclasses.dataclass(frozen=True)
class StackInfo:
  """A stack found by tracing: its key, depth and the names its block tags."""

  key: str
  num_layers: int
  tagged_names: tuple[str, ...]


class _Keys:
  """Keys for loops: their own (Haiku module names) or ``loop_<k>`` by order."""

  def __init__(self):
    self._count = 0

  def __call__(self, key: Optional[str]) -> str:
    if key is not None:
      return key
    key, self._count = f"loop_{self._count}", self._count + 1
    return key


class _Discovery:
  """Records every auto stack; traces them as ``"full"``."""

  def __init__(self):
    self.stacks: dict[str, StackInfo] = {}
    self._keys = _Keys()

  def remat_for(self, key, length, probe):
    key = self._keys(key)
    if key not in self.stacks:
      tagged = sorted(probe() - set(policy_lib.RESERVED_NAMES))
      self.stacks[key] = StackInfo(key, length, tuple(tagged))
    return policy_lib.REMAT_ALIASES["full"]


class Fixed:
  """Answers with a fixed choice per stack key."""

  def __init__(self, choice: Mapping[str, Any]):
    self.choice = choice
    self._keys = _Keys()

  def remat_for(self, key, length, probe):
    del length, probe
    key = self._keys(key)
    if key not in self.choice:
      raise ValueError(
          f"remat='auto': the plan has no choice for the stack {key!r}; it "
          f"plans {sorted(self.choice)}. Plan the same step function that you "
          "trace under the plan (stacks are named by module name; pure loops "
          "by the order in which they are traced).")
    return self.choice[key]


def under(context, fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` that runs under ``context``, whenever it is called or traced."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with segments_lib.plan_context(context):
      return fn(*args, **kwargs)
  return wrapped


def discover(step_fn: Callable[..., Any], *args: Any) -> tuple[StackInfo, ...]:
  """The stacks built with ``remat="auto"`` that ``step_fn(*args)`` runs."""
  context = _Discovery()
  jax.eval_shape(under(context, step_fn), *args)
  if not context.stacks:
    raise ValueError(
        "No stack in step_fn uses remat='auto', so there is nothing to plan. "
        "Build the stacks to plan with remat='auto' (st.Stacked(..., "
        "remat='auto')).")
  return tuple(context.stacks.values())


# ---------------------------------------------------------------------------
# Candidates.


def candidates(stack: StackInfo, *, offload: bool = True) -> dict[str, Any]:
  """Every candidate remat value for one stack, by a short label.

  Example::

    found = candidates(StackInfo("h", 8, ("mlp_hidden",)))
    # {"none": ..., "full": ..., ..., "save:mlp_hidden": ...,
    #  "none:2,full:6": per_depth(...), ...}
    assert {"full", "save:mlp_hidden", "none:2,full:6"} <= set(found)

  Args:
    stack: the stack, as :func:`discover` found it.
    offload: include ``"offload"`` (where the backend has host memory).

  Returns:
    label -> remat value.
  """
  out: dict[str, Any] = {}
  for alias, policy in policy_lib.REMAT_ALIASES.items():
    if alias != "offload" or offload:
      out[alias] = policy
  for name in stack.tagged_names:
    out[f"save:{name}"] = policy_lib.CheckpointPolicy(save_block_internals=[name])
  if len(stack.tagged_names) > 1:
    out["save:" + "+".join(stack.tagged_names)] = policy_lib.CheckpointPolicy(
        save_block_internals=list(stack.tagged_names))
  n = stack.num_layers
  splits = sorted({round(f * n) for f in MIX_FRACTIONS} - {0, n})
  for first, rest in MIX_PAIRS:
    for k in splits:
      mix = segments_lib.per_depth((k, first), (n - k, rest))
      out[str(mix)] = mix
  return out


def host_memory_available() -> bool:
  """Whether the default device has pinned host memory to offload to."""
  try:
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  except (AttributeError, NotImplementedError, RuntimeError):
    return False
  return "pinned_host" in kinds


# ---------------------------------------------------------------------------
# The report.


@dataclasses.dataclass(frozen=True)
class ReportRow:
  """One candidate plan, compiled.

  Attributes:
    plan: stack key -> candidate label.
    temp_bytes: ``memory_analysis().temp_size_in_bytes`` of the step.
    flops: FLOPs of the step, recomputation included, counted from its
      jaxpr with every loop body times its trip count.
    xla_flops: ``cost_analysis()["flops"]``, which counts a loop body once
      whatever its trip count (so it undercounts deep stacks).
    bytes_accessed: ``cost_analysis()["bytes accessed"]``, likewise.
    step_time_s: the median step time, when measured.
  """

  plan: Mapping[str, str]
  temp_bytes: int
  flops: float
  xla_flops: float
  bytes_accessed: float
  step_time_s: Optional[float] = None

  def plan_text(self) -> str:
    if len(self.plan) == 1:
      return next(iter(self.plan.values()))
    return "; ".join(f"{k}={v}" for k, v in self.plan.items())


@dataclasses.dataclass(frozen=True)
class RematReport:
  """Every candidate plan of a step, with its compiled cost.

  ``str(report)`` is a table, one row per candidate, smallest memory first;
  a per-depth mix that needs more temp memory than each of its policies
  (each seam copies the per-layer inputs it slices) is marked ``above none
  and full``.
  """

  stacks: tuple[StackInfo, ...]
  rows: tuple[ReportRow, ...]
  compile_seconds: float
  remats: Mapping[str, Mapping[str, Any]] = dataclasses.field(
      default_factory=dict, repr=False)   # stack key -> label -> remat value
  budget: Optional[int] = None
  chosen: Optional[ReportRow] = None

  def __str__(self) -> str:
    timed = any(r.step_time_s is not None for r in self.rows)
    header = (["plan", "temp MiB", "GFLOPs", "XLA GFLOPs", "XLA GB accessed"] +
              (["step ms"] if timed else []))
    lines = []
    for row in sorted(self.rows, key=lambda r: (r.temp_bytes, r.flops)):
      cells = [row.plan_text(), f"{row.temp_bytes / 2**20:.2f}",
               f"{row.flops / 1e9:.3f}", f"{row.xla_flops / 1e9:.3f}",
               f"{row.bytes_accessed / 1e9:.3f}"]
      if timed:
        cells.append("" if row.step_time_s is None else f"{1e3 * row.step_time_s:.2f}")
      marks = [f"above {' and '.join(names)}" for names in self._above_its_policies(row)]
      if self.budget is not None and row.temp_bytes > self.budget:
        marks.append("over budget")
      if row is self.chosen:
        marks.append("<- chosen")
      lines.append(cells + [" ".join(marks)])
    header.append("")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    title = (f"remat report: {len(self.rows)} candidate plans compiled in "
             f"{self.compile_seconds:.1f} s")
    if self.budget is not None:
      title += f"; budget {format_bytes(self.budget)}"
    return "\n".join([title, fmt(header)] + [fmt(c) for c in lines])

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
      if all(o is not None and o.temp_bytes < row.temp_bytes for o in others):
        above.append(names)
    return above

  def plan(self, *, budget: Union[int, str], by_time: bool = True) -> Any:
    """The plan :func:`stacktools.plan_remat` would choose from this report.

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
      plan = report.plan(budget="48MiB")
      with plan:
        step = jax.jit(train_step).lower(params, batch).compile()

    Args:
      budget: the most compiled temp memory, as bytes or e.g. ``"48MiB"``.
      by_time: choose the fastest measured plan (the report must be
        measured); otherwise the one with the fewest FLOPs.

    Returns:
      The :class:`stacktools.plan.RematPlan`.

    Raises:
      ValueError: when no candidate fits: names the smallest achievable
        temp memory and its plan.
    """
    # plan.py builds on this module; imported here, where a plan is asked for.
    from stacktools import plan as plan_lib  # pylint: disable=g-import-not-at-top
    return plan_lib.RematPlan.from_report(self, budget=budget, by_time=by_time)

  def to_json(self) -> dict[str, Any]:
    return {"budget_bytes": self.budget,
            "compile_seconds": self.compile_seconds,
            "stacks": [dataclasses.asdict(s) for s in self.stacks],
            "chosen": None if self.chosen is None else dataclasses.asdict(self.chosen),
            "rows": [dataclasses.asdict(r) for r in self.rows]}


def _cost(compiled: Any) -> tuple[float, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):   # older JAX: one dict per program
    cost = cost[0] if cost else {}
  cost = cost or {}
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def _median_time(compiled: Any, args: Sequence[Any], repeats: int) -> float:
  jax.block_until_ready(compiled(*args))   # warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _restrict(found: dict[str, Any], only: Optional[Sequence[str]],
              key: str) -> dict[str, Any]:
  if only is None:
    return found
  if isinstance(only, str):
    only = (only,)
  kept = {label: found[label] for label in only if label in found}
  if not kept:
    raise ValueError(f"{_checks.where()}only={list(only)} keeps no candidate of stack "
                     f"{key!r}; its candidates are {list(found)}.")
  return kept


def _joint_plans(per_stack: Mapping[str, Mapping[str, Any]]) -> list[dict[str, str]]:
  """Every combination of the stacks' candidates, or a uniform subset."""
  keys = list(per_stack)
  sizes = [len(per_stack[k]) for k in keys]
  total = 1
  for size in sizes:
    total *= size
  if total <= MAX_JOINT_PLANS:
    return [dict(zip(keys, labels))
            for labels in itertools.product(*(list(per_stack[k]) for k in keys))]
  # Too many to compile: every stack takes the same label where it has it,
  # falling back to "full".
  labels = dict.fromkeys(label for k in keys for label in per_stack[k])
  return [{k: label if label in per_stack[k] else "full" for k in keys}
          for label in labels]


def _check_known(only: Optional[Sequence[str]],
                 found: Mapping[str, Mapping[str, Any]]) -> None:
  """Every label in ``only`` is a candidate of some stack.

  One stack's labels may be missing from another's (a name only its block
  tags); a label that no stack has is a typo, which would otherwise be
  dropped, the plan made among fewer candidates than asked.
  """
  if only is None:
    return
  labels = (only,) if isinstance(only, str) else tuple(only)
  unknown = [label for label in labels if not any(label in f for f in found.values())]
  if unknown:
    known = {key: list(f) for key, f in found.items()}
    listing = next(iter(known.values())) if len(known) == 1 else known
    raise ValueError(
        f"{_checks.where()}only={list(labels)} names {unknown[0]!r}, which is no "
        f"candidate of {'the stack' if len(found) == 1 else 'any stack'} "
        f"{' or '.join(map(repr, found))}; the candidates are {listing}. Fix or "
        "drop the label.")


def _check_measurable(args: Sequence[Any]) -> None:
  """``measure=True`` runs each candidate: every argument must be an array."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise ValueError(
          f"{_checks.where()}measure=True runs every candidate, but "
          f"{_checks.path_str('args', path)} is a jax.ShapeDtypeStruct "
          f"{leaf.dtype}{list(leaf.shape)}, which cannot be run: pass arrays, or "
          "measure=False to choose by FLOPs from the compiled programs alone.")


def remat_report(step_fn: Callable[..., Any], *args: Any, measure: bool = False,
                 repeats: int = 5, offload: Optional[bool] = None,
                 only: Optional[Sequence[str]] = None,
                 budget: Union[int, str, None] = None) -> RematReport:
  """Compiles ``step_fn`` once per candidate plan and reports each one's cost.

  ``step_fn``'s stacks are built with ``remat="auto"``; they are found by
  tracing it, with the names their blocks tag.

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
    print(report)        # plan, temp MiB, GFLOPs, XLA's cost analysis

  Args:
    step_fn: the function to plan, e.g. a training step (not jitted, or
      jitted: it is traced again under each plan).
    *args: its arguments: arrays, or ``jax.ShapeDtypeStruct`` when
      ``measure=False``.
    measure: also run each compiled candidate and record the median of
      ``repeats`` step times.
    repeats: timed runs per candidate, after one warm-up run.
    offload: include ``"offload"``; by default where the backend has pinned
      host memory.
    only: compile only the candidates with these labels (``"full"``,
      ``"save:mlp_hidden"``, ``"none:16,full:48"``, ...), to plan faster.
    budget: bytes or e.g. ``"48MiB"``; rows over it are marked, and with
      ``measure=True`` only the plans within it are timed.

  Returns:
    The report.

  Raises:
    ValueError: for a label in ``only`` that is no stack's candidate, or
      ``measure=True`` with ``jax.ShapeDtypeStruct`` arguments.
  """
  with _checks.subject("st.remat_report"):
    return build(step_fn, *args, measure=measure, repeats=repeats, offload=offload,
                 only=only, budget=budget)


def build(step_fn: Callable[..., Any], *args: Any, measure: bool, repeats: int,
          offload: Optional[bool], only: Optional[Sequence[str]],
          budget: Union[int, str, None]) -> RematReport:
  """:func:`remat_report`, its mistakes named after the caller's subject."""
  if measure:
    _check_measurable(args)
  stacks = discover(step_fn, *args)
  if offload is None:
    offload = host_memory_available()
  found = {s.key: candidates(s, offload=offload) for s in stacks}
  per_stack = {key: _restrict(f, only, key) for key, f in found.items()}
  _check_known(only, found)
  budget_bytes = None if budget is None else parse_bytes(budget)
  rows, start = [], time.perf_counter()
  for plan in _joint_plans(per_stack):
    choice = {k: per_stack[k][label] for k, label in plan.items()}
    planned = under(Fixed(choice), step_fn)
    compiled = jax.jit(planned).lower(*args).compile()
    xla_flops, accessed = _cost(compiled)
    temp_bytes = int(compiled.memory_analysis().temp_size_in_bytes)
    timed = measure and (budget_bytes is None or temp_bytes <= budget_bytes)
    step_time = _median_time(compiled, args, repeats) if timed else None
    rows.append(ReportRow(plan=plan, flops=_costs.flops(planned, *args),
                          xla_flops=xla_flops, bytes_accessed=accessed,
                          temp_bytes=temp_bytes,
                          step_time_s=step_time))
  return RematReport(stacks=stacks, rows=tuple(rows), remats=per_stack,
                     budget=budget_bytes,
                     compile_seconds=time.perf_counter() - start)
