r"""Generates text from a trained checkpoint with a KV cache through scan blocks.

  python examples/gpt/sample.py --workdir=workdir/gpt --prompt="def " --num_tokens=300
  python examples/gpt/sample.py --num_samples=4 --top_k=5   # 4 continuations, one batch

The prompt is prefilled in one call; then each new character is decoded alone,
its keys and values written into the whole cache, which enters the stack as
``st.per_layer(cache, in_place=True)`` and is updated where it lies: the
compiled step takes the cache donated, and picks the next character on the
device, so the host only dispatches one call per character.
"""

from __future__ import annotations

import math
import os
import shlex
import sys

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.gpt import restoring  # pylint: disable=g-import-not-at-top

from examples.gpt import data as data_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import decoding  # pylint: disable=g-import-not-at-top
from examples.gpt import files  # pylint: disable=g-import-not-at-top
from examples.gpt import model as model_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import model_config  # pylint: disable=g-import-not-at-top
from examples.gpt import saving  # pylint: disable=g-import-not-at-top

#: What separates the samples of --num_samples > 1 on the standard output.
SEPARATOR = "-" * 40


def define_flags() -> None:
  """This binary's flags; defined only when it runs, so train.py can import
  :func:`generate` without a clash of flag names."""
  flags.DEFINE_string("workdir", "workdir/gpt", "Folder that train.py wrote its "
                      "checkpoints to (the latest committed step is used).")
  flags.DEFINE_string("prompt", "def ", "Text to continue.")
  flags.DEFINE_integer("num_tokens", 300, "Characters to generate.", lower_bound=1)
  flags.DEFINE_float("temperature", 0.8, "0 for greedy.", lower_bound=0.0)
  flags.register_validator(
      "temperature", math.isfinite,
      message="--temperature must be a finite number >= 0 (0: greedy), e.g. 0.8.")
  flags.DEFINE_integer("top_k", 0, "Sample among the K likeliest characters "
                       "(0: off); at most the vocabulary's size.", lower_bound=0)
  flags.DEFINE_integer("num_samples", 1, "Continuations of the prompt, decoded "
                       "as one batch and printed one after another, separated "
                       "by a line of dashes.", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_enum("dtype", "float32", model_config.DTYPES, "Compute dtype of the "
                    "decode step and its KV cache: float32 (right on a CPU) or "
                    "bfloat16 (right on an accelerator, TPU or GPU; the "
                    "parameters stay float32), whichever train.py trained in.")


def main(argv):
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  workdir = FLAGS.workdir
  # What makes a checkpoint here (this binary has no --resume to drop).
  train = f"python examples/gpt/train.py --workdir={shlex.quote(workdir)}"
  problem = files.readable_folder_problem(workdir)
  if problem:
    train_first = f", or train first with {train}" if problem == files.MISSING else ""
    sys.exit(f"error: --workdir={workdir!r} {problem}; pass the folder that "
             f"train.py wrote its checkpoints to{train_first}.")
  try:
    step, meta = saving.latest(workdir)
  except saving.NotFoundError as e:
    sys.exit(f"error: {e} Train first with {train}.")
  except saving.CheckpointError as e:
    sys.exit(f"error: {e}")
  cfg = model_config.GPTConfig(**{**meta["config"], "dtype": FLAGS.dtype})
  if FLAGS.top_k > cfg.vocab_size:
    sys.exit(f"error: --top_k={FLAGS.top_k} is more than the vocabulary's "
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
        workdir, step, jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes))
    decoding.warn_if_cut(FLAGS.prompt, cfg.seq_len, "--prompt")
    texts = decoding.generate(cfg, params, dataset, FLAGS.prompt, FLAGS.num_tokens,
                     temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                     num_samples=FLAGS.num_samples, seed=FLAGS.seed)
  except (saving.CheckpointError, ValueError) as e:
    sys.exit(f"error: {e}")
  print(f"\n{SEPARATOR}\n".join(texts))


if __name__ == "__main__":
  define_flags()
  app.run(main)
