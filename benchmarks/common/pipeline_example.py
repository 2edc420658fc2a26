"""Question 5 of ``pipeline``: the GPT example's step against M, per schedule.

The GPT example's training loss (``examples/gpt/model.py``'s ``loss_fn``:
embedding, the stack, head and cross entropy), ``value_and_grad`` on
``pipe:P``, microbatches of a fixed number of sequences, M growing: compiled
temp memory per device of each schedule, each step run once against the
plain model on one device, and the step's time, the schedules timed side by
side (:func:`against_m`). Here too: the page's table (:func:`table`) and
the figure's panel (:func:`panel`).
"""

from __future__ import annotations

from typing import Any, Optional

import haiku as hk
import jax
from jax.sharding import NamedSharding, PartitionSpec

import stacktools as st
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import meshes
from benchmarks.common import pipeline_bubble
from benchmarks.common import pipeline_steps
from benchmarks.common import report
from examples.gpt import model as gpt
from examples.gpt import model_config

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


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
  mesh = meshes.make_mesh({"pipe": stages})
  tokens = lambda m: jax.random.randint(  # noqa: E731
      jax.random.PRNGKey(m), (args.example_micro_batch * m, args.example_seq_len + 1),
      0, args.example_vocab)
  plain = example_loss(args, None)
  params = jax.device_get(jax.jit(plain.init)(jax.random.PRNGKey(0), tokens(1)))
  placed, _ = meshes.place(params, mesh, pipeline_steps.STACK)
  device = jax.devices()[0]
  rtol = pipeline_steps.RTOL
  rows = []
  for m in args.against_m:
    toks = tokens(m)
    compiled, _, ref_loss, ref_grads = pipeline_steps.compile_step(
        plain, jax.device_put(params, device), jax.device_put(toks, device), None, options)
    plain_temp = int(compiled.memory_analysis().temp_size_in_bytes)
    x = jax.device_put(toks, NamedSharding(mesh, PartitionSpec()))
    steps = {}
    for schedule in schedules:
      repeats = args.repeats if schedule in pipeline_bubble.CHUNKED else 1
      model = example_loss(args, st.Pipeline(microbatches=m, schedule=schedule,
                                             repeats=repeats))
      compiled, seconds, loss, grads = pipeline_steps.compile_step(model, placed, x, mesh,
                                                                   options)
      steps[schedule] = lambda compiled=compiled: compiled(placed, x)
      row = {"schedule": schedule, "microbatches": m, "stages": stages, "repeats": repeats,
             "batch": int(toks.shape[0]),
             "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
             "plain_temp_bytes": plain_temp, "compile_seconds": seconds,
             "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss),
             "grads_max_rel_diff": instruments.max_rel_diff(grads, ref_grads),
             "wall_seconds": [], "cpu_seconds": []}
      row["matches_plain"] = row["loss_rel_diff"] <= rtol and row["grads_max_rel_diff"] <= rtol
      rows.append(row)
    timed = {r["schedule"]: r for r in rows[-len(schedules):]}
    wall, cpu = instruments.alternating_rounds(steps, rounds)
    for schedule, row in timed.items():
      row["wall_seconds"], row["cpu_seconds"] = wall[schedule], cpu[schedule]
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


def table(example: dict[str, Any]) -> list[str]:
  """The page's lines for the example: temp memory and step time per
  schedule against M, and the largest difference from the plain model."""
  ms = sorted({r["microbatches"] for r in example["rows"]})
  by = {(r["schedule"], r["microbatches"]): r for r in example["rows"]}
  model = example["model"]
  lines = ["", f"**The GPT example against M** ({example['mesh']}; {model['num_layers']} "
           f"layers, width {model['d_model']}, {model['seq_len']} tokens, "
           f"{model['sequences_per_microbatch']} sequences per microbatch, remat=full; "
           "temp per device in MiB, the median step of "
           f"{example['rounds']} in seconds, wall)", "",
           "| schedule | " + " | ".join(f"M={m}" for m in ms) + f" | M={ms[-1]} / M={ms[0]} |",
           "|---|" + "---:|" * (len(ms) + 1)]
  growth, schedules = example["temp_growth"], example["schedules"]
  def label(s):
    return f"{s} R={by[(s, ms[0])]['repeats']}" if s in pipeline_bubble.CHUNKED else s
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
  return lines + ["", f"Every step against the plain model on one device: largest relative "
                  f"difference {worst:.1e} (loss or a gradient leaf)."]


def panel(ax: Any, example: dict[str, Any]) -> None:
  """Temp memory per device against M, a line per schedule, and the plain model's."""
  ms = sorted({r["microbatches"] for r in example["rows"]})
  for i, schedule in enumerate(example["schedules"]):
    temp = [r["temp_bytes"] / 2**20 for m in ms for r in example["rows"]
            if (r["schedule"], r["microbatches"]) == (schedule, m)]
    ax.plot(ms, temp, "-", marker="osDv"[i % 4], label=f"{schedule}, per device")
  plain = [r["plain_temp_bytes"] / 2**20 for m in ms for r in example["rows"]
           if (r["schedule"], r["microbatches"]) == (example["schedules"][0], m)]
  ax.plot(ms, plain, "^:", color="gray", label="plain model, 1 device")
  report.log2_axis(ax, ms, f"microbatches M (of {example['model']['sequences_per_microbatch']} "
                   "sequences)")
  ax.set_yscale("log", base=2)
  ax.set_ylabel("compiled temp MiB")
  ax.set_title(f"GPT example's gradient step against M\n({example['mesh']}, "
               f"{example['model']['num_layers']} layers, remat=full)")
  ax.legend(fontsize=8)
