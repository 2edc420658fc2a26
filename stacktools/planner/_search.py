"""What the remat planner searches: the auto stacks of a step and their candidates.

Vocabulary:

* a *stack* is any loop built with ``remat="auto"`` (a ``Stacked``,
  ``BlockSeq`` or ``layer_stack`` named by its Haiku module name, or an
  ``st.fold``/``st.scan`` named by the order in which it is traced);
* a *candidate* is one remat value for one stack: each alias, each name the
  block tags with ``checkpoint_name`` (and all of them), and per-depth mixes
  of two policies at a few split points;
* a *plan* gives every stack a candidate (a *joint plan* where there are
  several stacks).

While a step is traced, ``remat="auto"`` is answered by a context
(``segments.plan_context``): :class:`_Discovery` records each stack and runs
it ``"full"``; :class:`Fixed` answers with a chosen candidate per stack. In
pseudo-code::

  traced = trace(step_fn, *args)          # stacks, each layer's trace, FLOPs
  per stack: candidates(stack), kept as only= says
  joint_plans(every stack's candidates)   # every combination, or uniform

The planner's arguments are checked here too: the budget (:func:`parse_bytes`),
``only=``, ``donate_argnums`` and ``measure=True``'s need for arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax

from stacktools.core import _checks
from stacktools.core import _jaxpr
from stacktools.planner import _cost_model
from stacktools.remat import _nested_split
from stacktools.remat import _policy
from stacktools.remat import _segments

#: How many joint plans are predicted at most before falling back to giving
#: every stack the same kind of candidate.
MAX_JOINT_PLANS = 64
#: The split points of per-depth mixes, as fractions of a stack's depth.
MIX_FRACTIONS = (0.25, 0.5, 0.75)
#: The same for an unrolled stack (``BlockSeq``), in eighths: there a mix is
#: one program like any other (no loop per segment, no copies at its seam),
#: so the finer grid costs predictions, not compiles.
UNROLLED_MIX_FRACTIONS = tuple(k / 8 for k in range(1, 8))
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


class Budget(NamedTuple):
  """A memory budget, parsed once where it enters the planner.

  ``given`` is the value as the caller wrote it (errors quote it), ``bytes``
  what it means.
  """
  given: Union[int, str]
  bytes: int


def parse_budget(budget: Union[int, str]) -> Budget:
  """``"48MiB"`` -> ``Budget("48MiB", 50331648)``; see :func:`parse_bytes`."""
  return Budget(budget, parse_bytes(budget))


def format_bytes(n: float) -> str:
  """Bytes as the report writes them: ``"48.00 MiB"``."""
  return f"{n / 2**20:.2f} MiB"


# ---------------------------------------------------------------------------
# Contexts that answer remat="auto" while a step is traced.


@dataclasses.dataclass(frozen=True)
class StackInfo:
  """A stack found by tracing: its key, depth and the names its block tags.

  ``period`` is the layers in one step of its loop (a mixed-layer pattern's
  length; 1 for a stack of one block): a nested split counts steps.
  ``looped=False`` for a stack whose layers run unrolled (``BlockSeq``).
  """

  key: str
  num_layers: int
  tagged_names: tuple[str, ...]
  period: int = 1
  looped: bool = True


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

  def remat_for(self, key, length, probe, period=1, looped=True):
    key = self._keys(key)
    if key not in self.stacks:
      with _jaxpr.recording_traces() as traces:   # one per kind of block
        tagged = sorted(probe() - set(_policy.RESERVED_NAMES))
      self.stacks[key] = StackInfo(key, length, tuple(tagged), period, looped)
      self.layers[key] = traces
    return _policy.REMAT_ALIASES[REFERENCE]


class Fixed:
  """Answers with a fixed choice per stack key."""

  def __init__(self, choice: Mapping[str, Any]):
    self.choice = choice
    self._keys = _Keys()

  def remat_for(self, key, length, probe, period=1, looped=True):
    del length, probe, period, looped
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
    with _segments.plan_context(context):
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
  models: Mapping[str, _cost_model.StackModel]
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
  models = {key: _cost_model.StackModel(info.num_layers,
                                   [_cost_model.Layer(c, a) for c, a in context.layers[key]],
                                   looped=info.looped)
            for key, info in context.stacks.items()}
  return Traced(stacks=tuple(context.stacks.values()), models=models,
                step_flops=_jaxpr.jaxpr_flops(closed.jaxpr), jaxpr=closed)


def discover(step_fn: Callable[..., Any], *args: Any) -> tuple[StackInfo, ...]:
  """The stacks built with ``remat="auto"`` that ``step_fn(*args)`` runs."""
  return trace(step_fn, *args).stacks


# ---------------------------------------------------------------------------
# Candidates and joint plans.


def candidates(stack: StackInfo, *, offload: bool = True) -> dict[str, Any]:
  """Every candidate remat value for one stack, by a short label.

  Example::

    found = candidates(StackInfo("h", 8, ("mlp_hidden",)))
    # {"none": ..., "full": ..., ..., "save:mlp_hidden": ...,
    #  "none:2,full:6": per_depth(...), ...}
    assert {"full", "save:mlp_hidden", "none:2,full:6"} <= set(found)
    deep = candidates(StackInfo("h", 64, ()))
    assert deep["nested(4,4)"] == _policy.CheckpointPolicy(nested=(4, 4))
    unrolled = candidates(StackInfo("h", 8, (), looped=False))
    assert "nested" not in unrolled and "none:7,full:1" in unrolled

  Args:
    stack: the stack, as :func:`discover` found it (an unrolled one gets no
      nested candidates, and mixes split in eighths).
    offload: include ``"offload"`` (where the backend has host memory).

  Returns:
    label -> remat value.
  """
  out: dict[str, Any] = {}
  for alias, policy in _policy.REMAT_ALIASES.items():
    # Unrolled layers have no loop to nest: "nested" would act as "full".
    if (alias != "offload" or offload) and (stack.looped or not policy.nested):
      out[alias] = policy
  # A third level of nesting, where the loop is deep enough for it to keep
  # fewer carries (it costs one more forward pass).
  levels = _nested_split.three_levels(stack.num_layers // stack.period)
  if levels is not None and stack.looped:
    out["nested({},{})".format(*levels)] = _policy.CheckpointPolicy(nested=levels)
  for name in stack.tagged_names:
    out[f"save:{name}"] = _policy.CheckpointPolicy(save_block_internals=[name])
  if len(stack.tagged_names) > 1:
    out["save:" + "+".join(stack.tagged_names)] = _policy.CheckpointPolicy(
        save_block_internals=list(stack.tagged_names))
  n = stack.num_layers
  fractions = MIX_FRACTIONS if stack.looped else UNROLLED_MIX_FRACTIONS
  splits = sorted({round(f * n) for f in fractions} - {0, n})
  for first, rest in MIX_PAIRS:
    if not stack.looped and "nested" in (first, rest):
      continue
    for k in splits:
      mix = _segments.per_depth((k, first), (n - k, rest))
      out[str(mix)] = mix
  return out


def host_memory_available() -> bool:
  """Whether the default device has pinned host memory to offload to."""
  try:
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  except (AttributeError, NotImplementedError, RuntimeError):
    return False
  return "pinned_host" in kinds


def restrict(found: dict[str, Any], only: Optional[Sequence[str]],
             key: str) -> dict[str, Any]:
  """The candidates of stack ``key`` that ``only`` keeps (all where None)."""
  if only is None:
    return found
  if isinstance(only, str):
    only = (only,)
  kept = {label: found[label] for label in only if label in found}
  if not kept:
    raise ValueError(f"{_checks.where()}only={list(only)} keeps no candidate of stack "
                     f"{key!r}; its candidates are {list(found)}.")
  return kept


def check_known(only: Optional[Sequence[str]],
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


def joint_plans(per_stack: Mapping[str, Mapping[str, Any]]) -> list[dict[str, str]]:
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


# ---------------------------------------------------------------------------
# The step's arguments.


def check_measurable(args: Sequence[Any]) -> None:
  """``measure=True`` runs candidates: every argument must be an array."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise ValueError(
          f"{_checks.where()}measure=True runs the candidates it times, but "
          f"{_checks.path_str('args', path)} is a jax.ShapeDtypeStruct "
          f"{leaf.dtype}{list(leaf.shape)}, which cannot be run: pass arrays, or "
          "measure=False to choose by FLOPs without running anything.")


def donated(donate_argnums: Union[int, Sequence[int]], num_args: int) -> tuple[int, ...]:
  """``donate_argnums`` as a sorted tuple; one that names no argument is refused."""
  numbers = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
  wrong = [n for n in numbers if not isinstance(n, int) or not 0 <= n < num_args]
  if wrong:
    raise ValueError(f"{_checks.where()}donate_argnums={donate_argnums!r} names {wrong}, "
                     f"but the step is given {num_args} arguments: give the positions "
                     f"(0 to {num_args - 1}) of those the step that runs donates.")
  return tuple(sorted(set(numbers)))
