"""The models every benchmark stacks: two blocks and the sizes of their carry.

* ``mlp``: a residual MLP block, ``x + W2 gelu(W1 LayerNorm(x))``, on a carry
  of shape ``[batch, width]``; the hidden activation is tagged
  ``"mlp_hidden"``.
* ``residual``: the reference workload of the nested memory floor,
  ``x + fc2(tanh(fc1 x))`` (no LayerNorm, no 4x hidden), on a carry of shape
  ``[batch, width]``; the hidden activation is tagged ``"mlp_hidden"``.
* ``gpt``: a small GPT-like pre-LayerNorm transformer block (causal
  multi-head self-attention, then a 4x MLP), on a carry of shape
  ``[batch, seq_len, width]``; the attention output is tagged ``"attn_out"``
  and the MLP hidden activation ``"mlp_hidden"``.

A :class:`ModelConfig` names one of them and its sizes; :func:`make_block`
turns it into the block factory ``st.Stacked`` takes. :class:`GeluMLPBlock`
is a cheaper residual MLP whose hidden width a script chooses (two of them
make a pattern's kinds with parameters of different shapes).

Parameters for a step that is timed or checked, not trained, are drawn in
numpy from the shapes ``model.init`` traces (:func:`fan_in_params`,
:func:`normal_params`): no init program compiles, and a real init can take
longer to compile than the step it feeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import stacktools as st


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The sizes of one block stack's carry and block.

  Attributes:
    kind: ``"mlp"``, ``"residual"`` or ``"gpt"``.
    width: model width (``d_model``).
    batch: batch size.
    seq_len: sequence length (``gpt`` only; ignored by ``mlp``).
    heads: attention heads (``gpt`` only).
  """

  kind: str
  width: int
  batch: int
  seq_len: int = 1
  heads: int = 1

  def __post_init__(self):
    if self.kind not in ("mlp", "residual", "gpt"):
      raise ValueError(f"ModelConfig.kind must be 'mlp', 'residual' or 'gpt', "
                       f"got {self.kind!r}.")
    if self.kind == "gpt" and self.width % self.heads:
      raise ValueError(f"gpt: width={self.width} must be a multiple of "
                       f"heads={self.heads}.")

  @property
  def carry_shape(self) -> tuple[int, ...]:
    if self.kind != "gpt":
      return (self.batch, self.width)
    return (self.batch, self.seq_len, self.width)

  @property
  def carry_bytes(self) -> int:
    """Bytes of one carry (float32): the guide's ``C``, computed analytically."""
    return 4 * math.prod(self.carry_shape)

  @property
  def param_bytes_per_layer(self) -> int:
    """Bytes of one block's parameters (float32), from their shapes."""
    block = hk.transform(lambda x: make_block(self)()(x))
    shapes = jax.eval_shape(block.init, jax.random.PRNGKey(0),
                            jax.ShapeDtypeStruct(self.carry_shape, jnp.float32))
    return sum(4 * math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes))

  def describe(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    if self.kind != "gpt":
      del out["seq_len"], out["heads"]
    out["carry_shape"] = list(self.carry_shape)
    out["carry_bytes"] = self.carry_bytes
    out["param_bytes_per_layer"] = self.param_bytes_per_layer
    return out


def model_config(args: argparse.Namespace) -> ModelConfig:
  """The ModelConfig of the flags --model --width --batch --seq_len --heads."""
  gpt = args.model == "gpt"
  return ModelConfig(args.model, width=args.width, batch=args.batch,
                     seq_len=args.seq_len if gpt else 1, heads=args.heads if gpt else 1)


class MLPBlock(hk.Module):
  """``x + W2 gelu(W1 LayerNorm(x))``; the hidden activation is ``mlp_hidden``."""

  def __init__(self, width: int, name: Optional[str] = None):
    super().__init__(name=name)
    self.width = width

  def __call__(self, x: jax.Array) -> jax.Array:
    h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
    h = jax.nn.gelu(hk.Linear(4 * self.width, name="fc")(h))
    h = st.checkpoint_name(h, "mlp_hidden")
    return x + hk.Linear(self.width, name="out")(h)


class ResidualBlock(hk.Module):
  """``x + fc2(tanh(fc1 x))``; the hidden activation is ``mlp_hidden``."""

  def __init__(self, width: int, name: Optional[str] = None):
    super().__init__(name=name)
    self.width = width

  def __call__(self, x: jax.Array) -> jax.Array:
    h = st.checkpoint_name(jnp.tanh(hk.Linear(self.width, name="fc1")(x)), "mlp_hidden")
    return x + hk.Linear(self.width, name="fc2")(h)


class GeluMLPBlock(hk.Module):
  """``x + W2 gelu(W1 x)`` with a hidden width of ``ratio`` times the carry's;
  the hidden activation is ``mlp_hidden``."""

  def __init__(self, ratio: int, name: Optional[str] = None):
    super().__init__(name=name)
    self.ratio = ratio

  def __call__(self, x: jax.Array) -> jax.Array:
    h = st.checkpoint_name(jax.nn.gelu(hk.Linear(self.ratio * x.shape[-1], name="fc")(x)),
                           "mlp_hidden")
    return x + hk.Linear(x.shape[-1], name="out")(h)


class GPTBlock(hk.Module):
  """A pre-LayerNorm transformer block: causal self-attention, then an MLP.

  Not the GPT example's ``Block`` (``examples/gpt/model.py``), which the
  benchmarks that train the example (checkpoint_cost, sharding) and
  mixed_layers use: this one is the block of the committed memory, compile,
  step and pipeline results. The example's block (a Linear with its own
  weight gradient, scaled queries, the mask as a bias, more named
  internals) compiles to other temp bytes: 0.92x this block's with
  ``remat="full"``, 0.995x with ``"none"`` at width 128, 4 to 16 layers.
  """

  def __init__(self, width: int, heads: int, name: Optional[str] = None):
    super().__init__(name=name)
    self.width, self.heads = width, heads

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, seq_len, width = x.shape
    head_dim = width // self.heads
    h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln1")(x)
    qkv = hk.Linear(3 * width, name="qkv")(h)
    q, k, v = jnp.split(qkv.reshape(batch, seq_len, 3, self.heads, head_dim), 3, axis=2)
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)
    attn = st.checkpoint_name(attn.reshape(batch, seq_len, width), "attn_out")
    x = x + hk.Linear(width, name="proj")(attn)
    h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln2")(x)
    h = jax.nn.gelu(hk.Linear(4 * width, name="fc")(h))
    h = st.checkpoint_name(h, "mlp_hidden")
    return x + hk.Linear(width, name="out")(h)


