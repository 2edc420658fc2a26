"""The scanned stack without remat against the unrolled one, on the example's GPT.

A scan writes every value its step keeps into a stacked ``[L, ...]`` buffer,
where an unrolled program lets XLA fuse elementwise values away; a loop step
without remat therefore keeps every value but elementwise ones, and
recomputes those. References: ``st.BlockSeq`` (a Python loop) with the same
parameters, through ``st.unstack_params``; memory from the compiled program.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st
from examples.gpt import model as model_lib


def _step(stack, remat, num_layers=4, d_model=128):
  cfg = model_lib.GPTConfig(vocab_size=256, seq_len=64, num_layers=num_layers,
                            num_heads=4, d_model=d_model, bias=False, stack=stack,
                            remat=remat)
  loss = hk.transform(lambda t: model_lib.loss_fn(cfg, t)[0])
  tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 65), 0, 256)
  params = loss.init(jax.random.PRNGKey(0), tokens)
  step = jax.jit(jax.value_and_grad(lambda p: loss.apply(p, None, tokens)))
  return step, params


@pytest.mark.parametrize("num_layers,d_model", [(4, 128), (6, 256)])
def test_scanned_none_temp_at_most_unrolled(num_layers, d_model):
  temp = {}
  for stack in ("scan", "unrolled"):
    step, params = _step(stack, "none", num_layers, d_model)
    temp[stack] = step.lower(params).compile().memory_analysis().temp_size_in_bytes
  # Target: at most 1.05x the unrolled program's (it was 1.56x-1.71x when
  # the loop kept every elementwise value too).
  assert temp["scan"] <= 1.05 * temp["unrolled"], temp


def test_scanned_none_gradients_equal_unrolled():
  scan_step, params = _step("scan", "none")
  unrolled_step, _ = _step("unrolled", "none")
  (loss_s, grads_s) = scan_step(params)
  (loss_u, grads_u) = unrolled_step(st.unstack_params(params, "h"))
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
  grads_s = st.unstack_params(grads_s, "h")
  assert jax.tree_util.tree_structure(grads_s) == jax.tree_util.tree_structure(grads_u)
  for a, b in zip(jax.tree_util.tree_leaves(grads_s), jax.tree_util.tree_leaves(grads_u)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_save_all_keeps_more_than_none():
  # save_all keeps every value of every layer: what no remat kept before.
  temp = {}
  for remat in ("none", "save_all"):
    step, params = _step("scan", remat)
    temp[remat] = step.lower(params).compile().memory_analysis().temp_size_in_bytes
  assert temp["none"] < temp["save_all"], temp
