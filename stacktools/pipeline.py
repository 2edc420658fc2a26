"""Pipeline parallelism over a stack's Layers axis: GPipe, circular, 1F1B, ZB-H1.

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

The ``1f1b``, ``interleaved`` (1F1B over circular's chunks) and ``zb``
(ZB-H1) schedules run each microbatch's backward inside the same loop, as
soon as its forward has left the last stage, so a stage holds a bounded
number of microbatches whatever M is; the loss is computed inside, and the
loop returns it with its gradients (:func:`run_with_loss`). Their tables
(:func:`one_f_one_b`, :func:`zero_bubble`) are data too.

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

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved", "zb")
# The schedules that run the backward in their own loop, the loss inside it.
LOSS_SCHEDULES = ("1f1b", "interleaved", "zb")


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
    schedule: ``"gpipe"`` (one pass over contiguous stages),
      ``"circular"`` (``repeats`` passes over interleaved stages), or one
      that computes the loss inside the pipeline (call the stack with
      ``loss``/``scan_loss``): ``"1f1b"`` (gpipe's stages, each
      microbatch's backward as soon as it can), ``"interleaved"`` (1F1B
      over circular's chunks; M a multiple of P) or ``"zb"`` (ZB-H1: 1F1B
      with the weight gradients put off to fill the bubble).
    repeats: R, for ``circular`` and ``interleaved``: how many chunks of
      layers each stage holds. The others take 1.
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
    if self.schedule in ("gpipe", "1f1b", "zb") and self.repeats != 1:
      chunked = "'interleaved'" if self.schedule in LOSS_SCHEDULES else "'circular'"
      raise ValueError(
          f"st.Pipeline: schedule={self.schedule!r} passes each stage once, so repeats "
          f"must be 1, got {self.repeats}. For {self.repeats} passes over interleaved "
          f"stages use schedule={chunked}.")
    if self.mesh is not None and self.axis not in self.mesh.shape:
      raise ValueError(
          f"st.Pipeline: the mesh given has axes {list(self.mesh.shape)} and no "
          f"{self.axis!r} axis to place the stages on. Add one (e.g. "
          f"jax.make_mesh((4, 2), ({self.axis!r}, 'data'))) or pass axis= one of "
          "its axes.")

  @property
  def computes_loss(self) -> bool:
    """Whether the schedule runs the backward itself, the loss inside its loop
    (the stack must then be called with ``loss`` or ``scan_loss``)."""
    return self.schedule in LOSS_SCHEDULES

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
    self._check_microbatches(stages)
    return num_layers // chunks

  def _check_microbatches(self, stages: int) -> None:
    # Why each schedule needs a microbatch per stage at least.
    why = {"circular": "a microbatch must be back at the first stage before its next repeat",
           "1f1b": "its steady state runs one forward and one backward per stage",
           "interleaved": "microbatches enter in groups of one per stage",
           "zb": "its steady state runs one forward and one backward per stage"}
    if self.schedule in why and self.microbatches < stages:
      raise ValueError(
          f"{_checks.where()}a {self.schedule} schedule needs at least as many "
          f"microbatches as stages ({why[self.schedule]}), got "
          f"microbatches={self.microbatches} for {stages} stages. Use "
          f"microbatches >= {stages}, or schedule='gpipe'.")
    if self.schedule == "interleaved" and self.repeats > 1 and self.microbatches % stages:
      raise ValueError(
          f"{_checks.where()}an interleaved schedule sends microbatches through each "
          f"chunk in groups of one per stage, so microbatches must be a multiple of "
          f"the {stages} stages, got microbatches={self.microbatches}. Use "
          f"microbatches={stages * (self.microbatches // stages)} or "
          f"{stages * (self.microbatches // stages + 1)}, or schedule='1f1b'.")

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
    if self.computes_loss:
      self._check_microbatches(count)
    if self.schedule in ("1f1b", "interleaved"):
      return one_f_one_b(count, self.microbatches, self.repeats)
    if self.schedule == "zb":
      return zero_bubble(count, self.microbatches)
    return schedule(count, self.microbatches, self.repeats)


# ---------------------------------------------------------------------------
# The schedule, as data: what every stage does at every tick.


class Schedule(NamedTuple):
  """Per ``[tick, stage]``: which microbatch and repeat, and whether any.

  The schedules that compute the loss inside the pipeline (``1f1b``,
  ``interleaved``, ``zb``) also say which ticks run a backward, which a
  weight-gradient half (``zb``), and where each stage keeps what it holds
  between a microbatch's forward and its backward: ``slot`` is the buffer
  slot the tick's op reads, ``receive_input`` and ``receive_cotangent`` the
  slot that what arrives after the tick goes into (-1: nothing arrives).
  """

  microbatch: np.ndarray   # int32 [T, P]; 0 where idle
  repeat: np.ndarray       # int32 [T, P]; 0 where idle
  busy: np.ndarray         # bool [T, P]
  backward: Optional[np.ndarray] = None   # bool [T, P]: a backward (its input half under zb)
  weight: Optional[np.ndarray] = None     # bool [T, P]: a weight-gradient half (zb only)
  slot: Optional[np.ndarray] = None               # int32 [T, P]
  receive_input: Optional[np.ndarray] = None      # int32 [T, P]
  receive_cotangent: Optional[np.ndarray] = None  # int32 [T, P]

  @property
  def bubble(self) -> float:
    """The fraction of stage-ticks in which a stage holds no microbatch."""
    return float(1.0 - self.busy.mean())

  @property
  def slots(self) -> int:
    """How many microbatch slots a stage's buffers need (0 without a backward)."""
    return 0 if self.slot is None else int(self.slot.max()) + 1


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


