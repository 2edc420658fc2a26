"""What does a pipelined stack cost and save, per device, measured?

Five questions about ``st.Stacked(..., pipeline=st.Pipeline(...))`` over 8
virtual CPU devices, each answered from the schedule or the compiled program:

1. **Bubble.** The idle share of stage-ticks, counted in the table that the
   pipeline runs (``st.Pipeline(microbatches=M, schedule=...,
   repeats=R).table(P)``), against
   (P-1)/(M+P-1) for ``gpipe`` and ``1f1b``, (P-1)/(R*M+P-1) for
   ``circular`` and ``interleaved``, and (P-1)/(3M+P-1) for ``zb`` (a tick
   per forward, input-gradient or weight-gradient op), for every P, M and R
   asked (all but ``gpipe`` need M >= P, ``interleaved`` M a multiple of P).
   They must agree exactly: compared as fractions of whole stage-ticks.
2. **Resident bytes.** What one device holds of the stack's parameters and
   of its Adam state (``optax.adam``) once placed with
   ``st.stacked_partition_specs(pipelined=["h"])``: the sum over leaves of
   ``addressable_shards[0].data.nbytes``, on the meshes ``pipe:8``,
   ``pipe:4,data:2``, ``pipe:2,fsdp:2,data:2`` and ``pipe:4,fsdp:2``, against
   the plain stack on one device. The pipe axis should divide them by P, an
   fsdp axis by its size again; every leaf that an axis leaves whole is listed.
3. **Temp memory and collectives.** A gradient step (``value_and_grad`` of
   ``mean(stack(x)**2)``) of the benchmark GPT block stack: compiled temp
   memory per device (``memory_analysis().temp_size_in_bytes``) of the
   pipelined step (pipe:4 on 4 devices and pipe:8 on 8; ``gpipe`` and
   ``circular``; remat ``full`` and ``nested``) against the plain stack on
   one device, and the collectives in each compiled program
   (``compiled.as_text()``), split into those that move activations
   (shaped like the carry) and those that move parameters or their
   gradients (everything else). A ``gpipe`` stage runs the contiguous layers
   the pipe axis already gives it; a ``circular`` stage runs every P-th chunk,
   so its parameters must be regrouped every step. Beside the temp bytes:
   the parameter copies the backward pass saves (``saved_residuals``), and
   the temp bytes of the first pipe size's ``gpipe`` step against M
   (``--sweep_microbatches``), which show what grows with the ticks.
4. **Correctness.** Every compiled step is also run once: its loss and every
   gradient leaf against the plain stack's with the same remat, to rtol
   1e-5 (``|a - b| <= 1e-5 * max|b|`` per leaf; the largest difference is in
   the JSON).
5. **Temp memory against M: gpipe, 1f1b, interleaved, zb.** The GPT
   example's training loss (``examples/gpt/model.py``'s ``loss_fn``:
   embedding, the stack, head and cross entropy; under the schedules that
   compute the loss the loss is the stack's call), ``value_and_grad`` on
   ``pipe:4``, microbatches of a fixed 2 sequences, M in 4, 8, 16, 32:
   compiled temp memory per device of each schedule (interleaved with
   ``--repeats`` chunks per stage), each step run once against the plain
   model on one device (as in 4), and the step's time, the schedules'
   rounds alternated.

The step times of 5 are the only wall times, and they say little: the
virtual devices share two cores, so a step takes about the sum of every
stage's work (idle ticks included), not the longest stage's; they show what
each schedule computes in all, never a bubble or an overlap. Steps compile
with ``fast_compile.CODEGEN`` (checked once per full run to give the same
temp bytes as XLA's defaults); the timed ones too.

  python -m benchmarks.pipeline               # full run, 1-3 min on 2 shared cores
  python -m benchmarks.pipeline --quick       # ~20 s (the smoke test)
  python -m benchmarks.pipeline --layers 32 --pipes 4 --remats full

JAX fixes its device count when it starts, so this script, run as one, puts
``--xla_force_host_platform_device_count=8`` into ``XLA_FLAGS`` before it
imports JAX (importing it as a module changes nothing); ``main()`` called
in a process whose JAX has fewer devices runs the script again in a
subprocess and returns what it wrote. Writes
``benchmarks/results/pipeline.json`` and ``pipeline.png``.
"""

from __future__ import annotations

import os
import re
import sys

