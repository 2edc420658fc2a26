"""What does an asynchronous Orbax checkpoint cost the training step?

The GPT example's train step at ``train.py``'s default size (4 layers, width
128, 4 heads, 64 characters, batch 16, ``remat=full``, AdamW with gradient
clipping) on one device, run for ``--steps`` steps in one process. Every step
is timed on its own (from its dispatch until its outputs are ready). Every
``--every`` steps the step is followed by a save of the parameters and the
optimizer state through ``examples/gpt/saving.Manager``, the saver that
``train.py`` uses: the saves alternate between an asynchronous manager (as
``train.py`` saves: ``save()`` waits for the arrays to be copied off the
devices, then a background thread writes them while training goes on) and a
synchronous one (the step waits for the whole write, as the hand-written
``.npz`` writer did), so both meet the same machine load. For each kind:

* the saving step (its own work plus ``save()``'s blocking part) over the
  median of the ``--window`` steps just before it (a local baseline, so that
  drift in the machine's load cancels);
* the ``--window`` steps after it, during which the background write runs;
* the extra time per save in all (saving step + window - baseline), in steps;
* how many later steps were dispatched while a save was still under way.

  python -m benchmarks.checkpoint_cost            # full run, ~1 min on 2 cores
  python -m benchmarks.checkpoint_cost --quick    # seconds (the smoke test)

Writes ``benchmarks/results/checkpoint_cost.json`` and ``checkpoint_cost.png``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import haiku as hk
import jax
import numpy as np
import optax

from benchmarks.common import fast_compile
from benchmarks.common import harness
from benchmarks.common import instruments
from examples.gpt import model as model_lib
from examples.gpt import model_config
from examples.gpt import saving

NAME = "checkpoint_cost"
KINDS = ("async", "sync")
QUICK = ["--d_model", "32", "--num_layers", "2", "--num_heads", "2", "--seq_len", "16",
         "--batch_size", "4", "--steps", "14", "--every", "4", "--window", "1",
         "--warmup", "2"]


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--num_layers", type=int, default=4)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--seq_len", type=int, default=64)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--vocab_size", type=int, default=96)
  p.add_argument("--remat", default="full")
  p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
  p.add_argument("--steps", type=int, default=600, help="timed steps")
  p.add_argument("--every", type=int, default=10, help="steps between saves")
  p.add_argument("--window", type=int, default=4,
                 help="steps after a save counted as its aftermath")
  p.add_argument("--workdir", type=Path, default=None,
                 help="where the checkpoints go (default: a temporary folder, removed)")
  return p


def folder_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path)
             for f in names)


def summarise(seconds: list[float], saves: dict[int, str], every: int,
              window: int) -> dict[str, Any]:
  """Ratios of each saving step and its window over the steps just before it.

  Each save is compared with the median of the ``window`` steps before it
  (none of which saves, as ``every > window``): a local baseline, so that
  drift in the machine's load between saves cancels.
  """
  near = set()
  for step in saves:
    near.update(range(step, step + window + 1))
  quiet = [s for i, s in enumerate(seconds) if i not in near]
  out = {"baseline_seconds": instruments.median(quiet), "quiet_steps": len(quiet)}
  for kind in KINDS:
    steps = [i for i, k in saves.items()
             if k == kind and i >= window and i + window < len(seconds)]
    local = [instruments.median(seconds[i - window:i]) for i in steps]
    save_step = [seconds[i] / b for i, b in zip(steps, local)]
    after = [float(np.mean(seconds[i + 1:i + 1 + window])) / b for i, b in zip(steps, local)]
    extra = [sum(seconds[i:i + 1 + window]) - (1 + window) * b for i, b in zip(steps, local)]
    extra_steps = [e / b for e, b in zip(extra, local)]
    out[kind] = {
        "saves": len(steps),
        "save_step_seconds": instruments.median(seconds[i] for i in steps),
        "save_step_ratio": instruments.median(save_step),
        "window_step_ratio": instruments.median(after),
        "extra_seconds_per_save": instruments.median(extra),
        "extra_steps_per_save": instruments.median(extra_steps),
        "overhead_per_step_at_this_interval": instruments.median(extra_steps) / every,
    }
  return out


def markdown(payload: dict[str, Any]) -> str:
  s, cfg = payload["summary"], payload["config"]
  lines = [f"Model: {cfg['num_params']:,} parameters; one checkpoint (parameters + "
           f"AdamW state) is {payload['checkpoint_bytes'] / 2**20:.2f} MiB on disk. "
           f"Median step: {s['baseline_seconds'] * 1e3:.1f} ms (of the "
           f"{s['quiet_steps']} steps with no save in the {cfg['window']} steps before).",
           "",
           f"| save | saves | saving step / step before | next {cfg['window']} steps / "
           "step before | extra per save (ms) | extra per save (steps) | steps run while "
           "the save was under way |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for kind in KINDS:
    k = s[kind]
    overlap = payload["overlap_steps"].get(kind)
    lines.append(f"| {kind} | {k['saves']} | {k['save_step_ratio']:.2f} | "
                 f"{k['window_step_ratio']:.2f} | {k['extra_seconds_per_save'] * 1e3:.1f} | "
                 f"{k['extra_steps_per_save']:.2f} | "
                 f"{'n/a' if overlap is None else f'{overlap:.1f}'} |")
  lines.append("")
  lines.append(f"Saves every {cfg['every']} steps, alternating asynchronous and "
               "synchronous in one run. Each save is measured against the median "
               f"of the {cfg['window']} steps just before it; ratios and extras are "
               "medians over saves.")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  seconds = np.asarray(payload["step_seconds"]) * 1e3
  saves = {int(k): v for k, v in payload["saves"].items()}

  def fig_fn(plt):
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.plot(np.arange(len(seconds)), seconds, color="gray", lw=0.8, label="step")
    for kind, color in zip(KINDS, ("C0", "C3")):
      steps = [i for i, k in saves.items() if k == kind]
      ax.plot(steps, seconds[steps], "o", color=color, label=f"{kind} save")
    ax.axhline(payload["summary"]["baseline_seconds"] * 1e3, color="black", ls="--",
               lw=0.8, label="median step")
    ax.set_yscale("log")
    ax.set_xlabel("timed step")
    ax.set_ylabel("ms (dispatch to ready, save included)")
    ax.set_title("Step time around checkpoint saves: asynchronous vs synchronous")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    return fig

  return fig_fn


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  start = time.perf_counter()
  cfg = model_config.GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len,
                               num_layers=args.num_layers, num_heads=args.num_heads,
                               d_model=args.d_model, remat=args.remat)
  model = hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)))
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, 2e-3, 2, 1000, 2e-4), weight_decay=0.01))
  tokens = np.random.default_rng(0).integers(
      0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1)).astype(np.int32)
  batch = jax.device_put(tokens)
  # --quick compiles with XLA's cheap LLVM settings: a smoke test checks
  # that the script runs, not how fast the code is.
  options = fast_compile.CODEGEN if args.quick else None

  def compiled(fn, *example):
    return jax.jit(fn).lower(*example).compile(compiler_options=options)

  key = jax.random.PRNGKey(0)
  params = compiled(model.init, key, batch)(key, batch)
  opt_state = compiled(optimizer.init, params)(params)

  def step_fn(params, opt_state, tokens):
    (loss, _), grads = jax.value_and_grad(model.apply, has_aux=True)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  train_step = compiled(step_fn, params, opt_state, batch)

  for _ in range(args.warmup):
    params, opt_state, loss = instruments.block(train_step(params, opt_state, batch))
  num_params = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
  root = str(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="checkpoint_cost_")
  managers = {kind: saving.Manager(os.path.join(root, kind), keep=2,
                                   asynchronous=kind == "async") for kind in KINDS}
  seconds, saves, in_flight = [], {}, {kind: [] for kind in KINDS}
  pending = None  # (kind, step index) of the last asynchronous save
  meta = {"note": "benchmarks/checkpoint_cost.py"}
  try:
    for i in range(args.steps):
      t0 = time.perf_counter()
      params, opt_state, loss = train_step(params, opt_state, batch)
      if (i + 1) % args.every == 0:
        kind = KINDS[len(saves) % 2]
        managers[kind].save(i + 1, params, opt_state, meta)
        saves[i] = kind
      instruments.block((params, opt_state, loss))
      seconds.append(time.perf_counter() - t0)
      if i in saves and saves[i] == "async":
        pending = i
      if pending is not None and not managers["async"].saving():
        in_flight["async"].append(i - pending)  # later steps run during the write
        pending = None
    for manager in managers.values():
      manager.close()
    checkpoint_bytes = folder_bytes(os.path.join(root, "async", saving.FOLDER,
                                                 str(max(s + 1 for s, k in saves.items()
                                                         if k == "async"))))
  finally:
    if args.workdir is None:
      shutil.rmtree(root, ignore_errors=True)
  summary = summarise(seconds, saves, args.every, args.window)
  for kind in KINDS:
    harness.log(f"{kind}: saving step {summary[kind]['save_step_ratio']:.2f}x the steps before, "
                f"next steps {summary[kind]['window_step_ratio']:.2f}x, "
                f"{summary[kind]['extra_steps_per_save']:.2f} steps extra per save")
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {"gpt": {"vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len,
                         "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                         "d_model": cfg.d_model, "remat": args.remat},
                 "batch_size": args.batch_size, "num_params": num_params,
                 "warmup": args.warmup, "steps": args.steps, "every": args.every,
                 "window": args.window, "devices": jax.device_count(),
                 "saver": "examples/gpt/saving.Manager (Orbax CheckpointManager)"},
      "checkpoint_bytes": checkpoint_bytes,
      "step_seconds": seconds,
      "saves": {str(i): k for i, k in saves.items()},
      "overlap_steps": {"async": (instruments.median(in_flight["async"])
                                  if in_flight["async"] else None), "sync": 0.0},
      "summary": summary,
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
