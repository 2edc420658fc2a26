"""Devices and processes for train.py: the mesh, shardings and host transfers.

Training runs on JAX's own SPMD runtime: one ``jax.jit`` whose inputs and
outputs carry ``NamedSharding``s over a ``Mesh`` with a ``data`` axis (the
batch is split over it) and an ``fsdp`` axis (parameters and optimizer state
are split over it, FSDP-style, by ``st.stacked_partition_specs``, which keeps
the stacked Layers axis whole), and optionally a ``pipe`` axis: the stages of
a pipelined stack (``st.Pipeline``), over which that stack's Layers axis is
split instead (:func:`make_pipeline` makes the pipeline that the flags ask
for, checked against the mesh). Several processes join through
``jax.distributed``; on CPU they talk through gloo.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

from absl import logging as absl_logging
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import stacktools as st

# Outermost first: a pipe axis (present only when --mesh names it) puts
# consecutive stages on consecutive blocks of devices, so the stages of a
# multi-process run sit on as few hosts each as can be, and only the
# activations that pass from stage to stage cross between them.
MESH_AXES = ("pipe", "data", "fsdp")
PIPE = "pipe"
# The stacks in the GPT model: st.Stacked(name="h") at the top level.
STACKED = ("h",)
# From this jax on (0.10.2 and 0.12.0.1 are fine), a program with
# cross-process collectives that a multi-process CPU run loads from the
# persistent compilation cache hangs in its first collective, whichever
# process wrote the cache (docs/guides/troubleshooting.md: the reproducer).
CACHE_HANGS_FROM = (0, 12, 1)


class SetupError(ValueError):
  """A flag combination that cannot work; the message names the flag."""


def parse_mesh(spec: str, num_devices: int) -> dict[str, int]:
  """``"data:4,fsdp:2"`` -> ``{"data": 4, "fsdp": 2}``, checked.

  An empty spec puts every device on ``data``. A ``data`` or ``fsdp`` axis
  left out has size 1; a ``pipe`` axis is in the result only when the spec
  names it (``"pipe:4,data:2"`` -> ``{"pipe": 4, "data": 2, "fsdp": 1}``),
  so a mesh without one stays the two-axis mesh it always was.

  Raises:
    SetupError: a spec that does not parse, names an unknown axis, repeats
      one, or does not multiply to ``num_devices``.
  """
  if not spec.strip():
    return {"data": num_devices, "fsdp": 1}
  sizes: dict[str, int] = {}
  for part in spec.split(","):
    name, sep, size = part.strip().partition(":")
    if not sep or not size.strip().isdigit() or int(size) < 1:
      raise SetupError(
          f"--mesh={spec!r} does not parse: write axis:size pairs separated by "
          "commas, e.g. --mesh=data:4,fsdp:2 or --mesh=pipe:4,data:2.")
    name = name.strip()
    if name not in MESH_AXES:
      raise SetupError(f"--mesh={spec!r} names the axis {name!r}; the axes are "
                       f"{', '.join(MESH_AXES)}.")
    if name in sizes:
      raise SetupError(f"--mesh={spec!r} gives the axis {name!r} twice.")
    sizes[name] = int(size)
  sizes = {axis: sizes.get(axis, 1) for axis in MESH_AXES
           if axis != PIPE or axis in sizes}
  if math.prod(sizes.values()) != num_devices:
    raise SetupError(
        f"--mesh={spec!r} has {math.prod(sizes.values())} devices but there are "
        f"{num_devices}; the axis sizes must multiply to the device count.")
  return sizes


def check_pipeline_flags(pipeline: str, microbatches: Optional[int],
                         pipeline_repeats: Optional[int], remat: str) -> None:
  """Checks what the pipeline flags alone rule out.

  What needs the mesh :func:`make_pipeline` checks, and what needs the
  depth stacktools says when train.py traces the model.

  Raises:
    ValueError: one line naming the flags.
  """
  if pipeline == "none":
    given = [name for name, value in (("microbatches", microbatches),
                                      ("pipeline_repeats", pipeline_repeats))
             if value is not None]
    if given:
      raise ValueError(
          f"--{' and --'.join(given)} {'need' if len(given) > 1 else 'needs'} "
          "a --pipeline (e.g. gpipe, circular or interleaved) and a pipe axis in "
          "--mesh (e.g. --mesh=pipe:4,data:2).")
    return
  if remat.lower() == "auto":   # compared as stacktools compares it
    # The planner's candidates include per-depth mixes, which a pipeline
    # refuses; refused here rather than after compiling the first of them.
    # (st.plan_remat offers them for a pipelined stack too.)
    raise ValueError(
        f"--pipeline={pipeline} runs every stage with one checkpoint policy, which "
        "--remat=auto does not fix: pass --remat as one policy (e.g. full or nested).")


def check_batch_size(batch_size: int, sizes: dict[str, int], grad_accum: int = 1) -> None:
  """Raises SetupError unless the mesh's data axis divides the batch (each
  of its ``grad_accum`` microbatches).

  The batch is split over the data axis (:func:`batch_sharding`): each data
  shard needs the same number of sequences.
  """
  if batch_size % (grad_accum * sizes["data"]):
    per = f" / --grad_accum={grad_accum}" if grad_accum > 1 else ""
    raise SetupError(f"--batch_size={batch_size}{per} is not divisible by the "
                     f"mesh's data axis ({sizes['data']}); each data shard needs "
                     "the same number of sequences.")


def make_pipeline(kind: str, sizes: dict[str, int], spec: str, batch_size: int,
                  microbatches: Optional[int], repeats: Optional[int]
                  ) -> Optional[st.Pipeline]:
  """The ``st.Pipeline`` that --pipeline asks for, checked against the mesh.

  Refuses a pipeline without a pipe axis, a pipe axis larger than 1 without a
  pipeline (it would only replicate the work; refused rather than made a
  gpipe, so that the schedule and --microbatches are always chosen, never
  guessed), a batch that the microbatches x data axis do not divide, or what
  ``st.Pipeline`` refuses. What needs the depth (layers that the stages x
  repeats do not divide, a circular schedule with fewer microbatches than
  stages) stacktools says when train.py traces the model.

  Example::

    pipeline = make_pipeline("gpipe", parse_mesh("pipe:4,data:2", 8),
                             "pipe:4,data:2", 16, None, None)   # 4 microbatches

  Args:
    kind: --pipeline: a schedule, or "none".
    sizes: from :func:`parse_mesh`.
    spec: --mesh as given, for the messages.
    batch_size: --batch_size.
    microbatches: --microbatches; None for the pipe axis size.
    repeats: --pipeline_repeats; None for 1.

  Returns:
    The pipeline, or ``None`` for --pipeline=none.

  Raises:
    SetupError: one line naming the flags.
  """
  pipe = sizes.get(PIPE)
  if kind == "none":
    if pipe is not None and pipe > 1:
      raise SetupError(f"--mesh={spec!r} has a pipe axis of {pipe}, which only a "
                       "pipeline uses: pass --pipeline=gpipe or --pipeline=circular (and "
                       "--microbatches), or leave the pipe axis out of --mesh.")
    return None
  if pipe is None:
    raise SetupError(f"--pipeline={kind} places its stages on a pipe axis, which is "
                     f"missing from --mesh={spec!r}; add one, e.g. "
                     "--mesh=pipe:4,data:2 (the sizes multiply to the device count).")
  try:
    pipeline = st.Pipeline(axis=PIPE, microbatches=microbatches or pipe,
                           schedule=kind, repeats=repeats or 1)
  except (TypeError, ValueError) as e:
    raise SetupError(str(e)) from None
  # The batch is split over the data axis, then each shard into
  # microbatches: this binary's layout, not the stack's.
  micro, data = pipeline.microbatches, sizes["data"]
  if batch_size % (micro * data):
    raise SetupError(f"--batch_size={batch_size} is not divisible by --microbatches "
                     f"({micro}) x the mesh's data axis ({data}) = {micro * data}; "
                     "each microbatch of each data shard needs the same number of sequences.")
  return pipeline


def device_count() -> int:
  """``jax.device_count()``, quietly: the first call starts the backends, and
  JAX logs an INFO line for each one that is absent (``libtpu.so`` on a CPU
  machine), which would precede a flag error's one line on stderr."""
  logger = logging.getLogger("jax._src.xla_bridge")
  level = logger.level
  logger.setLevel(max(level, logging.WARNING))
  try:
    return jax.device_count()
  finally:
    logger.setLevel(level)


