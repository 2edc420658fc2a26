"""Checkpoint (remat) policies for one step of a scanned loop.

A :class:`CheckpointPolicy` says what the backward pass of a scanned block
keeps from the forward pass and what it recomputes. It is built from a
``remat=`` value (``False``, ``True``, ``"nested"``, ``"offload"``, ...) by
:meth:`CheckpointPolicy.from_remat` and turned into a ``jax.checkpoint`` call
for the loop body by :meth:`CheckpointPolicy.checkpoint_step` (and, for the
outer loop of a nested loop, :meth:`CheckpointPolicy.checkpoint_chunk`),
which ``_checkpoint.py``, the only module that calls ``jax.checkpoint``,
carries out. :data:`REMAT_ALIASES` is the table of ``remat=`` aliases.

A block tags its own intermediates with :func:`checkpoint_name`; the policy
maps onto ``jax.checkpoint_policies``: names to save on device, names to
offload to host memory, everything else recomputed.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeVar, Union

import jax
import numpy as np

from stacktools.core import _checks
from stacktools.remat import _checkpoint
from stacktools.remat import _nested_split
from stacktools.remat._checkpoint import CARRY_NAME  # noqa: F401  (re-exported)
from stacktools.remat._checkpoint import INPUT_NAME  # noqa: F401
from stacktools.remat._checkpoint import OUTER_CARRY_NAME  # noqa: F401
from stacktools.remat._checkpoint import RECOMPUTED, SMALL_SLICE  # noqa: F401
from stacktools.remat._checkpoint import RESERVED_NAMES
from stacktools.remat._checkpoint import checkpoint_name  # noqa: F401

T = TypeVar("T")

SaveOption = Union[bool, Literal["offload"]]
RematSpec = Union[bool, str, "CheckpointPolicy", None]



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
      :func:`stacktools.remat._nested_split.split_nested`, which also weighs the sizes of carries and inputs);
      with more levels, each level's count, then the remainder.

    Raises:
      ValueError: when the policy is not nested, or its outer size exceeds
        ``length``.
    """
    if not self.nested:
      raise ValueError(f"{self} is not nested, so it does not split a loop; "
                       "use CheckpointPolicy(nested=True) or an outer size.")
    return _nested_split.split_nested(length, self.nested)

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
    return _checkpoint.jax_policy(self)

  def checkpoint_step(self, step: Callable[..., T], *,
                      looped: bool = True) -> Callable[..., T]:
    """Wraps one loop step ``step(carry, x)`` in ``jax.checkpoint``.

    See :func:`stacktools.remat._checkpoint.checkpoint_step`: what a step keeps,
    by the policy's fields; without checkpointing, every value but the
    outputs of elementwise and layout operations (:data:`RECOMPUTED`).

    Args:
      step: ``step(carry, x) -> out``.
      looped: whether the step is the body of a loop.

    Returns:
      The wrapped step; ``step`` itself when checkpointing is disabled and
      the step is not looped.
    """
    return _checkpoint.checkpoint_step(self, step, looped=looped)

  def checkpoint_chunk(self, chunk: Callable[..., T]) -> Callable[..., T]:
    """Wraps one outer step ``chunk(carry, x)`` of a nested loop (see
    :func:`stacktools.remat._checkpoint.checkpoint_chunk`)."""
    return _checkpoint.checkpoint_chunk(self, chunk)


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


