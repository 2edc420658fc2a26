"""Meshes named in text, trees placed on them, and the bytes a device holds.

* :func:`parse_mesh` and :func:`make_mesh`: ``"pipe:4,data:2"`` as axis
  sizes, and as a mesh over the first devices it needs;
* :func:`place`: a tree placed by ``st.stacked_partition_specs``, a stack's
  Layers axis split over the pipe axis;
* :func:`per_device_bytes` and :func:`total_bytes`: what one device holds of
  a placed tree, and what the whole tree takes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

import stacktools as st

PyTree = Any


def parse_mesh(spec: str) -> dict[str, int]:
  """``"pipe:4,data:2"`` -> ``{"pipe": 4, "data": 2}``."""
  return {name: int(size) for name, size in (part.split(":") for part in spec.split(","))}


def make_mesh(shape: dict[str, int]) -> Mesh:
  """A mesh of Auto axes (``Mesh``'s default) over the first devices it needs."""
  count = math.prod(shape.values())
  devices = np.array(jax.devices()[:count]).reshape(tuple(shape.values()))
  return Mesh(devices, tuple(shape))


def place(tree: PyTree, mesh: Mesh, stack: str) -> tuple[PyTree, PyTree]:
  """``tree`` placed on ``mesh`` by the pipelined rule for the stack named
  ``stack`` (``st.stacked_partition_specs(stacked=[stack],
  pipelined=[stack])``), and the partition specs it was placed by."""
  specs = st.stacked_partition_specs(tree, mesh, stacked=[stack], pipelined=[stack])
  return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)), specs


def per_device_bytes(tree: PyTree) -> int:
  """Bytes one device (device 0's shard of every leaf) holds of ``tree``."""
  return int(sum(leaf.addressable_shards[0].data.nbytes
                 for leaf in jax.tree_util.tree_leaves(tree)))


def total_bytes(tree: PyTree) -> int:
  """Bytes of every leaf of ``tree``, whole."""
  return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree)))
