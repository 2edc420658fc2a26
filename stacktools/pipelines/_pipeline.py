"""``st.Pipeline``: how a stack runs as a pipeline over a mesh axis, and its checks.

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
* ``1f1b``, ``interleaved`` (1F1B over circular's chunks) and ``zb``
  (ZB-H1) run each microbatch's backward inside the same loop, as soon as
  its forward has left the last stage, so a stage holds a bounded number of
  microbatches whatever M is; the loss is computed inside the loop.

The parameter tree stays the plain stack's (a leading ``num_layers`` axis),
so checkpoints move between pipelined and plain runs unchanged.

This module holds the configuration only. The tables of the schedules are
in ``_schedules.py``; the loops that run them in ``_run_forward.py`` (gpipe,
circular) and ``_run_with_loss.py`` (the schedules that compute the loss,
with the parts around the stack of ``_ends.py``), over the layouts of
``_stages.py``. The checks only the mesh can tell, the choice of a pipelined
stack's loop and the chunk of layers a stage runs are
``stacks/_run_stacked.py``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from stacktools.core import _checks
from stacktools.pipelines import _schedules

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

  def table(self, stages: int) -> _schedules.Schedule:
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
      return _schedules.one_f_one_b(count, self.microbatches, self.repeats)
    if self.schedule == "zb":
      return _schedules.zero_bubble(count, self.microbatches)
    return _schedules.schedule(count, self.microbatches, self.repeats)