# An op of a loss-computing schedule: (kind, microbatch, chunk). A chunk is
# one of the stage's R pieces of layers: virtual stage v = chunk * P + stage.
_F, _B, _W = "F", "B", "W"


def _megatron_order(k: int, stages: int, repeats: int, backward: bool) -> tuple[int, int]:
  """The k-th forward (or backward) of a stage: microbatches in groups of P,
  each group through every chunk in turn (backwards: the chunks reversed)."""
  group, within = divmod(k, stages * repeats)
  chunk = within // stages
  return group * stages + within % stages, (repeats - 1 - chunk) if backward else chunk


def one_f_one_b(stages: int, microbatches: int, repeats: int = 1) -> Schedule:
  """The 1F1B table (Narayanan et al. 2021), interleaved when ``repeats > 1``.

  A tick is one forward or one backward of one microbatch through one chunk
  of a stage's layers. Stage ``s`` first runs ``P - s - 1`` forwards
  (interleaved: ``2 (P - s - 1) + (R - 1) P``), then a forward and a
  backward in turn, then the backwards left; each op waits for what it
  needs from the neighbouring stage. Interleaved, stage ``s`` holds chunks
  ``s, P + s, ...`` (as ``circular``), and microbatches enter in groups of
  P, so M must be a multiple of P. A stage holds at most ``P - s`` inputs
  between forward and backward (interleaved: its warm-up count plus one
  chunk inputs), whatever M is. There are ``2 (R M + P - 1)`` ticks, so the
  bubble is ``(P-1) / (R M + P-1)``, the same share as gpipe's
  (``repeats=1``) or circular's.

  Example::

    table = one_f_one_b(4, 8)
    assert table.busy.shape == (22, 4)
    assert np.isclose(table.bubble, 3 / 11)
    assert np.isclose(one_f_one_b(4, 8, repeats=2).bubble, 3 / 19)

  Args:
    stages: P.
    microbatches: M.
    repeats: R, chunks per stage (virtual stages per device).

  Returns:
    A :class:`Schedule` whose ``backward`` marks the backward ticks.
  """
  total = microbatches * repeats
  ops = []
  for s in range(stages):
    warm = stages - s - 1 if repeats == 1 else 2 * (stages - s - 1) + (repeats - 1) * stages
    warm = min(warm, total)
    order = lambda k, back: _megatron_order(k, stages, repeats, back)  # noqa: E731
    seq = [(_F, *order(k, False)) for k in range(warm)]
    for k in range(total - warm):
      seq += [(_F, *order(warm + k, False)), (_B, *order(k, True))]
    seq += [(_B, *order(k, True)) for k in range(total - warm, total)]
    ops.append(seq)
  return _lockstep(ops, stages, repeats)


