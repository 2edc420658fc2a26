r"""Generates text from a trained checkpoint with a KV cache through scan blocks.

  python examples/gpt/sample.py --workdir=workdir/gpt --prompt="def " --num_tokens=300
  python examples/gpt/sample.py --num_samples=4 --top_k=5   # 4 continuations, one batch
  python examples/gpt/sample.py --workdir=workdir/lora/merged.npz   # train.py --export_npz's
  # Each row on its own LoRA run's adapters (train.py --lora_rank), over one base:
  python examples/gpt/sample.py --workdir=workdir/gpt --adapters=workdir/lora_a,workdir/lora_b

The prompt is prefilled in one call; then each new character is decoded alone,
its keys and values written into the whole cache, which enters the stack as
``st.per_layer(cache, in_place=True)`` and is updated where it lies: the
compiled step takes the cache donated, and picks the next character on the
device, so the host only dispatches one call per character.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Sequence

from absl import app
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.gpt import data as data_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import decoding  # pylint: disable=g-import-not-at-top
from examples.gpt import distributed  # pylint: disable=g-import-not-at-top
from examples.gpt import files  # pylint: disable=g-import-not-at-top
from examples.gpt import model as model_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import model_config  # pylint: disable=g-import-not-at-top
from examples.gpt import restoring  # pylint: disable=g-import-not-at-top
from examples.gpt import sample_adapters  # pylint: disable=g-import-not-at-top
from examples.gpt import sample_flags  # pylint: disable=g-import-not-at-top
from examples.gpt import saving  # pylint: disable=g-import-not-at-top
from examples.gpt.resume import StartError  # pylint: disable=g-import-not-at-top
from examples.gpt.run_config import SampleConfig  # pylint: disable=g-import-not-at-top

#: What separates the samples of --num_samples > 1 on the standard output.
SEPARATOR = "-" * 40


def sample(config: SampleConfig) -> list[str]:
  """The continuations of ``config.prompt`` by the latest committed step in
  ``config.workdir`` (or by the export it names: train.py --export_npz's
  .npz): what the binary prints, callable from Python.

  Example::

    texts = sample(SampleConfig(workdir="workdir/gpt", num_tokens=50, num_samples=2))

  Raises:
    SystemExit: no readable checkpoint there, or a setting it does not fit;
      the message is one line.
  """
  workdir = config.workdir
  # What makes a checkpoint here (this binary has no --resume to drop).
  train = f"python examples/gpt/train.py --workdir={shlex.quote(workdir)}"
  export = saving.is_export(workdir)   # train.py --export_npz's file: a run of one step
  problem = None if export else files.readable_folder_problem(workdir)
  if problem:
    train_first = f", or train first with {train}" if problem == files.MISSING else ""
    sys.exit(f"error: --workdir={workdir!r} {problem}; pass the folder that "
             f"train.py wrote its checkpoints to{train_first}.")
  # Starts the backends quietly: JAX's line for each absent one (libtpu on a
  # CPU machine) would be the first the user reads.
  distributed.device_count()
  try:
    step, meta = saving.latest(workdir)
  except saving.NotFoundError as e:
    sys.exit(f"error: {e} " + (
        "Pass the .npz that train.py --export_npz wrote, or a run's folder."
        if export else f"Train first with {train}."))
  except saving.CheckpointError as e:
    sys.exit(f"error: {e}")
  # A LoRA run's checkpoints hold adapters: its base is the model, decoded
  # with them (as with --adapters=<that run>).
  runs, base_dir = config.adapters or (), workdir
  if "lora" in meta:
    if runs:
      sys.exit(f"error: --workdir={workdir!r} holds adapters; with --adapters pass their "
               f"base, --workdir={meta['lora']['base']!r}.")
    runs, base_dir, step = (workdir,), meta["lora"]["base"], meta["lora"]["base_step"]
    try:
      _, meta = saving.latest(base_dir)   # the model's config, dtype and characters
    except saving.CheckpointError as e:
      sys.exit(f"error: the adapters' base {base_dir!r}: {e}")
  # The run's own dtype unless --dtype says otherwise (a checkpoint from
  # before the dtype was recorded: float32, the default it trained in then).
  dtype = config.dtype or meta.get("dtype", "float32")
  cfg = model_config.GPTConfig(**{**meta["config"], "dtype": dtype})
  if config.top_k > cfg.vocab_size:
    sys.exit(f"error: --top_k={config.top_k} is more than the vocabulary's "
             f"{cfg.vocab_size} characters; pass 0 (off) up to {cfg.vocab_size}.")
  chars = meta["chars"]
  dataset = data_lib.CharDataset(chars=chars, train=np.zeros(0, np.int32),
                                 valid=np.zeros(0, np.int32))
  template = hk.without_apply_rng(hk.transform(lambda t: model_lib.forward(cfg, t)))
  shapes = jax.eval_shape(template.init, jax.random.PRNGKey(0),
                          jnp.zeros((1, cfg.seq_len), jnp.int32))
  # Whatever mesh saved it, the parameters are read onto this one device.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  try:
    params, _ = restoring.restore(
        base_dir, step, jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes))
    index = None
    if runs:   # each run's adapters on config.num_samples rows, one decode loop
      cfg, params, index = sample_adapters.with_adapters(cfg, params, runs,
                                                         config.num_samples, device)
    decoding.warn_if_cut(config.prompt, cfg.seq_len, "--prompt")
    return decoding.generate(cfg, params, dataset, config.prompt, config.num_tokens,
                             temperature=config.temperature, top_k=config.top_k,
                             num_samples=config.num_samples * max(len(runs), 1),
                             seed=config.seed, adapter_index=index)
  except (saving.CheckpointError, StartError, ValueError) as e:
    sys.exit(f"error: {e}")


# The flags are read once, here, into one frozen config (sample_flags.py).
def main(argv: Sequence[str]) -> None:
  del argv
  print(f"\n{SEPARATOR}\n".join(sample(sample_flags.config())))


if __name__ == "__main__":
  sample_flags.define()
  app.run(main)
