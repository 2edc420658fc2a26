"""The pipelines that compute the loss: 1F1B, interleaved 1F1B, ZB-H1.

The ``1f1b``, ``interleaved`` (1F1B over circular's chunks) and ``zb``
(ZB-H1) schedules run each microbatch's backward inside the same loop as the
forwards, as soon as its forward has left the last stage, so a stage holds a
bounded number of microbatches whatever M is. The loss is computed inside
too: ``embed`` on the first virtual stage, ``head`` on the last, per
microbatch (``_ends.Ends``), and the loop returns the loss with its
gradients (:func:`with_gradients`), so that an outer ``jax.grad`` gets them
as if it had differentiated the loop itself.

One tick of the loop, on every stage at once (the op, microbatch ``m``,
chunk ``r`` and buffer slot come from the table, ``_schedules.one_f_one_b``
or ``_schedules.zero_bubble``)::

  F:  (x, loss), (ys, state) = forward(params, inputs[slot], m, r)
  B:  grads += vjp(forward at slot)(cotangents[slot], 1/M on the last stage)
      (under zb: B pulls back to the input only, W later to the parameters)
  send x forward, the input's cotangent back; put what arrives in its slot
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from stacktools.core import _checks
from stacktools.pipelines import _ends
from stacktools.pipelines import _pipeline
from stacktools.pipelines import _schedules
from stacktools.pipelines import _stages
from stacktools.step import _layer_step

PyTree = Any


# ---------------------------------------------------------------------------
# Gradients computed by the loop, handed to an outer jax.grad.


def _inexact(tree: PyTree) -> list[bool]:
  return [jnp.issubdtype(jnp.asarray(a).dtype, jnp.inexact)
          for a in jax.tree_util.tree_leaves(tree)]


def _split(tree: PyTree) -> tuple[list[Any], Callable[[list[Any]], PyTree]]:
  """The float leaves of ``tree`` (what has a gradient), and how to put them back."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  mask = _inexact(tree)

  def rebuild(floats):
    it = iter(floats)
    return jax.tree_util.tree_unflatten(
        treedef, [next(it) if m else a for a, m in zip(leaves, mask)])
  return [a for a, m in zip(leaves, mask) if m], rebuild


def with_gradients(value: jax.Array, pairs: list[tuple[PyTree, PyTree]]) -> jax.Array:
  """``value``, whose gradient with respect to each ``v`` is the given ``g``.

  ``value + sum(g . (v - stop_gradient(v)))``: the added term is exactly 0,
  and its derivative in ``v`` is ``g``. This is how a loss whose gradients
  the pipeline computed itself (each stage's ``jax.vjp``) takes part in an
  outer ``jax.grad`` as if it had been differentiated there.
  """
  out = lax.stop_gradient(value)
  for values, grads in pairs:
    for v, g in zip(jax.tree_util.tree_leaves(values), jax.tree_util.tree_leaves(grads)):
      if jnp.issubdtype(v.dtype, jnp.inexact):
        out = out + jnp.vdot(lax.stop_gradient(g).astype(v.dtype),
                             v - lax.stop_gradient(v)).astype(out.dtype)
  return out


# ---------------------------------------------------------------------------
# The loop: forward and backward of every microbatch, the loss inside.