NUM_DEVICES = 8
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _force_device_count() -> None:
  """Asks XLA for 8 CPU devices (only effective before JAX is imported)."""
  flags = re.sub(rf"{_DEVICE_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags.strip()} {_DEVICE_FLAG}={NUM_DEVICES}".strip()


if __name__ == "__main__" and "jax" not in sys.modules:
  _force_device_count()

# pylint: disable=wrong-import-position
import json
import math
import time
from fractions import Fraction
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

try:
  from jax.ad_checkpoint import saved_residuals
except ImportError:  # not public in every JAX version
  from jax._src.ad_checkpoint import saved_residuals

import stacktools as st
from benchmarks.common import fast_compile
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import models
from examples.gpt import model as gpt
from examples.gpt import model_config
# pylint: enable=wrong-import-position

NAME = "pipeline"
STACK = "h"
MESHES = ("pipe:8", "pipe:4,data:2", "pipe:2,fsdp:2,data:2", "pipe:4,fsdp:2")
REMATS = ("full", "nested")
SCHEDULES = ("gpipe", "circular")   # the compiled steps of question 3
BUBBLE_SCHEDULES = ("gpipe", "1f1b", "circular", "interleaved", "zb")
AGAINST_M = ("gpipe", "1f1b", "interleaved", "zb")
CHUNKED = ("circular", "interleaved")   # the schedules that take --repeats
RTOL = 1e-5
COLLECTIVES = ("all-to-all", "collective-permute", "all-gather", "all-reduce",
               "reduce-scatter")
QUICK = ["--layers", "8", "--width", "32", "--heads", "2", "--seq_len", "16",
         "--batch", "8", "--microbatches", "4", "--pipes", "4", "--remats", "full",
         "--stages", "2,4", "--bubble_microbatches", "1,4,8", "--bubble_repeats", "1,2",
         "--sweep_microbatches", "--against_m", "4,8", "--example_layers", "4",
         "--against_schedules", "gpipe,1f1b",
         "--time_rounds", "1"]


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--layers", type=int, default=16, help="L, the stack's depth")
  p.add_argument("--width", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq_len", type=int, default=64)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--microbatches", type=int, default=8,
                 help="M of every compiled pipelined step")
  p.add_argument("--repeats", type=int, default=2,
                 help="R of the circular steps and of question 5's interleaved one")
  p.add_argument("--pipes", type=harness.int_list, default=[4, 8],
                 help="pipe axis sizes of the compiled steps (pipe:P on P devices)")
  p.add_argument("--remats", type=harness.str_list(REMATS), default=list(REMATS))
  p.add_argument("--meshes", nargs="+", choices=MESHES, default=list(MESHES),
                 help="meshes of the resident-bytes question, separated by spaces")
  p.add_argument("--stages", type=harness.int_list, default=[2, 4, 8],
                 help="P of the bubble question")
  p.add_argument("--bubble_microbatches", type=harness.int_list,
                 default=[1, 2, 4, 8, 16, 32], help="M of the bubble question")
  p.add_argument("--bubble_repeats", type=harness.int_list, default=[1, 2, 4],
                 help="R of the bubble question (circular, and interleaved above 1)")
  p.add_argument("--sweep_microbatches", type=int, nargs="*", default=[4, 16],
                 help="more M for the first pipe size's gpipe step (temp memory "
                      "against M), besides --microbatches; none to skip")
  p.add_argument("--against_m", type=harness.int_list, default=[4, 8, 16, 32],
                 help="M of question 5 (the GPT example, each schedule against M)")
  p.add_argument("--against_schedules", type=harness.str_list(AGAINST_M),
                 default=list(AGAINST_M), help="the schedules of question 5")
  p.add_argument("--example_pipe", type=int, default=4, help="P of question 5")
  p.add_argument("--example_layers", type=int, default=8)
  p.add_argument("--example_width", type=int, default=64)
  p.add_argument("--example_heads", type=int, default=4)
  p.add_argument("--example_seq_len", type=int, default=32)
  p.add_argument("--example_vocab", type=int, default=65)
  p.add_argument("--example_micro_batch", type=int, default=2,
                 help="sequences per microbatch (the batch is M times this)")
  p.add_argument("--time_rounds", type=int, default=5,
                 help="timed steps per schedule and M, the schedules alternated")
  return p


# ---------------------------------------------------------------------------
# 1. The bubble, counted in the schedule.


def bubble_rows(stages: list[int], microbatches: list[int],
                repeats: list[int]) -> list[dict[str, Any]]:
  """One row per (schedule, P, M, R): the counted bubble and the formula's.

  The count is exact: idle stage-ticks over all stage-ticks of the table, as
  a fraction, against the formula as a fraction.
  """
  rows = []
  for schedule in BUBBLE_SCHEDULES:
    for p in stages:
      chunks = ([r for r in repeats if r > 1] if schedule == "interleaved"
                else repeats if schedule == "circular" else [1])
      for r in chunks:
        for m in microbatches:
          if schedule != "gpipe" and m < p or schedule == "interleaved" and m % p:
            # circular: a microbatch must be back at stage 0 before its next
            # repeat; the others: their steady state runs one forward and
            # one backward on every stage; interleaved: microbatches enter
            # in groups of P.
            continue
          table = st.Pipeline(microbatches=m, schedule=schedule, repeats=r).table(p)
          idle, total = int((~table.busy).sum()), int(table.busy.size)
          # Busy ticks per stage: zb's 3M (F, B, W); the others' R*M, halved
          # with their ticks (each of their ops, F or B, is one tick).
          work = 3 * m if schedule == "zb" else r * m
          counted, formula = Fraction(idle, total), Fraction(p - 1, work + p - 1)
          rows.append({"schedule": schedule, "P": p, "M": m, "R": r,
                       "ticks": int(table.busy.shape[0]), "idle_stage_ticks": idle,
                       "stage_ticks": total, "bubble": table.bubble,
                       "formula": float(formula), "counted": str(counted),
                       "exact": counted == formula,
                       "float_diff": abs(table.bubble - float(formula))})
  return rows


# ---------------------------------------------------------------------------
# The model: the benchmark GPT block, stacked, with or without a pipeline.


def transformed(cfg: models.ModelConfig, layers: int, remat: str,
                pipeline: Optional[st.Pipeline]) -> hk.Transformed:
  """``mean(stack(x)**2)`` over an L-layer stack named ``h``."""
  def loss(x):
    stack = st.Stacked(models.make_block(cfg), layers, remat=remat,
                       pipeline=pipeline, name=STACK)
    return jnp.mean(stack.fold(x) ** 2)
  return hk.without_apply_rng(hk.transform(loss))


def parse_mesh(spec: str) -> dict[str, int]:
  """``"pipe:4,data:2"`` -> ``{"pipe": 4, "data": 2}``."""
  return {name: int(size) for name, size in (part.split(":") for part in spec.split(","))}


def make_mesh(shape: dict[str, int]) -> Mesh:
  """A mesh of Auto axes (``Mesh``'s default) over the first devices it needs."""
  count = math.prod(shape.values())
  devices = np.array(jax.devices()[:count]).reshape(tuple(shape.values()))
  return Mesh(devices, tuple(shape))


def place(tree, mesh: Mesh):
  """``tree`` placed on ``mesh`` by the pipelined rule; its specs too."""
  specs = st.stacked_partition_specs(tree, mesh, stacked=[STACK], pipelined=[STACK])
  return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)), specs


