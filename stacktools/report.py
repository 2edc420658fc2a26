"""The cost of every remat candidate of a step: ``st.remat_report``.

Vocabulary:

* a *stack* is any loop built with ``remat="auto"`` (a ``Stacked``,
  ``BlockSeq`` or ``layer_stack`` named by its Haiku module name, or an
  ``st.fold``/``st.scan`` named by the order in which it is traced);
* a *candidate* is one remat value for one stack: each alias, each name the
  block tags with ``checkpoint_name`` (and all of them), and per-depth mixes
  of two policies at a few split points;
* a *plan* gives every stack a candidate.

Every plan is predicted from one trace of the step, without compiling it
(``_model.py``: what the loops keep per layer and the FLOPs of a layer,
times counts, plus carries, seams and nested splits). One compile, of the
plan that runs every stack ``"full"``, tells what the step holds besides its
stacks, which every prediction then adds. In pseudo-code::

  traced = trace(step_fn, *args)              # stacks, each layer's trace
  rows = [predict(plan) for plan in plans]     # no compile
  rest = temp(compile(all "full")) - predict(all "full")
  with a budget: compile a few more and choose (plan.py)
  compile_all=True: compile (and time) every plan, beside its prediction
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

from stacktools import _checks
from stacktools import _costs
from stacktools import _model
from stacktools import _nested_split
from stacktools import policy as policy_lib
from stacktools import segments as segments_lib

#: How many joint plans are predicted at most before falling back to giving
#: every stack the same kind of candidate.
MAX_JOINT_PLANS = 64
#: The split points of per-depth mixes, as fractions of a stack's depth.
MIX_FRACTIONS = (0.25, 0.5, 0.75)
#: The pairs of policies mixed per depth: (first layers, remaining layers).
MIX_PAIRS = (("none", "full"), ("full", "nested"))
#: The label of the reference candidate, compiled first.
REFERENCE = "full"

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
  """A stack found by tracing: its key, depth and the names its block tags.

  ``period`` is the layers in one step of its loop (a mixed-layer pattern's
  length; 1 for a stack of one block): a nested split counts steps.
  """

  key: str
  num_layers: int
  tagged_names: tuple[str, ...]
  period: int = 1


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
  """Records every auto stack and its layers' traces; traces them as ``"full"``."""

  def __init__(self):
    self.stacks: dict[str, StackInfo] = {}
    self.layers: dict[str, list[Any]] = {}
    self._keys = _Keys()

  def remat_for(self, key, length, probe, period=1):
    key = self._keys(key)
    if key not in self.stacks:
      with _checks.recording_traces() as traces:   # one per kind of block
        tagged = sorted(probe() - set(policy_lib.RESERVED_NAMES))
      self.stacks[key] = StackInfo(key, length, tuple(tagged), period)
      self.layers[key] = traces
    return policy_lib.REMAT_ALIASES[REFERENCE]


class Fixed:
  """Answers with a fixed choice per stack key."""

  def __init__(self, choice: Mapping[str, Any]):
    self.choice = choice
    self._keys = _Keys()

  def remat_for(self, key, length, probe, period=1):
    del length, probe, period
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


@dataclasses.dataclass(frozen=True)
class Traced:
  """What one trace of the step tells the planner.

  Attributes:
    stacks: the auto stacks, in the order the step runs them.
    models: stack key -> its cost model.
    step_flops: FLOPs of the step with every stack ``"full"``.
    jaxpr: the step's closed jaxpr, so traced.
  """

  stacks: tuple[StackInfo, ...]
  models: Mapping[str, _model.StackModel]
  step_flops: int
  jaxpr: Any

  def text(self) -> str:
    """The step's jaxpr as text: what a remembered plan is keyed on."""
    return str(self.jaxpr)