def make_block(cfg: ModelConfig) -> Callable[[], hk.Module]:
  """A factory of the block ``cfg`` describes, as ``st.Stacked`` takes it."""
  if cfg.kind == "mlp":
    return lambda: MLPBlock(cfg.width, name="block")
  if cfg.kind == "residual":
    return lambda: ResidualBlock(cfg.width, name="block")
  return lambda: GPTBlock(cfg.width, cfg.heads, name="block")


def example_input(cfg: ModelConfig, seed: int = 1) -> jax.Array:
  """A random float32 carry of ``cfg``'s shape, the same for every contender."""
  return jax.random.normal(jax.random.PRNGKey(seed), cfg.carry_shape, jnp.float32)


def fan_in_params(model: hk.Transformed, *inputs: Any, seed: int = 0) -> Any:
  """Parameters of ``model`` for ``inputs``, drawn in numpy: nothing compiles.

  As ``contenders.Contender.synthetic_params``: LayerNorm scales ones,
  offsets and biases zeros, weights ``normal / sqrt(fan_in)``.
  """
  abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    last = jax.tree_util.keystr(path[-1:])
    if "scale" in last:
      return jnp.ones(leaf.shape, leaf.dtype)
    if "offset" in last or "'b'" in last:
      return jnp.zeros(leaf.shape, leaf.dtype)
    fan_in = leaf.shape[-2] if len(leaf.shape) >= 2 else 1
    return jnp.asarray(rng.standard_normal(leaf.shape) / np.sqrt(fan_in), leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, abstract)


def normal_params(model: hk.Transformed, *inputs: Any, scale: float = 0.2,
                  seed: int = 0) -> Any:
  """Parameters of ``model`` for ``inputs``, every leaf ``scale`` times a
  standard normal, drawn in numpy (as numpy arrays): nothing compiles."""
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: (scale * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
