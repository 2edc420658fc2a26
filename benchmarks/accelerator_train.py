"""On an accelerator: how many tokens a second does the example's whole train step reach, by batch and remat?

The example's train step (``step.make_train_step``, AdamW included) at the
GPT-2-small shape (L=12, d=768, H=12, T=1024, vocabulary 256) in bfloat16,
with the attention ``GPTConfig``'s default picks (the splash kernel on a
TPU), at batches 4, 8, 16 and 32 under each remat of :data:`TRAIN_REMATS`:
tokens/s, model TFLOP/s and MFU against the device's peak
(``metrics.PEAK_FLOPS``). The steps of a batch are compiled first, then
timed in ``--rounds`` alternated rounds of ``--steps`` steps.

  python -m benchmarks.accelerator_train           # on the accelerator
  python -m benchmarks.accelerator_train --small   # CPU sizes
  python -m benchmarks.accelerator_train --quick   # the smoke test (tinier still)

Writes ``benchmarks/results/accelerator_train_<device>.json`` and ``.png``
(``benchmarks/common/accelerator.py``); ``--small`` and ``--quick`` write
into a scratch folder unless ``--results_dir`` is given.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional

import jax
import optax

from benchmarks.common import accelerator
from benchmarks.common import harness
from benchmarks.common.accelerator import GPTParams, gpt_config, gpt_tokens, remat_label
from benchmarks.common.device_runs import compile_runs, gib, oom_text, time_runs
from examples.gpt import metrics
from examples.gpt import step as step_lib

NAME = "accelerator_train"
#: The remat policies (label, remat), each at every batch.
TRAIN_REMATS = (("none", "none"), ("example default", accelerator.DEFAULT),
                ("full", "full"), ("nested", "nested"))


def measure(part: dict[str, Any], sizes: dict[str, Any], args, options,
            limit: Optional[int], report: Callable[[], None]) -> None:
  """The example's whole train step (AdamW included) in bfloat16 at every
  batch of ``size["batches"]`` under each of :data:`TRAIN_REMATS`, into
  ``part``: tokens/s, model TFLOP/s and MFU (where the device's peak is
  known); ``report()`` after each batch."""
  del limit   # the batches are the sizes'
  size = sizes["train"]
  peak = metrics.peak_flops(jax.devices()[0].device_kind)
  part.update({"size": size, "peak_flops": peak, "runs": []})
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
  # One set of parameters and optimizer state serves every run (none is
  # donated here): the remat and the batch do not change their shapes.
  params = GPTParams(size).get("scan")
  opt_state = optimizer.init(params)
  for batch in size["batches"]:
    tokens = gpt_tokens(size, batch)
    specs = []
    for label, remat in TRAIN_REMATS:
      cfg = gpt_config(size, "scan", remat, "bfloat16")
      flops = metrics.model_flops_per_token(
          cfg, sum(a.size for a in jax.tree.leaves(params)))
      record = {"label": label, "remat": remat_label(remat), "dtype": "bfloat16",
                "batch": batch, "attention": "splash" if cfg.uses_splash(size["seq_len"])
                else "xla", "flops_per_token": flops}
      specs.append((record, step_lib.make_train_step(step_lib.transform(cfg), optimizer),
                    (params, opt_state, tokens), None))
    harness.log(f"train, batch {batch}: compiling {len(specs)}")
    runs = compile_runs(specs, options, args.compile_threads)
    del specs
    time_runs(runs, args.rounds, args.steps)
    for run in runs:
      r = run.record
      if "step_s" in r:
        r["tokens_s"] = batch * size["seq_len"] / r["step_s"]
        r["model_tflop_s"] = r["tokens_s"] * r["flops_per_token"] / 1e12
        r["mfu"] = None if peak is None else r["model_tflop_s"] * 1e12 / peak
        harness.log(f"  {r['label']:16s} batch {batch:3d} {r['tokens_s'] / 1e3:8.1f}k tokens/s"
                    + ("" if peak is None else f"  MFU {100 * r['mfu']:.1f}%"))
      part["runs"].append(r)
    del runs
    gc.collect()
    report()



def summarise(payload: dict[str, Any]) -> tuple[None, dict[str, Optional[bool]]]:
  """No ratios and no goals: the tokens/s are the result."""
  del payload
  return None, {}


def tables(payload: dict[str, Any]) -> list[str]:
  """tokens/s by batch and remat (MFU and temp where the peak is known)."""
  part = payload["train"]
  if not part.get("runs"):
    return []
  size = part["size"]
  attention = sorted({r["attention"] for r in part["runs"]})
  lines = [f"**The example's train step** (AdamW included; L={size['layers']}, "
           f"d={size['d_model']}, T={size['seq_len']}, bfloat16 compute, "
           f"{' and '.join(attention)} attention): tokens/s by batch and remat", "",
           "| remat | " + " | ".join(f"batch {b}" for b in size["batches"]) + " |",
           "|---|" + "---:|" * len(size["batches"])]
  by = {(r["label"], r["batch"]): r for r in part["runs"]}
  for label, _ in TRAIN_REMATS:
    cells = []
    for b in size["batches"]:
      r = by.get((label, b), {})
      if "tokens_s" in r:
        cells.append(f"{r['tokens_s'] / 1e3:.1f}k" + (
            "" if r.get("mfu") is None else f" ({100 * r['mfu']:.1f}% MFU, "
            f"{gib(r['temp_bytes'])} GiB)"))
      else:
        cells.append(oom_text(r) if "out_of_memory" in r else "")
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return lines + [""]


def draw(ax: Any, payload: dict[str, Any]) -> None:
  """tokens/s against batch, one line per remat."""
  runs = payload.get("train", {}).get("runs", [])
  for label, _ in TRAIN_REMATS:
    points = sorted((r["batch"], r["tokens_s"] / 1e3) for r in runs
                    if r["label"] == label and "tokens_s" in r)
    if points:
      ax.plot(*zip(*points), marker="o", label=label)
  if runs:
    ax.set_xscale("log", base=2)
  ax.set_xlabel("batch (sequences)")
  ax.set_ylabel("tokens/s (thousands)")
  ax.set_title("The example's train step (bfloat16)")
  if runs:
    ax.legend(fontsize=8)


PART = accelerator.Part("train", __doc__, ("train",), measure, summarise, tables, draw)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  return accelerator.main(PART, argv)


if __name__ == "__main__":
  main()