def run_with_loss(chunk: _stages.Chunk, layers: _layer_step.LayerSlice,
                  ends: _ends.Ends, *, pipeline: _pipeline.Pipeline, stages: int
                  ) -> tuple[jax.Array, PyTree, PyTree]:
  """Runs embed, the layers and head as a 1F1B-family pipeline; ``(loss, ys, state)``.

  One ``shard_map`` over the pipe axis runs a ``lax.scan`` over the ticks of
  the pipeline's table (``_schedules.one_f_one_b``,
  ``_schedules.zero_bubble``). At each tick a stage looks up its op,
  microbatch ``m`` and chunk ``r``:

  * forward: chunk ``r``'s layers (after ``embed`` on the first virtual
    stage) on the input that arrived for ``(m, r)``; on the last virtual
    stage ``head`` gives ``m``'s loss. The input and the layers' state stay
    in the op's slot of the stage's buffers, the output goes to the next
    virtual stage.
  * backward: ``jax.vjp`` of the same function at that slot (so it
    recomputes the forward, each layer with the stack's checkpoint policy),
    pulled back from the cotangent the next virtual stage sent (on the last,
    from ``1/M`` on the loss); the gradients add up and the input's
    cotangent goes to the previous virtual stage. Under ``zb`` the backward
    is two ops: ``B`` pulls back to the input only, ``W`` (later) to the
    parameters only.

  Two ``ppermute`` per tick carry activations forward and cotangents back
  (cyclic when interleaved: the last stage's chunk feeds the first stage's
  next chunk).

  Args:
    chunk: how a stage runs one chunk of its layers on one microbatch
      (:data:`_stages.Chunk`).
    layers: every layer's params, state, apply key, per-layer arguments and
      index, each with a leading ``num_layers`` axis.
    ends: ``embed``, ``head`` and what they take (``_ends.prepare_ends``).
    pipeline: the configuration (``1f1b``, ``interleaved`` or ``zb``).
    stages: P (> 1).

  Returns:
    The mean of the microbatches' losses, carrying the gradients of the
    layers' parameters and per-layer arguments, the broadcast arguments and
    ``embed``'s and ``head``'s parameters (see :func:`with_gradients`); each
    layer's ``y`` (``[L, B, ...]``, no gradient; ``None`` for a fold) and the
    new per-layer state.
  """
  micro, axis, repeats = pipeline.microbatches, pipeline.axis, pipeline.repeats
  table = pipeline.table(stages)
  ops = _op_codes(table)
  inputs = _stages.split_microbatches(ends.inputs, micro)
  targets = _stages.split_microbatches(ends.targets, micro)
  staged = _stages.on_pipe(_stages.to_stages(_stages.on_pipe(layers, pipeline), stages,
                                             repeats), pipeline)
  # What has a gradient: layer params, per-layer args, embed's and head's
  # params, broadcast args (their float leaves).
  outer = (layers.params, layers.sliced, ends.embed_params, ends.head_params,
           ends.broadcast)
  x_shape, loss_shape = _microbatch_shapes(ends, inputs, targets, pipeline)
  loop = _Loop(chunk, ends, pipeline, stages, table.weight is not None, table.slots,
               x_shape, loss_shape)

  spec, whole = PartitionSpec(axis), PartitionSpec()
  # check_vma=False: as in _run_forward.run, the buffers start equal on every stage
  # and vary by stage once a ppermute has filled them.
  mapped = jax.shard_map(
      functools.partial(_per_device, loop), mesh=pipeline.mesh,
      in_specs=(whole, whole, spec, whole, whole, whole, whole),
      out_specs=(whole, spec, spec, spec), axis_names=frozenset({axis}),
      check_vma=False)
  columns = tuple(jnp.asarray(a) for a in (ops, table.microbatch, table.repeat, table.slot,
                                           table.receive_input, table.receive_cotangent))
  # The loop computes its own gradients (with_gradients below adds them):
  # cut its inputs off from an outer jax.grad, which would otherwise
  # linearize the whole loop only to drop the result.
  (loss, embed_g, head_g, bcast_g), (params_g, sliced_g), ys, state = mapped(
      *lax.stop_gradient((inputs, targets, staged, ends.embed_params, ends.head_params,
                          ends.broadcast)), columns)
  grads = (_stages.from_stages(params_g), _stages.from_stages(sliced_g), embed_g, head_g,
           bcast_g)
  loss = with_gradients(loss, list(zip(outer, grads)))
  # [P, R, K, M, mb, ...] -> [L, M, mb, ...] -> [L, B, ...]
  if ys is not None:
    ys = lax.stop_gradient(_stages.merge_microbatches(_stages.from_stages(ys), axis=1))
  return loss, ys, _stages.from_stages(state)


