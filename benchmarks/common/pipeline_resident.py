"""Question 2 of ``pipeline``: the bytes of state each device holds.

What one device holds of a stack's parameters and of its Adam state once
placed by the pipelined rule (``meshes.place``): the sum over leaves of
``addressable_shards[0].data.nbytes``, against the plain stack on one
device. The pipe axis should divide them by P, an fsdp axis by its size
again; every leaf that an axis leaves whole is listed. Here: one mesh's row
(:func:`row`), the page's table (:func:`table`) and the figure's panel
(:func:`panel`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from benchmarks.common import meshes


def row(spec: str, params, opt_state, plain: dict[str, int], stack: str) -> dict[str, Any]:
  """Per-device bytes of params and Adam state on one mesh, and which leaves
  an axis leaves whole.

  ``*_ratio`` is over every leaf; ``*_ratio_split`` over the leaves that
  every sharding axis of the mesh (pipe, and fsdp when it has one) splits,
  which must be exactly ``1 / (P * fsdp)``.
  """
  shape = meshes.parse_mesh(spec)
  mesh = meshes.make_mesh(shape)
  axes = {axis: shape[axis] for axis in ("pipe", "fsdp") if shape.get(axis, 1) > 1}
  out = {"mesh": spec, "mesh_shape": shape, "expected_divisor": math.prod(axes.values()),
         "leaves_not_split": {axis: [] for axis in axes}}
  for kind, tree in (("param", params), ("opt", opt_state)):
    placed, specs = meshes.place(tree, mesh, stack)
    held = split_held = split_total = 0
    flat_specs = jax.tree_util.tree_leaves(
        specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    for (path, leaf), leaf_spec in zip(jax.tree_util.tree_flatten_with_path(placed)[0],
                                       flat_specs):
      mine = int(leaf.addressable_shards[0].data.nbytes)
      held += mine
      whole_on = [axis for axis in axes if axis not in tuple(leaf_spec)]
      for axis in whole_on:
        out["leaves_not_split"][axis].append(
            {"tree": kind, "leaf": jax.tree_util.keystr(path), "shape": list(leaf.shape),
             "bytes": int(leaf.nbytes)})
      if not whole_on:
        split_held, split_total = split_held + mine, split_total + int(leaf.nbytes)
    plain_bytes = plain["params" if kind == "param" else "opt_state"]
    out[f"{kind}_bytes_per_device"] = held
    out[f"{kind}_ratio"] = held / plain_bytes
    out[f"{kind}_split_bytes_fraction"] = split_total / plain_bytes
    out[f"{kind}_ratio_split"] = split_held / split_total if split_total else None
  out["exact_on_split_leaves"] = all(
      out[f"{kind}_ratio_split"] == 1 / out["expected_divisor"] for kind in ("param", "opt"))
  return out


def table(resident: dict[str, Any]) -> list[str]:
  """The page's lines for the resident bytes: a heading and a row per mesh."""
  lines = [f"**Resident bytes per device** (plain stack on one device: "
           f"{resident['plain']['params'] / 2**20:.2f} MiB parameters, "
           f"{resident['plain']['opt_state'] / 2**20:.2f} MiB Adam state)", "",
           "| mesh | params / device (KiB) | x plain | Adam / device (KiB) | x plain "
           "| expected | leaves an axis leaves whole |",
           "|---|---:|---:|---:|---:|---:|---|"]
  for r in resident["rows"]:
    whole = {}
    for axis, leaves in r["leaves_not_split"].items():
      for leaf in leaves:
        whole.setdefault(f"{leaf['leaf']} {tuple(leaf['shape'])}", []).append(axis)
    whole_text = "; ".join(f"{name} (by {', '.join(axes)})"
                           for name, axes in whole.items()) or "none"
    lines.append(f"| {r['mesh']} | {r['param_bytes_per_device'] / 1024:.1f} | "
                 f"{r['param_ratio']:.4f} | {r['opt_bytes_per_device'] / 1024:.1f} | "
                 f"{r['opt_ratio']:.6f} | 1/{r['expected_divisor']} = "
                 f"{1 / r['expected_divisor']:.4f} | {whole_text} |")
  return lines + [""]


def panel(ax: Any, rows: list[dict[str, Any]]) -> None:
  """Bars of each mesh's bytes per device over the plain stack's, and 1/(P·fsdp)."""
  pos = np.arange(len(rows))
  ax.bar(pos - 0.2, [r["param_ratio"] for r in rows], 0.4, label="parameters")
  ax.bar(pos + 0.2, [r["opt_ratio"] for r in rows], 0.4, label="Adam state")
  ax.plot(pos, [1 / r["expected_divisor"] for r in rows], "_", color="black", ms=30,
          mew=2, label="1 / (P·fsdp)")
  ax.set_xticks(pos, [r["mesh"].replace(",", ",\n") for r in rows], fontsize=8)
  ax.set_ylabel("bytes per device / plain stack's")
  ax.set_title("Resident bytes per device\n(st.stacked_partition_specs, pipelined)")
  ax.legend(fontsize=8)
