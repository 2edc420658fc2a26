"""Helpers shared by the Haiku combinator tests (layer_stack, Stacked, BlockSeq).

A test module imports what it uses by name; importing ``check_jax_usage``
makes it an autouse fixture of that module.

Also the library tests' small transformer (:func:`transformer`, built of
:class:`TransformerBlock`): token and position embeddings, pre-LayerNorm
blocks of causal self-attention and an MLP whose intermediates are tagged
with ``st.checkpoint_name``, a final LayerNorm and a head, stacked by
``st.Stacked`` or ``st.BlockSeq``, with fold or scan blocks, an optional
pattern of sliding-window (``L``) and full (``G``) attention, and an
optional per-layer input. Its module names are the GPT example's
(``h/block/attn/qkv``, ``h/block/fc_out``, ``tok_embed``, ...), so what a
library test says of its parameter tree reads as it would of the example's;
the example's own model is for the example's tests (``tests/example/``).
"""

import dataclasses
import functools
from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st

RTOL, ATOL = 1e-5, 1e-5
B, D = 3, 8  # The default batch and width of test inputs.


@pytest.fixture(autouse=True)
def check_jax_usage():
  """As in Haiku's own layer_stack tests: flag JAX transforms misused inside a
  Haiku transform."""
  with hk.config.context(check_jax_usage=True):
    yield


def jitted(transformed):
  """``transformed`` (``hk.Transformed`` or ``hk.TransformedWithState``) with
  its init and apply under ``jax.jit``.

  For a test that checks values: run eagerly, every primitive outside a loop
  compiles as a program of its own (a hundred or more for the tiny
  transformer's init), where jit compiles one. Not for a test of eager
  behaviour, of an error raised while tracing, or of bit-identity between two
  programs; nor inside a trace that a context changes (``st.plan_remat``'s
  plans): a jitted function is traced once for its argument shapes.
  """
  return type(transformed)(*(jax.jit(f) for f in transformed))


def random_input(shape, seed=0):
  return jax.random.uniform(jax.random.PRNGKey(seed), shape, minval=-1.0, maxval=1.0)


def random_x(shape=(B, D), seed=0):
  """A test input, uniform in [-1, 1): ``(B, D)`` unless told."""
  return random_input(shape, seed)


def random_like(shapes, seed=0):
  """Random arrays shaped like ``shapes`` (a tree of ShapeDtypeStructs).

  Floats are normal with scale 0.4; int leaves (state counters) are small
  non-negative ints.
  """
  rng = np.random.default_rng(seed)

  # Cast by numpy and put on the device as they are: jnp.asarray(x, dtype)
  # compiles a conversion for every shape.
  def sample(s):
    if jnp.issubdtype(s.dtype, jnp.integer):
      return jax.device_put(np.asarray(rng.integers(0, 5, s.shape), s.dtype))
    return jax.device_put(np.asarray(0.4 * rng.standard_normal(s.shape), s.dtype))

  return jax.tree.map(sample, shapes)


def layer_slice(bundles, prefix, i):
  """Layer ``i`` of stacked params/state, with ``prefix/`` cut from the names."""
  return {k[len(prefix) + 1:]: {n: v[i] for n, v in b.items()}
          for k, b in bundles.items() if k.startswith(prefix + "/")}


def stack_layers(trees):
  """Per-layer trees (a sequence) -> one tree with a leading layer axis."""
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def restack(per_layer, prefix):
  """Inverse of ``layer_slice`` over all layers: per-layer params/state ->
  stacked, with ``prefix/`` put back on the names."""
  return {f"{prefix}/{k}": b for k, b in stack_layers(per_layer).items()}


def sin_loss(tree):
  """A scalar loss of every leaf whose gradient is not constant."""
  return sum(jnp.sum(jnp.sin(3.0 * leaf)) for leaf in jax.tree.leaves(tree))


def signature(bundles):
  """``{module: {name: (shape, dtype)}}`` of Haiku params or state."""
  return {m: {n: (tuple(v.shape), str(v.dtype)) for n, v in b.items()}
          for m, b in bundles.items()}


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
  """Same tree structure, and every leaf close."""
  assert (jax.tree_util.tree_structure(actual)
          == jax.tree_util.tree_structure(expected))
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol),
               actual, expected)


# ---------------------------------------------------------------------------
# A small transformer for the library's tests.

#: Every name a block tags with ``st.checkpoint_name``.
CHECKPOINT_NAMES = ("qkv", "attn_scores", "attn_probs", "attn_out", "mlp_pre",
                    "mlp_hidden", "mlp_out")
#: The two linear layers whose outputs a block adds to the residual stream:
#: zeroed (weights and biases), the block is the identity.
RESIDUAL_OUTPUTS = ("attn/proj", "fc_out")
#: The kinds of a pattern, by letter, and the scope their parameters live under.
KINDS = {"L": "local", "G": "global"}


@dataclasses.dataclass(frozen=True)
class Tiny:
  """The shape of :func:`transformer` and how its blocks are stacked.

  ``block``: ``"fold"`` (a block returns ``x``) or ``"scan"`` (``(x, stats)``,
  one number per sequence and layer). ``stack``: ``"scan"`` (``st.Stacked``)
  or ``"unrolled"`` (``st.BlockSeq``). ``pattern``: ``""``, or letters of
  :data:`KINDS` (``L`` attends to the last ``window`` positions). ``per_layer``:
  the blocks take a per-layer gate on their MLP (``[num_layers]``, passed with
  ``st.per_layer``).
  """

  num_layers: int = 2
  width: int = 16
  heads: int = 2
  vocab: int = 13
  seq_len: int = 8
  mlp_ratio: int = 4
  block: str = "fold"
  stack: str = "scan"
  remat: object = False
  pattern: str = ""
  window: int = 0
  bias: bool = True
  per_layer: bool = False