# The op codes of a tick: the table's kinds as one int32 column.
_FORWARD, _BACKWARD, _INPUT_HALF, _WEIGHT_HALF = 1, 2, 3, 4


def _op_codes(table: _schedules.Schedule) -> np.ndarray:
  """``[ticks, P]`` int32: 0 idle, or which op (a backward is two under ``zb``)."""
  split = table.weight is not None
  ops = np.where(table.backward, _INPUT_HALF if split else _BACKWARD,
                 table.busy.astype(np.int32))
  if split:
    ops = np.where(table.weight, _WEIGHT_HALF, ops)
  return ops.astype(np.int32)


def _microbatch_shapes(ends: _ends.Ends, inputs: PyTree, targets: PyTree,
                       pipeline: _pipeline.Pipeline) -> tuple[PyTree, jax.ShapeDtypeStruct]:
  """The shapes of ``embed``'s output and of ``head``'s loss on one microbatch.

  Raises:
    ValueError: when the loss is not one number.
  """
  x_shape = jax.eval_shape(ends.embed, ends.embed_params, _take(inputs, 0))
  loss_shape = jax.eval_shape(ends.head, ends.head_params, x_shape, _take(targets, 0))
  if loss_shape.shape != ():
    raise ValueError(
        f"{_checks.where()}a {pipeline.schedule} pipeline's head must return one number "
        f"per microbatch (its mean loss), got shape {tuple(loss_shape.shape)}.")
  return x_shape, loss_shape


def _take(tree: PyTree, i: Any) -> PyTree:
  return jax.tree_util.tree_map(lambda a: a[i], tree)


def _zeros_like(tree: PyTree) -> PyTree:
  return jax.tree_util.tree_map(jnp.zeros_like, tree)


class _Loop(NamedTuple):
  """What every device's loop shares (fixed when the step is traced)."""

  chunk: _stages.Chunk        # one chunk of the stage's layers (run_with_loss's chunk)
  ends: _ends.Ends
  pipeline: _pipeline.Pipeline
  stages: int
  split: bool                 # zb: a backward is an input half, then a weight half
  num_slots: int              # microbatches a stage holds between forward and backward
  x_shape: PyTree             # a microbatch's carry
  loss_shape: jax.ShapeDtypeStruct


class _Device(NamedTuple):
  """What one device's tick reads besides its carry."""

  loop: _Loop
  stage: jax.Array            # this device's index on the pipe axis
  local: _layer_step.LayerSlice   # its stage's layers, [R, K, ...]
  diff: list[Any]             # the float leaves of what has a gradient
  rebuild: Callable[[list[Any]], PyTree]   # diff -> (params, sliced, embed's, head's, broadcast)
  inputs: PyTree              # [M, mb, ...]
  targets: PyTree             # [M, mb, ...]
  table: tuple[jax.Array, ...]   # op, microbatch, repeat, slot, receive_input, receive_cotangent


