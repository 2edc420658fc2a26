"""On an accelerator at the GPT-2-medium shape: how far is the scanned stack's step from the unrolled one's, where does the difference go, and how long does each stack take to initialise?

One prepared run (at most 9 minutes on one TPU v5e chip), its parts each
measured side by side in this one process:

* ``gpt``: the example's GPT at the GPT-2-medium shape (L=24, d=1024, H=16,
  T=1024, vocabulary 256, no biases) in bfloat16 compute (``GPTConfig.dtype``,
  float32 parameters), attention ``auto`` (the splash kernel on a TPU): one
  ``value_and_grad`` of ``loss_fn``, no optimizer, at batch 8 and at
  :data:`LARGE_BATCH`, where the unrolled stack without remat still fits the
  chip. Rows: ``st.BlockSeq`` and ``st.Stacked`` without remat and with the
  example's default, and at batch 8 ``st.Stacked`` with ``unroll`` 2 and 4.
  Each: the median step over alternated rounds, the compiled temp memory, the
  compile time. The pairs of :data:`PROFILED` are then profiled
  (``benchmarks/common/device_profile.py``): device time by kind of op, and the
  scanned program's minus the unrolled one's by op and output shape (a
  stacked buffer's leading layer axis dropped, so its writes group with the
  value they hold).
* ``init``: the example's model init as ``train.py`` does it, for each stack:
  the trace of the model (``step.trace_model``), then ``jax.jit(init)``
  lowered, compiled and run, then the AdamW state's init, each in seconds.

  python -m benchmarks.scan_gap           # on the accelerator: the published run
  python -m benchmarks.scan_gap --quick   # the smoke test (tiny sizes, CPU)

Writes ``benchmarks/results/scan_gap_<device>.json`` after each part (a run cut
short still reports) and its plot ``scan_gap_<device>.png``.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any, Optional

import haiku as hk
import jax
import optax

from benchmarks.common import accelerator
from benchmarks.common import device_profile
from benchmarks.common import device_runs
from benchmarks.common import fast_compile
from benchmarks.common import harness
from benchmarks.common import instruments
from examples.gpt import model as model_lib
from examples.gpt import step as step_lib

NAME = "scan_gap"
PARTS = ("gpt", "init")
DEFAULT = accelerator.DEFAULT
#: (label, stack, remat, unroll) at batch 8; the large batch runs the first four.
RUNS = (
    ("BlockSeq, none", "unrolled", "none", 1),
    ("Stacked, none", "scan", "none", 1),
    ("BlockSeq, example default", "unrolled", DEFAULT, 1),
    ("Stacked, example default", "scan", DEFAULT, 1),
    ("Stacked, none, unroll=2", "scan", "none", 2),
    ("Stacked, none, unroll=4", "scan", "none", 4),
)
#: (scanned label, unrolled label) pairs whose programs are profiled and compared.
PROFILED = (("Stacked, none", "BlockSeq, none"),
            ("Stacked, example default", "BlockSeq, example default"))
SIZES = {
    "accelerator": dict(layers=24, d_model=1024, heads=16, seq_len=1024, batches=(8, 16)),
    "quick": dict(layers=2, d_model=32, heads=2, seq_len=16, batches=(2,)),
}
#: The larger batch. Through train.py (parameters and AdamW state donated) the
#: unrolled stack without remat fits at 20; its value_and_grad here, which
#: holds the parameters and their gradients, at 16 (12.2 GiB of temp).
LARGE_BATCH = SIZES["accelerator"]["batches"][1]
DTYPE = "bfloat16"
QUICK = ["--rounds", "2", "--steps", "1", "--profile_steps", "1"]


def gpt_step(size: dict[str, int], stack: str, remat: Any, unroll: int):
  """``value_and_grad`` of one configuration's float32 loss."""
  cfg = dataclasses.replace(accelerator.gpt_config(size, stack, remat, DTYPE), unroll=unroll)
  transformed = hk.transform(lambda tokens: model_lib.loss_fn(cfg, tokens)[0])
  return jax.value_and_grad(lambda p, t: transformed.apply(p, None, t).astype("float32"))


