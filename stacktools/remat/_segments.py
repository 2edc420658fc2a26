"""The loop plan: what a ``remat=`` value means for one loop, decided once.

A ``remat=`` value is one of three things:

* a single policy (an alias or a :class:`CheckpointPolicy`) for every layer;
* :func:`per_depth` segments: consecutive runs of layers, each with its own
  policy, run as consecutive loops over slices of the same stacked inputs;
* ``"auto"``: the policy comes from the active :class:`stacktools.RematPlan`
  (``with plan: ...``), chosen by :func:`stacktools.plan_remat` under a
  memory budget (at Haiku init, which is never differentiated, ``"none"``).

:func:`plan_loop` turns it, with the loop's depth, pattern period and
direction, into a :class:`LoopPlan`: the segments in layer order, each with
its layers, its policy, the policy of each kind's steps and its loop shape
(flat, or nested with its split). It is the only reader of the active plan;
``_loops.py`` (the engine) and ``_block_seq.py`` (the unrolled walk) run what it
returns::

  for segment in plan.in_order():                 # reversed when reverse=True
    carry, ys[segment] = loop(steps, carry, xs[segment], segment)

This module knows nothing of Haiku; ``_plan_remat.py`` installs the contexts that
answer ``"auto"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Optional, Protocol, Union

import jax

from stacktools.core import _checks
from stacktools.core import _context
from stacktools.core import _jaxpr
from stacktools.remat import _nested_split
from stacktools.remat import _policy
from stacktools.step import _pattern

#: The ``remat=`` value that asks the active plan for a policy.
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class PerDepth:
  """Per-depth checkpoint policies; build one with :func:`per_depth`.

  Attributes:
    segments: ``(num_layers, policy)`` pairs, in layer order.
  """

  segments: tuple[tuple[int, _policy.CheckpointPolicy], ...]

  @property
  def num_layers(self) -> int:
    return sum(count for count, _ in self.segments)

  def __str__(self) -> str:
    return ",".join(f"{p}:{count}" for count, p in self.segments)


@dataclasses.dataclass(frozen=True)
class AutoRemat:
  """``remat="auto"`` for one loop; ``key`` names it in a plan.

  Haiku stacks use their module name; a pure-JAX loop has ``key=None`` and is
  told apart from other loops by the order in which it is traced.
  """

  key: Optional[str] = None


Remat = Union[_policy.CheckpointPolicy, PerDepth, AutoRemat]


class Segment(NamedTuple):
  """A run of consecutive layers ``[start, start + length)`` under one policy.

  ``split`` is the loop's shape: ``None`` for a flat loop (one ``lax.scan``
  over the segment's periods), or ``(outer, inner, remainder)`` for a nested
  one: ``outer`` checkpointed chunks of ``inner`` whole periods, then one of
  ``remainder``. ``steps`` is the policy each kind's layer steps run with
  inside a loop (``.outside_loop()`` of it outside one).
  """

  start: int
  length: int
  policy: _policy.CheckpointPolicy
  split: Optional[tuple[int, int, int]]
  steps: Mapping[str, _policy.CheckpointPolicy]


class LoopPlan(NamedTuple):
  """How a loop over layers runs: its segments in layer order.

  ``period`` is the length of the pattern a mixed-layer stack repeats (1 for
  a stack of one block, whose pattern is one kind); ``reverse`` runs the
  segments, and the layers in each, from last to first.
  """

  segments: tuple[Segment, ...]
  period: int = 1
  reverse: bool = False

  def in_order(self) -> tuple[Segment, ...]:
    """The segments in the order they run."""
    return tuple(reversed(self.segments)) if self.reverse else self.segments


def per_depth(*segments: Union[tuple[int, _policy.RematSpec], str]) -> PerDepth:
  """Per-depth checkpoint policies: consecutive segments of one stack.

  The segments run in order as consecutive loops over slices of the *same*
  stacked parameters, so the parameter tree, per-layer inputs and scan
  outputs are exactly those of one stack, and ``layer_index()`` is global.
  ``reverse=True`` runs the segments in reverse order.

  Example::

    class Block(hk.Module):
      def __call__(self, x):
        return x + jnp.tanh(hk.Linear(x.shape[-1])(x))

    remat = st.per_depth((16, "none"), (48, "full"))   # keep all in 16 layers
    blocks = st.Stacked(Block, num_layers=64, remat=remat, name="h")
    x = blocks.fold(jnp.ones((2, 8)))
    assert st.per_depth("none:16,full:48") == remat     # the same, from a flag

  ``str()`` of the result is the string form, so it round-trips through a flag.

  Args:
    *segments: ``(num_layers, remat)`` pairs; ``remat`` is any alias or
      :class:`CheckpointPolicy` (``"nested"`` included). The counts must add
      up to the stack's length. Or one string of comma-separated
      ``alias:num_layers`` parts.

  Returns:
    A value accepted wherever ``remat=`` is.

  Raises:
    ValueError: for no segments, a count below 1, or a remat that is itself
      per-depth or ``"auto"``.
  """
  if len(segments) == 1 and isinstance(segments[0], str):
    return parse_per_depth(segments[0])
  if not segments:
    raise ValueError("st.per_depth needs at least one (num_layers, remat) segment, "
                     "e.g. st.per_depth((16, 'none'), (48, 'full')).")
  parsed = []
  for i, segment in enumerate(segments):
    if not isinstance(segment, (tuple, list)) or len(segment) != 2:
      raise TypeError(
          f"st.per_depth: segment {i} is {segment!r}; each segment is a pair "
          "(num_layers, remat), e.g. (16, 'none').")
    count, remat = segment
    value = _checks.as_int(count)
    if value is None or value < 1:
      raise ValueError(f"st.per_depth: segment {i} has num_layers={count!r}; "
                       "each segment needs an int >= 1.")
    if isinstance(remat, (PerDepth, AutoRemat)) or (
        isinstance(remat, str) and remat.lower() == AUTO):
      raise ValueError(f"st.per_depth: segment {i} has remat={remat!r}; a "
                       "segment takes one policy (an alias or CheckpointPolicy).")
    parsed.append((value, _policy.CheckpointPolicy.from_remat(remat)))
  return PerDepth(tuple(parsed))


def parse_per_depth(spec: str) -> PerDepth:
  """``"none:2,full:6"`` -> ``per_depth((2, "none"), (6, "full"))``.

  Example::

    assert parse_per_depth("none:16,full:48") == per_depth((16, "none"), (48, "full"))

  Args:
    spec: comma-separated ``alias:num_layers`` pairs.

  Returns:
    The per-depth policies.
  """
  # A segment's count, then another separator than a comma before the next
  # alias ("none:2;full:2", "none:2 full:2"): name the separator, not the
  # glued "none:2;full" as an unknown policy.
  glued = re.compile(r"(:\d+)(\s*[^\w\s,]?\s*)(?=[A-Za-z_])")
  found = glued.search(spec)
  if found:
    sep = found.group(2).strip() or found.group(2)
    fixed = glued.sub(r"\1,", spec)
    raise ValueError(
        f"st.per_depth({spec!r}): segments are separated by commas"
        f"{f', not {sep!r}' if sep else ''}: write {fixed!r} (each segment is "
        "alias:num_layers).")
  segments = []
  for part in spec.split(","):
    alias, sep, count = part.strip().rpartition(":")
    if not sep or not count.strip().isdigit():
      raise ValueError(
          f"{spec!r} is not a per-depth spec: each part is alias:num_layers, "
          f"e.g. 'none:2,full:6' (aliases: {', '.join(_policy.REMAT_ALIASES)}).")
    segments.append((int(count), alias.strip()))
  return per_depth(*segments)


def as_remat(remat: Any, *, key: Optional[str] = None) -> Remat:
  """Checks any ``remat=`` value; ``"auto"`` becomes an :class:`AutoRemat`."""
  if isinstance(remat, (PerDepth, AutoRemat)):
    return remat
  if isinstance(remat, str) and remat.lower() == AUTO:
    return AutoRemat(key)
  return _policy.CheckpointPolicy.from_remat(remat)


# ---------------------------------------------------------------------------
# "auto": who answers it.


class PlanContext(Protocol):
  """What answers ``remat="auto"`` while a plan is active (see _plan_remat.py)."""

  def remat_for(self, key: Optional[str], length: int,
                probe: Callable[[], set[str]], period: int = 1,
                looped: bool = True) -> Any:
    """The remat value for the loop ``key`` of ``length`` layers.

    ``probe()`` returns the names the loop's body tags with checkpoint_name;
    only a context that discovers loops calls it (it traces the body again).
    ``period`` is the layers in one step of the loop (a pattern's length).
    ``looped=False``: the layers run unrolled (``BlockSeq``), one program
    each, with no loop around them.
    """


_PLANS = _context.ContextStack[PlanContext]()


def plan_active() -> bool:
  """Whether a plan (or the planner's discovery) answers ``"auto"`` now."""
  return bool(_PLANS)


def plan_context(context: PlanContext) -> contextlib.AbstractContextManager[PlanContext]:
  """Makes ``context`` answer ``remat="auto"`` inside the ``with`` block."""
  return _PLANS.push(context)


#: ``sizes()`` for a nested split: the carry's bytes, the bytes of one
#: period's inputs, and the largest of those inputs' leaves (see
#: :func:`stacktools.remat._nested_split.split_nested`).
Sizes = Callable[[], tuple[float, float, float]]


def plan_loop(remat: Any, num_layers: int, *, kinds: Sequence[str] = (_pattern.ONE_KIND,),
              period: int = 1, reverse: bool = False, init: bool = False,
              probe: Optional[Callable[[], set[str]]] = None,
              sizes: Optional[Sizes] = None,
              tags: Optional[Callable[[], Mapping[str, set[str]]]] = None,
              looped: bool = True) -> LoopPlan:
  """The one place a ``remat=`` value becomes how a loop runs.

  In pseudo-code, the engine then runs::

    for segment in plan.in_order():
      for layers in partial period, whole periods (flat or nested), partial:
        x = checkpointed steps of segment.policy over layers

  Args:
    remat: the ``remat=`` value as :func:`as_remat` returned it where it entered.
    num_layers: the loop's length.
    kinds: the kinds of block in the loop (one for a stack of one block).
    period: the pattern's length (1 for a stack of one block).
    reverse: run from the last layer to the first.
    init: whether Haiku is initialising. Init is never differentiated, so no
      policy changes it, and a plan is made from initialised parameters, so
      ``"auto"`` needs no plan there: it runs as ``"none"``.
    probe: returns the names the blocks tag, for a plan that discovers loops.
      It traces each kind's step once, and that trace is what the planner
      costs the candidates from.
    sizes: the bytes a nested split weighs (default: carries alone).
    tags: returns the names each kind's block tags; asked only when several
      kinds run under a policy that names block internals, which each kind
      then keeps where it tags them.
    looped: whether the layers run in a loop (``False`` for ``BlockSeq``'s
      Python loop, which the planner costs without a loop's seams).

  Returns:
    The plan.

  Raises:
    ValueError: when per-depth counts do not add up to ``num_layers``, a
      nested outer size exceeds its segment's whole periods, or ``"auto"`` is
      used outside a plan.
  """
  if isinstance(remat, AutoRemat):
    if _PLANS:
      # The active plan's answer enters here, so it is normalised here.
      remat = as_remat(_PLANS.innermost().remat_for(remat.key, num_layers, probe or set,
                                                 period=period, looped=looped))
    elif init:
      remat = _policy.REMAT_ALIASES["none"]
    else:
      raise ValueError(
          f"{_checks.where()}remat='auto' needs a plan, and none is active. Make "
          "one and trace inside it: plan = st.plan_remat(step_fn, *args, "
          "budget='48MiB'); then `with plan:` around the first call (or "
          ".lower()) of the jitted step, since jax.jit traces at its first "
          "call; or jax.jit(plan.wrap(step_fn)). Or pick a policy: remat='full'.")
  if isinstance(remat, _policy.CheckpointPolicy):
    parts = ((num_layers, remat),)
  elif remat.num_layers != num_layers:
    raise ValueError(
        f"{_checks.where()}st.per_depth({remat}) covers {remat.num_layers} "
        f"layers, but the stack has {num_layers}. Make the segment counts add up "
        f"to {num_layers}.")
  else:
    parts = remat.segments
  tagged = None
  if len(kinds) > 1 and tags is not None and any(p.named_internals() for _, p in parts):
    tagged = tags()
  segments, start = [], 0
  for count, policy in parts:
    split = None
    whole = (start + count) // period - -(-start // period)
    if policy.nested and whole > 0:
      carry_bytes, period_bytes, largest = sizes() if sizes else (1.0, 0.0, 0.0)
      if policy.save_carries != "offload":
        # Only a chunk under jax.checkpoint (carries offloaded) copies its
        # slice of the inputs; the engine's own nested loop reads each row
        # in place (see stacktools/remat/_nested_scan.py), so carries alone count.
        period_bytes = largest = 0.0
      split = _nested_split.split_nested(
          whole, policy.nested, carry_bytes=carry_bytes, layer_bytes=period_bytes,
          largest_leaf_bytes=largest, period=period)
    steps = {kind: _kind_policy(policy.inner(), kind, tagged) for kind in kinds}
    segments.append(Segment(start, count, policy, split, steps))
    start += count
  return LoopPlan(tuple(segments), period, reverse)


def _kind_policy(policy: _policy.CheckpointPolicy, kind: str,
                 tags: Optional[Mapping[str, set[str]]]) -> _policy.CheckpointPolicy:
  """``policy`` for ``kind``'s layers: it saves (or offloads) the named
  internals that this kind tags (``tags``: kind -> names)."""
  wanted = policy.named_internals()
  if not wanted or tags is None or not set(wanted) <= set().union(*tags.values()):
    # A name that no kind tags is left in, so that the policy's own check
    # names it.
    return policy

  def keep(names):
    return tuple(n for n in names if n in tags[kind])

  saved = policy.save_block_internals
  return dataclasses.replace(
      policy, save_block_internals=saved if isinstance(saved, bool) else keep(saved),
      offload_block_internals=keep(policy.offload_block_internals))


def plan_for(steps: Mapping[str, Callable[..., Any]], x: PyTree, xs: Mapping[str, PyTree],
             pattern: _pattern.Pattern, remat: Any, *, reverse: bool = False,
             init: bool = False,
             tags: Optional[Callable[[], Mapping[str, set[str]]]] = None
             ) -> LoopPlan:
  """The loop plan of ``remat`` for these steps and inputs.

  Gives :func:`plan_loop` what only the loop's values
  tell: the names the blocks tag (for a plan that discovers loops) and the
  sizes a nested split weighs.

  Args:
    steps: each kind's ``step(x, layer_slice) -> (x, out)``.
    x: the carry.
    xs: each kind's inputs, in kind order (leading axis: the kind's count).
    pattern: the layout (one kind, period 1, for a plain loop).
    remat: any ``remat=`` value.
    reverse: run from the last layer to the first.
    init: whether Haiku is initialising (``"auto"`` then needs no plan).
    tags: returns the names each kind's block tags (see
      :func:`plan_loop`).

  Returns:
    The plan :func:`stacktools.remat._loops.run` takes.
  """
  def first(kind):
    return jax.tree_util.tree_map(lambda a: a[0], xs[kind])

  def probe():
    return set().union(*(_jaxpr.names_tagged_in(steps[k], x, first(k)) for k in steps))

  def sizes():
    carry_bytes = sum(_checks.nbytes(c) for c in jax.tree_util.tree_leaves(x)) or 1
    leaves = [pattern.per_period(k) * _checks.nbytes(a, skip_leading=True)
              for k in xs for a in jax.tree_util.tree_leaves(xs[k])]
    return carry_bytes, sum(leaves), max(leaves, default=0)

  return plan_loop(remat, pattern.num_layers, kinds=pattern.names,
                   period=pattern.period, reverse=reverse, init=init,
                   probe=probe, sizes=sizes, tags=tags)
