"""Decoding the GPT with a KV cache: the cache, the decode step, and generating text.

The same blocks that train (``model.py``), given a per-layer KV cache through
``st.per_layer(cache, in_place=True)``, return ``(x, cache)`` with their new
keys and values written into their row: that is how :func:`decode` goes token
by token. With ``GPTConfig.pattern``, decoding keeps a ring cache of
``window`` positions for each local layer and a full cache for each global
layer, passed per kind with ``st.per_kind``.

:func:`generate` prefills the prompt in one call; then each new character is
decoded alone, its keys and values written into the whole cache, which is
updated where it lies: the compiled step takes the cache donated, and picks
the next character on the device, so the host only dispatches one call per
character. train.py samples through it after training, sample.py from a
saved run.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import stacktools as st
from examples.gpt import data as data_lib
from examples.gpt.attention import Cache
from examples.gpt.attention import cache_head_group
from examples.gpt.model import block_stack
from examples.gpt.model import embed_and_head
from examples.gpt.model import precision_and_adapters
from examples.gpt.model_config import GPTConfig
from examples.gpt.model_config import KINDS


def init_cache(cfg: GPTConfig, batch_size: int, dtype=None,
               head_group: Optional[int] = None):
  """An empty KV cache: ``[num_layers, B, heads / group, seq_len, group *
  head_dim]`` each.

  In ``dtype``, by default the compute dtype (``cfg.compute_dtype``).

  Heads before positions: a decode step's dot over ``head_dim`` then reads
  each layer's cache in place, with no transposed copy. ``head_group``
  heads share a row (by default :func:`cache_head_group`: 1 off a TPU, so
  ``[num_layers, B, heads, seq_len, head_dim]``; on a TPU in bfloat16
  enough to fill 128 lanes). :func:`decode` reads the group from the
  cache's shape.

  With a pattern, one per kind: ``{"local": ..., "global": ...}``, a local
  layer's ``window`` positions long (a ring), a global layer's ``seq_len``;
  the leading axis is the kind's count.
  """
  dtype = cfg.compute_dtype if dtype is None else dtype
  group = cache_head_group(cfg, dtype) if head_group is None else head_group
  if group < 1 or cfg.num_heads % group:
    raise ValueError(f"head_group={group} must divide num_heads={cfg.num_heads}.")

  def zeros(layers, length):
    shape = (layers, batch_size, cfg.num_heads // group, length,
             group * cfg.d_model // cfg.num_heads)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

  if not cfg.pattern:
    return zeros(cfg.num_layers, cfg.seq_len)
  lengths = {"L": cfg.window, "G": cfg.seq_len}
  return {KINDS[c]: zeros(cfg.kind_count(c), lengths[c])
          for c in dict.fromkeys(cfg.pattern) if cfg.kind_count(c)}


def decode(cfg: GPTConfig, tokens: jax.Array, cache: Cache, pos: jax.Array, *,
           in_place: bool = True, adapter_index: Optional[jax.Array] = None
           ) -> tuple[jax.Array, Cache]:
  """Logits for ``tokens`` placed at ``pos``, attending to the cache.

  Call inside ``hk.transform`` (same parameters as ``model.forward``). The
  cache goes into the stack as ``st.per_layer(cache, in_place=True)``
  (``st.per_kind`` for a pattern): each layer writes its new keys and values
  into its row of the whole cache, which comes back as the stack's scan
  output, updated in place when the caller donates it. ``in_place=False``
  slices the cache per layer and stacks every layer's new slice instead (a
  second cache each step; what ``benchmarks/decode.py`` compares against).

  Args:
    cfg: the model config.
    tokens: ``[B, T]``: the prompt (prefill, ``pos=0``) or one new token.
    cache: from :func:`init_cache` or the previous call.
    pos: where ``tokens`` start.
    in_place: the in-place form (above) or the sliced one.
    adapter_index: with ``cfg.lora_count``, each row's adapter (int ``[B]``).

  Returns:
    ``(logits [B, T, vocab], new_cache)``.
  """
  with precision_and_adapters(cfg, adapter_index):
    return _decode(cfg, tokens, cache, pos, in_place)


def _decode(cfg: GPTConfig, tokens: jax.Array, cache: Cache, pos: jax.Array,
            in_place: bool) -> tuple[jax.Array, Cache]:
  embed, head = embed_and_head(cfg)
  x = embed(tokens, pos)
  if cfg.pattern:
    x, cache = block_stack(cfg, ys_by_kind=True).scan(
        x, st.per_kind(cache, in_place=in_place), pos)
  else:
    x, cache = block_stack(cfg).scan(x, st.per_layer(cache, in_place=in_place), pos)
  return head(x), cache


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


def generate(cfg: GPTConfig, params, dataset: data_lib.CharDataset,
             prompt: str, num_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, num_samples: int = 1, seed: int = 0,
             adapter_index: Optional[np.ndarray] = None) -> list[str]:
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
    adapter_index: with ``cfg.lora_count``, each sample's adapter (``[num_samples]``):
      the rows decode together, in one loop, each on its own adapter.

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
      lambda t, c, p, index: decode(cfg, t, c, p, adapter_index=index)))
  index = None if adapter_index is None else jnp.asarray(adapter_index, jnp.int32)

  # One compiled call per character: the decode step and the choice of the
  # next token; the cache is donated, so the step writes into it in place.
  @functools.partial(jax.jit, donate_argnums=1)
  def step(params, cache, tokens, pos, key):
    logits, cache = model.apply(params, tokens, cache, pos, index)
    key, sub = jax.random.split(key)
    return next_token(logits[:, -1], sub, temperature=temperature, top_k=top_k), cache, key

  prompt_ids = list(dataset.encode(prompt)[-cfg.seq_len:])
  key = jax.random.PRNGKey(seed)

  def prefill(windows, key):
    cache = init_cache(cfg, num_samples)
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
