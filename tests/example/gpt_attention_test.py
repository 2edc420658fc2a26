"""The GPT example's splash attention (``GPTConfig.attention``) against XLA's.

The Pallas TPU kernel runs here in Pallas's interpreter, so what it computes
is checked on a CPU: the loss and every parameter's gradient of a stacked
model (the kernel inside ``st.Stacked``'s vmapped init and scanned apply,
under a checkpoint policy) equal XLA attention's, for full causal attention
and for a sliding window (a ``"LG"`` pattern). Then what ``"auto"`` picks,
and the configurations refused with the fix named.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # Public in some JAX versions; only in jax._src in jax 0.10.
  from jax.ad_checkpoint import saved_residuals
except ImportError:
  from jax._src.ad_checkpoint import saved_residuals

from examples.gpt import attention as attention_lib
from examples.gpt import model as model_lib
from examples.gpt import model_config
import stacktools as st

T = 2 * model_config.SPLASH_TILE    # two kernel blocks of 128 positions


def config(attention, **kwargs):
  return model_config.GPTConfig(**{**dict(vocab_size=11, seq_len=T, num_layers=2, num_heads=2,
                                          d_model=16, attention=attention), **kwargs})


def loss_and_grads(cfg, tokens):
  model = hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)[0]))
  # The kernel is first built inside a jitted init, as train.py builds it;
  # the cached kernel then serves the other traces.
  attention_lib._splash.cache_clear()  # pylint: disable=protected-access
  params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
  return jax.jit(jax.value_and_grad(model.apply))(params, tokens)


@pytest.mark.parametrize("kwargs", [dict(remat="full"),
                                    dict(pattern="LG", window=40, remat=False)],
                         ids=["causal-full-remat", "sliding-window"])
def test_splash_equals_xla_attention(kwargs):
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 11, (2, T + 1)), jnp.int32)
  loss_x, grads_x = loss_and_grads(config("xla", **kwargs), tokens)
  loss_s, grads_s = loss_and_grads(config("splash", **kwargs), tokens)
  np.testing.assert_allclose(loss_s, loss_x, rtol=1e-5)
  for path, gx in jax.tree_util.tree_leaves_with_path(grads_x):
    gs = grads_s
    for key in path:
      gs = gs[key.key]
    scale = float(np.max(np.abs(gx))) or 1.0
    np.testing.assert_allclose(np.asarray(gs) / scale, np.asarray(gx) / scale, atol=2e-5,
                               err_msg=jax.tree_util.keystr(path))


def test_auto_takes_the_kernel_only_where_it_applies(monkeypatch):
  assert config("splash").uses_splash(T)
  assert not config("splash").uses_splash(T + 1)            # a prompt of any length
  assert not config("xla").uses_splash(T)
  assert not config("auto").uses_splash(T)                  # XLA's off a TPU
  # On a TPU: one chip and a fold block, the sequence a multiple of 128.
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  monkeypatch.setattr(jax, "device_count", lambda: 1)
  assert config("auto").uses_splash(T)
  assert not config("auto").uses_splash(T - 1)
  assert not config("auto", block="scan").uses_splash(T)    # its stats need the probabilities
  monkeypatch.setattr(jax, "device_count", lambda: 8)      # XLA cannot split the kernel
  assert not config("auto").uses_splash(T)


@pytest.mark.parametrize("kwargs,message", [
    (dict(attention="flash"), "use one of auto, xla, splash"),
    (dict(attention="splash", block="scan"), "needs block='fold'"),
    (dict(attention="splash", seq_len=100), "multiple of 128"),
])
def test_refused_with_the_fix(kwargs, message):
  with pytest.raises(ValueError, match=message):
    model_config.GPTConfig(**{**dict(vocab_size=11, seq_len=T), **kwargs})


def test_keeping_attn_mix_keeps_what_the_kernels_backward_reads():
  # The kernel's output and softmax statistics are tagged attn_mix: a policy
  # that keeps attn_mix keeps them (the backward pass then has no need to
  # run the kernel's forward pass again); "full" keeps neither.
  tokens = jnp.zeros((2, T + 1), jnp.int32)
  heads, length = 2, T
  stats = (1, 2, heads, length)           # [layers, B, heads, T]
  out = (1, 2, heads, length, 8)          # [layers, B, heads, T, head_dim]

  def kept(remat):
    cfg = config("splash", remat=remat, num_layers=1)
    model = hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)[0]))
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
    return [aval.shape for aval, _ in saved_residuals(model.apply, params, tokens)]
  keeps_mix = kept(st.CheckpointPolicy(save_block_internals=("attn_mix",)))
  assert stats in keeps_mix and out in keeps_mix, keeps_mix
  full = kept("full")
  assert stats not in full and out not in full, full
