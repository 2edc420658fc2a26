"""What the remat planner searches: each auto stack's candidates, and the joint plans.

Vocabulary:

* a *stack* is any loop built with ``remat="auto"`` (``_stack_info.py``:
  what one trace tells of it, and how it is keyed);
* a *candidate* is one remat value for one stack: each alias, each name the
  block tags with ``checkpoint_name`` (and all of them), and per-depth mixes
  of two policies at a few split points;
* a *plan* gives every stack a candidate (a *joint plan* where there are
  several stacks).

The stacks come from one trace of the step (``_trace.py``). In pseudo-code::

  per stack: candidates(stack), kept as only= says
  joint_plans(every stack's candidates)   # every combination, or uniform

The planner's arguments are checked here too: ``only=``, ``donate_argnums``
and ``measure=True``'s need for arrays (the budget is parsed in
``_budget.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import jax

from stacktools.core import _checks
from stacktools.planner import _stack_info
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

# ---------------------------------------------------------------------------
# Candidates and joint plans.


def candidates(stack: _stack_info.StackInfo, *, offload: bool = True) -> dict[str, Any]:
  """Every candidate remat value for one stack, by a short label.

  Example::

    found = candidates(_stack_info.StackInfo("h", 8, ("mlp_hidden",)))
    # {"none": ..., "full": ..., ..., "save:mlp_hidden": ...,
    #  "none:2,full:6": per_depth(...), ...}
    assert {"full", "save:mlp_hidden", "none:2,full:6"} <= set(found)
    deep = candidates(_stack_info.StackInfo("h", 64, ()))
    assert deep["nested(4,4)"] == _policy.CheckpointPolicy(nested=(4, 4))
    unrolled = candidates(_stack_info.StackInfo("h", 8, (), looped=False))
    assert "nested" not in unrolled and "none:7,full:1" in unrolled

  Args:
    stack: the stack, as ``_trace.discover`` found it (an unrolled one gets no
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