def _per_device(loop: _Loop, inputs: PyTree, targets: PyTree, staged: _layer_step.LayerSlice,
                embed_params: PyTree, head_params: PyTree, broadcast: PyTree,
                table: tuple[jax.Array, ...]) -> tuple[Any, ...]:
  """One device's share of the ``shard_map``: its stage's tick loop.

  Returns:
    The loss and the gradients of embed's and head's parameters and of the
    broadcast arguments (summed over stages), then per stage
    (``[1, R, K, ...]``): the layers' parameter and per-layer argument
    gradients, the ys and the new state.
  """
  micro, repeats = loop.pipeline.microbatches, loop.pipeline.repeats
  stage = lax.axis_index(loop.pipeline.axis)
  local = _take(staged, 0)   # [R, K, ...]
  diff, rebuild = _split((local.params, local.sliced, embed_params, head_params,
                          broadcast))
  device = _Device(loop, stage, local, diff, rebuild, inputs, targets, table)
  state0 = _take(local.state, 0)
  ys_shape = jax.eval_shape(
      lambda d, s, x: _forward(device, d, s, x, 0, 0)[1][0], diff, state0, loop.x_shape)
  x_zero = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), loop.x_shape)
  slots = lambda t: jax.tree_util.tree_map(  # noqa: E731
      lambda a: jnp.zeros((loop.num_slots,) + a.shape, a.dtype), t)
  carry = {"inputs": slots(x_zero), "cotangents": slots(x_zero), "states": slots(state0),
           "state": local.state, "grads": _zeros_like(diff),
           "loss": jnp.zeros((), loop.loss_shape.dtype),
           "ys": jax.tree_util.tree_map(
               lambda s: jnp.zeros((repeats,) + s.shape[:1] + (micro,) + s.shape[1:],
                                   s.dtype), ys_shape)}
  carry, _ = lax.scan(functools.partial(_tick, device), carry, jnp.arange(table[0].shape[0]))
  params_g, sliced_g, embed_g, head_g, bcast_g = rebuild(carry["grads"])
  # Only the first stage has embed's gradient, the last head's and the
  # loss; every stage adds to the broadcast arguments'.
  shared = lax.psum((carry["loss"], embed_g, head_g, bcast_g), loop.pipeline.axis)
  expand = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)  # noqa: E731
  # Per stage: [1, R, K, ...], the [P, R, K, ...] layout of to_stages.
  return (shared, expand((params_g, sliced_g)), expand(carry["ys"]),
          expand(carry["state"]))


def _forward(device: _Device, diff: list[Any], state: PyTree, x_in: PyTree,
             m: Any, r: Any) -> tuple[tuple[PyTree, jax.Array], tuple[PyTree, PyTree]]:
  """Chunk ``r`` of the stage on microbatch ``m``: ``((x, loss), (ys, state))``.

  ``embed`` makes the input on the first virtual stage, ``head`` the loss on
  the last (0 elsewhere); ``diff`` is what the backward differentiates.
  """
  loop, stage = device.loop, device.stage
  stages, repeats, ends = loop.stages, loop.pipeline.repeats, loop.ends
  params, sliced, e_params, h_params, bcast = device.rebuild(diff)
  first = (stage == 0) & (r == 0)
  x0 = jax.tree_util.tree_map(functools.partial(jnp.where, first),
                              ends.embed(e_params, _take(device.inputs, m)), x_in)
  with ends.with_broadcast(bcast):
    x1, results = loop.chunk(x0, device.local._replace(params=params, sliced=sliced),
                             state, r, m)
  last = (stage == stages - 1) & (r == repeats - 1)
  loss = jnp.where(last, ends.head(h_params, x1, _take(device.targets, m)), 0)
  return (x1, loss), (results[0], results[1])


def _forward_op(device: _Device, carry: dict[str, Any], m: Any, r: Any,
                slot: Any) -> tuple[dict[str, Any], PyTree]:
  """A forward: runs it on the input at ``slot``, keeps what its backward reads."""
  micro = device.loop.pipeline.microbatches
  state = _take(carry["state"], r)
  (x1, loss), (ys, new_state) = _forward(device, device.diff, state,
                                         _take(carry["inputs"], slot), m, r)
  carry = dict(carry, loss=carry["loss"] + loss / micro,
               state=_stages.put_tree(carry["state"], new_state, r),
               states=_stages.put_tree(carry["states"], state, slot))
  if ys is not None:
    carry["ys"] = _stages.put_tree(carry["ys"], ys, r, slice(None), m)
  return carry, x1


