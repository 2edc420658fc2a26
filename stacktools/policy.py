"""Checkpoint (remat) policies for one step of a scanned loop.

A :class:`CheckpointPolicy` says what the backward pass of a scanned block
keeps from the forward pass and what it recomputes. It is built from a
``remat=`` value (``False``, ``True``, ``"nested"``, ``"offload"``, ...) by
:meth:`CheckpointPolicy.from_remat` and turned into a ``jax.checkpoint`` call
for the loop body by :meth:`CheckpointPolicy.checkpoint_step` (and, for the
outer loop of a nested loop, :meth:`CheckpointPolicy.checkpoint_chunk`). This
is the only module that calls ``jax.checkpoint``.

The loop machinery in ``loops.py`` tags the carry and the per-layer input of
every step with the reserved names :data:`CARRY_NAME` and :data:`INPUT_NAME`;
a block tags its own intermediates with :func:`checkpoint_name`. The policy
then maps onto ``jax.checkpoint_policies``: names to save on device, names to
offload to host memory, everything else recomputed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, Optional, TypeVar, Union

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name as _jax_checkpoint_name

from stacktools import _checks
from stacktools import _context

T = TypeVar("T")

#: Name given to the loop carry at the start of every step.
CARRY_NAME = "stacktools_carry"
#: Name given to the per-layer input (the slice of ``xs``) of every step.
INPUT_NAME = "stacktools_input"
#: Name given to the carry entering each outer step of a nested loop, so that
#: ``save_carries="offload"`` can move those carries to host memory too.
OUTER_CARRY_NAME = "stacktools_outer_carry"
#: Names stacktools gives values itself; a policy may not list them.
RESERVED_NAMES = (CARRY_NAME, INPUT_NAME, OUTER_CARRY_NAME)

SaveOption = Union[bool, Literal["offload"]]
RematSpec = Union[bool, str, "CheckpointPolicy", None]



def checkpoint_name(tree: T, name: str) -> T:
  """Tags every array leaf of ``tree`` with ``name`` for a checkpoint policy.

  A policy that lists ``name`` in ``save_block_internals`` keeps the tagged
  values for the backward pass instead of recomputing them; one that lists it
  in ``offload_block_internals`` keeps them in host memory. Leaves that are
  not arrays (``None``, Python scalars) are returned unchanged.

  Example::

    def block(x, w):
      h = st.checkpoint_name(jax.nn.gelu(x @ w), "mlp_hidden")
      return x + h @ w.T

    policy = st.CheckpointPolicy(save_block_internals=["mlp_hidden"])
    y = st.fold(block, remat=policy)(jnp.ones((2, 8)), jnp.full((4, 8, 16), 0.1))

  Args:
    tree: any pytree; its array leaves are tagged.
    name: the name a policy refers to.

  Returns:
    ``tree`` with the same structure and values.
  """
  if not isinstance(name, str) or not name:
    raise TypeError(f"checkpoint_name needs a non-empty string name, got {name!r}.")

  def tag(leaf):
    if isinstance(leaf, (jax.Array, np.ndarray)):
      return _jax_checkpoint_name(leaf, name)
    return leaf

  for names in _RECORDERS.values():
    names.add(name)
  return jax.tree_util.tree_map(tag, tree)


#: One set per checkpointed step being traced, innermost last: each collects
#: the names given to checkpoint_name while its step is traced.
_RECORDERS = _context.ContextStack[set[str]]()


def _check_save_option(field: str, value: Any) -> None:
  if value is not True and value is not False and value != "offload":
    raise ValueError(
        f"CheckpointPolicy({field}={value!r}) is not accepted: use True (keep "
        "on device), False (recompute) or 'offload' (keep in host memory).")


def _as_names(field: str, value: Any) -> tuple[str, ...]:
  if isinstance(value, str):
    value = (value,)
  try:
    names = tuple(value)
  except TypeError:
    raise TypeError(
        f"CheckpointPolicy({field}={value!r}) must be a sequence of names given "
        "to st.checkpoint_name, e.g. ['attn_out'].") from None
  for name in names:
    if not isinstance(name, str):
      raise TypeError(
          f"CheckpointPolicy({field}=...) holds {name!r}, which is not a string; "
          "list the names passed to st.checkpoint_name.")
    if name in RESERVED_NAMES:
      raise ValueError(
          f"CheckpointPolicy({field}=...) names {name!r}, which stacktools "
          "reserves for loop carries and inputs; use save_carries= or "
          "save_inputs= instead.")
  return names


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
  """What the backward pass of a scanned loop keeps and what it recomputes.

  Each step of the loop is wrapped in ``jax.checkpoint``. Whatever a step
  needs in the backward pass and the policy does not keep is recomputed from
  the step's input. The input of a step (its carry) is needed to recompute
  anything at all, so it is kept unless ``save_carries="offload"`` moves it
  to host memory or ``nested`` keeps only a few of them.

  Example::

    def block(x, w):
      return x + st.checkpoint_name(jnp.tanh(x @ w), "attn_out")

    policy = st.CheckpointPolicy(save_block_internals=["attn_out"], nested=True)
    y = st.fold(block, remat=policy)(jnp.ones((2, 8)), jnp.full((16, 8, 8), 0.1))

  Attributes:
    save_carries: keep each step's carry on device (``True``) or in host
      memory (``"offload"``). The carry is the step's input, needed to
      recompute anything, so ``False`` keeps it too; in a nested loop only the
      outer carries are kept either way.
    save_inputs: likewise for each step's slice of ``xs``. A step's slice is
      one of its inputs and is read from ``xs`` in the backward pass at no
      cost, so ``True`` and ``False`` keep the same; ``"offload"`` moves a
      copy to host memory.
    save_block_internals: ``True`` keeps every intermediate (no
      recomputation); a sequence keeps the values tagged with those names by
      :func:`checkpoint_name`.
    offload_block_internals: names of tagged intermediates kept in host memory.
    nested: ``True`` or an outer-loop size: a two-level loop that keeps only
      the outer loop's carries (about ``2*sqrt(N)`` carries in all) and
      recomputes each inner loop in the backward pass. A tuple of sizes adds
      levels: ``nested=(4, 4)`` runs 4 chunks of 4 chunks of ``N // 16``
      steps and keeps about ``3*cbrt(N)`` carries, for one more forward pass.
    prevent_cse: passed to ``jax.checkpoint``. Inside a scan ``False`` is safe
      and lets XLA optimise more.
    disable: no checkpointing at all: every intermediate is kept.
  """

  #: The ``remat=`` aliases and the policies they stand for (set below the
  #: class, as :data:`REMAT_ALIASES`).
  ALIASES: ClassVar[Mapping[str, "CheckpointPolicy"]]

  save_carries: SaveOption = True
  save_inputs: SaveOption = False
  save_block_internals: Union[bool, Sequence[str]] = False
  offload_block_internals: Sequence[str] = ()
  nested: Union[bool, int, tuple[int, ...]] = False
  prevent_cse: bool = False
  disable: bool = False

  def __post_init__(self):
    _check_save_option("save_carries", self.save_carries)
    _check_save_option("save_inputs", self.save_inputs)
    if not isinstance(self.save_block_internals, bool):
      object.__setattr__(self, "save_block_internals",
                         _as_names("save_block_internals", self.save_block_internals))
    offload = _as_names("offload_block_internals", self.offload_block_internals)
    object.__setattr__(self, "offload_block_internals", offload)
    nested = self.nested
    sizes = tuple(nested) if isinstance(nested, (tuple, list)) else (nested,)
    is_size = lambda n: isinstance(n, (int, np.integer)) and not isinstance(n, bool)
    if not isinstance(nested, bool) and not (sizes and all(map(is_size, sizes))):
      raise TypeError(f"CheckpointPolicy(nested={nested!r}) must be a bool or a "
                      "positive int (the outer-loop size), or a tuple of ints "
                      "(the chunk counts of each level but the innermost), e.g. "
                      "nested=(4, 4) for three levels.")
    if not isinstance(nested, bool):
      if min(sizes) < 1:
        raise ValueError(f"CheckpointPolicy(nested={nested}) must be True or "
                         "outer-loop sizes >= 1.")
      sizes = tuple(int(n) for n in sizes)
      object.__setattr__(self, "nested", sizes[0] if len(sizes) == 1 else sizes)
      if len(sizes) > 1 and self.save_carries == "offload":
        raise ValueError(
            f"CheckpointPolicy(nested={nested}, save_carries='offload'): carries "
            "move to host memory in a loop of two levels only; use nested=True "
            "or an int with offloading, or keep the carries on device.")

    if self.disable:
      # Only fields that ask for something disable=True would not do.
      changed = [name for name in ("save_block_internals",
                                   "offload_block_internals", "nested")
                 if getattr(self, name)]
      changed += [name for name in ("save_carries", "save_inputs")
                  if getattr(self, name) == "offload"]
      if changed:
        raise ValueError(
            f"CheckpointPolicy(disable=True) turns checkpointing off, so "
            f"{', '.join(changed)} would be ignored; drop disable=True or those "
            "fields.")
    if self.save_block_internals is True and self.offloads_anything:
      raise ValueError(
          "CheckpointPolicy(save_block_internals=True) keeps every intermediate "
          "on device, so nothing can also be offloaded to host memory "
          "(save_carries/save_inputs='offload' or offload_block_internals). "
          "List the internals to keep by name instead, or do not offload.")
    if not isinstance(self.save_block_internals, bool):
      both = sorted(set(self.save_block_internals) & set(offload))
      if both:
        raise ValueError(
            f"CheckpointPolicy names {both} in both save_block_internals and "
            "offload_block_internals; a value is either kept on device or "
            "offloaded to host, so list each name in one of them.")

  def named_internals(self) -> tuple[str, ...]:
    """The names of block internals this policy saves or offloads."""
    saved = () if isinstance(self.save_block_internals, bool) else self.save_block_internals
    return tuple(saved) + tuple(self.offload_block_internals)

  @property
  def offloads_anything(self) -> bool:
    return (self.save_carries == "offload" or self.save_inputs == "offload" or
            bool(self.offload_block_internals))

  @classmethod
  def from_remat(cls, remat: RematSpec) -> "CheckpointPolicy":
    """Builds a policy from a ``remat=`` value.

    Example::

      assert st.CheckpointPolicy.from_remat("nested") == st.CheckpointPolicy(nested=True)

    Args:
      remat: ``False``/``None``/``"none"`` (no checkpointing), ``True``/
        ``"full"`` (keep carries, recompute internals), ``"nested"`` (two-level
        loop, ~2*sqrt(N) carries), ``"offload"`` (carries in host memory),
        ``"save_all"`` (keep everything through the checkpoint machinery), or
        a :class:`CheckpointPolicy`, returned as it is.

    Returns:
      The policy.

    Raises:
      ValueError: for any other value.
    """
    if isinstance(remat, CheckpointPolicy):
      return remat
    if remat is None or remat is False:
      return REMAT_ALIASES["none"]
    if remat is True:
      return REMAT_ALIASES["full"]
    if isinstance(remat, str) and remat.lower() in REMAT_ALIASES:
      return REMAT_ALIASES[remat.lower()]
    raise ValueError(
        f"remat={remat!r} is not a checkpoint policy. Accepted: False, None, "
        f"True, {', '.join(map(repr, REMAT_ALIASES))}, or a CheckpointPolicy.")

  def __str__(self) -> str:
    """The alias this policy is (``"nested"``), or its non-default fields."""
    for alias, known in REMAT_ALIASES.items():
      if self == known:
        return alias
    defaults = CheckpointPolicy()
    fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
              if getattr(self, f.name) != getattr(defaults, f.name)]
    return f"CheckpointPolicy({', '.join(fields)})"

  def nested_split(self, length: int) -> tuple[int, ...]:
    """How this policy's ``nested`` splits a loop of ``length`` steps.

    Example::

      assert st.CheckpointPolicy(nested=True).nested_split(61) == (8, 7, 5)

    Args:
      length: the number of steps.

    Returns:
      ``(outer, inner, remainder)``: ``outer`` chunks of ``inner`` steps, then
      one chunk of ``remainder`` steps when ``remainder > 0`` (see
      :func:`split_nested`, which also weighs the sizes of carries and inputs);
      with more levels, each level's count, then the remainder.

    Raises:
      ValueError: when the policy is not nested, or its outer size exceeds
        ``length``.
    """
    if not self.nested:
      raise ValueError(f"{self} is not nested, so it does not split a loop; "
                       "use CheckpointPolicy(nested=True) or an outer size.")
    return split_nested(length, self.nested)

  def inner(self) -> "CheckpointPolicy":
    """This policy for one step of the inner loop of a nested loop."""
    return dataclasses.replace(self, nested=False)

  def outside_loop(self) -> "CheckpointPolicy":
    """This policy for a step that runs outside any loop.

    Outside a loop XLA would merge the recomputation with the forward pass
    (common subexpression elimination) and keep everything, so a checkpoint
    there must prevent it.
    """
    return self if self.disable else dataclasses.replace(self, prevent_cse=True)

  def jax_policy(self) -> Callable[..., Any]:
    """The ``jax.checkpoint_policies`` entry this policy maps onto."""
    cp = jax.checkpoint_policies
    if self.save_block_internals is True:
      # Also saves the carry and inputs; save_carries=False cannot make a
      # step forget values it needs once everything else is kept.
      return cp.everything_saveable
    save = list(self.save_block_internals or ())
    offload = list(self.offload_block_internals)
    # Carries and inputs are inputs of the step, kept without being named;
    # only offloading them needs their names.
    for option, name in ((self.save_carries, CARRY_NAME),
                         (self.save_inputs, INPUT_NAME)):
      if option == "offload":
        offload.append(name)
    if offload:
      return cp.save_and_offload_only_these_names(
          names_which_can_be_saved=save,
          names_which_can_be_offloaded=offload,
          offload_src="device",
          offload_dst="pinned_host")
    return cp.save_only_these_names(*save)

  def checkpoint_step(self, step: Callable[..., T], *,
                      looped: bool = True) -> Callable[..., T]:
    """Wraps one loop step ``step(carry, x)`` in ``jax.checkpoint``.

    When carries or inputs are offloaded, they are tagged with
    :data:`CARRY_NAME` or :data:`INPUT_NAME` before ``step`` sees them, so
    that the offloading policy can refer to them.

    With checkpointing disabled, a step outside a loop is returned as it is.
    A step inside a ``lax.scan`` keeps every value of the step but the
    outputs of elementwise and layout operations (:data:`RECOMPUTED`),
    which the backward pass recomputes from the values kept: a scan writes
    each value it keeps into a stacked ``[L, ...]`` buffer, so keeping the
    chain of elementwise values behind every activation costs more memory
    and time than recomputing it, where an unrolled program lets XLA fuse
    them away. Nothing costly (a matmul, a reduction, a jitted function, a
    random draw) is recomputed.

    Args:
      step: ``step(carry, x) -> out``.
      looped: whether the step is the body of a loop.

    Returns:
      The wrapped step; ``step`` itself when checkpointing is disabled and
      the step is not looped.
    """
    if self.disable:
      if not looped:
        return step
      return jax.checkpoint(step, policy=_keeps_all_but_elementwise,
                            prevent_cse=False)

    # A step's slice of xs is one of its inputs, so the backward pass has it
    # whether or not the policy saves it: inside lax.scan it is read straight
    # from xs, at no cost. Tagging it would make a named copy, and saving that
    # copy would double the memory of xs, so it is tagged only to offload it.
    tag_inputs = self.save_inputs == "offload"

    # The carry too is an input of the step, kept in the backward pass
    # whatever the policy; a named copy would only add a buffer (and the
    # reduce-precision ops JAX puts on saved values), so it too is tagged
    # only to offload it.
    tag_carry = self.save_carries == "offload"

    wanted = self.named_internals()

    def named_step(carry, x):
      if tag_inputs:
        x = checkpoint_name(x, INPUT_NAME)
      if tag_carry:
        carry = checkpoint_name(carry, CARRY_NAME)
      with _RECORDERS.push(set()) as tagged:
        out = step(carry, x)
      if not set(wanted) <= tagged:
        # Recorded names cover st.checkpoint_name only; a block may also tag
        # with jax.ad_checkpoint.checkpoint_name, which only its jaxpr shows.
        _checks.check_names_tagged(wanted, step, carry, x,
                                   reserved=RESERVED_NAMES)
      return out

    return jax.checkpoint(named_step, policy=self.jax_policy(),
                          prevent_cse=self.prevent_cse)


  def checkpoint_chunk(self, chunk: Callable[..., T]) -> Callable[..., T]:
    """Wraps one outer step ``chunk(carry, x)`` of a nested loop.

    The chunk is checkpointed as a whole: only its input carry is kept (in
    host memory when ``save_carries="offload"``), and the backward pass
    recomputes the chunk's inner loop, whose steps are wrapped by
    :meth:`checkpoint_step` of :meth:`inner`.

    Args:
      chunk: ``chunk(carry, x) -> out``, an inner loop over a chunk of steps.

    Returns:
      The wrapped chunk.
    """
    cp = jax.checkpoint_policies
    if self.save_carries == "offload":
      jax_policy = cp.save_and_offload_only_these_names(
          names_which_can_be_saved=[],
          names_which_can_be_offloaded=[OUTER_CARRY_NAME],
          offload_src="device", offload_dst="pinned_host")
    else:
      jax_policy = cp.nothing_saveable

    def named_chunk(carry, x):
      return chunk(checkpoint_name(carry, OUTER_CARRY_NAME), x)

    return jax.checkpoint(named_chunk, policy=jax_policy,
                          prevent_cse=self.prevent_cse)


#: The primitives whose outputs a loop step without checkpointing does not
#: keep (see :meth:`CheckpointPolicy.checkpoint_step`): elementwise
#: arithmetic and layout changes, recomputed for the price of reading their
#: inputs. Anything else (``dot_general``, reductions, ``pjit``, gathers,
#: random bits, custom calls) is kept.
RECOMPUTED = frozenset({
    # Elementwise arithmetic.
    "abs", "add", "ceil", "clamp", "cos", "div", "erf", "erfc", "exp", "exp2",
    "expm1", "floor", "integer_pow", "log", "log1p", "logistic", "max", "min",
    "mul", "neg", "pow", "rem", "round", "rsqrt", "sign", "sin", "sqrt",
    "square", "sub", "tanh",
    # Fused forms that newer JAX writes in derivatives (tanh's is
    # one_minus_square in jax 0.12, where 0.10 wrote sub and mul).
    "one_minus_square", "polynomial",
    # Comparisons, logic and selection.
    "and", "eq", "ge", "gt", "le", "lt", "ne", "not", "or", "select_n", "xor",
    # Layout: the same values, moved or retyped.
    "bitcast_convert_type", "broadcast_in_dim", "concatenate",
    "convert_element_type", "copy", "copy_p", "expand_dims", "iota", "pad",
    "reshape", "slice", "split", "squeeze", "stop_gradient", "transpose",
    # A tag (st.checkpoint_name): the identity, so a tagged value is kept or
    # recomputed as the operation that made it is (a tagged matmul output is
    # still kept). Keeping every tagged value kept the attention's scores and
    # probabilities both, and on a TPU a bfloat16 copy of them besides: the
    # GPT-2-small step took 1.39x the unrolled one's time and 1.48x its
    # memory (benchmarks/results/accelerator_tpu_v5_lite.json).
    "name",
})


def _keeps_all_but_elementwise(prim: Any, *_, **__) -> bool:
  return prim.name not in RECOMPUTED


#: The ``remat=`` aliases and the policies they stand for. ``False`` and
#: ``None`` mean ``"none"``; ``True`` means ``"full"``. ``from_remat``, its
#: error message, the GPT example's ``--remat`` flag and the benchmarks all
#: read this one table.
REMAT_ALIASES: Mapping[str, CheckpointPolicy] = types.MappingProxyType({
    # Keep everything: no checkpointing at all.
    "none": CheckpointPolicy(disable=True),
    # Keep each layer's carry, recompute its internals.
    "full": CheckpointPolicy(),
    # A two-level loop: keep about 2*sqrt(N) carries.
    "nested": CheckpointPolicy(nested=True),
    # Like "full", with the carries in host memory. The per-layer inputs stay
    # where they are: they are the loop's own inputs (most often the stacked
    # parameters), on device for the whole step anyway, so a host copy would
    # only add transfers (on a TPU v5e, 0.5 GB of a residual MLP's weights
    # made the step 1.18x slower).
    "offload": CheckpointPolicy(save_carries="offload"),
    # The memory of "none", through the checkpoint machinery.
    "save_all": CheckpointPolicy(save_carries=True, save_inputs=True,
                                 save_block_internals=True),
})
#: The same table on the class, where a user looks for it:
#: ``st.CheckpointPolicy.ALIASES["nested"]``, ``list(st.CheckpointPolicy.ALIASES)``.
CheckpointPolicy.ALIASES = REMAT_ALIASES


def split_nested(length: int, nested: Union[bool, int, tuple[int, ...]], *,
                 carry_bytes: float = 1.0, layer_bytes: float = 0.0,
                 largest_leaf_bytes: float = 0.0, period: int = 1) -> tuple[int, ...]:
  """How a nested loop of ``length`` steps is split.

  Example::

    assert split_nested(61, True) == (8, 7, 5)   # 8 chunks of 7 steps, then 5 steps

  With ``nested=True`` the split minimises an estimate of the bytes the
  backward pass holds at its peak:

  * the carries: one per outer chunk, plus the ``inner`` carries of the
    chunk being differentiated;
  * the chunk's slice of ``xs`` and its gradient, ``2 * inner * layer_bytes``
    (this is what makes nested worse than full when a layer's parameters are
    much larger than its carry, unless chunks are kept short);
  * with a remainder, the gradient of its slice of ``xs`` is padded to the
    full length one leaf at a time: ``length * largest_leaf_bytes``.

  With the default sizes this counts carries alone.

  Args:
    length: the number of steps.
    nested: ``True`` to choose the split, an int number of full outer
      chunks, at most ``length``, or a tuple of chunk counts per level
      (their product at most ``length``).
    carry_bytes: the size of the carry.
    layer_bytes: the size of one step's slice of ``xs``.
    largest_leaf_bytes: the size of the largest leaf of one step's slice.
    period: the layers in one step (a mixed-layer stack loops over periods
      of its pattern), for the error message.

  Returns:
    ``(outer, inner, remainder)`` with ``outer * inner + remainder == length``:
    ``outer`` chunks of ``inner`` steps, then one chunk of ``remainder``
    steps when ``remainder > 0``. For a tuple ``nested=(a, b)``,
    ``(a, b, inner, remainder)`` with ``a * b * inner + remainder == length``.

  Raises:
    ValueError: when ``nested`` is an int larger than ``length``.
  """
  if length < 1:
    raise ValueError(f"A nested loop needs length >= 1, got {length}.")
  if nested is True:
    def peak_bytes(inner):
      outer, remainder = divmod(length, inner)
      has_rem = remainder > 0
      estimate = (carry_bytes * (outer + has_rem + inner) +
                  2 * layer_bytes * max(inner, remainder) +
                  has_rem * length * largest_leaf_bytes)
      return estimate, has_rem, abs(inner - outer)
    inner = min(range(1, length + 1), key=peak_bytes)
    outer, remainder = divmod(length, inner)
    return outer, inner, remainder
  sizes = nested if isinstance(nested, tuple) else (nested,)
  if math.prod(sizes) > length:
    if period == 1:
      asked, has = "", f"the loop has only {length} steps"
    else:
      asked = " of whole periods"
      has = (f"the stack (or this per_depth segment) has {length} whole periods "
             f"of {period} layers")
    raise ValueError(
        f"{_checks.where()}CheckpointPolicy(nested={nested}) asks for "
        f"{math.prod(sizes)} {'outer ' if len(sizes) == 1 else ''}chunks{asked}, but {has}. Use nested=True to let stacktools "
        f"choose the split, or an outer size between 1 and {length}.")
  inner, remainder = divmod(length, math.prod(sizes))
  return (*sizes, inner, remainder)


def three_levels(length: int) -> Optional[tuple[int, int]]:
  """The ``nested=(outer, middle)`` that keeps the fewest carries, if it pays.

  Example::

    assert three_levels(64) == (4, 4)   # 4 + 4 + 4 carries against 8 + 8

  A third level costs one more forward pass, so it is offered (by the
  planner, see :func:`stacktools.report.candidates`) only where it keeps at
  least two carries fewer than the best two-level split.

  Args:
    length: the number of steps.

  Returns:
    ``(outer, middle)`` for ``CheckpointPolicy(nested=...)``, or ``None``.
  """
  def peak(sizes):   # carries live at the backward pass's peak
    *outer, inner, remainder = split_nested(length, sizes)
    return sum(outer) + (remainder > 0) + max(inner, remainder), sizes

  two = min(peak((a,)) for a in range(1, length + 1))
  three = min(peak((a, b)) for a in range(1, length + 1)
              for b in range(1, length // a + 1))
  return three[1] if three[0] <= two[0] - 2 else None