def zero_bubble(stages: int, microbatches: int) -> Schedule:
  """The ZB-H1 table (Qi et al. 2024): 1F1B with each backward cut in two.

  ``B`` (a ``backward`` tick) computes only the input's gradient, which the
  previous stage waits for; ``W`` (a ``weight`` tick) the parameters'
  gradient, which nobody waits for. Stage ``s`` runs 1F1B's ``P - s``
  warm-up forwards, then ``B``, ``W``, ``F`` in turn, holding back ``s``
  of its ``W`` s to fill the ticks in which the last backwards are on their
  way; at most ``P`` microbatches are between forward and ``W`` on any
  stage, 1F1B's peak. With a tick per F, B or W there are ``3 M + P - 1``
  ticks, so the bubble is ``(P-1) / (3 M + P-1)``; 1F1B's, on the same
  ticks (its backward being B and W), is ``3 (P-1) / (3 M + 3 (P-1))``.

  Example::

    table = zero_bubble(4, 8)
    assert table.busy.shape == (27, 4)
    assert np.isclose(table.bubble, 3 / 27)

  Args:
    stages: P.
    microbatches: M.

  Returns:
    A :class:`Schedule` whose ``backward`` marks the B ticks and ``weight``
    the W ticks.
  """
  ops = []
  for s in range(stages):
    warm = min(stages - s, microbatches)
    seq = [(_F, m, 0) for m in range(warm)]
    done_b = done_w = 0
    for m in range(warm, microbatches + stages - s):
      seq.append((_B, done_b, 0))
      done_b += 1
      if done_b - done_w > s:
        seq.append((_W, done_w, 0))
        done_w += 1
      if m < microbatches:
        seq.append((_F, m, 0))
    seq += [(_B, m, 0) for m in range(done_b, microbatches)]
    seq += [(_W, m, 0) for m in range(done_w, microbatches)]
    ops.append(seq)
  return _lockstep(ops, stages, 1)


