r"""Trains a small character-level GPT whose blocks live in a stacktools stack.

  python examples/gpt/train.py                         # defaults: ~1.2 minutes on 2 CPU cores
  python examples/gpt/train.py --remat=nested --block=scan
  python examples/gpt/train.py --stack=unrolled        # st.BlockSeq, a Python loop
  python examples/gpt/train.py --remat=full --save_names=attn_out,mlp_hidden
  python examples/gpt/train.py --remat=none:2,full:2   # per-depth segments
  python examples/gpt/train.py --remat=auto --memory_budget=32MiB  # planned
  python examples/gpt/train.py --optimizer=muon --layer_lr_decay=0.8 --freeze_layers=0:1 --layer_drop=0.1
  # Fine-tune an earlier run's parameters; or grow its 2 layers to 4 and go on:
  python examples/gpt/train.py --init_from=workdir/gpt --freeze_layers=0:2 --workdir=workdir/tuned
  python examples/gpt/train.py --init_from=workdir/gpt2 --num_layers=4 --depth_map=zero_new \
      --init_opt_state=mapped --workdir=workdir/gpt4
  # Low-rank adapters on a trained run (only they train; checkpoints hold them alone):
  python examples/gpt/train.py --init_from=workdir/gpt --lora_rank=8 --lora_targets=attn,mlp \
      --data_path=other.txt --workdir=workdir/lora --export_npz=workdir/lora/merged.npz
  # A pipeline of 4 stages x 2 repeats, 8 microbatches, 2-way data parallel:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/gpt/train.py \
      --mesh=pipe:4,data:2 --pipeline=circular --pipeline_repeats=2 --microbatches=8 --num_layers=8

Logs step, train and validation loss, tokens/s and step time (of training
alone: evaluation and checkpoints are left out), with the model TFLOP/s and MFU
where the device's peak is known (a TPU, a GPU; --peak_flops), and at start-up
the compiled temp memory of the train step (which is what --remat changes).
On an accelerator, train in mixed precision: --dtype=bfloat16.
Writes metrics.jsonl and loss.png (with matplotlib installed) to --workdir,
each atomically (with --remat=auto also remat_plan.json, the report of every
candidate and the chosen plan, and remat_plan-<hash>.json, the plan that a
--resume or rerun reuses), and Orbax checkpoints to --workdir/checkpoints/<step>/
(every --checkpoint_every steps and at the end, asynchronously, each process
its own shards, the last --keep_checkpoints kept); a start removes what a
killed run's writes left there. --export_npz also writes the final parameters
(a LoRA run's merged into its base) as one .npz, with the run's metadata:
sample.py --workdir and --init_from read it as they read a run.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

from absl import app
from absl import logging
import jax

# Runnable as a script from anywhere: put the repository root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.gpt import decoding  # pylint: disable=g-import-not-at-top
from examples.gpt import distributed  # pylint: disable=g-import-not-at-top
from examples.gpt import flags as flags_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import lora_start  # pylint: disable=g-import-not-at-top
from examples.gpt import metrics  # pylint: disable=g-import-not-at-top
from examples.gpt import saving  # pylint: disable=g-import-not-at-top
from examples.gpt import start_up  # pylint: disable=g-import-not-at-top
from examples.gpt.run_config import TrainConfig  # pylint: disable=g-import-not-at-top


def train_loop(run: start_up.Run) -> Any:
  """Trains from ``run.start_step`` to ``run.last_step``.

  Logs, evaluates, appends to ``run.records`` (and writes them) and saves
  checkpoints as ``run.config`` says.

  Args:
    run: what ``start_up.set_up`` made.

  Returns:
    The final parameters.
  """
  config, params, opt_state, last_step = run.config, run.params, run.opt_state, run.last_step
  # The losses of the steps since the last log line, and the seconds they
  # took: the clock runs while steps run and stops (once the steps dispatched
  # so far are done) for evaluation and checkpoints.
  window_losses, stopwatch = [], metrics.Stopwatch()
  peak = metrics.run_peak_flops(config.peak_flops)   # None: no MFU on the log lines
  throughput = metrics.Throughput(
      config.batch_size * config.seq_len, peak=peak, flops_per_token=None if peak is None
      else metrics.model_flops_per_token(
          run.cfg, sum(x.size for x in jax.tree_util.tree_leaves(params))))
  for step in range(run.start_step + 1, last_step + 1):
    batch = run.batches.next()
    params, opt_state, loss, stats = run.compiled_step(params, opt_state, batch)
    window_losses.append(loss)
    record = None
    if step % config.log_every == 0 or step == last_step:
      losses = [float(l) for l in window_losses]  # waits for the steps
      record, message = throughput.record(step, losses, stopwatch.lap(), stats)
      logging.info(message)
      window_losses = []
    if step % config.eval_every == 0 or step == last_step:
      stopwatch.stop(loss)  # evaluation is not training time
      record = record or {"step": step}
      record["valid_loss"] = run.evaluate(params)
      logging.info("step %5d  validation loss %.4f", step, record["valid_loss"])
      stopwatch.start()
    if record is not None:
      run.records.append(record)
      if run.is_chief:
        metrics.write_metrics(run.metrics_path, run.records)
    if (config.checkpoint_every and step % config.checkpoint_every == 0) or step == last_step:
      stopwatch.stop(loss)  # nor is writing a checkpoint
      run.save_checkpoint(step, params, opt_state)
      stopwatch.start()
  return params


def finish(run: start_up.Run, params: Any) -> None:
  """Logs the final loss, waits for the last checkpoint; on the chief, exports
  (--export_npz), plots the losses and samples.

  Args:
    run: what ``start_up.set_up`` made, its records filled by :func:`train_loop`.
    params: the final parameters.
  """
  config, dataset, records = run.config, run.dataset, run.records
  # Host copies, for sampling and the export (a collective; checkpoints never gather).
  host_params = (distributed.to_host(run.merged(params))
                 if config.sample_tokens or config.export_npz else None)
  logging.info("Final validation loss %.4f (unigram entropy %.4f).",
               records[-1].get("valid_loss", float("nan")) if records else float("nan"),
               dataset.unigram_entropy())
  # Every process waits until the last save is committed.
  run.checkpoints.close()
  if not run.is_chief:
    return
  if config.export_npz:   # a run of one step, for sample.py and --init_from
    meta = {**start_up.model_meta(run.cfg, dataset.chars), "step": run.last_step,
            "workdir": os.path.abspath(run.workdir)}
    logging.info("Wrote %s", saving.export_npz(config.export_npz, host_params, meta))
  metrics.plot_losses(run.workdir, records, dataset.unigram_entropy())
  if config.sample_tokens:
    # Sampling is small: it runs on process 0 alone, from host copies.
    prompt = "".join(c for c in config.sample_prompt if c in dataset.chars)
    if prompt != config.sample_prompt:
      logging.warning("--sample_prompt has characters outside the corpus; "
                      "sampling from %r instead.", prompt or dataset.chars[0])
    decoding.warn_if_cut(prompt, run.cfg.seq_len, "--sample_prompt")
    (text,) = decoding.generate(run.cfg.without_adapters(), host_params, dataset, prompt or dataset.chars[0],
                                config.sample_tokens, temperature=0.8, seed=config.seed)
    logging.info("Sample (KV-cache decoding through scan blocks):\n%s", text)


def train(config: TrainConfig, workdir: str) -> Any:
  """Trains the GPT ``config`` describes, writing its outputs to ``workdir``.

  What the binary does for its flags, callable from Python: checks, sets up
  (``start_up.set_up``), trains (:func:`train_loop`), then logs, exports,
  plots and samples (:func:`finish`).

  Example::

    config = TrainConfig(num_layers=2, d_model=32, steps=20, sample_tokens=0)
    params = train(config, "/tmp/gpt")

  Args:
    config: what the run is told: train.py's flags but --workdir.
    workdir: where its metrics, plots and checkpoints go (--workdir).

  Returns:
    The final parameters.

  Raises:
    SystemExit: a check at start-up failed; the message is its one line.
  """
  run = (lora_start if config.lora_rank else start_up).set_up(config, workdir)
  params = train_loop(run)
  finish(run, params)
  return params


# The flags are read once, here, into one frozen config (flags.py); the
# module docstring above is the binary's usage message.
def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments {argv[1:]}; every option is a --flag.")
  train(flags_lib.config(), flags_lib.workdir())


if __name__ == "__main__":
  app.run(main)