def per_device_bytes(tree) -> int:
  """Bytes one device (device 0's shard of every leaf) holds of ``tree``."""
  return int(sum(leaf.addressable_shards[0].data.nbytes
                 for leaf in jax.tree_util.tree_leaves(tree)))


def total_bytes(tree) -> int:
  return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree)))


def leaf_name(path) -> str:
  return jax.tree_util.keystr(path)


# ---------------------------------------------------------------------------
# 2. Resident bytes per device.


def bytes_row(spec: str, params, opt_state, plain: dict[str, int]) -> dict[str, Any]:
  """Per-device bytes of params and Adam state on one mesh, and which leaves
  an axis leaves whole.

  ``*_ratio`` is over every leaf; ``*_ratio_split`` over the leaves that
  every sharding axis of the mesh (pipe, and fsdp when it has one) splits,
  which must be exactly ``1 / (P * fsdp)``.
  """
  shape = parse_mesh(spec)
  mesh = make_mesh(shape)
  axes = {axis: shape[axis] for axis in ("pipe", "fsdp") if shape.get(axis, 1) > 1}
  row = {"mesh": spec, "mesh_shape": shape, "expected_divisor": math.prod(axes.values()),
         "leaves_not_split": {axis: [] for axis in axes}}
  for kind, tree in (("param", params), ("opt", opt_state)):
    placed, specs = place(tree, mesh)
    held = split_held = split_total = 0
    flat_specs = jax.tree_util.tree_leaves(
        specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    for (path, leaf), spec_ in zip(jax.tree_util.tree_flatten_with_path(placed)[0],
                                   flat_specs):
      mine = int(leaf.addressable_shards[0].data.nbytes)
      held += mine
      whole_on = [axis for axis in axes if axis not in tuple(spec_)]
      for axis in whole_on:
        row["leaves_not_split"][axis].append(
            {"tree": kind, "leaf": leaf_name(path), "shape": list(leaf.shape),
             "bytes": int(leaf.nbytes)})
      if not whole_on:
        split_held, split_total = split_held + mine, split_total + int(leaf.nbytes)
    plain_bytes = plain["params" if kind == "param" else "opt_state"]
    row[f"{kind}_bytes_per_device"] = held
    row[f"{kind}_ratio"] = held / plain_bytes
    row[f"{kind}_split_bytes_fraction"] = split_total / plain_bytes
    row[f"{kind}_ratio_split"] = split_held / split_total if split_total else None
  row["exact_on_split_leaves"] = all(
      row[f"{kind}_ratio_split"] == 1 / row["expected_divisor"] for kind in ("param", "opt"))
  return row


# ---------------------------------------------------------------------------
# 3 and 4. Compiled gradient steps: temp memory, collectives, correctness.


_COLLECTIVE_RE = re.compile(
    r"^\s*\S+ = (?P<shape>.*?) (?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(", re.M)
_ARRAY_RE = re.compile(r"\b([a-z]+)(\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1}


def collectives(hlo: str, carry_tail: tuple[int, ...]) -> dict[str, dict[str, int]]:
  """Counts each collective in compiled HLO text, split by what it moves.

  An op whose arrays end in the carry's ``(seq_len, width)`` moves
  activations (microbatches between stages, the outputs' final sum); any
  other moves parameters or their gradients (``main`` checks that no
  parameter's shape ends like the carry, so the split is unambiguous). Each
  op is counted once where it appears in the program, not per loop trip;
  ``*_bytes`` adds up the bytes of what each op returns (per device).
  """
  counts = {op: {"activations": 0, "parameters": 0, "activations_bytes": 0,
                 "parameters_bytes": 0} for op in COLLECTIVES}
  for match in _COLLECTIVE_RE.finditer(hlo):
    arrays = [(kind, bits, tuple(int(d) for d in dims.split(",") if d))
              for kind, bits, dims in _ARRAY_RE.findall(match.group("shape"))]
    moves_carry = all(d[-len(carry_tail):] == carry_tail for _, _, d in arrays if d)
    size = sum(math.prod(d) * (int(bits) // 8 if bits else _BYTES.get(kind, 4))
               for kind, bits, d in arrays)
    what = "activations" if moves_carry else "parameters"
    counts[match.group("op")][what] += 1
    counts[match.group("op")][f"{what}_bytes"] += size
  return counts


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


def max_rel_diff(tree, ref) -> float:
  """The largest ``|a - b| / max|b|`` over the leaves (each leaf's own scale)."""
  out = 0.0
  for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(ref)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out = max(out, float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)))
  return out


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


# ---------------------------------------------------------------------------
# 5. The GPT example's step against M, for each schedule.


def example_loss(args, pipeline: Optional[st.Pipeline]) -> hk.Transformed:
  """The GPT example's training loss (``loss_fn``), its stack named ``h``."""
  cfg = model_config.GPTConfig(vocab_size=args.example_vocab, seq_len=args.example_seq_len,
                               num_layers=args.example_layers, num_heads=args.example_heads,
                               d_model=args.example_width, remat="full", pipeline=pipeline)
  return hk.without_apply_rng(hk.transform(lambda tokens: gpt.loss_fn(cfg, tokens)[0]))


def against_m(args, options) -> dict[str, Any]:
  """Temp memory per device, numbers against the plain model, and step time
  of the example's gradient step for each schedule of ``--against_schedules`` and M.

  The microbatch stays ``--example_micro_batch`` sequences, so the batch
  grows with M: what a run that raises M to shrink the bubble does. Per M,
  the plain model's step on one device (the reference), then each
  schedule's on ``pipe:P``; then ``--time_rounds`` rounds of one step each,
  the schedules' order alternating from round to round.
  """
  stages, rounds, schedules = args.example_pipe, args.time_rounds, args.against_schedules
  mesh = make_mesh({"pipe": stages})
  tokens = lambda m: jax.random.randint(  # noqa: E731
      jax.random.PRNGKey(m), (args.example_micro_batch * m, args.example_seq_len + 1),
      0, args.example_vocab)
  plain = example_loss(args, None)
  params = jax.device_get(jax.jit(plain.init)(jax.random.PRNGKey(0), tokens(1)))
  placed, _ = place(params, mesh)
  device = jax.devices()[0]
  rows = []
  for m in args.against_m:
    toks = tokens(m)
    compiled, _, ref_loss, ref_grads = compile_step(
        plain, jax.device_put(params, device), jax.device_put(toks, device), None, options)
    plain_temp = int(compiled.memory_analysis().temp_size_in_bytes)
    x = jax.device_put(toks, NamedSharding(mesh, PartitionSpec()))
    steps = {}
    for schedule in schedules:
      repeats = args.repeats if schedule in CHUNKED else 1
      model = example_loss(args, st.Pipeline(microbatches=m, schedule=schedule,
                                             repeats=repeats))
      compiled, seconds, loss, grads = compile_step(model, placed, x, mesh, options)
      steps[schedule] = compiled
      row = {"schedule": schedule, "microbatches": m, "stages": stages, "repeats": repeats,
             "batch": int(toks.shape[0]),
             "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
             "plain_temp_bytes": plain_temp, "compile_seconds": seconds,
             "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss),
             "grads_max_rel_diff": max_rel_diff(grads, ref_grads),
             "wall_seconds": [], "cpu_seconds": []}
      row["matches_plain"] = row["loss_rel_diff"] <= RTOL and row["grads_max_rel_diff"] <= RTOL
      rows.append(row)
    timed = {r["schedule"]: r for r in rows[-len(schedules):]}
    for i in range(rounds):
      for schedule in (schedules if i % 2 == 0 else schedules[::-1]):
        wall, cpu = instruments.clocks()
        instruments.block(steps[schedule](placed, x))
        wall_end, cpu_end = instruments.clocks()
        timed[schedule]["wall_seconds"].append(wall_end - wall)
        timed[schedule]["cpu_seconds"].append(cpu_end - cpu)
    for row in timed.values():
      row["median_wall_seconds"] = instruments.median(row["wall_seconds"])
      row["median_cpu_seconds"] = instruments.median(row["cpu_seconds"])
      harness.log(f"example pipe:{stages} {row['schedule']} M={m}: temp "
                  f"{row['temp_bytes'] / 2**20:.2f} MiB; step {row['median_wall_seconds']:.3f}s "
                  f"wall; loss rel diff {row['loss_rel_diff']:.1e}, grads "
                  f"{row['grads_max_rel_diff']:.1e}")
  by = {(r["schedule"], r["microbatches"]): r for r in rows}
  first, last = min(args.against_m), max(args.against_m)
  growth = {s: by[(s, last)]["temp_bytes"] / by[(s, first)]["temp_bytes"] for s in schedules}
  base = schedules[0]
  time_ratio = {s: {m: by[(s, m)]["median_wall_seconds"] / by[(base, m)]["median_wall_seconds"]
                    for m in args.against_m} for s in schedules[1:]}
  return {"model": {"vocab_size": args.example_vocab, "seq_len": args.example_seq_len,
                    "num_layers": args.example_layers, "num_heads": args.example_heads,
                    "d_model": args.example_width, "remat": "full",
                    "sequences_per_microbatch": args.example_micro_batch},
          "mesh": f"pipe:{stages}", "rounds": rounds, "schedules": schedules, "rows": rows,
          "temp_growth": {"from_M": first, "to_M": last, **growth},
          "step_time_ratio_over": base, "step_time_ratio": time_ratio}


def markdown(payload: dict[str, Any]) -> str:
  lines = []
  bubble = payload["bubble"]
  ms = sorted({r["M"] for r in bubble["rows"]})
  lines += ["**Bubble, counted in `st.Pipeline(...).table(P)`** (equal to the formula, as "
            f"fractions of stage-ticks, in {bubble['exact']} of {len(bubble['rows'])} "
            "cells)", "",
            "| schedule | P | " + " | ".join(f"M={m}" for m in ms) + " |",
            "|---|---:|" + "---:|" * len(ms)]
  by = {(r["schedule"], r["R"], r["P"], r["M"]): r for r in bubble["rows"]}
  for schedule, r_, p in sorted({(r["schedule"], r["R"], r["P"]) for r in bubble["rows"]},
                                key=lambda k: (BUBBLE_SCHEDULES.index(k[0]), k[1], k[2])):
    name = f"{schedule} R={r_}" if schedule in CHUNKED else schedule
    cells = [f"{by[(schedule, r_, p, m)]['bubble']:.3f}" if (schedule, r_, p, m) in by
             else "–" for m in ms]
    lines.append(f"| {name} | {p} | " + " | ".join(cells) + " |")
  lines.append("")

  res = payload["resident"]
  lines += [f"**Resident bytes per device** (plain stack on one device: "
            f"{res['plain']['params'] / 2**20:.2f} MiB parameters, "
            f"{res['plain']['opt_state'] / 2**20:.2f} MiB Adam state)", "",
            "| mesh | params / device (KiB) | x plain | Adam / device (KiB) | x plain "
            "| expected | leaves an axis leaves whole |",
            "|---|---:|---:|---:|---:|---:|---|"]
  for r in res["rows"]:
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
  lines.append("")

  comp = payload["compiled"]
  lines += ["**Gradient step, compiled: temp memory per device, collectives, and the "
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
          for op in COLLECTIVES if c[op]["parameters"])
  if moved:
    lines += ["", "Parameter collectives of the circular step, per device (in all, once "
              "per step): " + "; ".join(f"{mesh}: {text}" for mesh, text in moved.items()) +
              ". The whole stack's parameters are "
              f"{payload['resident']['plain']['params'] / 2**20:.2f} MiB."]
  sweep = payload["compiled"].get("sweep")
  if sweep:
    lines += ["", f"**Temp memory against M** ({sweep['mesh']}, {sweep['schedule']}, "
              f"remat={sweep['remat']}): " + ", ".join(
                  f"M={p['microbatches']}: {p['temp_bytes'] / 2**20:.1f} MiB, of which "
                  f"{p['saved_param_bytes'] / 2**20:.1f} MiB saved parameter copies"
                  for p in sweep["points"]) +
              f"; {sweep['slope_bytes_per_tick'] / 2**20:.2f} MiB more per tick, against "
              f"{sweep['chunk_param_bytes'] / 2**20:.2f} MiB of parameters in one chunk."]
  example = payload.get("against_m")
  if example:
    ms = sorted({r["microbatches"] for r in example["rows"]})
    by = {(r["schedule"], r["microbatches"]): r for r in example["rows"]}
    model = example["model"]
    lines += ["", f"**The GPT example against M** ({example['mesh']}; {model['num_layers']} "
              f"layers, width {model['d_model']}, {model['seq_len']} tokens, "
              f"{model['sequences_per_microbatch']} sequences per microbatch, remat=full; "
              "temp per device in MiB, the median step of "
              f"{example['rounds']} in seconds, wall)", "",
              "| schedule | " + " | ".join(f"M={m}" for m in ms) +
              f" | M={ms[-1]} / M={ms[0]} |",
              "|---|" + "---:|" * (len(ms) + 1)]
    growth, schedules = example["temp_growth"], example["schedules"]
    label = lambda s: f"{s} R={by[(s, ms[0])]['repeats']}" if s in CHUNKED else s  # noqa: E731
    for schedule in schedules:
      lines.append(f"| {label(schedule)} temp | " + " | ".join(
          f"{by[(schedule, m)]['temp_bytes'] / 2**20:.2f}" for m in ms) +
          f" | {growth[schedule]:.3f} |")
    lines.append("| plain, 1 device, temp | " + " | ".join(
        f"{by[('gpipe', m)]['plain_temp_bytes'] / 2**20:.2f}" for m in ms) + " | |")
    for schedule in schedules:
      lines.append(f"| {label(schedule)} step (s) | " + " | ".join(
          f"{by[(schedule, m)]['median_wall_seconds']:.3f}" for m in ms) + " | |")
    for schedule, ratios in example["step_time_ratio"].items():
      lines.append(f"| {schedule} / {example['step_time_ratio_over']} step | " + " | ".join(
          f"{ratios[m]:.2f}" for m in ms) + " | |")
    worst = max(max(r["loss_rel_diff"], r["grads_max_rel_diff"]) for r in example["rows"])
    lines += ["", f"Every step against the plain model on one device: largest relative "
              f"difference {worst:.1e} (loss or a gradient leaf)."]
  lines += ["", "Virtual CPU devices sharing the machine's cores: a step time is about "
            "the sum of every stage's work, idle ticks included; it says nothing of how "
            "fast a real pipeline runs."]
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  bubble = payload["bubble"]["rows"]
  res = payload["resident"]["rows"]
  comp = payload["compiled"]["rows"]
  sweep = payload["compiled"].get("sweep")
  example = payload.get("against_m")

  def fig_fn(plt):
    panels = 3 + bool(sweep) + bool(example)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.6))
    ax_b, ax_m, ax_t = axes[:3]
    stages = sorted({r["P"] for r in bubble})
    kinds = sorted({(r["schedule"], r["R"]) for r in bubble},
                   key=lambda k: (BUBBLE_SCHEDULES.index(k[0]), k[1]))
    styles = dict(zip(kinds, [("-", "o"), ("--", "s"), (":", "^"), ("-.", "v"), ("-", "D"),
                              ("--", "P"), (":", "*"), ("-.", "X"), ("-", "h")]))
    for i, p in enumerate(stages):
      for key in kinds:
        pts = sorted((r["M"], r["bubble"], r["formula"]) for r in bubble
                     if r["P"] == p and (r["schedule"], r["R"]) == key)
        if not pts:
          continue
        m, counted, formula = zip(*pts)
        ls, marker = styles[key]
        label = f"P={p} " + (f"{key[0]} R={key[1]}" if key[0] in CHUNKED else key[0])
        ax_b.plot(m, counted, ls, marker=marker, color=f"C{i}", label=label, ms=5)
        ax_b.plot(m, formula, "x", color="black", ms=4)
    ax_b.set_xscale("log", base=2)
    ms = sorted({r["M"] for r in bubble})
    ax_b.set_xticks(ms, [str(m) for m in ms])
    ax_b.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    ax_b.set_xlabel("microbatches M")
    ax_b.set_ylabel("bubble: idle stage-ticks / all")
    ax_b.set_title("Bubble counted in st.Pipeline(...).table(P)\n"
                   "(black x: (P-1)/(R·M+P-1); zb: (P-1)/(3M+P-1))")
    ax_b.legend(fontsize=6, ncol=2)

    pos = np.arange(len(res))
    ax_m.bar(pos - 0.2, [r["param_ratio"] for r in res], 0.4, label="parameters")
    ax_m.bar(pos + 0.2, [r["opt_ratio"] for r in res], 0.4, label="Adam state")
    ax_m.plot(pos, [1 / r["expected_divisor"] for r in res], "_", color="black", ms=30,
              mew=2, label="1 / (P·fsdp)")
    ax_m.set_xticks(pos, [r["mesh"].replace(",", ",\n") for r in res], fontsize=8)
    ax_m.set_ylabel("bytes per device / plain stack's")
    ax_m.set_title("Resident bytes per device\n(st.stacked_partition_specs, pipelined)")
    ax_m.legend(fontsize=8)

    remats = list(dict.fromkeys(r["remat"] for r in comp))
    cases = list(dict.fromkeys((r["mesh"], r["schedule"]) for r in comp))
    width = 0.8 / max(len(remats), 1)
    for j, remat in enumerate(remats):
      by = {(r["mesh"], r["schedule"]): r["temp_ratio"] for r in comp if r["remat"] == remat}
      ax_t.bar(np.arange(len(cases)) + (j - (len(remats) - 1) / 2) * width,
               [by.get(c, 0.0) for c in cases], width, label=f"remat={remat}",
               color=f"C{j + 2}")
    ax_t.axhline(1.0, color="gray", ls="--", lw=1, label="plain stack, 1 device")
    ax_t.set_xticks(np.arange(len(cases)), [f"{m}\n{s}" for m, s in cases], fontsize=8)
    ax_t.set_ylabel("temp bytes per device / plain stack's")
    ax_t.set_title("Gradient step: compiled temp memory per device\n"
                   f"(L={payload['config']['layers']}, M={payload['config']['microbatches']})")
    ax_t.legend(fontsize=8)

    if sweep:
      ax_s = axes[3]
      ticks = [p["ticks"] for p in sweep["points"]]
      temp = np.array([p["temp_bytes"] for p in sweep["points"]]) / 2**20
      saved = np.array([p["saved_param_bytes"] for p in sweep["points"]]) / 2**20
      ax_s.plot(ticks, temp, "o-", label="temp per device")
      ax_s.plot(ticks, saved, "s--", label="of which: saved parameter copies")
      ax_s.plot(ticks, temp - saved, "^:", color="gray", label="the rest")
      ax_s.set_xticks(ticks, [f"{t}\n(M={p['microbatches']})"
                              for t, p in zip(ticks, sweep["points"])])
      ax_s.set_xlabel("ticks R·M+P-1")
      ax_s.set_ylabel("MiB per device")
      ax_s.set_title(f"Temp memory against M\n({sweep['mesh']} {sweep['schedule']}, "
                     f"remat={sweep['remat']})")
      ax_s.legend(fontsize=8)
    if example:
      ax_e = axes[-1]
      ms = sorted({r["microbatches"] for r in example["rows"]})
      for i, schedule in enumerate(example["schedules"]):
        temp = [r["temp_bytes"] / 2**20 for m in ms for r in example["rows"]
                if (r["schedule"], r["microbatches"]) == (schedule, m)]
        ax_e.plot(ms, temp, "-", marker="osDv"[i % 4], label=f"{schedule}, per device")
      plain = [r["plain_temp_bytes"] / 2**20 for m in ms for r in example["rows"]
               if (r["schedule"], r["microbatches"]) == (example["schedules"][0], m)]
      ax_e.plot(ms, plain, "^:", color="gray", label="plain model, 1 device")
      ax_e.set_xscale("log", base=2)
      ax_e.set_yscale("log", base=2)
      ax_e.set_xticks(ms, [str(m) for m in ms])
      ax_e.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
      ax_e.set_xlabel(f"microbatches M (of {example['model']['sequences_per_microbatch']} "
                      "sequences)")
      ax_e.set_ylabel("compiled temp MiB")
      ax_e.set_title(f"GPT example's gradient step against M\n({example['mesh']}, "
                     f"{example['model']['num_layers']} layers, remat=full)")
      ax_e.legend(fontsize=8)
    for ax in axes:
      ax.grid(True, axis="y", alpha=0.3)
    return fig

  return fig_fn


