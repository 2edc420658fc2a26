"""The GPT example's train step with gradient accumulation (``--grad_accum``).

A step over ``grad_accum`` microbatches, their gradients averaged, must give
what one step over the whole batch gives: the same loss, per-layer stats,
gradients and so the same parameters after the update.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.gpt import model as model_lib
from examples.gpt import step as step_lib


def _step_outputs(grad_accum, cfg, tokens, optimizer):
  model = step_lib.transform(cfg)
  params = model.init(jax.random.PRNGKey(0), tokens)
  step = jax.jit(step_lib.make_train_step(model, optimizer, grad_accum))
  return step(params, optimizer.init(params), tokens)


@pytest.mark.parametrize("block", ["fold", "scan"])
def test_grad_accum_gives_the_whole_batch_step(block):
  cfg = model_lib.GPTConfig(vocab_size=13, seq_len=8, num_layers=2, num_heads=2,
                            d_model=16, block=block, remat="full")
  tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 9), 0, 13)
  # SGD with a learning rate of 1: the parameters move by the (clipped)
  # gradients themselves. (Adam's first step divides a gradient by its own
  # size, which turns rounding in a near-zero gradient into a whole step.)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  whole = _step_outputs(1, cfg, tokens, optimizer)
  for grad_accum in (2, 4):
    accumulated = _step_outputs(grad_accum, cfg, tokens, optimizer)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        accumulated, whole)
  # The update moved the parameters: the comparison is not of two no-ops.
  params = step_lib.transform(cfg).init(jax.random.PRNGKey(0), tokens)
  moved = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), whole[0], params)
  assert max(jax.tree_util.tree_leaves(moved)) > 1e-3


def test_grad_accum_microbatches_take_every_kth_sequence():
  """Microbatch ``m`` holds sequences ``m, m + k, ...``: each then takes its
  share of every data shard of the batch's rows."""
  seen = []

  def loss(params, tokens, training):
    del training
    jax.debug.callback(lambda t: seen.append(np.asarray(t)), tokens)
    return jnp.sum(params["w"]) * jnp.mean(tokens.astype(jnp.float32)), None

  model = hk.Transformed(init=None, apply=loss)
  step = step_lib.make_train_step(model, optax.sgd(0.1), 3)
  tokens = jnp.arange(6 * 2).reshape(6, 2)
  params = {"w": jnp.ones(2)}
  jax.block_until_ready(step(params, optax.sgd(0.1).init(params), tokens))
  assert [s[:, 0].tolist() for s in seen] == [[0, 6], [2, 8], [4, 10]]


def test_grad_accum_refuses_what_it_cannot_cut():
  with pytest.raises(ValueError, match="--batch_size=6 is not divisible by --grad_accum=4"):
    step_lib.check_grad_accum(4, 6, "none")
  with pytest.raises(ValueError, match="a pipeline cuts the batch into --microbatches"):
    step_lib.check_grad_accum(2, 8, "1f1b")
  step_lib.check_grad_accum(2, 8, "none")
  step_lib.check_grad_accum(1, 8, "gpipe")
