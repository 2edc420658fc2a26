"""Sharding rules for stacked parameters: keep the Layers axis whole, or pipeline it.

A :class:`Stacked` parameter has a leading Layers axis that ``lax.scan``
slices one layer at a time. Sharding that axis across devices would make
every step of the scan gather a layer from other devices, so the rule here
shards each parameter FSDP-style on its largest *other* axis that the FSDP
mesh axis divides, and leaves the Layers axis (or axes, in nested stacks)
whole. Parameters outside any stack follow the same rule over all their axes.

The rule reads the Haiku module name of each leaf from its path, so it works
on parameters and equally on optimizer states that hold parameter-shaped
trees (``optax`` moments), whose paths end in the same ``[module][name]``.

A pipelined stack (``Stacked(..., pipeline=st.Pipeline(...))``) is the one
exception: its Layers axis is split over the pipe mesh axis, so each stage
keeps its own layers (and their optimizer state) and nothing else. Contiguous
blocks of layers are what a ``gpipe`` stage runs, so a gpipe step moves no
parameters; a ``circular`` stage runs every P-th chunk of layers, which a
PartitionSpec of the plain ``[num_layers, ...]`` array cannot express, so a
circular step regroups the stack's parameters (and their gradients) with one
all-to-all over the pipe axis each way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import jax
from jax.sharding import PartitionSpec

from stacktools.core import _checks

PyTree = Any


def num_layer_axes(module: str, stacked: Sequence[str]) -> int:
  """How many leading Layers axes a module's parameters have.

  Example::

    assert num_layer_axes("model/h/block/linear", ["model/h"]) == 1

  Args:
    module: a Haiku module name, e.g. ``"model/h/block/linear"``.
    stacked: the full names of the stacks in the model (``Stacked`` or
      ``layer_stack`` modules); a nested stack is listed too.

  Returns:
    The number of names in ``stacked`` that ``module`` lies under.
  """
  return sum(module == s or module.startswith(s + "/") for s in stacked)


def fsdp_spec(shape: Sequence[int], layer_axes: int, fsdp_size: int,
              fsdp_axis: str = "fsdp") -> PartitionSpec:
  """The PartitionSpec of one array: the largest non-Layers axis that divides.

  Example::

    assert fsdp_spec((12, 128, 512), layer_axes=1, fsdp_size=4) == (
        PartitionSpec(None, None, 'fsdp'))

  Args:
    shape: the array's shape.
    layer_axes: how many leading axes are Layers axes (never sharded).
    fsdp_size: the size of the FSDP mesh axis.
    fsdp_axis: its name.

  Returns:
    A spec that shards one axis over ``fsdp_axis``, or replicates the array
    when no axis is divisible (or ``fsdp_size`` is 1).
  """
  if fsdp_size <= 1:
    return PartitionSpec()
  candidates = [(size, axis) for axis, size in enumerate(shape)
                if axis >= layer_axes and size % fsdp_size == 0]
  if not candidates:
    return PartitionSpec()
  # Largest axis first; among equals, the last (the output features of a
  # weight), so a matmul's contraction axis stays local where it can.
  _, axis = max(candidates)
  spec = [None] * len(shape)
  spec[axis] = fsdp_axis
  return PartitionSpec(*spec)


def stacked_partition_specs(tree: PyTree, mesh: Optional[jax.sharding.Mesh] = None, *,
                            stacked: Sequence[str] = (),
                            fsdp_axis: Optional[str] = None,
                            fsdp_size: Optional[int] = None,
                            pipelined: Sequence[str] = (),
                            pipe_axis: str = "pipe") -> PyTree:
  """PartitionSpecs for Haiku parameters (or optimizer state) with stacks.

  Example::

    from jax.sharding import NamedSharding

    params = {"model/h/block/fc": {"w": jnp.ones((12, 16, 64))},
              "model/head": {"w": jnp.ones((16, 8))}}
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
    specs = st.stacked_partition_specs(params, mesh, stacked=["model/h"])
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.device_put(params, shardings)

  Args:
    tree: Haiku params ``{module: {name: array}}``, or any pytree whose array
      leaves sit under ``[module][name]`` keys (optax states); other leaves
      (step counts) are replicated.
    mesh: the device mesh; its ``fsdp_axis`` size is the shard count. Or
      pass ``fsdp_size`` instead.
    stacked: the full module names of the stacks in the model; each must
      hold at least one leaf of ``tree``.
    fsdp_axis: the mesh axis that parameters are sharded over; it must be an
      axis of ``mesh``. By default ``"fsdp"`` when the mesh has such an axis,
      and no sharding (everything replicated) when it does not.
    fsdp_size: the shard count, when no mesh is given.
    pipelined: the full names of pipelined stacks (a subset of ``stacked``,
      or added to it): their Layers axis is split over ``pipe_axis``, one
      block of layers per stage, and FSDP applies to their other axes.
    pipe_axis: the mesh axis of the pipeline's stages (``st.Pipeline.axis``).

  Example, pipelined::

    params = {"model/h/block/fc": {"w": jnp.ones((12, 16, 64))}}
    mesh = jax.make_mesh((4, 2), ("pipe", "fsdp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs = st.stacked_partition_specs(params, mesh, stacked=["model/h"],
                                       pipelined=["model/h"])
    fc = specs["model/h/block/fc"]            # w: [L, d, 4d]
    assert fc["w"] == PartitionSpec('pipe', None, 'fsdp')

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``tree``.

  Raises:
    ValueError: for an ``fsdp_axis`` or ``pipe_axis`` that the mesh lacks, a
      name in ``stacked`` that no leaf of ``tree`` lies under, or a
      pipelined stack whose depth the pipe axis does not divide.
  """
  if isinstance(stacked, str):
    stacked = (stacked,)
  if isinstance(pipelined, str):
    pipelined = (pipelined,)
  stacked = tuple(stacked) + tuple(p for p in pipelined if p not in stacked)
  pipe_size = 1
  if pipelined:
    if mesh is None or pipe_axis not in dict(mesh.shape):
      axes = list(dict(mesh.shape)) if mesh is not None else None
      raise ValueError(
          f"stacked_partition_specs: pipelined={list(pipelined)} puts their Layers "
          f"axis on the {pipe_axis!r} mesh axis, but the mesh "
          f"{'is missing' if mesh is None else f'has axes {axes}'}. Pass a mesh "
          f"with a {pipe_axis!r} axis (e.g. jax.sharding.Mesh(devices.reshape(4, 2), "
          f"({pipe_axis!r}, 'data'))), or pipe_axis= the axis the st.Pipeline uses.")
    pipe_size = int(dict(mesh.shape)[pipe_axis])
  if fsdp_size is None:
    if mesh is None:
      raise ValueError("stacked_partition_specs needs a mesh or fsdp_size=.")
    axes = dict(mesh.shape)
    if fsdp_axis is not None and fsdp_axis not in axes:
      raise ValueError(
          f"stacked_partition_specs: fsdp_axis={fsdp_axis!r} is not an axis of "
          f"the mesh, whose axes are {list(axes)}. Pass one of those, or leave "
          "fsdp_axis unset to shard over 'fsdp' when the mesh has it.")
    fsdp_axis = fsdp_axis or "fsdp"
    fsdp_size = axes.get(fsdp_axis, 1)
  fsdp_axis = fsdp_axis or "fsdp"
  with _checks.subject("stacked_partition_specs"):
    check_stacks_exist(tree, stacked)

  def spec(path, leaf):
    shape = getattr(leaf, "shape", ())
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    module = module_of(path)
    layer_axes = num_layer_axes(module, stacked)
    if layer_axes > len(shape):
      raise ValueError(
          f"{module}/{keys[-1]} has shape {tuple(shape)}, which has fewer than the "
          f"{layer_axes} Layers axes its stacks {list(stacked)} imply; check "
          "stacked=.")
    base = fsdp_spec(shape, layer_axes, fsdp_size, fsdp_axis)
    pipe = [p for p in pipelined if num_layer_axes(module, [p])]
    if not pipe:
      return base
    # The pipelined stack's own Layers axis: after those of the stacks around it.
    axis = num_layer_axes(pipe[0], [s for s in stacked if s != pipe[0]])
    if shape[axis] % pipe_size:
      raise ValueError(
          f"stacked_partition_specs: {module}/{keys[-1]} has {shape[axis]} layers "
          f"on axis {axis}, which the {pipe_axis!r} axis of size {pipe_size} does not "
          f"divide; a pipelined stack needs num_layers to be a multiple of the "
          "number of stages (times the circular schedule's repeats).")
    out = list(base) + [None] * (len(shape) - len(base))
    out[axis] = pipe_axis
    return PartitionSpec(*out)

  return jax.tree_util.tree_map_with_path(spec, tree)


def module_of(path: Any) -> str:
  """The Haiku module name in a leaf's path: the key before the last."""
  keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
  return str(keys[-2]) if len(keys) >= 2 else ""


def check_stacks_exist(tree: PyTree, stacked: Sequence[str]) -> None:
  """Each name in ``stacked`` must have at least one leaf under it."""
  modules = {module_of(path)
             for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
  modules.discard("")
  for name in stacked:
    if not any(num_layer_axes(m, [name]) for m in modules):
      shown = sorted(modules)
      more = f" and {len(shown) - 20} more" if len(shown) > 20 else ""
      raise ValueError(
          f"{_checks.where()}stacked={list(stacked)} names {name!r}, but "
          f"no parameter lies under it, so its Layers axis would be treated "
          f"like any other axis. The modules are {shown[:20]}{more}; pass the "
          "full name of each stack (e.g. 'model/h').")
