"""Questions 3 and 4 of ``pipeline``: pipelined gradient steps, compiled and run.

A gradient step (``value_and_grad`` of ``mean(stack(x)**2)``) of the
benchmark GPT block stacked L times, pipelined on a ``pipe:P`` mesh
(:class:`Steps`): its compiled temp memory per device, the collectives in
its program (:mod:`collectives`), the parameter copies its backward pass
saves (:func:`saved_param_bytes`), and its loss and gradients against the
plain stack's on one device (to ``RTOL``); :func:`sweep`, the same step
against M. Here too: the page's table (:func:`table`) and the figure's
panels (:func:`temp_panel`, :func:`sweep_panel`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

try:
  from jax.ad_checkpoint import saved_residuals
except ImportError:  # not public in every JAX version
  from jax._src.ad_checkpoint import saved_residuals

import stacktools as st
from benchmarks.common import collectives
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import meshes
from benchmarks.common import models

#: The stack's name, which the pipelined placement rule is given.
STACK = "h"
#: A pipelined step's loss and every gradient leaf against the plain one's.
RTOL = 1e-5


def transformed(cfg: models.ModelConfig, layers: int, remat: str,
                pipeline: Optional[st.Pipeline]) -> hk.Transformed:
  """``mean(stack(x)**2)`` over an L-layer stack named ``h``."""
  def loss(x):
    stack = st.Stacked(models.make_block(cfg), layers, remat=remat,
                       pipeline=pipeline, name=STACK)
    return jnp.mean(stack.fold(x) ** 2)
  return hk.without_apply_rng(hk.transform(loss))


def compile_step(model: hk.Transformed, params, x, mesh: Optional[Mesh],
                 options: Optional[dict[str, Any]]):
  """The compiled gradient step, its compile seconds, and its outputs once run."""
  step = jax.jit(jax.value_and_grad(model.apply))
  start = time.perf_counter()
  if mesh is None:
    compiled = step.lower(params, x).compile(compiler_options=options)
  else:
    # The pipeline reads the mesh set around tracing.
    with jax.set_mesh(mesh):
      compiled = step.lower(params, x).compile(compiler_options=options)
  seconds = time.perf_counter() - start
  loss, grads = jax.block_until_ready(compiled(params, x))
  return compiled, seconds, float(loss), jax.device_get(grads)


def saved_param_bytes(model: hk.Transformed, params, x, mesh: Mesh, ticks: int,
                      layer_shapes: set[tuple[int, ...]],
                      carry_tail: tuple[int, ...]) -> int:
  """Bytes per device of the parameter copies the backward pass saves.

  The residuals that the pipeline's ``shard_map`` hands the backward pass
  have a leading axis of stages x ticks (every device's every tick); those
  shaped like one layer's parameter leaf (not like the carry) are copies of
  the parameters a tick used.
  """
  stages = int(mesh.shape["pipe"])
  with jax.set_mesh(mesh):
    residuals = saved_residuals(model.apply, params, x)
  total = 0
  for aval, _ in residuals:
    shape = tuple(aval.shape)
    if (shape and shape[0] == stages * ticks and shape[-len(carry_tail):] != carry_tail
        and any(shape[-len(s):] == s for s in layer_shapes if s)):
      total += math.prod(shape) * aval.dtype.itemsize
  return total // stages


class Steps:
  """Compiles and runs gradient steps of one model against the plain stack's.

  The plain stack's step runs on one device once per remat; each pipelined
  step is compared with it, leaf by leaf.
  """

  def __init__(self, args, cfg: models.ModelConfig, params, x, options):
    self.args, self.cfg, self.params, self.x = args, cfg, params, x
    self.options = options
    self.plain: dict[str, tuple[int, float, Any]] = {}
    self.rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    self.carry_tail = (cfg.seq_len, cfg.width)
    self.param_bytes = meshes.total_bytes(params)
    self.layer_shapes = {tuple(np.shape(leaf))[1:] for leaf in jax.tree_util.tree_leaves(params)}

  def reference(self, remat: str) -> tuple[int, float, Any]:
    if remat not in self.plain:
      device = jax.devices()[0]
      compiled, seconds, loss, grads = compile_step(
          transformed(self.cfg, self.args.layers, remat, None),
          jax.device_put(self.params, device), jax.device_put(self.x, device), None,
          self.options)
      temp = int(compiled.memory_analysis().temp_size_in_bytes)
      harness.log(f"plain remat={remat}: temp {temp / 2**20:.2f} MiB "
                  f"(compiled in {seconds:.1f}s)")
      self.plain[remat] = (temp, loss, grads)
    return self.plain[remat]

  def pipelined(self, remat: str, stages: int, schedule: str, microbatches: int,
                options: Any = "default") -> dict[str, Any]:
    """One pipelined step on a ``pipe:stages`` mesh (``stages`` devices): a row.

    Each case compiles once with ``self.options``; asked again, the same row.
    """
    case = (remat, stages, schedule, microbatches)
    if options == "default" and case in self.rows:
      return self.rows[case]
    plain_temp, ref_loss, ref_grads = self.reference(remat)
    repeats = self.args.repeats if schedule == "circular" else 1
    mesh = meshes.make_mesh({"pipe": stages})
    placed, _ = meshes.place(self.params, mesh, STACK)
    x = jax.device_put(self.x, NamedSharding(mesh, PartitionSpec()))
    pipeline = st.Pipeline(axis="pipe", microbatches=microbatches, schedule=schedule,
                           repeats=repeats)
    model = transformed(self.cfg, self.args.layers, remat, pipeline)
    compiled, seconds, loss, grads = compile_step(
        model, placed, x, mesh, self.options if options == "default" else options)
    memory = compiled.memory_analysis()
    ticks = repeats * microbatches + stages - 1
    chunk = self.param_bytes // (stages * repeats)
    leaves = lambda t: jax.tree_util.tree_leaves(t)  # noqa: E731
    row = {"remat": remat, "mesh": f"pipe:{stages}", "devices": stages,
           "schedule": schedule, "repeats": repeats, "microbatches": microbatches,
           "ticks": ticks, "temp_bytes": int(memory.temp_size_in_bytes),
           "argument_bytes": int(memory.argument_size_in_bytes),
           "plain_temp_bytes": plain_temp,
           "chunk_param_bytes": chunk, "tick_param_bytes": ticks * chunk,
           "saved_param_bytes": saved_param_bytes(model, placed, x, mesh, ticks,
                                                  self.layer_shapes, self.carry_tail),
           "collectives": collectives.count(compiled.as_text(), self.carry_tail),
           "compile_seconds": seconds, "loss": loss, "plain_loss": ref_loss,
           "loss_abs_diff": abs(loss - ref_loss),
           "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss),
           "grads_max_abs_diff": float(max(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                                           for a, b in zip(leaves(grads), leaves(ref_grads)))),
           "grads_max_rel_diff": instruments.max_rel_diff(grads, ref_grads)}
    row["temp_ratio"] = row["temp_bytes"] / plain_temp
    row["matches_plain"] = row["loss_rel_diff"] <= RTOL and row["grads_max_rel_diff"] <= RTOL
    moved = {op: c["parameters"] for op, c in row["collectives"].items() if c["parameters"]}
    harness.log(f"pipe:{stages} {schedule} M={microbatches} remat={remat}: temp "
                f"{row['temp_bytes'] / 2**20:.2f} MiB (x{row['temp_ratio']:.3f}); parameter "
                f"collectives {moved or 'none'}; loss rel diff {row['loss_rel_diff']:.1e}, "
                f"grads {row['grads_max_rel_diff']:.1e} (compiled in {seconds:.1f}s)")
    if options == "default":
      self.rows[case] = row
    return row


def sweep(steps: Steps, rows: list[dict[str, Any]], remat: str, stages: int, schedule: str,
          microbatches: list[int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """Temp memory against M: what grows with the ticks (per tick, one chunk's
  parameters, were they saved). The steps of ``rows`` are reused; returns the
  sweep and the steps it compiled besides."""
  known = {r["microbatches"]: r for r in rows
           if (r["remat"], r["devices"], r["schedule"]) == (remat, stages, schedule)}
  points = [known.get(m) or steps.pipelined(remat, stages, schedule, m)
            for m in sorted(set(microbatches) | set(known))]
  _, slope = instruments.fit_line([q["ticks"] for q in points],
                                  [q["temp_bytes"] for q in points])
  out = {"remat": remat, "mesh": f"pipe:{stages}", "schedule": schedule,
         "points": [{k: q[k] for k in ("microbatches", "ticks", "temp_bytes",
                                       "saved_param_bytes", "tick_param_bytes",
                                       "matches_plain", "grads_max_rel_diff")}
                    for q in points],
         "slope_bytes_per_tick": slope, "chunk_param_bytes": points[0]["chunk_param_bytes"],
         "slope_over_chunk_params": slope / points[0]["chunk_param_bytes"]}
  return out, [q for q in points if all(q is not r for r in rows)]


def table(payload: dict[str, Any]) -> list[str]:
  """The page's lines for the compiled steps: their table, the plain stack's
  temp memory, the parameters' collectives and the sweep against M."""
  comp = payload["compiled"]
  lines = ["**Gradient step, compiled: temp memory per device, collectives, and the "
           "numbers against the plain stack** "
           f"(L={payload['config']['layers']}, M={payload['config']['microbatches']}; "
           "each collective count as activations / parameters)", "",
           "| remat | mesh | schedule | temp (MiB) | x plain | saved parameter copies (MiB) "
           "| T x chunk params (MiB) | "
           "all-to-all | collective-permute | all-gather | all-reduce | "
           "loss rel. diff | grads max rel. diff |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  plains = {}
  for r in comp["rows"]:
    plains.setdefault(r["remat"], r["plain_temp_bytes"])
    c = r["collectives"]
    cell = lambda op: f"{c[op]['activations']} / {c[op]['parameters']}"  # noqa: E731
    sched = r["schedule"] + (f" R={r['repeats']}" if r["schedule"] == "circular" else "")
    lines.append(f"| {r['remat']} | {r['mesh']} | {sched} | {r['temp_bytes'] / 2**20:.1f} "
                 f"| {r['temp_ratio']:.3f} | {r['saved_param_bytes'] / 2**20:.1f} | "
                 f"{r['tick_param_bytes'] / 2**20:.1f} | "
                 f"{cell('all-to-all')} | {cell('collective-permute')} | "
                 f"{cell('all-gather')} | {cell('all-reduce')} | "
                 f"{r['loss_rel_diff']:.1e} | {r['grads_max_rel_diff']:.1e} |")
  lines.append("")
  lines.append("Plain stack on one device, temp: " + ", ".join(
      f"remat={k} {v / 2**20:.1f} MiB" for k, v in plains.items()) + ". "
      "T x chunk params: the ticks (R·M+P-1) times one chunk's parameters (L/(P·R) "
      "layers). Saved parameter copies: the residuals of the backward pass shaped "
      "like a layer's parameters, per device (`saved_residuals`).")
  moved = {}
  for r in comp["rows"]:
    c = r["collectives"]
    if any(c[op]["parameters"] for op in c) and r["mesh"] not in moved:
      moved[r["mesh"]] = ", ".join(
          f"{c[op]['parameters']} {op} returning {c[op]['parameters_bytes'] / 2**20:.2f} MiB"
          for op in collectives.NAMES if c[op]["parameters"])
  if moved:
    lines += ["", "Parameter collectives of the circular step, per device (in all, once "
              "per step): " + "; ".join(f"{mesh}: {text}" for mesh, text in moved.items()) +
              ". The whole stack's parameters are "
              f"{payload['resident']['plain']['params'] / 2**20:.2f} MiB."]
  swept = comp.get("sweep")
  if swept:
    lines += ["", f"**Temp memory against M** ({swept['mesh']}, {swept['schedule']}, "
              f"remat={swept['remat']}): " + ", ".join(
                  f"M={p['microbatches']}: {p['temp_bytes'] / 2**20:.1f} MiB, of which "
                  f"{p['saved_param_bytes'] / 2**20:.1f} MiB saved parameter copies"
                  for p in swept["points"]) +
              f"; {swept['slope_bytes_per_tick'] / 2**20:.2f} MiB more per tick, against "
              f"{swept['chunk_param_bytes'] / 2**20:.2f} MiB of parameters in one chunk."]
  return lines


def temp_panel(ax: Any, payload: dict[str, Any]) -> None:
  """Bars of each step's temp memory per device over the plain stack's, per remat."""
  comp = payload["compiled"]["rows"]
  remats = list(dict.fromkeys(r["remat"] for r in comp))
  cases = list(dict.fromkeys((r["mesh"], r["schedule"]) for r in comp))
  width = 0.8 / max(len(remats), 1)
  for j, remat in enumerate(remats):
    by = {(r["mesh"], r["schedule"]): r["temp_ratio"] for r in comp if r["remat"] == remat}
    ax.bar(np.arange(len(cases)) + (j - (len(remats) - 1) / 2) * width,
           [by.get(c, 0.0) for c in cases], width, label=f"remat={remat}",
           color=f"C{j + 2}")
  ax.axhline(1.0, color="gray", ls="--", lw=1, label="plain stack, 1 device")
  ax.set_xticks(np.arange(len(cases)), [f"{m}\n{s}" for m, s in cases], fontsize=8)
  ax.set_ylabel("temp bytes per device / plain stack's")
  ax.set_title("Gradient step: compiled temp memory per device\n"
               f"(L={payload['config']['layers']}, M={payload['config']['microbatches']})")
  ax.legend(fontsize=8)


def sweep_panel(ax: Any, swept: dict[str, Any]) -> None:
  """Temp memory per device against the ticks, and the saved parameter copies in it."""
  ticks = [p["ticks"] for p in swept["points"]]
  temp = np.array([p["temp_bytes"] for p in swept["points"]]) / 2**20
  saved = np.array([p["saved_param_bytes"] for p in swept["points"]]) / 2**20
  ax.plot(ticks, temp, "o-", label="temp per device")
  ax.plot(ticks, saved, "s--", label="of which: saved parameter copies")
  ax.plot(ticks, temp - saved, "^:", color="gray", label="the rest")
  ax.set_xticks(ticks, [f"{t}\n(M={p['microbatches']})"
                        for t, p in zip(ticks, swept["points"])])
  ax.set_xlabel("ticks R·M+P-1")
  ax.set_ylabel("MiB per device")
  ax.set_title(f"Temp memory against M\n({swept['mesh']} {swept['schedule']}, "
               f"remat={swept['remat']})")
  ax.legend(fontsize=8)
