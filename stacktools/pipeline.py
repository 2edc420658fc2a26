"""Pipeline parallelism over a stack's Layers axis: GPipe and circular schedules.

Under a mesh with a ``pipe`` axis of size P, a pipelined :class:`Stacked`
splits its layers into P stages, one per device along that axis, and the
batch into M microbatches that move from stage to stage with
``lax.ppermute``, inside one ``jax.shard_map`` that is manual over the pipe
axis alone (data and FSDP axes stay with the compiler).

* ``gpipe``: stage ``s`` holds layers ``[s*L/P, (s+1)*L/P)``; a microbatch
  passes each stage once.
* ``circular`` with ``repeats=R``: the layers are cut into ``R*P`` chunks of
  ``K = L/(R*P)`` and stage ``s`` holds chunks ``s, P+s, 2P+s, ...``; a
  microbatch loops over the stages R times, so the pipeline's fill and drain
  (its bubble) is shared by R times as much work.

Both run one schedule (:func:`schedule`): at tick ``t`` stage ``s`` works on
iteration ``j = t - s`` (repeat ``j // M``, microbatch ``j % M``) when
``0 <= j < R*M``. Stage 0 reads microbatch inputs from a buffer of all M;
what leaves the last stage goes back into that buffer (the input of the
microbatch's next repeat, or its output after the last), which is why a
circular schedule needs ``M >= P``. Every stage computes every tick (SPMD):
a tick outside the schedule is the bubble, computed and discarded.

The parameter tree stays the plain stack's (a leading ``num_layers`` axis),
so checkpoints move between pipelined and plain runs unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from stacktools import _checks
from stacktools import loops
from stacktools import policy as policy_lib

PyTree = Any

SCHEDULES = ("gpipe", "circular", "1f1b")


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """How a :class:`Stacked` runs its layers as a pipeline over a mesh axis.

  Example::

    class Block(hk.Module):
      def __call__(self, x):
        return x + jnp.tanh(hk.Linear(x.shape[-1])(x))

    def loss_fn(batch):
      blocks = st.Stacked(Block, num_layers=32, remat="full", name="h",
                          pipeline=st.Pipeline(axis="pipe", microbatches=8,
                                               schedule="circular", repeats=2))
      return jnp.mean(blocks.fold(batch) ** 2)

    loss_fn = hk.without_apply_rng(hk.transform(loss_fn))
    batch = jnp.ones((16, 8))
    params = loss_fn.init(jax.random.PRNGKey(0), batch)   # init: no mesh needed
    mesh = jax.make_mesh((4, 2), ("pipe", "data"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
      loss, grads = jax.jit(jax.value_and_grad(loss_fn.apply))(params, batch)

  With no mesh at all, or a ``pipe`` axis of size 1, the stack runs as a
  plain stack: one model definition serves both. A mesh that lacks the axis
  is an error (a misspelt axis would otherwise run unpipelined, silently).

  Attributes:
    axis: the mesh axis that holds the stages.
    microbatches: M, how many pieces the batch (the carry's leading axis) is
      cut into; each moves through the stages on its own.
    schedule: ``"gpipe"`` (one pass over contiguous stages) or
      ``"circular"`` (``repeats`` passes over interleaved stages).
    repeats: R, for ``circular``: how many chunks of layers each stage
      holds. ``gpipe`` takes 1.
    mesh: the mesh to pipeline over; by default the one set with
      ``jax.set_mesh`` when the step is traced.
  """

  axis: str = "pipe"
  microbatches: int = 1
  schedule: str = "gpipe"
  repeats: int = 1
  mesh: Optional[jax.sharding.Mesh] = None

  def __post_init__(self):
    if not isinstance(self.axis, str) or not self.axis:
      raise TypeError(f"st.Pipeline: axis must be a mesh axis name (a string, e.g. "
                      f"'pipe'), got {_checks.show(self.axis)}.")
    for field in ("microbatches", "repeats"):
      value = _checks.as_int(getattr(self, field))
      if value is None or value < 1:
        raise ValueError(f"st.Pipeline: {field} must be an integer >= 1, got "
                         f"{_checks.show(getattr(self, field))}.")
      object.__setattr__(self, field, value)
    if self.schedule not in SCHEDULES:
      raise ValueError(f"st.Pipeline: schedule={self.schedule!r} is not one of "
                       f"{list(SCHEDULES)}.")
    if self.schedule in ("gpipe", "1f1b") and self.repeats != 1:
      raise ValueError(
          f"st.Pipeline: schedule={self.schedule!r} passes each stage once, so repeats "
          f"must be 1, got {self.repeats}. For {self.repeats} passes over interleaved "
          "stages use schedule='circular'.")
    if self.mesh is not None and self.axis not in self.mesh.shape:
      raise ValueError(
          f"st.Pipeline: the mesh given has axes {list(self.mesh.shape)} and no "
          f"{self.axis!r} axis to place the stages on. Add one (e.g. "
          f"jax.make_mesh((4, 2), ({self.axis!r}, 'data'))) or pass axis= one of "
          "its axes.")

  def stages(self) -> int:
    """P: the size of the pipe axis in the mesh in use (1 with no mesh).

    Raises:
      ValueError: when the mesh in use has no axis named ``axis``. Only the
        absence of any mesh (init, a single-device run) means "no pipeline".
    """
    mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False):
      return 1
    names = list(mesh.axis_names)
    if self.axis not in names:
      raise ValueError(
          f"{_checks.where()}st.Pipeline(axis={self.axis!r}) names an axis that the "
          f"mesh in use lacks: its axes are {names}. Pass axis= one of them (the "
          "one that holds the stages), or add the axis to the mesh; only with no "
          "mesh at all does a pipelined stack run as a plain stack.")
    size = int(dict(mesh.shape)[self.axis])
    explicit = [n for n, t in zip(names, getattr(mesh, "axis_types", ()) or ())
                if t == jax.sharding.AxisType.Explicit]
    if size > 1 and explicit:
      raise ValueError(
          f"st.Pipeline: the mesh's axes {explicit} are Explicit (jax.make_mesh's "
          "default), which the pipeline's shard_map cannot regroup layers on. "
          "Build the mesh with Auto axes: jax.make_mesh(shape, names, "
          "axis_types=(jax.sharding.AxisType.Auto,) * len(names)), or "
          "jax.sharding.Mesh(devices, names).")
    return size

  def check(self, num_layers: int, stages: int) -> int:
    """Checks the stack's depth against the mesh; returns the layers per chunk."""
    chunks = stages * self.repeats
    if num_layers % chunks:
      fits = [p * self.repeats for p in range(1, num_layers + 1)
              if num_layers % (p * self.repeats) == 0]
      raise ValueError(
          f"{_checks.where()}num_layers={num_layers} cannot be split into {stages} stages "
          f"x {self.repeats} repeats = {chunks} equal chunks. Make num_layers a "
          f"multiple of {chunks}, or change the {self.axis!r} axis size or "
          f"repeats (with repeats={self.repeats}, stages x repeats may be "
          f"{fits}).")
    # Why each schedule needs a microbatch per stage at least.
    why = {"circular": "a microbatch must be back at the first stage before its next repeat",
           "1f1b": "its steady state runs one forward and one backward per stage"}
    if self.schedule in why and self.microbatches < stages:
      raise ValueError(
          f"{_checks.where()}a {self.schedule} schedule needs at least as many "
          f"microbatches as stages ({why[self.schedule]}), got "
          f"microbatches={self.microbatches} for {stages} stages. Use "
          f"microbatches >= {stages}, or schedule='gpipe'.")
    return num_layers // chunks

  def table(self, stages: int) -> "Schedule":
    """The tick-by-stage table this pipeline runs over ``stages`` stages.

    Example::

      assert np.isclose(st.Pipeline(microbatches=8).table(4).bubble, 3 / 11)
      assert np.isclose(st.Pipeline(microbatches=8, schedule="circular",
                                    repeats=2).table(4).bubble, 3 / 19)

    Args:
      stages: P, the size of the pipe axis.

    Returns:
      A :class:`Schedule` of ``[ticks, stages]`` arrays (see :func:`schedule`).
    """
    count = _checks.as_int(stages)
    if count is None or count < 1:
      raise ValueError(f"st.Pipeline.table: stages must be an int >= 1, got "
                       f"{_checks.show(stages)}.")
    if self.schedule == "1f1b":
      return one_f_one_b(count, self.microbatches)
    return schedule(count, self.microbatches, self.repeats)


# ---------------------------------------------------------------------------
# The schedule, as data: what every stage does at every tick.


class Schedule(NamedTuple):
  """Per ``[tick, stage]``: which microbatch and repeat, and whether any."""

  microbatch: np.ndarray   # int32 [T, P]; 0 where idle
  repeat: np.ndarray       # int32 [T, P]; 0 where idle
  busy: np.ndarray         # bool [T, P]
  backward: Optional[np.ndarray] = None   # bool [T, P]: a backward (1f1b only)

  @property
  def bubble(self) -> float:
    """The fraction of stage-ticks in which a stage holds no microbatch."""
    return float(1.0 - self.busy.mean())


def schedule(stages: int, microbatches: int, repeats: int = 1) -> Schedule:
  """The tick-by-stage table that the pipeline runs.

  At tick ``t`` stage ``s`` works on iteration ``j = t - s`` when
  ``0 <= j < repeats * microbatches``: repeat ``j // microbatches`` of
  microbatch ``j % microbatches``. There are ``repeats * microbatches +
  stages - 1`` ticks, so the bubble is ``(P-1) / (R*M + P-1)``.

  :meth:`Pipeline.table` is the public way in.

  Example::

    assert np.isclose(schedule(4, 8).bubble, 3 / 11)
    assert np.isclose(schedule(4, 8, repeats=2).bubble, 3 / 19)

  Args:
    stages: P, the pipe axis size.
    microbatches: M.
    repeats: R (1 for gpipe).

  Returns:
    A :class:`Schedule` of ``[ticks, stages]`` arrays.
  """
  ticks = repeats * microbatches + stages - 1
  j = np.arange(ticks)[:, None] - np.arange(stages)[None, :]
  busy = (j >= 0) & (j < repeats * microbatches)
  jj = np.where(busy, j, 0)
  return Schedule(microbatch=(jj % microbatches).astype(np.int32),
                  repeat=(jj // microbatches).astype(np.int32), busy=busy)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
  """The 1F1B table (Narayanan et al. 2021): forwards and backwards interleaved.

  A tick is one forward or one backward of one microbatch on one stage.
  Stage ``s`` runs a backward as soon as it can (its microbatch's backward
  has left stage ``s+1`` on an earlier tick; on the last stage, its forward
  has), otherwise the next forward if that microbatch has arrived and fewer
  than ``P - s`` microbatches are between their forward and backward there.
  That cap is what keeps activation memory flat in M: a stage holds the
  inputs of at most ``P`` microbatches. There are ``2 * (M + P - 1)`` ticks,
  so the bubble is ``(P-1) / (M+P-1)``, GPipe's.

  Example::

    table = one_f_one_b(4, 8)
    assert table.busy.shape == (22, 4)
    assert np.isclose(table.bubble, 3 / 11)

  Args:
    stages: P.
    microbatches: M.

  Returns:
    A :class:`Schedule` whose ``backward`` marks the backward ticks.
  """
  done_f, done_b = {}, {}   # (microbatch, stage) -> tick
  next_f, next_b = [0] * stages, [0] * stages
  rows, never = [], 1 << 30
  while min(next_b) < microbatches:
    t, row = len(rows), []
    for s in range(stages):
      mb, mf = next_b[s], next_f[s]
      last = s == stages - 1
      ready = done_f.get((mb, s), never) if last else done_b.get((mb, s + 1), never)
      if mb < mf and ready < t:
        row.append((2, mb))
      elif (mf < microbatches and (s == 0 or done_f.get((mf, s - 1), never) < t)
            and mf - mb < stages - s):
        row.append((1, mf))
      else:
        row.append((0, 0))
    for s, (op, m) in enumerate(row):
      if op == 1:
        done_f[(m, s)], next_f[s] = t, next_f[s] + 1
      elif op == 2:
        done_b[(m, s)], next_b[s] = t, next_b[s] + 1
    rows.append(row)
  ops = np.asarray([[op for op, _ in row] for row in rows], np.int32)
  micro = np.asarray([[m for _, m in row] for row in rows], np.int32)
  return Schedule(microbatch=micro, repeat=np.zeros_like(micro), busy=ops > 0,
                  backward=ops == 2)


# ---------------------------------------------------------------------------
# Layouts: the plain stack's Layers axis <-> [stage, repeat, layer-in-chunk].


def to_stages(tree: PyTree, stages: int, repeats: int) -> PyTree:
  """``[L, ...] -> [P, R, K, ...]``: stage ``s``, repeat ``r`` holds chunk ``r*P + s``."""
  def one(a):
    k = a.shape[0] // (stages * repeats)
    return jnp.swapaxes(a.reshape((repeats, stages, k) + a.shape[1:]), 0, 1)
  return jax.tree_util.tree_map(one, tree)


def from_stages(tree: PyTree) -> PyTree:
  """The inverse of :func:`to_stages`: ``[P, R, K, ...] -> [L, ...]``."""
  def one(a):
    a = jnp.swapaxes(a, 0, 1)
    return a.reshape((-1,) + a.shape[3:])
  return jax.tree_util.tree_map(one, tree)


def split_microbatches(tree: PyTree, microbatches: int) -> PyTree:
  """``[B, ...] -> [M, B/M, ...]``, microbatch ``m`` the rows ``m, m+M, ...``.

  Strided rather than contiguous: a batch sharded over a data axis in
  contiguous blocks keeps every microbatch sharded the same way, with no
  data movement (``B/M`` must divide by the data axis size).
  """
  def one(path, a):
    if a.ndim == 0 or a.shape[0] % microbatches:
      raise ValueError(
          f"{_checks.where()}the pipeline cuts the carry's leading (batch) axis into "
          f"{microbatches} microbatches, but {_checks.path_str('x', path)} has "
          f"shape {tuple(a.shape)}. Make the batch size a multiple of "
          f"microbatches={microbatches} (times the data axis size, when the batch "
          "is sharded), or change microbatches.")
    return jnp.swapaxes(a.reshape((a.shape[0] // microbatches, microbatches) + a.shape[1:]),
                        0, 1)
  return jax.tree_util.tree_map_with_path(one, tree)


def merge_microbatches(tree: PyTree, axis: int = 0) -> PyTree:
  """The inverse of :func:`split_microbatches`, for ``[..., M, B/M, ...]`` at ``axis``."""
  def one(a):
    a = jnp.swapaxes(a, axis, axis + 1)
    return a.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 2:])
  return jax.tree_util.tree_map(one, tree)


# ---------------------------------------------------------------------------
# The pipelined loop.


def _on_pipe(tree: PyTree, pipeline: Pipeline) -> PyTree:
  """Pins each leaf's leading (Layers) axis to the pipe axis, other axes free.

  The regrouping into stages is a reshape and a transpose; with the plain
  layout pinned on both sides, its gradient is regrouped back by the same
  all-to-all, instead of being gathered whole on every device.
  """
  def one(a):
    spec = PartitionSpec(pipeline.axis, *[PartitionSpec.UNCONSTRAINED] * (a.ndim - 1))
    target = (spec if pipeline.mesh is None
              else jax.sharding.NamedSharding(pipeline.mesh, spec))
    return lax.with_sharding_constraint(a, target)
  return jax.tree_util.tree_map(one, tree)


class StageLayers(NamedTuple):
  """What a pipelined stack's loop reads per layer (all ``[L, ...]``)."""

  params: PyTree
  state: PyTree
  rng: Optional[jax.Array]
  sliced: PyTree
  index: jax.Array


def _stage_chunk(body, make_slice, policy, unroll, x_in, local, state, repeat,
                 microbatch):
  """The K layers of chunk ``repeat`` on one microbatch, with the stack's policy.

  Each layer's parameters are picked from the stage's ``[R, K, ...]``
  arrays inside the layer's step, that is inside its checkpoint: the
  backward pass then keeps the stage's own parameters once (a loop
  invariant) rather than a copy of every chunk at every tick.
  """
  def layer_step(carry, xs):
    k, layer_state = xs
    pick = lambda a: a[repeat, k]  # noqa: E731
    rng = None
    if local.rng is not None:   # a fresh key per microbatch, the same on every stage
      rng = jax.random.fold_in(pick(local.rng), microbatch)
    layer = make_slice(jax.tree_util.tree_map(pick, local.params), layer_state, rng,
                       jax.tree_util.tree_map(pick, local.sliced), pick(local.index))
    return body(carry, layer)

  chunk_size = local.index.shape[1]
  return loops.loop(layer_step, x_in, (jnp.arange(chunk_size), state), chunk_size,
                    policy, unroll)


def run(body: Callable[[PyTree, Any], tuple[PyTree, Any]], x: PyTree,
        layers: StageLayers, make_slice: Callable[..., Any], *,
        pipeline: Pipeline, stages: int, policy: policy_lib.CheckpointPolicy,
        unroll: Any) -> tuple[PyTree, PyTree, PyTree]:
  """Runs ``body`` over every layer as a pipeline; returns ``(x, ys, state)``.

  Args:
    body: one layer, ``body(carry, layer_slice) -> (carry, (y, new_state))``.
    x: the carry, batch-major ``[B, ...]`` in every leaf.
    layers: every layer's params, state, apply key, per-layer arguments and
      index, each with a leading ``num_layers`` axis.
    make_slice: ``make_slice(params, state, rng, sliced, index)`` builds
      what ``body`` takes for one layer.
    pipeline: the configuration.
    stages: P (> 1).
    policy: the checkpoint policy of every layer.
    unroll: the stack's unroll, for each stage's scan over its layers.

  Returns:
    ``x`` after the last layer, the stacked ``ys`` (``[L, B, ...]``; ``None``
    for a fold) and the new per-layer state (``[L, ...]``).
  """
  micro, repeats = pipeline.microbatches, pipeline.repeats
  table = schedule(stages, micro, repeats)
  axis = pipeline.axis
  xs = split_microbatches(x, micro)
  staged = _on_pipe(to_stages(_on_pipe(layers, pipeline), stages, repeats), pipeline)
  shift = [(s, (s + 1) % stages) for s in range(stages)]

  def stage_chunk(x_in, local, state, repeat, microbatch):
    return _stage_chunk(body, make_slice, policy, unroll, x_in, local, state, repeat,
                        microbatch)

  def probe_ys():
    local = jax.tree_util.tree_map(lambda a: a[0], staged)
    x0 = jax.tree_util.tree_map(lambda a: a[0], xs)
    state = jax.tree_util.tree_map(lambda a: a[0], local.state)
    return jax.eval_shape(lambda l, s: stage_chunk(x0, l, s, 0, 0)[1][0], local, state)

  ys_shape = probe_ys()
  mb_size = jax.tree_util.tree_leaves(xs)[0].shape[1]
  for path, leaf in jax.tree_util.tree_flatten_with_path(ys_shape)[0]:
    # [K, mb, ...]: each layer's y must be per example to be put back together.
    if leaf.ndim < 2 or leaf.shape[1] != mb_size:
      raise ValueError(
          f"{_checks.where()}under a pipeline each layer's output y is computed per "
          f"microbatch and put back together along the batch axis, so every leaf "
          f"must have the batch as its leading axis; "
          f"{_checks.path_str('y', path)} has per-layer shape {tuple(leaf.shape[1:])} "
          f"for a microbatch of {mb_size}. Return per-example values (e.g. a "
          "loss per example, reduced after the stack), or run without a pipeline.")

  def per_device(xs, staged, micro_idx, repeat_idx, busy):
    stage = lax.axis_index(axis)
    local = jax.tree_util.tree_map(lambda a: a[0], staged)   # [R, K, ...]
    zeros_like = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)  # noqa: E731
    ys_buf = jax.tree_util.tree_map(
        lambda s: jnp.zeros((repeats,) + s.shape[:1] + (micro,) + s.shape[1:], s.dtype),
        ys_shape)

    def tick(carry, t):
      buf, incoming, state, ys_buf = carry
      m, r, ok = micro_idx[t, stage], repeat_idx[t, stage], busy[t, stage]
      first = jax.tree_util.tree_map(lambda b: b[m], buf)
      x_in = jax.tree_util.tree_map(lambda a, b: jnp.where(stage == 0, a, b),
                                    first, incoming)
      x_out, results = stage_chunk(
          x_in, local, jax.tree_util.tree_map(lambda a: a[r], state), r, m)
      ys, new_state = results[0], results[1]   # a stage refuses in-place writes
      state = jax.tree_util.tree_map(
          lambda old, new: old.at[r].set(jnp.where(ok, new, old[r])), state, new_state)
      ys_buf = jax.tree_util.tree_map(
          lambda b, y: b.at[r, :, m].set(jnp.where(ok, y, b[r, :, m])), ys_buf, ys)
      sent = jax.tree_util.tree_map(lambda a: lax.ppermute(a, axis, shift), x_out)
      # What the last stage finished this tick arrives at stage 0: the input
      # of its microbatch's next repeat, or its output after the last.
      m_last, ok_last = micro_idx[t, stages - 1], busy[t, stages - 1]
      keep = ok_last & (stage == 0)
      buf = jax.tree_util.tree_map(
          lambda b, v: b.at[m_last].set(jnp.where(keep, v, b[m_last])), buf, sent)
      return (buf, sent, state, ys_buf), None

    init = (xs, zeros_like(jax.tree_util.tree_map(lambda a: a[0], xs)), local.state,
            ys_buf)
    (buf, _, state, ys_buf), _ = lax.scan(tick, init, jnp.arange(micro_idx.shape[0]))
    # Only stage 0's buffer holds the outputs; the sum hands them to every stage.
    out = jax.tree_util.tree_map(
        lambda b: lax.psum(jnp.where(stage == 0, b, jnp.zeros_like(b)), axis), buf)
    expand = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)  # noqa: E731
    return out, expand(state), expand(ys_buf)

  spec = PartitionSpec(axis)
  # check_vma=False: the tick loop's carries start the same on every stage
  # (zeros, the whole buffer) and vary by stage once a ppermute has run, a
  # change of type that the check would refuse in a scan carry; the outputs
  # are made equal across stages by the psum, or are per stage by their spec.
  mapped = jax.shard_map(
      per_device, mesh=pipeline.mesh,
      in_specs=(PartitionSpec(), spec, PartitionSpec(), PartitionSpec(), PartitionSpec()),
      out_specs=(PartitionSpec(), spec, spec), axis_names=frozenset({axis}),
      check_vma=False)
  out, state, ys = mapped(xs, staged, jnp.asarray(table.microbatch),
                          jnp.asarray(table.repeat), jnp.asarray(table.busy))
  new_x = merge_microbatches(out)
  new_state = from_stages(state)
  # [P, R, K, M, mb, ...] -> [L, M, mb, ...] -> [L, B, ...]
  ys = merge_microbatches(from_stages(ys), axis=1) if ys_shape is not None else None
  return new_x, ys, new_state


# ---------------------------------------------------------------------------
# 1F1B: forward and backward in one loop, the loss inside it.


class Ends(NamedTuple):
  """The parts around a stack that a 1F1B pipeline runs per microbatch.

  ``embed(embed_params, inputs) -> x`` runs on the first stage and
  ``head(head_params, x, targets) -> loss`` (a scalar: the microbatch's mean)
  on the last; both are pure. ``broadcast`` holds the block's broadcast
  arguments and ``with_broadcast(values)`` a context in which the block
  sees ``values`` instead, so that their gradients come out too.
  """

  embed: Callable[..., PyTree]
  head: Callable[..., jax.Array]
  embed_params: PyTree
  head_params: PyTree
  inputs: PyTree
  targets: PyTree
  broadcast: PyTree
  with_broadcast: Callable[[PyTree], Any]


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


def run_1f1b(body: Callable[[PyTree, Any], tuple[PyTree, Any]], layers: StageLayers,
             make_slice: Callable[..., Any], ends: Ends, *, pipeline: Pipeline,
             stages: int, policy: policy_lib.CheckpointPolicy, unroll: Any
             ) -> tuple[jax.Array, PyTree, PyTree]:
  """Runs embed, the layers and head as a 1F1B pipeline; ``(loss, ys, state)``.

  One ``shard_map`` over the pipe axis runs a ``lax.scan`` over the ticks of
  :func:`one_f_one_b`. At each tick a stage looks up its op and switches:

  * forward of microbatch ``m``: its layers (after ``embed`` on the first
    stage) on the input that arrived for ``m``; on the last stage ``head``
    gives ``m``'s loss. The input and the layers' state stay in slot
    ``m % P`` of the stage's buffers, the output goes to the next stage.
  * backward of ``m``: ``jax.vjp`` of the same function at slot ``m % P``
    (so it recomputes the forward, each layer with the stack's checkpoint
    policy), pulled back from the cotangent the next stage sent (on the last
    stage, from ``1/M`` on the loss); the gradients add up and the input's
    cotangent goes to the previous stage.

  Two ``ppermute`` per tick carry activations forward and cotangents back.
  The schedule keeps at most ``P - s`` microbatches between forward and
  backward on stage ``s``, so ``P`` slots suffice whatever M is.

  Returns:
    The mean of the microbatches' losses, carrying the gradients of the
    layers' parameters and per-layer arguments, the broadcast arguments and
    ``embed``'s and ``head``'s parameters (see :func:`with_gradients`); each
    layer's ``y`` (``[L, B, ...]``, no gradient; ``None`` for a fold) and the
    new per-layer state.
  """
  micro, axis = pipeline.microbatches, pipeline.axis
  table = one_f_one_b(stages, micro)
  ops = np.where(table.backward, 2, table.busy.astype(np.int32)).astype(np.int32)
  inputs = split_microbatches(ends.inputs, micro)
  targets = split_microbatches(ends.targets, micro)
  staged = _on_pipe(to_stages(_on_pipe(layers, pipeline), stages, 1), pipeline)
  take = lambda tree, i: jax.tree_util.tree_map(lambda a: a[i], tree)  # noqa: E731
  zeros_like = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)  # noqa: E731
  # What has a gradient: layer params, per-layer args, embed's and head's
  # params, broadcast args (their float leaves).
  outer = (layers.params, layers.sliced, ends.embed_params, ends.head_params,
           ends.broadcast)
  x_shape = jax.eval_shape(ends.embed, ends.embed_params, take(inputs, 0))
  loss_shape = jax.eval_shape(ends.head, ends.head_params, x_shape, take(targets, 0))
  if loss_shape.shape != ():
    raise ValueError(
        f"{_checks.where()}a 1f1b pipeline's head must return one number per "
        f"microbatch (its mean loss), got shape {tuple(loss_shape.shape)}.")

  def per_device(inputs, targets, staged, embed_params, head_params, broadcast, ops,
                 micro_idx):
    stage = lax.axis_index(axis)
    first, last = stage == 0, stage == stages - 1
    local = take(staged, 0)   # [1, K, ...]
    diff, rebuild = _split((local.params, local.sliced, embed_params, head_params,
                            broadcast))

    def forward(diff, state, x_in, m):
      params, sliced, e_params, h_params, bcast = rebuild(diff)
      x0 = jax.tree_util.tree_map(functools.partial(jnp.where, first),
                                  ends.embed(e_params, take(inputs, m)), x_in)
      with ends.with_broadcast(bcast):
        x1, results = _stage_chunk(body, make_slice, policy, unroll, x0,
                                   local._replace(params=params, sliced=sliced),
                                   state, 0, m)
      loss = jnp.where(last, ends.head(h_params, x1, take(targets, m)), 0)
      return (x1, loss), (results[0], results[1])

    state0 = take(local.state, 0)
    ys_shape = jax.eval_shape(
        lambda d, s, x: forward(d, s, x, 0)[1][0], diff, state0, x_shape)
    x_zero = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), x_shape)
    slots = lambda t: jax.tree_util.tree_map(  # noqa: E731
        lambda a: jnp.zeros((stages,) + a.shape, a.dtype), t)

    def fwd_op(carry, m):
      slot = m % stages
      (x1, loss), (ys, new_state) = forward(diff, carry["state"],
                                            take(carry["inputs"], slot), m)
      carry = dict(carry, state=new_state, loss=carry["loss"] + loss / micro,
                   states=jax.tree_util.tree_map(lambda b, v: b.at[slot].set(v),
                                                 carry["states"], carry["state"]))
      if ys is not None:
        carry["ys"] = jax.tree_util.tree_map(lambda b, y: b.at[:, m].set(y),
                                             carry["ys"], ys)
      return carry, x1, x_zero

    def bwd_op(carry, m):
      slot = m % stages
      state, x_in = take(carry["states"], slot), take(carry["inputs"], slot)
      (_, loss), pull, _ = jax.vjp(lambda d, x: forward(d, state, x, m), diff, x_in,
                                   has_aux=True)
      cotangent = jax.tree_util.tree_map(
          lambda c: jnp.where(last, jnp.zeros_like(c), c), take(carry["cotangents"], slot))
      grads, dx = pull((cotangent, jnp.where(last, 1.0 / micro, 0.0).astype(loss.dtype)))
      carry = dict(carry, grads=jax.tree_util.tree_map(jnp.add, carry["grads"], grads))
      return carry, x_zero, dx

    fwd_shift = [(s, s + 1) for s in range(stages - 1)]
    bwd_shift = [(s + 1, s) for s in range(stages - 1)]

    def tick(carry, t):
      m, op = micro_idx[t, stage], ops[t, stage]
      # Both slots run every tick and the op picks one: a lax.switch would
      # skip the other, but stages would then take different branches, and
      # the collectives XLA puts inside them (a data axis's sums) must be
      # entered by every device.
      after_f, x1, _ = fwd_op(carry, m)
      after_b, _, dx = bwd_op(carry, m)
      carry = jax.tree_util.tree_map(
          lambda f, b, c: jnp.where(op == 1, f, jnp.where(op == 2, b, c)),
          after_f, after_b, carry)
      sent_f = jax.tree_util.tree_map(lambda a: jnp.where(op == 1, a, 0), x1)
      sent_b = jax.tree_util.tree_map(lambda a: jnp.where(op == 2, a, 0), dx)
      got_f = jax.tree_util.tree_map(lambda a: lax.ppermute(a, axis, fwd_shift), sent_f)
      # One collective after the other on every device: run side by side,
      # devices could enter them in different orders and wait on each other.
      got_f, sent_b = lax.optimization_barrier((got_f, sent_b))
      got_b = jax.tree_util.tree_map(lambda a: lax.ppermute(a, axis, bwd_shift), sent_b)
      # What arrived goes into the slot of its microbatch: an input from the
      # previous stage's forward, a cotangent from the next stage's backward.
      prev, nxt = jnp.maximum(stage - 1, 0), jnp.minimum(stage + 1, stages - 1)
      for key, got, peer, op, ok in (("inputs", got_f, prev, 1, stage > 0),
                                     ("cotangents", got_b, nxt, 2, stage < stages - 1)):
        keep = ok & (ops[t, peer] == op)
        slot = micro_idx[t, peer] % stages
        carry[key] = jax.tree_util.tree_map(
            lambda b, v: b.at[slot].set(jnp.where(keep, v, b[slot])), carry[key], got)
      return carry, None

    carry = {"inputs": slots(x_zero), "cotangents": slots(x_zero), "states": slots(state0),
             "state": state0, "grads": zeros_like(diff),
             "loss": jnp.zeros((), loss_shape.dtype),
             "ys": jax.tree_util.tree_map(
                 lambda s: jnp.zeros(s.shape[:1] + (micro,) + s.shape[1:], s.dtype),
                 ys_shape)}
    carry, _ = lax.scan(tick, carry, jnp.arange(ops.shape[0]))
    params_g, sliced_g, embed_g, head_g, bcast_g = rebuild(carry["grads"])
    # Only the first stage has embed's gradient, the last head's and the
    # loss; every stage adds to the broadcast arguments'.
    shared = lax.psum((carry["loss"], embed_g, head_g, bcast_g), axis)
    expand = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)  # noqa: E731
    # Per stage: [1, 1, K, ...], the [P, R, K, ...] layout of to_stages.
    return (shared, expand((params_g, sliced_g)), expand(expand(carry["ys"])),
            expand(expand(carry["state"])))

  spec, whole = PartitionSpec(axis), PartitionSpec()
  # check_vma=False: as in run(), the buffers start equal on every stage
  # and vary by stage once a ppermute has filled them.
  mapped = jax.shard_map(
      per_device, mesh=pipeline.mesh,
      in_specs=(whole, whole, spec, whole, whole, whole, whole, whole),
      out_specs=(whole, spec, spec, spec), axis_names=frozenset({axis}),
      check_vma=False)
  # The loop computes its own gradients (with_gradients below adds them):
  # cut its inputs off from an outer jax.grad, which would otherwise
  # linearize the whole loop only to drop the result.
  (loss, embed_g, head_g, bcast_g), (params_g, sliced_g), ys, state = mapped(
      *lax.stop_gradient((inputs, targets, staged, ends.embed_params, ends.head_params,
                          ends.broadcast)),
      jnp.asarray(ops), jnp.asarray(table.microbatch))
  grads = (from_stages(params_g), from_stages(sliced_g), embed_g, head_g, bcast_g)
  loss = with_gradients(loss, list(zip(outer, grads)))
  # [P, 1, K, M, mb, ...] -> [L, M, mb, ...] -> [L, B, ...]
  if ys is not None:
    ys = lax.stop_gradient(merge_microbatches(from_stages(ys), axis=1))
  return loss, ys, from_stages(state)