def gpt_part(part: dict[str, Any], size: dict[str, Any], args, options, report) -> None:
  """Each batch's runs compiled, timed and recorded into ``part``; at the
  first batch, each of :data:`PROFILED`'s programs profiled after its timing
  (on a TPU a program is dropped once timed: see ``device_runs.time_runs``)."""
  held: dict[str, Any] = {}
  both = accelerator.GPTParams(size)   # a quick run's: each layout initialised once

  def params_of(stack: str) -> Any:
    """One layout's float32 parameters on the device, the other's dropped
    (both beside a GPT-2-medium step at batch 16 did not fit)."""
    if args.quick:
      return both.get(stack)
    if held.get("stack") != stack:
      held.clear()
      gc.collect()
      held.update(stack=stack, params=accelerator.GPTParams(size).get(stack))
    return held["params"]

  key, one = jax.random.PRNGKey(0), accelerator.gpt_tokens(size, 1)
  shapes = {stack: jax.eval_shape(accelerator.gpt_loss(size, stack, "none", "float32")[0].init,
                                  key, one) for stack in ("scan", "unrolled")}
  part.update({"size": dict(size), "dtype": DTYPE, "runs": []})
  profiles: dict[str, Any] = {}
  profiled = {label for pair in PROFILED for label in pair}
  for batch in args.batches or size["batches"]:
    tokens = accelerator.gpt_tokens(size, batch)
    specs = []
    for label, stack, remat, unroll in RUNS[:6 if batch == size["batches"][0] else 4]:
      record = {"label": label, "stack": stack, "remat": accelerator.remat_label(remat),
                "unroll": unroll, "dtype": DTYPE, "batch": batch}
      specs.append((record, gpt_step(size, stack, remat, unroll),
                    # On a TPU lowered from shapes: the parameters are put on the
                    # device one layout at a time (params_of); a CPU warms each
                    # program up right after compiling it (device_runs.compile_runs).
                    (params_of(stack) if device_runs.hold_programs() else shapes[stack],
                     tokens), None))
    harness.log(f"gpt, batch {batch}: compiling {len(specs)}")
    runs = device_runs.compile_runs(specs, options, args.compile_threads)
    for run in runs:
      run.args = (params_of(run.record["stack"]), tokens) if run.ok else ()
      compiled = run.compiled   # time_runs drops it on a TPU
      device_runs.time_runs([run], args.rounds, args.steps)
      if ("step_s" in run.record and batch == size["batches"][0]
          and run.record["label"] in profiled):
        try:
          profiles[run.record["label"]] = device_profile.profile(compiled, run.args,
                                                                 args.profile_steps)
        except Exception as e:  # pylint: disable=broad-except
          profiles[run.record["label"]] = device_runs.failure(e)
      run.compiled = compiled = None
      run.args = ()
      gc.collect()
      part["runs"].append(run.record)
      if "step_s" in run.record:
        harness.log(f"  {run.record['label']:32s} batch {batch} "
                    f"{1e3 * run.record['step_s']:8.1f} ms")
    del runs, specs
    gc.collect()
    report()
  compare_profiles(part, profiles, size)


