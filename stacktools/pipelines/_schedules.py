"""The schedule tables of a pipeline, as data: what every stage does at every tick.

Pure numpy, no JAX: a table is built once, when the step is traced, and the
tick loops (``_run_forward.py``, ``_run_with_loss.py``) read it as arrays.

The words: P *stages* (the devices along the pipe axis), M *microbatches*
(pieces of the batch), R *repeats* (the chunks of layers each stage holds;
chunk ``r`` of stage ``s`` is virtual stage ``v = r * P + s``). A *tick* is
one step of the loop, in which every stage runs at most one op. A table is a
:class:`Schedule` of ``[ticks, stages]`` arrays::

  for t in range(ticks):                  # one lax.scan step
    for s in range(stages):               # side by side, one per device
      if busy[t, s]:
        run chunk repeat[t, s] of stage s on microbatch microbatch[t, s]

* :func:`schedule`: ``gpipe`` (R = 1) and ``circular``, forwards only.
* :func:`one_f_one_b`: ``1f1b`` and ``interleaved`` (R > 1): each
  microbatch's backward as soon as it can run.
* :func:`zero_bubble`: ``zb`` (ZB-H1): 1F1B with each backward cut in two.

:meth:`stacktools.Pipeline.table` is the public way in.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np


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