def trace(step_fn: Callable[..., Any], *args: Any) -> Traced:
  """Traces ``step_fn(*args)`` once, abstractly: its auto stacks and models."""
  context = _Discovery()
  closed = jax.make_jaxpr(under(context, step_fn))(*args)
  if not context.stacks:
    raise ValueError(
        "No stack in step_fn uses remat='auto', so there is nothing to plan. "
        "Build the stacks to plan with remat='auto' (st.Stacked(..., "
        "remat='auto')).")
  models = {key: _model.StackModel(info.num_layers,
                                   [_model.Layer(c, a) for c, a in context.layers[key]])
            for key, info in context.stacks.items()}
  return Traced(stacks=tuple(context.stacks.values()), models=models,
                step_flops=_costs.jaxpr_flops(closed.jaxpr), jaxpr=closed)


def discover(step_fn: Callable[..., Any], *args: Any) -> tuple[StackInfo, ...]:
  """The stacks built with ``remat="auto"`` that ``step_fn(*args)`` runs."""
  return trace(step_fn, *args).stacks


# ---------------------------------------------------------------------------
# Candidates.


def candidates(stack: StackInfo, *, offload: bool = True) -> dict[str, Any]:
  """Every candidate remat value for one stack, by a short label.

  Example::

    found = candidates(StackInfo("h", 8, ("mlp_hidden",)))
    # {"none": ..., "full": ..., ..., "save:mlp_hidden": ...,
    #  "none:2,full:6": per_depth(...), ...}
    assert {"full", "save:mlp_hidden", "none:2,full:6"} <= set(found)
    deep = candidates(StackInfo("h", 64, ()))
    assert deep["nested(4,4)"] == policy_lib.CheckpointPolicy(nested=(4, 4))

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
  # A third level of nesting, where the loop is deep enough for it to keep
  # fewer carries (it costs one more forward pass).
  levels = _nested_split.three_levels(stack.num_layers // stack.period)
  if levels is not None:
    out["nested({},{})".format(*levels)] = policy_lib.CheckpointPolicy(nested=levels)
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

  stacks: tuple[StackInfo, ...]
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
      title += f"; budget {format_bytes(self.budget)}"
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
      plan = report.plan(budget="48MiB")
      with plan:
        step = jax.jit(train_step).lower(params, batch).compile()

    Args:
      budget: the most compiled temp memory, as bytes or e.g. ``"48MiB"``.
      by_time: choose the fastest timed plan (ties within the timing noise
        go to fewer FLOPs, then less memory); otherwise the one with the
        fewest FLOPs.

    Returns:
      The :class:`stacktools.plan.RematPlan`.

    Raises:
      ValueError: when no candidate fits: names the smallest temp memory and
        its plan.
    """
    # plan.py builds on this module; imported here, where a plan is asked for.
    from stacktools import plan as plan_lib  # pylint: disable=g-import-not-at-top
    return plan_lib.RematPlan.from_report(self, budget=budget, by_time=by_time)

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
    stacks = tuple(StackInfo(s["key"], s["num_layers"], tuple(s["tagged_names"]),
                             s.get("period", 1))
                   for s in data["stacks"])
    return cls(stacks=stacks, rows=rows, compile_seconds=data["compile_seconds"],
               remats=remats, budget=data["budget_bytes"], chosen=chosen_row,
               compiles=data["compiles"], rest_bytes=data["rest_bytes"],
               seconds=data["seconds"], decision=data["decision"])