def make_mesh(sizes: dict[str, int]) -> Mesh:
  """A mesh over all devices (of every process), outermost axis first.

  The axes are ``sizes``' in the order of :data:`MESH_AXES` (pipe, data,
  fsdp). ``jax.sharding.Mesh`` makes them ``Auto`` axes, which a pipelined
  stack's ``shard_map`` needs (it is manual over the pipe axis alone).
  """
  names = tuple(axis for axis in MESH_AXES if axis in sizes)
  devices = np.asarray(jax.devices()).reshape(tuple(sizes[axis] for axis in names))
  return Mesh(devices, names)


def pipe_size(mesh: Mesh) -> int:
  """The size of the mesh's pipe axis; 1 without one."""
  return int(dict(mesh.shape).get(PIPE, 1))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows of a batch split over ``data``, replicated over ``fsdp`` and ``pipe``.

  A pipelined stack cuts each data shard into microbatches itself.
  """
  return NamedSharding(mesh, PartitionSpec("data"))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def tree_shardings(mesh: Mesh, tree: Any, pipelined: bool = False) -> Any:
  """FSDP shardings of params or optimizer state (shapes are enough).

  Args:
    mesh: from :func:`make_mesh`.
    tree: parameters, optimizer state, or their ``jax.eval_shape``.
    pipelined: whether the model's stack runs as a pipeline over the mesh's
      pipe axis: then its Layers axis is split over that axis (each stage
      holds its own layers and their optimizer state). The tree itself is
      the same either way, so checkpoints move between plain and pipelined
      runs.
  """
  specs = st.stacked_partition_specs(tree, mesh, stacked=STACKED,
                                     pipelined=STACKED if pipelined else (),
                                     pipe_axis=PIPE)
  return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs)


def put_global(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A global array from a host array every process holds in full.

  Each process transfers only the slices its own devices hold.
  """
  array = np.asarray(array)
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def put_tree(tree: Any, shardings: Any) -> Any:
  return jax.tree_util.tree_map(put_global, tree, shardings)