# Uniform weights of truncated normal's scale: they compile several times faster.
W_INIT = hk.initializers.VarianceScaling(1.0, "fan_in", "uniform")


def _linear(cfg: Tiny, size: int, name: str) -> hk.Linear:
  return hk.Linear(size, with_bias=cfg.bias, w_init=W_INIT, name=name)


class Attention(hk.Module):
  """Causal multi-head self-attention (within ``window`` positions if given)."""

  def __init__(self, cfg: Tiny, window: Optional[int] = None, name=None):
    super().__init__(name=name)
    self.cfg, self.window = cfg, window

  def __call__(self, x):
    cfg = self.cfg
    b, t, d = x.shape
    qkv = st.checkpoint_name(_linear(cfg, 3 * d, "qkv")(x), "qkv")
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * cfg.heads, d // cfg.heads), 3, axis=2)
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if self.window is not None:
      mask &= pos[None, :] > pos[:, None] - self.window
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // cfg.heads) ** 0.5
    scores = st.checkpoint_name(jnp.where(mask, scores, -1e30), "attn_scores")
    probs = st.checkpoint_name(jax.nn.softmax(scores, axis=-1), "attn_probs")
    mixed = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
    out = _linear(cfg, d, "proj")(mixed)
    return st.checkpoint_name(out, "attn_out"), probs


class TransformerBlock(hk.Module):
  """A pre-LayerNorm block: attention, then an MLP, each added to ``x``."""

  def __init__(self, cfg: Tiny, window: Optional[int] = None, name=None):
    super().__init__(name=name)
    self.cfg, self.window = cfg, window

  def __call__(self, x, gate=None):
    cfg = self.cfg
    x_in = x
    ln1 = hk.LayerNorm(-1, create_scale=True, create_offset=cfg.bias, name="ln1")
    attn, probs = Attention(cfg, self.window, name="attn")(ln1(x))
    x = x + attn
    ln2 = hk.LayerNorm(-1, create_scale=True, create_offset=cfg.bias, name="ln2")
    h = _linear(cfg, cfg.mlp_ratio * cfg.width, "fc")(ln2(x))
    h = st.checkpoint_name(jax.nn.gelu(st.checkpoint_name(h, "mlp_pre")), "mlp_hidden")
    h = st.checkpoint_name(_linear(cfg, cfg.width, "fc_out")(h), "mlp_out")
    x = x + (h if gate is None else gate * h)
    if cfg.block == "fold":
      return x
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
    return x, {"attn_entropy": jnp.mean(entropy, axis=(1, 2)),
               "update": jnp.mean(jnp.abs(x - x_in), axis=(1, 2))}


def tiny_stack(cfg: Tiny):
  """The block stack ``h`` of ``cfg`` (call inside a Haiku transform)."""
  if cfg.pattern:
    windows = {"L": cfg.window, "G": None}
    make_block = {KINDS[c]: functools.partial(TransformerBlock, cfg, windows[c],
                                              name="block")
                  for c in dict.fromkeys(cfg.pattern)}
    config = dict(pattern=tuple(KINDS[c] for c in cfg.pattern))
  else:
    make_block, config = (lambda: TransformerBlock(cfg, name="block")), {}
  cls = st.Stacked if cfg.stack == "scan" else st.BlockSeq
  return cls(make_block, cfg.num_layers, remat=cfg.remat, name="h", **config)


def tiny_forward(cfg: Tiny, tokens, gates=None):
  """``(logits, stats)``: ``stats`` is ``None`` for fold blocks, else
  ``[num_layers, B]`` arrays. Call inside a Haiku transform."""
  init = hk.initializers.RandomNormal(0.02)
  x = hk.Embed(cfg.vocab, cfg.width, w_init=init, name="tok_embed")(tokens)
  x = x + hk.Embed(cfg.seq_len, cfg.width, w_init=init,
                   name="pos_embed")(jnp.arange(tokens.shape[1]))[None]
  args = (st.per_layer(gates[:, None, None, None]),) if cfg.per_layer else ()
  stack = tiny_stack(cfg)
  stats = None
  if cfg.block == "fold":
    x = stack.fold(x, *args)
  else:
    x, stats = stack.scan(x, *args)
  x = hk.LayerNorm(-1, create_scale=True, create_offset=cfg.bias, name="ln_f")(x)
  return _linear(cfg, cfg.vocab, "head")(x), stats


def tiny_loss(cfg: Tiny, tokens, gates=None):
  """Mean next-token cross entropy over ``tokens[:, 1:]`` (``[B, seq_len + 1]``)."""
  logits, _ = tiny_forward(cfg, tokens[:, :-1], gates)
  log_probs = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))


def transformer(cfg: Tiny, what: str = "logits"):
  """``hk.transform`` of :func:`tiny_forward`'s logits (``what="logits"``), of
  ``(logits, stats)`` (``"forward"``) or of :func:`tiny_loss` (``"loss"``),
  without an apply rng. With ``cfg.per_layer``, each takes the gates last."""
  fn = {"logits": lambda *a: tiny_forward(cfg, *a)[0],
        "forward": functools.partial(tiny_forward, cfg),
        "loss": functools.partial(tiny_loss, cfg)}[what]
  return hk.without_apply_rng(hk.transform(fn))


def tiny_tokens(cfg: Tiny, batch: int = 3, extra: int = 0, seed: int = 0):
  """``[batch, seq_len + extra]`` random token ids."""
  return jax.random.randint(jax.random.PRNGKey(seed), (batch, cfg.seq_len + extra),
                            0, cfg.vocab)
