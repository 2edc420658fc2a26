"""What a checkpoint policy does to a step: the calls of ``jax.checkpoint``.

The only module that calls ``jax.checkpoint``. :func:`checkpoint_step` wraps
one loop step, :func:`checkpoint_chunk` one outer step of a nested loop, by
a ``stacktools.remat._policy.CheckpointPolicy``'s fields (:func:`jax_policy`). A
block tags its intermediates with :func:`checkpoint_name`; the step tags its
carry and per-layer input with the reserved names :data:`CARRY_NAME` and
:data:`INPUT_NAME` when a policy offloads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name as _jax_checkpoint_name

from stacktools.core import _context
from stacktools.core import _jaxpr

T = TypeVar("T")
#: A ``stacktools.remat._policy.CheckpointPolicy`` (not imported: it imports this).
Policy = Any

#: Name given to the loop carry at the start of every step.
CARRY_NAME = "stacktools_carry"
#: Name given to the per-layer input (the slice of ``xs``) of every step.
INPUT_NAME = "stacktools_input"
#: Name given to the carry entering each outer step of a nested loop, so that
#: ``save_carries="offload"`` can move those carries to host memory too.
OUTER_CARRY_NAME = "stacktools_outer_carry"
#: Names stacktools gives values itself; a policy may not list them.
RESERVED_NAMES = (CARRY_NAME, INPUT_NAME, OUTER_CARRY_NAME)


def checkpoint_name(tree: T, name: str) -> T:
  """Tags every array leaf of ``tree`` with ``name`` for a checkpoint policy.

  A policy that lists ``name`` in ``save_block_internals`` keeps the tagged
  values for the backward pass instead of recomputing them; one that lists it
  in ``offload_block_internals`` keeps them in host memory. Leaves that are
  not arrays (``None``, Python scalars, strings) are returned unchanged and
  tag nothing: a policy that names only such a value is refused.

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

  tagged = []

  def tag(leaf):
    if isinstance(leaf, (jax.Array, np.ndarray)):
      tagged.append(leaf)
      return _jax_checkpoint_name(leaf, name)
    return leaf

  out = jax.tree_util.tree_map(tag, tree)
  if tagged:
    # A name on no array (a string, a Python float) saves nothing: not
    # recorded, so a policy that names it is refused as for an untagged name.
    for names in _RECORDERS.values():
      names.add(name)
  return out


#: One set per checkpointed step being traced, innermost last: each collects
#: the names given to checkpoint_name while its step is traced.
_RECORDERS = _context.ContextStack[set[str]]()


def jax_policy(policy: Policy) -> Callable[..., Any]:
  """The ``jax.checkpoint_policies`` entry this policy maps onto."""
  cp = jax.checkpoint_policies
  if policy.save_block_internals is True:
    # Also saves the carry and inputs; save_carries=False cannot make a
    # step forget values it needs once everything else is kept.
    return cp.everything_saveable
  save = list(policy.save_block_internals or ())
  offload = list(policy.offload_block_internals)
  # Carries and inputs are inputs of the step, kept without being named;
  # only offloading them needs their names.
  for option, name in ((policy.save_carries, CARRY_NAME),
                       (policy.save_inputs, INPUT_NAME)):
    if option == "offload":
      offload.append(name)
  if offload:
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=save,
        names_which_can_be_offloaded=offload,
        offload_src="device",
        offload_dst="pinned_host")
  return cp.save_only_these_names(*save)

def checkpoint_step(policy: Policy, step: Callable[..., T], *,
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

  Arguments and result as :meth:`stacktools.CheckpointPolicy.checkpoint_step`.
  """
  if policy.disable:
    if not looped:
      return step
    return jax.checkpoint(step, policy=_keeps_all_but_elementwise,
                          prevent_cse=False)

  # A step's slice of xs is one of its inputs, so the backward pass has it
  # whether or not the policy saves it: inside lax.scan it is read straight
  # from xs, at no cost. Tagging it would make a named copy, and saving that
  # copy would double the memory of xs, so it is tagged only to offload it.
  tag_inputs = policy.save_inputs == "offload"

  # The carry too is an input of the step, kept in the backward pass
  # whatever the policy; a named copy would only add a buffer (and the
  # reduce-precision ops JAX puts on saved values), so it too is tagged
  # only to offload it.
  tag_carry = policy.save_carries == "offload"

  wanted = policy.named_internals()

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
      _jaxpr.check_names_tagged(wanted, step, carry, x,
                                 reserved=RESERVED_NAMES)
    return out

  return jax.checkpoint(named_step, policy=policy.jax_policy(),
                        prevent_cse=policy.prevent_cse)


def checkpoint_chunk(policy: Policy, chunk: Callable[..., T]) -> Callable[..., T]:
  """Wraps one outer step ``chunk(carry, x)`` of a nested loop.

  The chunk is checkpointed as a whole: only its input carry is kept (in
  host memory when ``save_carries="offload"``), and the backward pass
  recomputes the chunk's inner loop, whose steps are wrapped by
  :func:`checkpoint_step` of the policy's ``inner()``.

  Args:
    chunk: ``chunk(carry, x) -> out``, an inner loop over a chunk of steps.

  Returns:
    The wrapped chunk.
  """
  cp = jax.checkpoint_policies
  if policy.save_carries == "offload":
    jax_policy = cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[OUTER_CARRY_NAME],
        offload_src="device", offload_dst="pinned_host")
  else:
    jax_policy = cp.nothing_saveable

  def named_chunk(carry, x):
    return chunk(checkpoint_name(carry, OUTER_CARRY_NAME), x)

  return jax.checkpoint(named_chunk, policy=jax_policy,
                        prevent_cse=policy.prevent_cse)


#: The primitives whose outputs a loop step without checkpointing does not
#: keep (see :func:`checkpoint_step`): elementwise
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
    # (A slice of at most SMALL_SLICE of its input is kept, below.)
    # A tag (st.checkpoint_name): the identity, so a tagged value is kept or
    # recomputed as the operation that made it is (a tagged matmul output is
    # still kept). Keeping every tagged value kept the attention's scores and
    # probabilities both, and on a TPU a bfloat16 copy of them besides: the
    # GPT-2-small step took 1.39x the unrolled one's time and 1.48x its
    # memory (benchmarks/results/accelerator_tpu_v5_lite.json).
    "name",
})


#: A slice at most this fraction of its input's size is kept, not recomputed:
#: recomputing it would keep its whole input for the backward pass. The
#: Pallas splash-attention kernel gives its softmax statistics 128 lanes
#: wide and the backward pass reads one lane (``logsumexp[..., 0]``);
#: recomputing that slice kept the 128 lanes, 600 MB of the GPT-2-small
#: step at batch 8 on a TPU, written and read back at 2.8 ms of its 65.
SMALL_SLICE = 1 / 8


def _keeps_all_but_elementwise(prim: Any, *avals: Any, **params: Any) -> bool:
  if prim.name == "slice":
    return _slice_size(params) <= SMALL_SLICE * math.prod(avals[0].shape)
  return prim.name not in RECOMPUTED


def _slice_size(params: dict[str, Any]) -> int:
  """The number of elements ``lax.slice`` with ``params`` gives."""
  starts, limits = params["start_indices"], params["limit_indices"]
  strides = params["strides"] or (1,) * len(starts)
  return math.prod(-(-(stop - start) // stride)
                   for start, stop, stride in zip(starts, limits, strides))
