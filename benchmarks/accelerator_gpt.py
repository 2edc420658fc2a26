"""On an accelerator: how does the scanned stack's gradient step compare with the unrolled one's, in time and memory?

The example's GPT (``examples/gpt/model.py``) at the GPT-2-small shape
(L=12, d=768, H=12, T=1024, vocabulary 256, batch 8, no biases): one
``value_and_grad`` of ``loss_fn`` (no optimizer) for every stack and policy
of :data:`GPT_RUNS` (``st.BlockSeq`` and ``st.Stacked`` with no remat,
``save_all``, ``full`` and the example's default; ``hk.layer_stack``, the
anchor), in float32 and in bfloat16 compute (float32 parameters, the model
run in bfloat16: ``GPTConfig.dtype``, the example's mixed precision). Each:
the median step, the compiled temp memory, the compile time; a program that
does not fit is recorded as out of memory, with the bytes XLA says it
needed.

The batch is halved until the unrolled float32 step without remat fits in
80% of ``memory_stats()["bytes_limit"]``. The steps are compiled first
(traced one by one, then compiled ``--compile_threads`` at a time), then
timed in ``--rounds`` rounds that alternate their order (A B C, C B A, ...);
a step's time is the median over rounds of the mean of ``--steps`` steps.

  python -m benchmarks.accelerator_gpt           # on the accelerator
  python -m benchmarks.accelerator_gpt --small   # CPU sizes
  python -m benchmarks.accelerator_gpt --quick   # the smoke test (tinier still)

Writes ``benchmarks/results/accelerator_gpt_<device>.json`` and ``.png``
(``benchmarks/common/accelerator.py``); ``--small`` and ``--quick`` write
into a scratch folder unless ``--results_dir`` is given.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional

import jax

from benchmarks.common import accelerator
from benchmarks.common import harness
from benchmarks.common.accelerator import GPTParams, gpt_loss, gpt_tokens, remat_label
from benchmarks.common.device_runs import cells, compile_runs, fit_batch, ratio, time_runs, x

NAME = "accelerator_gpt"
DTYPES = ("float32", "bfloat16")
DEFAULT = accelerator.DEFAULT
#: (label, stack, remat) of the GPT configurations, in the table's order.
GPT_RUNS = (
    ("BlockSeq (unrolled), none", "unrolled", "none"),
    ("Stacked, none", "scan", "none"),
    ("Stacked, save_all", "scan", "save_all"),
    ("hk.layer_stack, no remat", "hk_layer_stack", None),
    ("hk.layer_stack + hk.remat", "hk_layer_stack", "full"),
    ("Stacked, full", "scan", "full"),
    ("Stacked, example default", "scan", DEFAULT),
    ("BlockSeq, example default", "unrolled", DEFAULT),
)
#: (label of the scanned run, label of the unrolled run) whose ratios are reported.
RATIOS = {"none": ("Stacked, none", "BlockSeq (unrolled), none"),
          "example default": ("Stacked, example default", "BlockSeq, example default")}


def measure(part: dict[str, Any], sizes: dict[str, Any], args, options,
            limit: Optional[int], report: Callable[[], None]) -> None:
  """Every configuration of :data:`GPT_RUNS` in each of :data:`DTYPES`, into
  ``part``; ``report()`` after each dtype."""
  size = sizes["gpt"]
  params = GPTParams(size)
  label, stack, remat = GPT_RUNS[0]
  step = lambda dtype, stack, remat: jax.value_and_grad(  # noqa: E731
      gpt_loss(size, stack, remat, dtype)[1])
  batch, fitted, tries = fit_batch(
      size["batch"], lambda b: jax.jit(step("float32", stack, remat)).lower(
          params.get(stack), gpt_tokens(size, b)).compile(compiler_options=options),
      limit, "gpt")
  part.update({"size": {**size, "batch": batch}, "batch_fitting": tries,
               "bf16_compute": "GPTConfig.dtype (the example's jmp mixed precision)",
               "runs": []})
  tokens = gpt_tokens(size, batch)
  for dtype in DTYPES:
    harness.log(f"gpt, {dtype}, batch {batch}: compiling")
    specs = []
    for label, stack, remat in GPT_RUNS:
      record = {"label": label, "stack": stack, "remat": remat_label(remat),
                "dtype": dtype, "batch": batch}
      given = fitted if (dtype, label) == ("float32", GPT_RUNS[0][0]) else None
      specs.append((record, step(dtype, stack, remat), (params.get(stack), tokens), given))
    runs = compile_runs(specs, options, args.compile_threads)
    del specs
    harness.log(f"gpt, {dtype}: timing {sum(r.ok for r in runs)} steps, "
                f"{args.rounds} rounds of {args.steps}")
    time_runs(runs, args.rounds, args.steps)
    part["runs"] += [r.record for r in runs]
    for r in runs:
      if "step_s" in r.record:
        harness.log(f"  {r.record['label']:32s} [{dtype}] {1e3 * r.record['step_s']:8.1f} ms")
    del runs
    fitted = None
    gc.collect()
    report()



def summarise(payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Optional[bool]]]:
  """Stacked over BlockSeq, step and temp, per dtype and remat; the goals."""
  goals: dict[str, Optional[bool]] = {}
  by = {(r["label"], r["dtype"]): r for r in payload["gpt"].get("runs", [])}
  gpt = {}
  for dtype in DTYPES:
    for key, (scanned, unrolled) in RATIOS.items():
      s, u = by.get((scanned, dtype), {}), by.get((unrolled, dtype), {})
      gpt[f"{dtype}, {key}"] = {
          "stacked_over_blockseq_step": ratio(s.get("step_s"), u.get("step_s")),
          "stacked_over_blockseq_temp": ratio(s.get("temp_bytes"), u.get("temp_bytes"))}
    none = gpt[f"{dtype}, none"]
    goals[f"gpt {dtype}: Stacked none <= 1.05x BlockSeq (step and temp)"] = (
        None if None in none.values() else max(none.values()) <= 1.05)
  default = gpt["float32, example default"]["stacked_over_blockseq_step"]
  goals["gpt float32: example default scanned <= 1.0x unrolled (step)"] = (
      None if default is None else default <= 1.0)
  return gpt, goals


def tables(payload: dict[str, Any]) -> list[str]:
  """Every configuration's step, temp and compile, float32 and bfloat16."""
  gpt = payload["gpt"]
  if not gpt.get("runs"):
    return []
  size = gpt["size"]
  by = {(r["label"], r["dtype"]): r for r in gpt["runs"]}
  lines = [f"**GPT, one `value_and_grad` step** (L={size['layers']}, d={size['d_model']}, "
           f"H={size['heads']}, T={size['seq_len']}, vocabulary {accelerator.VOCAB}, batch "
           f"{size['batch']}; bf16: {gpt['bf16_compute']}; median of "
           f"{payload['config']['rounds']} alternated rounds; compile s: tracing, then "
           f"XLA, {payload['config'].get('compile_threads', 1)} programs at once):", "",
           "| stack, remat | f32 step ms | f32 temp GiB | f32 compile s | "
           "bf16 step ms | bf16 temp GiB | bf16 compile s |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for label, _, _ in GPT_RUNS:
    lines.append(f"| {label} | " + " | ".join(
        cells(by.get((label, "float32"))) + cells(by.get((label, "bfloat16")))) + " |")
  ratios = [f"{key}: step {x(r['stacked_over_blockseq_step'])}, temp "
            f"{x(r['stacked_over_blockseq_temp'])}"
            for key, r in payload["summary"]["gpt"].items()]
  return lines + ["", "Stacked over BlockSeq: " + "; ".join(ratios) + ".", ""]


def draw(ax: Any, payload: dict[str, Any]) -> None:
  """Step time against temp memory, one point per configuration and dtype."""
  for dtype, marker in zip(DTYPES, ("o", "s")):
    for r in payload.get("gpt", {}).get("runs", []):
      if r["dtype"] == dtype and "step_s" in r:
        ax.scatter(r["temp_bytes"] / 2**30, 1e3 * r["step_s"], marker=marker,
                   color="C0" if dtype == "float32" else "C1")
        ax.annotate(r["label"], (r["temp_bytes"] / 2**30, 1e3 * r["step_s"]), fontsize=6,
                    xytext=(4, 2), textcoords="offset points")
    ax.scatter([], [], marker=marker, color="C0" if dtype == "float32" else "C1",
               label=dtype if dtype == "float32" else "bfloat16 compute")
  if payload.get("gpt", {}).get("runs"):
    ax.set_xscale("log")
  ax.set_xlabel("compiled temp memory (GiB, log)")
  ax.set_ylabel("step (ms)")
  ax.set_title("GPT: step time against memory")
  ax.legend(fontsize=8)


PART = accelerator.Part("gpt", __doc__, ("gpt",), measure, summarise, tables, draw)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  return accelerator.main(PART, argv)


if __name__ == "__main__":
  main()