def abstract_tree(shapes: Any, shardings: Any) -> Any:
  """``jax.ShapeDtypeStruct``s with shardings: where a restore puts each array.

  Args:
    shapes: a pytree of arrays or ``ShapeDtypeStruct``s (``jax.eval_shape``'s).
    shardings: the same pytree of ``NamedSharding``s (:func:`tree_shardings`).
  """
  return jax.tree_util.tree_map(
      lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      shapes, shardings)


def to_host(tree: Any) -> Any:
  """Full numpy copies of (possibly cross-process sharded) arrays.

  A collective in a multi-process run: every process must call it, and every
  process then holds every array whole. For what must be whole on one host
  (sampling, ``--export_npz``); checkpoints never gather (saving.py).
  """
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)


def per_device_bytes(tree: Any) -> int:
  """Bytes of ``tree`` held by one device (the first addressable one)."""
  device = jax.local_devices()[0]
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    for shard in leaf.addressable_shards:
      if shard.device == device:
        total += shard.data.nbytes
  return total


def initialize(coordinator_address: Optional[str], num_processes: int,
               process_id: Optional[int]) -> None:
  """Joins a multi-process run (gloo collectives on CPU); checks the flags."""
  if num_processes == 1:
    if coordinator_address:
      raise SetupError("--coordinator_address needs --num_processes > 1.")
    return
  if not coordinator_address:
    raise SetupError(f"--num_processes={num_processes} needs --coordinator_address "
                     "(host:port of process 0), e.g. --coordinator_address=127.0.0.1:1234.")
  if process_id is None:
    raise SetupError(f"--num_processes={num_processes} needs --process_id, this "
                     f"process's index in 0..{num_processes - 1}.")
  if not 0 <= process_id < num_processes:
    raise SetupError(f"--process_id={process_id} must be in 0..{num_processes - 1} "
                     f"with --num_processes={num_processes}.")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=120)
  avoid_cache_hang()


def _version(text: str) -> tuple[int, ...]:
  """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; a suffix such as ``.dev`` ends it."""
  parts = []
  for part in text.split("."):
    if not part.isdigit():
      break
    parts.append(int(part))
  return tuple(parts)


def avoid_cache_hang() -> bool:
  """Turns the persistent compilation cache off where loading from it hangs.

  That is a run of several processes on CPU with jax from
  :data:`CACHE_HANGS_FROM` on, with a cache set (``JAX_COMPILATION_CACHE_DIR``):
  JAX's bug, not the example's (two processes that share one ppermute hang
  the same way). Called after ``jax.distributed.initialize``, before
  anything is compiled; logs one line when it turns the cache off.

  Returns:
    Whether it turned the cache off.
  """
  if (jax.process_count() == 1 or jax.default_backend() != "cpu"
      or _version(jax.__version__) < CACHE_HANGS_FROM
      or not jax.config.jax_enable_compilation_cache
      or not jax.config.jax_compilation_cache_dir):
    return False
  jax.config.update("jax_enable_compilation_cache", False)
  absl_logging.warning(
      "Persistent compilation cache off in this run: with jax %s, a multi-process "
      "CPU run that loads a program with cross-process collectives from it hangs "
      "in that program's first collective.", jax.__version__)
  return True