def compare_profiles(part: dict[str, Any], profiles: dict[str, Any],
                     size: dict[str, Any]) -> None:
  """Each profiled pair's device time by kind, and scanned minus unrolled by op."""
  part["profiles"] = {}
  for scanned, unrolled in PROFILED:
    tables = {label: profiles[label] for label in (scanned, unrolled) if label in profiles}
    if len(tables) == 2 and all("by_op_ms" in t for t in tables.values()):
      key = device_profile.without_layers_axis(size["layers"])
      tables["scanned_minus_unrolled_ms"] = device_profile.difference(
          tables[scanned]["by_op_ms"], tables[unrolled]["by_op_ms"], key=key)
      tables["by_kind_scanned_minus_unrolled_ms"] = device_profile.difference(
          tables[scanned]["by_kind_ms"], tables[unrolled]["by_kind_ms"], top=20)
      for label in (scanned, unrolled):   # the full per-op table is long: keep the top
        tables[label]["by_op_ms"] = dict(list(tables[label]["by_op_ms"].items())[:40])
    part["profiles"][f"{scanned} vs {unrolled}"] = tables
    harness.log(f"  profiled {scanned} / {unrolled}: " + ", ".join(
        f"{t.get('device_ms', 0):.1f} ms" for t in tables.values() if isinstance(t, dict)
        and "device_ms" in t))


def init_part(part: dict[str, Any], size: dict[str, Any]) -> None:
  """The example's init of each stack, phase by phase, as ``train.py`` runs it."""
  part["runs"] = []
  mesh = jax.make_mesh((1,), ("data",))
  tokens = accelerator.gpt_tokens(size, 1)[:, :-1]
  for stack in ("scan", "unrolled"):
    cfg = accelerator.gpt_config(size, stack, "none", DTYPE)
    model = step_lib.transform(cfg)
    key = jax.random.PRNGKey(0)
    record: dict[str, Any] = {"stack": stack}
    seconds, shapes = instruments.timed(lambda: step_lib.trace_model(cfg, mesh, key, tokens))
    record["trace_model_s"] = seconds
    seconds, lowered = instruments.timed(lambda: jax.jit(model.init).lower(key, tokens))
    record["lower_s"] = seconds
    seconds, compiled = instruments.timed(lowered.compile)
    record["compile_s"] = seconds
    seconds, params = instruments.timed(lambda: instruments.block(compiled(key, tokens)))
    record["run_s"] = seconds
    optimizer = optax.adamw(1e-3)
    seconds, _ = instruments.timed(
        lambda: instruments.block(jax.jit(optimizer.init)(params)))
    record["optimizer_init_s"] = seconds
    record["total_s"] = sum(v for k, v in record.items() if k.endswith("_s"))
    record["leaves"] = len(jax.tree.leaves(shapes))
    part["runs"].append(record)
    harness.log(f"  init {stack:9s} " + ", ".join(
        f"{k} {v:.1f}" for k, v in record.items() if k.endswith("_s")))
    del params, compiled, lowered
    gc.collect()


def summarise(payload: dict[str, Any]) -> dict[str, Any]:
  """The ratios the page reads: scanned step and temp over unrolled, per batch."""
  rows = {(r["label"], r["batch"]): r for r in payload.get("gpt", {}).get("runs", [])}
  out: dict[str, Any] = {}
  for (label, batch), r in rows.items():
    base = rows.get((("BlockSeq, example default" if "default" in label
                      else "BlockSeq, none"), batch))
    if base is None or base is r or "step_s" not in r or "step_s" not in base:
      continue
    out[f"{label} / unrolled, batch {batch}"] = {
        "step": r["step_s"] / base["step_s"],
        "temp": r["temp_bytes"] / max(base["temp_bytes"], 1)}
  for r in payload.get("init", {}).get("runs", []):
    out[f"init {r['stack']} s"] = r["total_s"]
  return out


