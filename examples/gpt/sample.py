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

import functools
import math
import os
import shlex
import sys

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.gpt import checkpoint  # pylint: disable=g-import-not-at-top
from examples.gpt import data as data_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import files  # pylint: disable=g-import-not-at-top
from examples.gpt import model as model_lib  # pylint: disable=g-import-not-at-top


def next_token(logits: jax.Array, key: jax.Array, *, temperature: float,
               top_k: int) -> jax.Array:
  """The next token of each sequence from its logits (``[B, vocab]``).

  Greedy (the likeliest) at temperature 0; otherwise drawn from the softmax
  of ``logits / temperature``, among the ``top_k`` likeliest when
  ``top_k > 0``.
  """
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits).astype(jnp.int32)


def generate(cfg: model_lib.GPTConfig, params, dataset: data_lib.CharDataset,
             prompt: str, num_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, num_samples: int = 1, seed: int = 0) -> list[str]:
  """``num_samples`` continuations of ``prompt``, ``num_tokens`` characters each.

  The samples are decoded together, as one batch. When the cache is full
  (``cfg.seq_len`` positions), the last half of the window is prefilled
  again from position 0 and decoding goes on.

  Args:
    cfg: the model config.
    params: the model's parameters.
    dataset: for the vocabulary.
    prompt: text to continue; at least one character.
    num_tokens: how many characters to add.
    temperature: 0 for greedy decoding.
    top_k: sample among the ``top_k`` likeliest characters (0: all).
    num_samples: how many continuations.
    seed: sampling seed.

  Returns:
    Each sample: the prompt and its continuation.
  """
  if not prompt:
    raise ValueError("generate needs a prompt of at least one character.")
  if not (math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"temperature={temperature}: use a finite number >= 0 (0: greedy).")
  if not 0 <= top_k <= cfg.vocab_size:
    raise ValueError(f"top_k={top_k}: use 0 (off) up to the vocabulary's "
                     f"{cfg.vocab_size} characters.")
  model = hk.without_apply_rng(hk.transform(
      lambda t, c, p: model_lib.decode(cfg, t, c, p)))

  # One compiled call per character: the decode step and the choice of the
  # next token; the cache is donated, so the step writes into it in place.
  @functools.partial(jax.jit, donate_argnums=1)
  def step(params, cache, tokens, pos, key):
    logits, cache = model.apply(params, tokens, cache, pos)
    key, sub = jax.random.split(key)
    return next_token(logits[:, -1], sub, temperature=temperature, top_k=top_k), cache, key

  prompt_ids = list(dataset.encode(prompt)[-cfg.seq_len:])
  key = jax.random.PRNGKey(seed)

  def prefill(windows, key):
    cache = model_lib.init_cache(cfg, num_samples)
    token, cache, key = step(params, cache, jnp.asarray(windows, jnp.int32), 0, key)
    return token, cache, key, len(windows[0])

  token, cache, key, pos = prefill([prompt_ids] * num_samples, key)
  chosen = [token]   # [num_samples] each, on the device until the end
  while len(chosen) < num_tokens:
    if pos == cfg.seq_len:
      texts = np.concatenate([np.tile(prompt_ids, (num_samples, 1)),
                              np.stack(jax.device_get(chosen), axis=1)], axis=1)
      token, cache, key, pos = prefill(texts[:, -(cfg.seq_len // 2):].tolist(), key)
    else:
      token, cache, key = step(params, cache, token[:, None], pos, key)
      pos += 1
    chosen.append(token)
  ids = np.stack(jax.device_get(chosen), axis=1)
  return [prompt + dataset.decode(row) for row in ids.tolist()]


def warn_if_cut(prompt: str, seq_len: int, flag: str) -> None:
  """Says, in one log line, that a prompt longer than the model's ``seq_len``
  is continued from its last ``seq_len`` characters (all it can see)."""
  if len(prompt) > seq_len:
    logging.warning("%s has %d characters, more than the %d positions the model "
                    "sees (the --seq_len it was trained with): the sample continues "
                    "its last %d characters (pass at most %d to have all of it seen).",
                    flag, len(prompt), seq_len, seq_len, seq_len)


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
  flags.DEFINE_enum("dtype", "float32", model_lib.DTYPES, "Compute dtype of the "
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
    step, meta = checkpoint.latest(workdir)
  except checkpoint.NotFoundError as e:
    sys.exit(f"error: {e} Train first with {train}.")
  except checkpoint.CheckpointError as e:
    sys.exit(f"error: {e}")
  cfg = model_lib.GPTConfig(**{**meta["config"], "dtype": FLAGS.dtype})
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
    params, _ = checkpoint.restore(
        workdir, step, jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes))
    warn_if_cut(FLAGS.prompt, cfg.seq_len, "--prompt")
    texts = generate(cfg, params, dataset, FLAGS.prompt, FLAGS.num_tokens,
                     temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                     num_samples=FLAGS.num_samples, seed=FLAGS.seed)
  except (checkpoint.CheckpointError, ValueError) as e:
    sys.exit(f"error: {e}")
  print(f"\n{SEPARATOR}\n".join(texts))


if __name__ == "__main__":
  define_flags()
  app.run(main)