def _pull_back(device: _Device, carry: dict[str, Any], m: Any, r: Any, slot: Any,
               wrt: str) -> Any:
  """The vjp of chunk r's forward at ``slot``, with respect to ``wrt``.

  ``wrt`` is ``"input"`` (the input's cotangent), ``"weights"`` (the
  gradients of ``diff``) or ``"both"`` (``(gradients, cotangent)``).
  """
  loop, stage, diff = device.loop, device.stage, device.diff
  stages, repeats, micro = loop.stages, loop.pipeline.repeats, loop.pipeline.microbatches
  state, x_in = _take(carry["states"], slot), _take(carry["inputs"], slot)
  last = (stage == stages - 1) & (r == repeats - 1)
  cotangent = jax.tree_util.tree_map(
      lambda c: jnp.where(last, jnp.zeros_like(c), c), _take(carry["cotangents"], slot))
  seed = (cotangent, jnp.where(last, 1.0 / micro, 0.0).astype(loop.loss_shape.dtype))
  forward = functools.partial(_forward, device)
  if wrt == "input":
    _, pull, _ = jax.vjp(lambda x: forward(diff, state, x, m, r), x_in, has_aux=True)
    return pull(seed)[0]
  if wrt == "weights":
    _, pull, _ = jax.vjp(lambda d: forward(d, state, x_in, m, r), diff, has_aux=True)
    return pull(seed)[0]
  _, pull, _ = jax.vjp(lambda d, x: forward(d, state, x, m, r), diff, x_in,
                       has_aux=True)
  return pull(seed)


def _add_grads(carry: dict[str, Any], grads: PyTree) -> dict[str, Any]:
  return dict(carry, grads=jax.tree_util.tree_map(jnp.add, carry["grads"], grads))


def _tick(device: _Device, carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], None]:
  """Tick ``t``: the stage runs the table's op, then sends and receives.

  The carry holds the stage's buffers by slot (``inputs``, ``cotangents``,
  ``states``: what arrived, and the state each forward started from), its
  layers' ``state``, the ``grads`` and ``loss`` so far and its ``ys``.
  """
  loop, stage = device.loop, device.stage
  stages, repeats, axis, split = (loop.stages, loop.pipeline.repeats, loop.pipeline.axis,
                                  loop.split)
  cyclic = repeats > 1   # the last stage's chunk r feeds the first stage's r + 1
  fwd_shift = [(s, s + 1) for s in range(stages - 1)] + [(stages - 1, 0)] * cyclic
  bwd_shift = [(s + 1, s) for s in range(stages - 1)] + [(0, stages - 1)] * cyclic
  op, m, r, slot, get_x, get_dx = (a[t, stage] for a in device.table)
  # Every op kind runs every tick and the op picks one: a lax.switch
  # would skip the others, but stages would then take different
  # branches, and the collectives XLA puts inside them (a data axis's
  # sums) must be entered by every device.
  after_f, x1 = _forward_op(device, carry, m, r, slot)
  after = {_FORWARD: after_f}
  if split:   # B changes nothing held: it only sends the input's cotangent
    dx = _pull_back(device, carry, m, r, slot, "input")
    after[_WEIGHT_HALF] = _add_grads(carry, _pull_back(device, carry, m, r, slot, "weights"))
  else:
    grads, dx = _pull_back(device, carry, m, r, slot, "both")
    after[_BACKWARD] = _add_grads(carry, grads)
  new = carry
  for code, value in after.items():
    new = jax.tree_util.tree_map(functools.partial(jnp.where, op == code), value, new)
  sent_f = jax.tree_util.tree_map(lambda a: jnp.where(op == _FORWARD, a, 0), x1)
  sends_dx = op == (_INPUT_HALF if split else _BACKWARD)
  sent_b = jax.tree_util.tree_map(lambda a: jnp.where(sends_dx, a, 0), dx)
  got_f = jax.tree_util.tree_map(lambda a: lax.ppermute(a, axis, fwd_shift), sent_f)
  # One collective after the other on every device: run side by side,
  # devices could enter them in different orders and wait on each other.
  got_f, sent_b = lax.optimization_barrier((got_f, sent_b))
  got_b = jax.tree_util.tree_map(lambda a: lax.ppermute(a, axis, bwd_shift), sent_b)
  # What arrived goes into the slot the table gives it (-1: nothing came).
  for key, got, to in (("inputs", got_f, get_x), ("cotangents", got_b, get_dx)):
    at = jnp.maximum(to, 0)
    new[key] = _stages.put_tree(
        new[key], jax.tree_util.tree_map(lambda b, v: jnp.where(to >= 0, v, b[at]),
                                         new[key], got), at)
  return new, None