def markdown(payload: dict[str, Any]) -> str:
  lines = ["| batch | stack, remat | step ms | temp GiB | compile s | step / unrolled |",
           "|---:|---|---:|---:|---:|---:|"]
  summary = payload.get("summary", {})
  for r in payload.get("gpt", {}).get("runs", []):
    if "step_s" not in r:
      lines.append(f"| {r['batch']} | {r['label']} | {device_runs.oom_text(r)} | | | |"
                   if "out_of_memory" in r else
                   f"| {r['batch']} | {r['label']} | {r.get('error', 'not run')[:60]} | | | |")
      continue
    ratio = summary.get(f"{r['label']} / unrolled, batch {r['batch']}", {}).get("step")
    lines.append(f"| {r['batch']} | {r['label']} | {1e3 * r['step_s']:.1f} | "
                 f"{r['temp_bytes'] / 2**30:.2f} | {r['compile_s']:.1f} | "
                 f"{'' if ratio is None else f'{ratio:.2f}x'} |")
  init = payload.get("init", {}).get("runs", [])
  if init:
    lines += ["", "| init | trace | lower | compile | run | optimizer | total s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['stack']} | {r['trace_model_s']:.1f} | {r['lower_s']:.1f} | "
              f"{r['compile_s']:.1f} | {r['run_s']:.1f} | {r['optimizer_init_s']:.1f} | "
              f"{r['total_s']:.1f} |" for r in init]
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  """Step time of each run, by batch, as bars."""
  runs = [r for r in payload.get("gpt", {}).get("runs", []) if "step_s" in r]

  def plot(pyplot):
    fig, ax = pyplot.subplots(figsize=(9, 4))
    labels = [f"{r['label']} (b{r['batch']})" for r in runs]
    ax.barh(range(len(runs)), [1e3 * r["step_s"] for r in runs],
            color=["tab:blue" if r["stack"] == "unrolled" else "tab:orange" for r in runs])
    ax.set_yticks(range(len(runs)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("value_and_grad step, ms (GPT-2-medium shape, bfloat16)")
    ax.set_title(f"{payload['environment']['device']}: scanned (orange) and unrolled (blue)")
    return fig
  return plot


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--parts", type=harness.str_list(PARTS), default=list(PARTS),
                 help="which parts to run, comma-separated")
  p.add_argument("--rounds", type=int, default=3, help="timing rounds, order alternated")
  p.add_argument("--steps", type=int, default=8, help="steps per round")
  p.add_argument("--profile_steps", type=int, default=3, help="steps per profile")
  p.add_argument("--batches", type=harness.int_list, default=None,
                 help="the gpt part's batches (default: the size's, 8 and 16)")
  p.add_argument("--compile_threads", type=int, default=None,
                 help="programs compiled at once (default: 6 on an accelerator, 1 on a CPU)")
  return p


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  if args.compile_threads is None:
    args.compile_threads = 1 if jax.default_backend() == "cpu" else 6
  size = SIZES["quick" if args.quick else "accelerator"]
  options = fast_compile.CODEGEN if args.quick and jax.default_backend() == "cpu" else None
  name = f"{NAME}_{device_runs.device_slug()}"
  start = time.perf_counter()
  payload: dict[str, Any] = {
      "question": __doc__.strip().splitlines()[0], "command": harness.command_line(),
      "quick": args.quick, "name": name,
      "config": {"size": size, "parts": args.parts, "rounds": args.rounds,
                 "steps": args.steps, "profile_steps": args.profile_steps,
                 "bytes_limit": device_runs.bytes_limit()},
      "environment": harness.environment()}

  def report() -> None:
    payload["seconds"] = time.perf_counter() - start
    payload["summary"] = summarise(payload)
    payload["markdown"] = markdown(payload)
    harness.write_json(harness.results_dir(args), name, payload)

  for part_name in args.parts:
    harness.log(f"== {part_name} ({time.perf_counter() - start:.0f} s in)")
    part = payload[part_name] = {}
    try:
      if part_name == "gpt":
        gpt_part(part, size, args, options, report)
      else:
        init_part(part, size)
    except Exception as e:  # pylint: disable=broad-except
      part["failed"] = device_runs.failure(e)
    report()
  payload["seconds"] = time.perf_counter() - start
  payload["summary"] = summarise(payload)
  return harness.publish(args, name, payload, markdown, draw)


if __name__ == "__main__":
  main()
