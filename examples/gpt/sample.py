r"""Generates text from a trained checkpoint with a KV cache through scan blocks.

  python examples/gpt/sample.py --workdir=workdir/gpt --prompt="def " --num_tokens=300

The prompt is prefilled in one call; then each new character is decoded alone,
its keys and values written into a per-layer cache that enters the stack as
``st.per_layer(cache)`` and comes back as the stack's scan output.
"""

from __future__ import annotations

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

from examples.gpt import checkpoint  # pylint: disable=g-import-not-at-top
from examples.gpt import data as data_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import files  # pylint: disable=g-import-not-at-top
from examples.gpt import model as model_lib  # pylint: disable=g-import-not-at-top


def generate(cfg: model_lib.GPTConfig, params, dataset: data_lib.CharDataset,
             prompt: str, num_tokens: int, *, temperature: float = 1.0,
             seed: int = 0) -> str:
  """``prompt`` followed by ``num_tokens`` sampled characters.

  When the cache is full (``cfg.seq_len`` positions), the last half of the
  window is prefilled again from position 0 and decoding goes on.

  Args:
    cfg: the model config.
    params: the model's parameters.
    dataset: for the vocabulary.
    prompt: text to continue; at least one character.
    num_tokens: how many characters to add.
    temperature: 0 for greedy decoding.
    seed: sampling seed.

  Returns:
    The prompt and its continuation.
  """
  if not prompt:
    raise ValueError("generate needs a prompt of at least one character.")
  model = hk.without_apply_rng(hk.transform(
      lambda t, c, p: model_lib.decode(cfg, t, c, p)))
  step = jax.jit(model.apply)
  ids = list(dataset.encode(prompt)[-cfg.seq_len:])
  key = jax.random.PRNGKey(seed)

  def prefill(window):
    cache = model_lib.init_cache(cfg, 1)
    logits, cache = step(params, jnp.asarray([window], jnp.int32), cache, 0)
    return logits[0, -1], cache, len(window)

  logits, cache, pos = prefill(ids)
  for _ in range(num_tokens):
    if temperature > 0:
      key, sub = jax.random.split(key)
      token = int(jax.random.categorical(sub, logits / temperature))
    else:
      token = int(jnp.argmax(logits))
    ids.append(token)
    if pos == cfg.seq_len:
      logits, cache, pos = prefill(ids[-(cfg.seq_len // 2):])
      continue
    logits, cache = step(params, jnp.asarray([[token]], jnp.int32), cache, pos)
    logits, pos = logits[0, -1], pos + 1
  return prompt + dataset.decode(ids[len(dataset.encode(prompt)[-cfg.seq_len:]):])


def define_flags() -> None:
  """This binary's flags; defined only when it runs, so train.py can import
  :func:`generate` without a clash of flag names."""
  flags.DEFINE_string("workdir", "workdir/gpt", "Folder that train.py wrote its "
                      "checkpoints to (the latest committed step is used).")
  flags.DEFINE_string("prompt", "def ", "Text to continue.")
  flags.DEFINE_integer("num_tokens", 300, "Characters to generate.", lower_bound=1)
  flags.DEFINE_float("temperature", 0.8, "0 for greedy.", lower_bound=0.0)
  flags.DEFINE_integer("seed", 0, "Sampling seed.")


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
    step, meta = checkpoint.latest(workdir)
  except checkpoint.NotFoundError as e:
    sys.exit(f"error: {e} Train first with {train}.")
  except checkpoint.CheckpointError as e:
    sys.exit(f"error: {e}")
  cfg = model_lib.GPTConfig(**meta["config"])
  chars = meta["chars"]
  dataset = data_lib.CharDataset(chars=chars, train=np.zeros(0, np.int32),
                                 valid=np.zeros(0, np.int32))
  template = hk.without_apply_rng(hk.transform(lambda t: model_lib.forward(cfg, t)))
  shapes = jax.eval_shape(template.init, jax.random.PRNGKey(0),
                          jnp.zeros((1, cfg.seq_len), jnp.int32))
  # Whatever mesh saved it, the parameters are read onto this one device.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  try:
    params, _ = checkpoint.restore(
        workdir, step, jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes))
    text = generate(cfg, params, dataset, FLAGS.prompt, FLAGS.num_tokens,
                    temperature=FLAGS.temperature, seed=FLAGS.seed)
  except (checkpoint.CheckpointError, ValueError) as e:
    sys.exit(f"error: {e}")
  print(text)


if __name__ == "__main__":
  define_flags()
  app.run(main)