def _lockstep(ops: list[list[tuple[str, int, int]]], stages: int,
              repeats: int) -> Schedule:
  """Runs each stage's ops in order, one per tick, each as soon as what it
  needs has arrived (a forward: the previous virtual stage's forward of its
  microbatch; a backward: the next one's backward, or on the last virtual
  stage its own forward; ``W``: its own ``B``); then gives every held input
  a buffer slot, reused once its last op has read it."""
  last_v = stages * repeats - 1
  done: dict[tuple[str, int, int], int] = {}   # (kind, microbatch, virtual stage) -> tick
  position, rows = [0] * stages, []
  needs = {_F: lambda m, v: (_F, m, v - 1) if v else None,
           _B: lambda m, v: (_F, m, v) if v == last_v else (_B, m, v + 1),
           _W: lambda m, v: (_B, m, v)}
  while any(p < len(seq) for p, seq in zip(position, ops)):
    t, row = len(rows), []
    for s in range(stages):
      op = ops[s][position[s]] if position[s] < len(ops[s]) else None
      if op is not None:
        kind, m, chunk = op
        need = needs[kind](m, chunk * stages + s)
        if need is not None and done.get(need, t) >= t:
          op = None   # not arrived yet: idle this tick
      row.append(op)
    for s, op in enumerate(row):
      if op is not None:
        done[(op[0], op[1], op[2] * stages + s)] = t
        position[s] += 1
    rows.append(row)
    # Every op waits on one made earlier, so some stage moves at least every
    # few ticks; a table this long means the ops above deadlock (a bug here).
    assert len(rows) <= 4 * sum(map(len, ops)) + 4, "pipeline schedule deadlocked"
  ticks = len(rows)
  table = {name: np.zeros((ticks, stages), np.int32)
           for name in ("microbatch", "repeat", "slot")}
  kinds = np.full((ticks, stages), "", object)
  receive = {_F: np.full((ticks, stages), -1, np.int32),
             _B: np.full((ticks, stages), -1, np.int32)}
  # Slots: stage s holds microbatch m's input to chunk r from its arrival
  # (the previous virtual stage's forward; on the first, its own forward)
  # to its last use (W if there is one, else B).
  split = any(op[0] == _W for seq in ops for op in seq)
  slot_of = {}
  for s in range(stages):
    spans = []
    for kind, m, chunk in ops[s]:
      if kind == _F:
        v = chunk * stages + s
        start = done[(_F, m, v - 1)] if v else done[(_F, m, v)]
        spans.append((start, done[(_W if split else _B, m, v)], m, chunk))
    free_after = []   # per slot: the tick of its last use
    for start, end, m, chunk in sorted(spans):
      slot = next((i for i, e in enumerate(free_after) if e <= start), len(free_after))
      free_after[slot:slot + 1] = [end]
      slot_of[(s, m, chunk)] = slot
  for t, row in enumerate(rows):
    for s, op in enumerate(row):
      if op is None:
        continue
      kind, m, chunk = op
      kinds[t, s] = kind
      table["microbatch"][t, s], table["repeat"][t, s] = m, chunk
      table["slot"][t, s] = slot_of[(s, m, chunk)]
      v = chunk * stages + s
      to = v + 1 if kind == _F else v - 1   # where its result goes
      if kind != _W and 0 <= to <= last_v:
        receive[kind][t, to % stages] = slot_of[(to % stages, m, to // stages)]
  return Schedule(microbatch=table["microbatch"], repeat=table["repeat"],
                  busy=kinds != "", backward=kinds == _B,
                  weight=(kinds == _W) if split else None, slot=table["slot"],
                  receive_input=receive[_F], receive_cotangent=receive[_B])


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


def run_with_loss(body: Callable[[PyTree, Any], tuple[PyTree, Any]], layers: StageLayers,
                  make_slice: Callable[..., Any], ends: Ends, *, pipeline: Pipeline,
                  stages: int, policy: policy_lib.CheckpointPolicy, unroll: Any
                  ) -> tuple[jax.Array, PyTree, PyTree]:
  """Runs embed, the layers and head as a 1F1B-family pipeline; ``(loss, ys, state)``.

  One ``shard_map`` over the pipe axis runs a ``lax.scan`` over the ticks of
  the pipeline's table (:func:`one_f_one_b`, :func:`zero_bubble`). At each
  tick a stage looks up its op, microbatch ``m`` and chunk ``r``:

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

  Returns:
    The mean of the microbatches' losses, carrying the gradients of the
    layers' parameters and per-layer arguments, the broadcast arguments and
    ``embed``'s and ``head``'s parameters (see :func:`with_gradients`); each
    layer's ``y`` (``[L, B, ...]``, no gradient; ``None`` for a fold) and the
    new per-layer state.
  """
  micro, axis, repeats = pipeline.microbatches, pipeline.axis, pipeline.repeats
  table = pipeline.table(stages)
  split = table.weight is not None
  # 1: forward; 2: backward (both halves); 3: its input half; 4: its weight half.
  ops = np.where(table.backward, 3 if split else 2, table.busy.astype(np.int32))
  if split:
    ops = np.where(table.weight, 4, ops)
  ops = ops.astype(np.int32)
  num_slots = table.slots
  inputs = split_microbatches(ends.inputs, micro)
  targets = split_microbatches(ends.targets, micro)
  staged = _on_pipe(to_stages(_on_pipe(layers, pipeline), stages, repeats), pipeline)
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
        f"{_checks.where()}a {pipeline.schedule} pipeline's head must return one number "
        f"per microbatch (its mean loss), got shape {tuple(loss_shape.shape)}.")

  def per_device(inputs, targets, staged, embed_params, head_params, broadcast, table):
    stage = lax.axis_index(axis)
    local = take(staged, 0)   # [R, K, ...]
    diff, rebuild = _split((local.params, local.sliced, embed_params, head_params,
                            broadcast))

    def forward(diff, state, x_in, m, r):
      params, sliced, e_params, h_params, bcast = rebuild(diff)
      first = (stage == 0) & (r == 0)
      x0 = jax.tree_util.tree_map(functools.partial(jnp.where, first),
                                  ends.embed(e_params, take(inputs, m)), x_in)
      with ends.with_broadcast(bcast):
        x1, results = _stage_chunk(body, make_slice, policy, unroll, x0,
                                   local._replace(params=params, sliced=sliced),
                                   state, r, m)
      last = (stage == stages - 1) & (r == repeats - 1)
      loss = jnp.where(last, ends.head(h_params, x1, take(targets, m)), 0)
      return (x1, loss), (results[0], results[1])

    state0 = take(local.state, 0)
    ys_shape = jax.eval_shape(
        lambda d, s, x: forward(d, s, x, 0, 0)[1][0], diff, state0, x_shape)
    x_zero = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), x_shape)
    slots = lambda t: jax.tree_util.tree_map(  # noqa: E731
        lambda a: jnp.zeros((num_slots,) + a.shape, a.dtype), t)

    def fwd_op(carry, m, r, slot):
      state = take(carry["state"], r)
      (x1, loss), (ys, new_state) = forward(diff, state, take(carry["inputs"], slot), m, r)
      carry = dict(carry, loss=carry["loss"] + loss / micro,
                   state=jax.tree_util.tree_map(lambda b, v: b.at[r].set(v),
                                                carry["state"], new_state),
                   states=jax.tree_util.tree_map(lambda b, v: b.at[slot].set(v),
                                                 carry["states"], state))
      if ys is not None:
        carry["ys"] = jax.tree_util.tree_map(lambda b, y: b.at[r, :, m].set(y),
                                             carry["ys"], ys)
      return carry, x1

    def pull_back(carry, m, r, slot, wrt):
      """The vjp of chunk r's forward at ``slot``, with respect to ``wrt``."""
      state, x_in = take(carry["states"], slot), take(carry["inputs"], slot)
      last = (stage == stages - 1) & (r == repeats - 1)
      cotangent = jax.tree_util.tree_map(
          lambda c: jnp.where(last, jnp.zeros_like(c), c), take(carry["cotangents"], slot))
      seed = (cotangent, jnp.where(last, 1.0 / micro, 0.0).astype(loss_shape.dtype))
      if wrt == "input":
        _, pull, _ = jax.vjp(lambda x: forward(diff, state, x, m, r), x_in, has_aux=True)
        return pull(seed)[0]
      if wrt == "weights":
        _, pull, _ = jax.vjp(lambda d: forward(d, state, x_in, m, r), diff, has_aux=True)
        return pull(seed)[0]
      _, pull, _ = jax.vjp(lambda d, x: forward(d, state, x, m, r), diff, x_in,
                           has_aux=True)
      return pull(seed)

    def add_grads(carry, grads):
      return dict(carry, grads=jax.tree_util.tree_map(jnp.add, carry["grads"], grads))

    cyclic = repeats > 1   # the last stage's chunk r feeds the first stage's r + 1
    fwd_shift = [(s, s + 1) for s in range(stages - 1)] + [(stages - 1, 0)] * cyclic
    bwd_shift = [(s + 1, s) for s in range(stages - 1)] + [(0, stages - 1)] * cyclic

    def tick(carry, t):
      op, m, r, slot, get_x, get_dx = (a[t, stage] for a in table)
      # Every op kind runs every tick and the op picks one: a lax.switch
      # would skip the others, but stages would then take different
      # branches, and the collectives XLA puts inside them (a data axis's
      # sums) must be entered by every device.
      after_f, x1 = fwd_op(carry, m, r, slot)
      after = {1: after_f}
      if split:   # B (3) changes nothing held: it only sends the input's cotangent
        dx = pull_back(carry, m, r, slot, "input")
        after[4] = add_grads(carry, pull_back(carry, m, r, slot, "weights"))
      else:
        grads, dx = pull_back(carry, m, r, slot, "both")
        after[2] = add_grads(carry, grads)
      new = carry
      for code, value in after.items():
        new = jax.tree_util.tree_map(functools.partial(jnp.where, op == code), value, new)
      sent_f = jax.tree_util.tree_map(lambda a: jnp.where(op == 1, a, 0), x1)
      sends_dx = op == (3 if split else 2)
      sent_b = jax.tree_util.tree_map(lambda a: jnp.where(sends_dx, a, 0), dx)
      got_f = jax.tree_util.tree_map(lambda a: lax.ppermute(a, axis, fwd_shift), sent_f)
      # One collective after the other on every device: run side by side,
      # devices could enter them in different orders and wait on each other.
      got_f, sent_b = lax.optimization_barrier((got_f, sent_b))
      got_b = jax.tree_util.tree_map(lambda a: lax.ppermute(a, axis, bwd_shift), sent_b)
      # What arrived goes into the slot the table gives it (-1: nothing came).
      for key, got, to in (("inputs", got_f, get_x), ("cotangents", got_b, get_dx)):
        at = jnp.maximum(to, 0)
        new[key] = jax.tree_util.tree_map(
            lambda b, v: b.at[at].set(jnp.where(to >= 0, v, b[at])), new[key], got)
      return new, None

    carry = {"inputs": slots(x_zero), "cotangents": slots(x_zero), "states": slots(state0),
             "state": local.state, "grads": zeros_like(diff),
             "loss": jnp.zeros((), loss_shape.dtype),
             "ys": jax.tree_util.tree_map(
                 lambda s: jnp.zeros((repeats,) + s.shape[:1] + (micro,) + s.shape[1:],
                                     s.dtype), ys_shape)}
    carry, _ = lax.scan(tick, carry, jnp.arange(ops.shape[0]))
    params_g, sliced_g, embed_g, head_g, bcast_g = rebuild(carry["grads"])
    # Only the first stage has embed's gradient, the last head's and the
    # loss; every stage adds to the broadcast arguments'.
    shared = lax.psum((carry["loss"], embed_g, head_g, bcast_g), axis)
    expand = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)  # noqa: E731
    # Per stage: [1, R, K, ...], the [P, R, K, ...] layout of to_stages.
    return (shared, expand((params_g, sliced_g)), expand(carry["ys"]),
            expand(carry["state"]))

  spec, whole = PartitionSpec(axis), PartitionSpec()
  # check_vma=False: as in run(), the buffers start equal on every stage
  # and vary by stage once a ppermute has filled them.
  mapped = jax.shard_map(
      per_device, mesh=pipeline.mesh,
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
  grads = (from_stages(params_g), from_stages(sliced_g), embed_g, head_g, bcast_g)
  loss = with_gradients(loss, list(zip(outer, grads)))
  # [P, R, K, M, mb, ...] -> [L, M, mb, ...] -> [L, B, ...]
  if ys is not None:
    ys = lax.stop_gradient(merge_microbatches(from_stages(ys), axis=1))
  return loss, ys, from_stages(state)
