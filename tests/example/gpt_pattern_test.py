"""The GPT example with a pattern: sliding-window local layers and per-kind KV caches.

Decoding token by token (``model.decode``: a ring cache of ``window``
positions per local layer, a full cache per global layer, passed with
``st.per_kind``) against the reference, the forward pass's logits over the
whole sequence. (Mixed-layer stacks themselves are tested in pattern_test.py.)
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.common import fast_compile
from examples.gpt import decoding
from examples.gpt import model as gpt
from examples.gpt import model_config

from haiku_helpers import random_like


@pytest.mark.parametrize("head_group", [1, 2])
def test_gpt_pattern_decoding_matches_forward(head_group):
  """Ring caches for local layers, full ones for global: the forward's logits,
  with each head in a row of its own and with both in one (a TPU's layout)."""
  cfg = model_config.GPTConfig(vocab_size=11, seq_len=12, num_layers=5, num_heads=2,
                               d_model=8, pattern="LLG", window=3, remat="full")
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 11)
  fwd = hk.without_apply_rng(hk.transform(lambda t: gpt.forward(cfg, t)[0]))
  dec = hk.without_apply_rng(hk.transform(lambda t, c, p: decoding.decode(cfg, t, c, p)))
  params = random_like(jax.eval_shape(fwd.init, jax.random.PRNGKey(0), tokens))
  assert {k.split("/")[1] for k in params if k.startswith("h/")} == {"local", "global"}
  cache = decoding.init_cache(cfg, 2, head_group=head_group)
  rows, lanes = 2 // head_group, 4 * head_group
  assert jax.tree.map(jnp.shape, cache) == {
      "local": {"k": (4, 2, rows, 3, lanes), "v": (4, 2, rows, 3, lanes)},
      "global": {"k": (1, 2, rows, 12, lanes), "v": (1, 2, rows, 12, lanes)}}

  def run(f, *args):   # compiled once, with XLA's fast options
    return jax.jit(f).lower(*args).compile(fast_compile.CODEGEN)(*args)

  full = run(fwd.apply, params, tokens)
  logits, cache = run(dec.apply, params, tokens[:, :5], cache, 0)  # a prefill > window
  step = jax.jit(dec.apply).lower(params, tokens[:, :1], cache, 5).compile(
      fast_compile.CODEGEN)
  decoded = [logits]
  for pos in range(5, 12):
    logits, cache = step(params, tokens[:, pos:pos + 1], cache, pos)
    decoded.append(logits)
  np.testing.assert_allclose(jnp.concatenate(decoded, axis=1), full, rtol=1e-5, atol=1e-5)