def rerun_in_subprocess(argv: Optional[list[str]]) -> dict[str, Any]:
  """Runs this script with 8 devices in a new process; returns its JSON."""
  args = harness.parse_args(build_parser, QUICK, argv)
  env = dict(os.environ)
  flags = re.sub(rf"{_DEVICE_FLAG}=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags.strip()} {_DEVICE_FLAG}={NUM_DEVICES}".strip()
  given = list(argv if argv is not None else sys.argv[1:])
  harness.run_module("benchmarks.pipeline", given, env).check_returncode()
  return json.loads((args.results_dir / f"{NAME}.json").read_text(encoding="utf-8"))


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
    self.param_bytes = total_bytes(params)
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
    mesh = make_mesh({"pipe": stages})
    placed, _ = place(self.params, mesh)
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
           "collectives": collectives(compiled.as_text(), self.carry_tail),
           "compile_seconds": seconds, "loss": loss, "plain_loss": ref_loss,
           "loss_abs_diff": abs(loss - ref_loss),
           "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss),
           "grads_max_abs_diff": float(max(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                                           for a, b in zip(leaves(grads), leaves(ref_grads)))),
           "grads_max_rel_diff": max_rel_diff(grads, ref_grads)}
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


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  if jax.device_count() < NUM_DEVICES:
    # JAX started before this module could ask for 8 devices (an import
    # from a test, say): only a new process can have them.
    return rerun_in_subprocess(argv)
  args = harness.parse_args(build_parser, QUICK, argv)
  start = time.perf_counter()

  rows = bubble_rows(args.stages, args.bubble_microbatches, args.bubble_repeats)
  exact = sum(r["exact"] for r in rows)
  harness.log(f"bubble: {exact}/{len(rows)} schedules equal the formula exactly")

  cfg = models.ModelConfig("gpt", width=args.width, batch=args.batch,
                           seq_len=args.seq_len, heads=args.heads)
  x = models.example_input(cfg)
  params = jax.device_get(jax.jit(transformed(cfg, args.layers, "full", None).init)(
      jax.random.PRNGKey(0), x))
  opt_state = jax.device_get(jax.jit(optax.adam(1e-3).init)(params))
  carry_tail = (args.seq_len, args.width)
  clash = [leaf_name(p) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
           if tuple(np.shape(leaf))[-2:] == carry_tail]
  if clash:
    raise SystemExit(f"error: parameters {clash} end in (seq_len, width) = {carry_tail}, "
                     "so their collectives would pass for activations; pick another "
                     "--seq_len.")

  plain = {"params": total_bytes(params), "opt_state": total_bytes(opt_state)}
  on_one = jax.device_put((params, opt_state), jax.devices()[0])
  assert per_device_bytes(on_one) == plain["params"] + plain["opt_state"]
  res_rows = []
  for spec in args.meshes:
    row = bytes_row(spec, params, opt_state, plain)
    res_rows.append(row)
    harness.log(f"{spec}: params x{row['param_ratio']:.4f}, Adam x{row['opt_ratio']:.6f} "
                f"(expected 1/{row['expected_divisor']})")

  # LLVM's cheap settings halve compile time; they run after buffer
  # assignment, so temp bytes do not change. Checked on the first pipelined
  # step of a full run; any difference falls back to the defaults.
  steps = Steps(args, cfg, params, x, fast_compile.CODEGEN)
  fast_check = None
  if not args.quick and args.pipes and args.remats:
    fast = steps.pipelined(args.remats[0], args.pipes[0], SCHEDULES[-1], args.microbatches)
    default = steps.pipelined(args.remats[0], args.pipes[0], SCHEDULES[-1],
                              args.microbatches, options=None)
    fast_check = {"case": f"{default['mesh']} {default['schedule']} {default['remat']}",
                  "fast_temp_bytes": fast["temp_bytes"],
                  "default_temp_bytes": default["temp_bytes"],
                  "equal": fast["temp_bytes"] == default["temp_bytes"]}
    if not fast_check["equal"]:
      harness.log(f"fast compile settings changed temp bytes ({fast_check}): using "
                  "XLA's defaults")
      steps = Steps(args, cfg, params, x, None)

  comp_rows = [steps.pipelined(remat, p, schedule, args.microbatches)
               for remat in args.remats for p in args.pipes for schedule in SCHEDULES]

  sweep = None
  if args.sweep_microbatches and args.pipes and args.remats:
    # What grows with M: per tick, one chunk's parameters (see the README).
    remat, p, schedule = args.remats[0], args.pipes[0], SCHEDULES[0]
    known = {r["microbatches"]: r for r in comp_rows
             if (r["remat"], r["devices"], r["schedule"]) == (remat, p, schedule)}
    points = [known.get(m) or steps.pipelined(remat, p, schedule, m)
              for m in sorted(set(args.sweep_microbatches) | set(known))]
    _, slope = instruments.fit_line([q["ticks"] for q in points],
                                    [q["temp_bytes"] for q in points])
    sweep = {"remat": remat, "mesh": f"pipe:{p}", "schedule": schedule,
             "points": [{k: q[k] for k in ("microbatches", "ticks", "temp_bytes",
                                           "saved_param_bytes", "tick_param_bytes",
                                           "matches_plain", "grads_max_rel_diff")}
                        for q in points],
             "slope_bytes_per_tick": slope, "chunk_param_bytes": points[0]["chunk_param_bytes"],
             "slope_over_chunk_params": slope / points[0]["chunk_param_bytes"]}
    comp_checked = [q for q in points if all(q is not r for r in comp_rows)]
  else:
    comp_checked = []

  example = against_m(args, steps.options) if args.against_m else None
  example_rows = example["rows"] if example else []

  checked = comp_rows + comp_checked
  mismatches = [f"{r['mesh']} {r['schedule']} M={r['microbatches']} {r['remat']}"
                for r in checked if not r["matches_plain"]] + [
                    f"example {r['schedule']} M={r['microbatches']}"
                    for r in example_rows if not r["matches_plain"]]
  key = lambda r: f"{r['remat']}/{r['mesh']}/{r['schedule']}"  # noqa: E731
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {"model": cfg.describe(), "layers": args.layers,
                 "microbatches": args.microbatches, "repeats": args.repeats,
                 "pipes": args.pipes, "remats": args.remats, "meshes": args.meshes,
                 "devices": jax.device_count(), "rtol": RTOL,
                 "loss": "mean(stack(x)**2), value_and_grad w.r.t. the stack's params",
                 "optimizer": "optax.adam(1e-3)",
                 "sharding": "st.stacked_partition_specs(stacked=['h'], pipelined=['h'])",
                 "compiler_options": steps.options,
                 "bubble": {"stages": args.stages, "microbatches": args.bubble_microbatches,
                            "repeats": args.bubble_repeats}},
      "bubble": {"rows": rows, "exact": exact,
                 "max_float_diff": max(r["float_diff"] for r in rows)},
      "resident": {"plain": plain, "rows": res_rows},
      "compiled": {"rows": comp_rows, "sweep": sweep, "fast_compile_check": fast_check},
      "against_m": example,
      "summary": {
          "bubble_all_exact": exact == len(rows),
          "resident_ratios": {r["mesh"]: {"params": r["param_ratio"], "adam": r["opt_ratio"],
                                          "expected": 1 / r["expected_divisor"],
                                          "exact_on_split_leaves": r["exact_on_split_leaves"]}
                              for r in res_rows},
          "temp_ratio": {key(r): round(r["temp_ratio"], 4) for r in comp_rows},
          "parameter_collectives": {
              key(r): {op: c["parameters"] for op, c in r["collectives"].items()
                       if c["parameters"]} for r in comp_rows},
          "temp_slope_over_chunk_params": sweep and sweep["slope_over_chunk_params"],
          "example_temp_growth": example and example["temp_growth"],
          "example_loss_schedules_growth_at_most_1_25": example and all(
              example["temp_growth"][s] <= 1.25 for s in example["schedules"] if s != "gpipe"),
          "example_step_time_ratio": example and example["step_time_ratio"],
          "cases_checked": len(checked) + len(example_rows),
          "all_match_plain": not mismatches,
          "mismatches": mismatches,
          "max_grads_rel_diff": max((r["grads_max_rel_diff"] for r in checked + example_rows),
                                    default=0.0),
          "max_loss_rel_diff": max((r["loss_rel_diff"] for r in checked + example_rows),
                                   default=0.0),
      },
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
