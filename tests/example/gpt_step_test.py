"""The GPT example's train step with gradient accumulation (``--grad_accum``).

A step over ``grad_accum`` microbatches, their gradients averaged, must give
what one step over the whole batch gives: the same loss, per-layer stats,
gradients and so the same parameters after the update.
"""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.gpt import distributed
from examples.gpt import model_config
from examples.gpt import step as step_lib


def _init(cfg, tokens):
  """The model's parameters, initialised in one compiled program (op by op,
  the init dispatched hundreds of small ones, each test again)."""
  return jax.jit(step_lib.transform(cfg).init)(jax.random.PRNGKey(0), tokens)


def _step_outputs(grad_accum, cfg, tokens, optimizer, params=None):
  model = step_lib.transform(cfg)
  if params is None:
    params = _init(cfg, tokens)
  step = jax.jit(step_lib.make_train_step(model, optimizer, grad_accum))
  return step(params, optimizer.init(params), tokens)


@pytest.mark.parametrize("block", ["fold", "scan"])
def test_grad_accum_gives_the_whole_batch_step(block):
  cfg = model_config.GPTConfig(vocab_size=13, seq_len=8, num_layers=2, num_heads=2,
                               d_model=16, block=block, remat="full")
  tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 9), 0, 13)
  # SGD with a learning rate of 1: the parameters move by the (clipped)
  # gradients themselves. (Adam's first step divides a gradient by its own
  # size, which turns rounding in a near-zero gradient into a whole step.)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  params = _init(cfg, tokens)
  whole = _step_outputs(1, cfg, tokens, optimizer, params)
  for grad_accum in (2, 4):
    accumulated = _step_outputs(grad_accum, cfg, tokens, optimizer, params)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        accumulated, whole)
  # The update moved the parameters: the comparison is not of two no-ops.
  moved = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), whole[0], params)
  assert max(jax.tree_util.tree_leaves(moved)) > 1e-3


def test_grad_accum_with_layer_drop_is_the_whole_batch_step():
  # layer_drop=0.5 over 4 layers skips some of them at every step; the
  # microbatches once drew their own drops (step-2 loss 4.5849 against
  # 4.7330): now they share the whole batch's, so the step is that batch's.
  cfg = model_config.GPTConfig(vocab_size=13, seq_len=8, num_layers=4, num_heads=2,
                               d_model=16, remat="full", layer_drop=0.5)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 9), 0, 13)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  params = _init(cfg, tokens)
  whole = _step_outputs(1, cfg, tokens, optimizer, params)
  for grad_accum in (2, 4):
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        _step_outputs(grad_accum, cfg, tokens, optimizer, params), whole)
  # The drops matter: without them the step is another one.
  kept = _step_outputs(1, dataclasses.replace(cfg, layer_drop=0.0), tokens, optimizer, params)
  assert abs(float(kept[2]) - float(whole[2])) > 1e-4


def test_grad_accum_microbatches_take_every_kth_sequence():
  """Microbatch ``m`` holds sequences ``m, m + k, ...``: each then takes its
  share of every data shard of the batch's rows."""
  seen = []

  def loss(params, tokens, training, seed=None):
    del training, seed
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


@pytest.mark.parametrize("error, refused", [
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
     "temporaries (16.43G) exceeds available HBM (15.75G).", True),
    ("INTERNAL: something else went wrong", False)])
def test_a_step_too_big_for_the_device_is_refused_in_one_line(monkeypatch, error, refused):
  """On an accelerator XLA refuses to compile a step that cannot fit (a CPU
  never does, so the refusal is raised here as XLA words it): train.py
  then stops with one line that says so and names the flags that help,
  not with XLA's traceback. Any other compile error goes through as it is."""
  def refuse(self, *args, **kwargs):
    raise jax.errors.JaxRuntimeError(error)

  cfg = model_config.GPTConfig(vocab_size=13, seq_len=8, num_layers=2, num_heads=2, d_model=16)
  tokens = jnp.zeros((2, 9), jnp.int32)
  model = step_lib.transform(cfg)
  params = model.init(jax.random.PRNGKey(0), tokens)
  optimizer = optax.sgd(0.1)
  mesh = distributed.make_mesh({"data": 1})
  sharding = distributed.replicated(mesh)
  shardings = (jax.tree_util.tree_map(lambda _: sharding, params),
               jax.tree_util.tree_map(lambda _: sharding, optimizer.init(params)), sharding)
  monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
  with pytest.raises(ValueError if refused else jax.errors.JaxRuntimeError) as caught:
    step_lib.compile_train_step(step_lib.make_train_step(model, optimizer), mesh, params,
                                optimizer.init(params), tokens.shape, shardings)
  message = str(caught.value)
  if refused:
    assert "\n" not in message
    assert message.startswith("the train step does not fit the device's memory (Ran out of "
                              "memory on HBM, the total memory required for HLO temporaries "
                              "(16.43G) exceeds available HBM (15.75G)). Make it smaller")
    for flag in ("--remat=full", "--grad_accum", "--batch_size"):
      assert flag in message
  else:
    assert message == error
