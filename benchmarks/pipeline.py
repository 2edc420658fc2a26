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

Each part's rows, its table on the page and its panel of the figure are in
``benchmarks/common/``: ``pipeline_bubble`` (1), ``pipeline_resident`` (2),
``pipeline_steps`` (3 and 4) and ``pipeline_example`` (5).
"""

from __future__ import annotations

import json
import sys

from benchmarks.common import virtual_devices

NUM_DEVICES = 8

if __name__ == "__main__" and "jax" not in sys.modules:
  virtual_devices.ask_for(NUM_DEVICES)

# pylint: disable=wrong-import-position
import time
from typing import Any, Optional

import jax
import numpy as np
import optax

from benchmarks.common import fast_compile
from benchmarks.common import harness
from benchmarks.common import meshes
from benchmarks.common import models
from benchmarks.common import pipeline_bubble
from benchmarks.common import pipeline_example
from benchmarks.common import pipeline_resident
from benchmarks.common import pipeline_steps
# pylint: enable=wrong-import-position

NAME = "pipeline"
MESHES = ("pipe:8", "pipe:4,data:2", "pipe:2,fsdp:2,data:2", "pipe:4,fsdp:2")
REMATS = ("full", "nested")
SCHEDULES = ("gpipe", "circular")   # the compiled steps of question 3
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
  p.add_argument("--against_schedules", type=harness.str_list(pipeline_example.SCHEDULES),
                 default=list(pipeline_example.SCHEDULES), help="the schedules of question 5")
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


def markdown(payload: dict[str, Any]) -> str:
  lines = (pipeline_bubble.table(payload["bubble"])
           + pipeline_resident.table(payload["resident"]) + pipeline_steps.table(payload))
  if payload.get("against_m"):
    lines += pipeline_example.table(payload["against_m"])
  lines += ["", "Virtual CPU devices sharing the machine's cores: a step time is about "
            "the sum of every stage's work, idle ticks included; it says nothing of how "
            "fast a real pipeline runs."]
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  sweep = payload["compiled"].get("sweep")
  example = payload.get("against_m")

  def fig_fn(plt):
    panels = 3 + bool(sweep) + bool(example)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.6))
    pipeline_bubble.panel(axes[0], payload["bubble"]["rows"])
    pipeline_resident.panel(axes[1], payload["resident"]["rows"])
    pipeline_steps.temp_panel(axes[2], payload)
    if sweep:
      pipeline_steps.sweep_panel(axes[3], sweep)
    if example:
      pipeline_example.panel(axes[-1], example)
    for ax in axes:
      ax.grid(True, axis="y", alpha=0.3)
    return fig

  return fig_fn


def rerun_in_subprocess(argv: Optional[list[str]]) -> dict[str, Any]:
  """Runs this script with 8 devices in a new process; returns its JSON."""
  args = harness.parse_args(build_parser, QUICK, argv)
  given = list(argv if argv is not None else sys.argv[1:])
  harness.run_module("benchmarks.pipeline", given,
                     virtual_devices.environment(NUM_DEVICES)).check_returncode()
  return json.loads((args.results_dir / f"{NAME}.json").read_text(encoding="utf-8"))


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  if jax.device_count() < NUM_DEVICES:
    # JAX started before this module could ask for 8 devices (an import
    # from a test, say): only a new process can have them.
    return rerun_in_subprocess(argv)
  args = harness.parse_args(build_parser, QUICK, argv)
  start = time.perf_counter()

  rows = pipeline_bubble.rows(args.stages, args.bubble_microbatches, args.bubble_repeats)
  exact = sum(r["exact"] for r in rows)
  harness.log(f"bubble: {exact}/{len(rows)} schedules equal the formula exactly")

  cfg = models.ModelConfig("gpt", width=args.width, batch=args.batch,
                           seq_len=args.seq_len, heads=args.heads)
  x = models.example_input(cfg)
  params = jax.device_get(jax.jit(pipeline_steps.transformed(cfg, args.layers, "full", None)
                                  .init)(jax.random.PRNGKey(0), x))
  opt_state = jax.device_get(jax.jit(optax.adam(1e-3).init)(params))
  carry_tail = (args.seq_len, args.width)
  clash = [jax.tree_util.keystr(p) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
           if tuple(np.shape(leaf))[-2:] == carry_tail]
  if clash:
    raise SystemExit(f"error: parameters {clash} end in (seq_len, width) = {carry_tail}, "
                     "so their collectives would pass for activations; pick another "
                     "--seq_len.")

  plain = {"params": meshes.total_bytes(params), "opt_state": meshes.total_bytes(opt_state)}
  on_one = jax.device_put((params, opt_state), jax.devices()[0])
  assert meshes.per_device_bytes(on_one) == plain["params"] + plain["opt_state"]
  res_rows = []
  for spec in args.meshes:
    row = pipeline_resident.row(spec, params, opt_state, plain, pipeline_steps.STACK)
    res_rows.append(row)
    harness.log(f"{spec}: params x{row['param_ratio']:.4f}, Adam x{row['opt_ratio']:.6f} "
                f"(expected 1/{row['expected_divisor']})")

  # LLVM's cheap settings halve compile time; they run after buffer
  # assignment, so temp bytes do not change. Checked on the first pipelined
  # step of a full run; any difference falls back to the defaults.
  steps = pipeline_steps.Steps(args, cfg, params, x, fast_compile.CODEGEN)
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
      steps = pipeline_steps.Steps(args, cfg, params, x, None)

  comp_rows = [steps.pipelined(remat, p, schedule, args.microbatches)
               for remat in args.remats for p in args.pipes for schedule in SCHEDULES]
  sweep, comp_checked = None, []
  if args.sweep_microbatches and args.pipes and args.remats:
    sweep, comp_checked = pipeline_steps.sweep(steps, comp_rows, args.remats[0], args.pipes[0],
                                               SCHEDULES[0], args.sweep_microbatches)

  example = pipeline_example.against_m(args, steps.options) if args.against_m else None
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
                 "devices": jax.device_count(), "rtol": pipeline_steps.RTOL,
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