# ---------------------------------------------------------------------------
# Compiling and timing one plan.


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
  lowered = jax.jit(under(Fixed(choice), step_fn),
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


def _donated(donate_argnums: Union[int, Sequence[int]], num_args: int) -> tuple[int, ...]:
  """``donate_argnums`` as a sorted tuple; one that names no argument is refused."""
  numbers = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
  wrong = [n for n in numbers if not isinstance(n, int) or not 0 <= n < num_args]
  if wrong:
    raise ValueError(f"{_checks.where()}donate_argnums={donate_argnums!r} names {wrong}, "
                     f"but the step is given {num_args} arguments: give the positions "
                     f"(0 to {num_args - 1}) of those the step that runs donates.")
  return tuple(sorted(set(numbers)))


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
  # Too many to weigh: every stack takes the same label where it has it,
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
  """``measure=True`` runs candidates: every argument must be an array."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise ValueError(
          f"{_checks.where()}measure=True runs the candidates it times, but "
          f"{_checks.path_str('args', path)} is a jax.ShapeDtypeStruct "
          f"{leaf.dtype}{list(leaf.shape)}, which cannot be run: pass arrays, or "
          "measure=False to choose by FLOPs without running anything.")


class Plans:
  """Every joint plan of a step, predicted, and compiled where asked.

  The working state of a report: :func:`build` and the planner (plan.py)
  compile and time plans through it, then :meth:`report` freezes it.
  """

  def __init__(self, step_fn: Callable[..., Any], args: Sequence[Any],
               traced: Traced, *, offload: Optional[bool],
               only: Optional[Sequence[str]], donate_argnums: Sequence[int] = ()):
    self.step_fn, self.args, self.traced = step_fn, tuple(args), traced
    self.donate_argnums = _donated(donate_argnums, len(self.args))
    if offload is None:
      offload = host_memory_available()
    found = {s.key: candidates(s, offload=offload) for s in traced.stacks}
    self.remats = {key: _restrict(f, only, key) for key, f in found.items()}
    _check_known(only, found)
    self.plans = _joint_plans(self.remats)
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
        _model.predict(traced.models, self.choice(plan), step_flops=traced.step_flops,
                       host_is_device=host_is_device) for plan in self.plans]

  def _all_full(self) -> Optional[int]:
    for i, plan in enumerate(self.plans):
      if all(label == REFERENCE for label in plan.values()):
        return i
    return None

  def choice(self, plan: Mapping[str, str]) -> dict[str, Any]:
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

  def row(self, i: int) -> ReportRow:
    p, c = self.predicted[i], self.compiled.get(i)
    return ReportRow(
        plan=self.plans[i], predicted_temp_bytes=p.temp_bytes + self.rest,
        saved_bytes=p.saved_bytes, flops=p.flops,
        temp_bytes=None if c is None or c.out_of_memory else c.temp_bytes,
        out_of_memory=c is not None and c.out_of_memory,
        xla_flops=None if c is None or c.out_of_memory else c.xla_flops,
        bytes_accessed=None if c is None or c.out_of_memory else c.bytes_accessed,
        step_time_s=min(self.times[i]) if i in self.times else None)

  def report(self, *, budget: Optional[int], chosen: Optional[int] = None,
             decision: str = "", seconds: float = 0.0) -> RematReport:
    rows = tuple(self.row(i) for i in range(len(self.plans)))
    return RematReport(
        stacks=self.traced.stacks, rows=rows, compile_seconds=self.compile_seconds,
        remats=self.remats, budget=budget,
        chosen=None if chosen is None else rows[chosen], compiles=len(self.compiled),
        rest_bytes=self.rest, seconds=seconds, decision=decision)


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
    if budget is not None and not compile_all:
      # plan.py builds on this module; imported where a choice is asked for.
      from stacktools import plan as plan_lib  # pylint: disable=g-import-not-at-top
      return plan_lib.choose(step_fn, *args, budget=budget, measure=measure,
                             repeats=repeats, offload=offload, only=only,
                             donate_argnums=donate_argnums)
    return build(step_fn, *args, measure=measure, repeats=repeats, offload=offload,
                 only=only, budget=budget, compile_all=compile_all,
                 donate_argnums=donate_argnums)


def build(step_fn: Callable[..., Any], *args: Any, measure: bool, repeats: int,
          offload: Optional[bool], only: Optional[Sequence[str]],
          budget: Union[int, str, None], compile_all: bool,
          donate_argnums: Sequence[int] = ()) -> RematReport:
  """:func:`remat_report` without a choice, its mistakes named after the
  caller's subject: the reference compiled, or every plan."""
  start = time.perf_counter()
  if measure:
    _check_measurable(args)
  plans = Plans(step_fn, args, trace(step_fn, *args), offload=offload, only=only,
                donate_argnums=donate_argnums)
  budget_bytes = None if budget is None else parse_bytes(budget)
  order = [plans.reference()]
  if compile_all:
    order += [i for i in range(len(plans.plans)) if i != order[0]]
  for i in order:
    compiled = plans.compile(i)
    if measure and (budget_bytes is None or compiled.temp_bytes <= budget_bytes):
      plans.time([i], repeats)
  return plans.report(budget=budget_bytes, seconds=time.perf_counter() - start)
