"""A decoder-only GPT in Haiku whose blocks live in a stacktools stack.

Token and learned position embeddings, pre-LayerNorm blocks of causal
multi-head self-attention and an MLP, a final LayerNorm and an output head.

The blocks come in two flavours, chosen by ``GPTConfig.block``:

* ``"fold"``: a block returns the new residual stream, and the stack folds it.
* ``"scan"``: a block returns ``(x, stats)``, with per-layer numbers worth
  watching (attention entropy, size of the residual update), one per
  sequence; the stack returns them stacked on a leading Layers axis, and
  :func:`forward` averages them over the batch. (Per sequence because a
  pipelined stack runs each microbatch of sequences on its own and puts the
  outputs back together along the batch axis.)

The same block, given a per-layer KV cache, returns ``(x, cache)`` instead:
``decoding.py`` decodes through it. ``GPTConfig.pattern`` mixes two kinds of
block in one stack (``st.Stacked`` with ``pattern=``): ``L`` layers attend
over a window of positions, ``G`` layers over the whole sequence.

The attention is ``attention.py``'s; the model's config, ``model_config.py``'s;
decoding with a KV cache, ``decoding.py``'s.

The linear layers are :class:`examples.gpt.linear.Linear`: ``hk.Linear``'s
parameters, with a weight gradient that runs faster on CPU.

``GPTConfig.dtype="bfloat16"`` is mixed precision through Haiku's
``hk.mixed_precision`` policies (:func:`precision_policies`, set by
:func:`precision` while :func:`forward`, ``decoding.decode`` or :func:`loss_fn` is
traced, and cleared after): the parameters, and so the gradients and the
optimizer state, stay float32; the blocks, the embeddings and the head compute
in bfloat16; the layer norms' statistics, the attention softmax and the loss
(the logits' log-softmax over the vocabulary) are float32. The stack's
vmapped init and scanned apply call the blocks inside, so the policies reach
every layer.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import jmp

import stacktools as st
from examples.gpt.attention import CausalSelfAttention
from examples.gpt.linear import Linear
from examples.gpt.model_config import GPTConfig
from examples.gpt.model_config import KINDS


class Block(hk.Module):
  """A pre-LayerNorm transformer block (attention, then MLP).

  ``window``: attend over the last ``window`` positions only (an ``L``
  layer); ``None`` for full causal attention.
  """

  def __init__(self, cfg: GPTConfig, window: Optional[int] = None,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.cfg = cfg
    self.window = window

  def __call__(self, x: jax.Array, cache: Any = None,
               pos: Optional[jax.Array] = None):
    cfg = self.cfg
    x_in = x
    ln1 = hk.LayerNorm(-1, create_scale=True, create_offset=cfg.bias, name="ln1")
    attn, probs, new_cache = CausalSelfAttention(cfg, self.window, name="attn")(
        ln1(x), cache, pos)
    x = x + attn
    ln2 = hk.LayerNorm(-1, create_scale=True, create_offset=cfg.bias, name="ln2")
    h = st.checkpoint_name(
        Linear(cfg.mlp_ratio * cfg.d_model, with_bias=cfg.bias, name="fc")(ln2(x)), "mlp_pre")
    h = st.checkpoint_name(jax.nn.gelu(h), "mlp_hidden")
    x = x + st.checkpoint_name(
        Linear(cfg.d_model, with_bias=cfg.bias, name="fc_out")(h), "mlp_out")
    if cache is not None:
      return x, new_cache
    if cfg.block == "fold":
      return x
    return x, block_stats(x_in, x, probs)


class Head(Linear):
  """The output projection: :class:`Linear`, as a class of its own so that
  its mixed-precision policy (float32 logits, for the loss) is its alone."""


def precision_policies(dtype: str) -> dict[type[hk.Module], jmp.Policy]:
  """Haiku mixed-precision policies for compute ``dtype``, by module class.

  None for float32. Otherwise every policy keeps the parameters float32 (each
  module casts them where it reads them; the gradients come back float32):
  the blocks (their matmuls, GELU and residual adds) and the embeddings
  compute in ``dtype`` and hand ``dtype`` on, so the stack's carry (which a
  remat policy keeps per layer) and the KV cache that decoding blocks write
  are ``dtype`` too; the layer norms compute in float32, as Haiku's ImageNet
  example does for its batch norm, and hand ``dtype`` on; the head computes
  in ``dtype`` and hands on float32 logits, so the loss's log-softmax over
  the vocabulary is float32. A module without a policy of its own (a block's
  attention, its linear layers) follows its caller's.

  Example::

    policies = precision_policies("bfloat16")
    policies[Head]   # params=float32, compute=bfloat16, output=float32
  """
  if dtype == "float32":
    return {}
  compute = jmp.get_policy(f"params=float32,compute={dtype},output={dtype}")
  return {
      hk.Embed: compute,
      Block: compute,
      hk.LayerNorm: jmp.get_policy(f"params=float32,compute=float32,output={dtype}"),
      Head: jmp.get_policy(f"params=float32,compute={dtype},output=float32"),
  }


@contextlib.contextmanager
def precision(cfg: GPTConfig) -> Iterator[None]:
  """``cfg.dtype``'s policies (:func:`precision_policies`) inside the ``with``.

  Haiku's policies are global (per thread) and apply while a module is
  traced: they are set here and cleared (or the earlier ones put back) on the
  way out, so a float32 model traced afterwards is untouched.
  :func:`forward`, ``decoding.decode`` and :func:`loss_fn` enter it themselves;
  code of one's own that calls this module's blocks directly enters it.

  Example::

    cfg = GPTConfig(vocab_size=64, num_layers=2, d_model=32, dtype="bfloat16")

    def one_block(x):              # inside hk.transform
      with precision(cfg):         # bfloat16 compute, float32 parameters
        return Block(cfg)(x)
  """
  with contextlib.ExitStack() as stack:
    for cls, policy in precision_policies(cfg.dtype).items():
      stack.enter_context(hk.mixed_precision.push_policy(cls, policy))
    yield


@contextlib.contextmanager
def precision_and_adapters(cfg: GPTConfig,
                           adapter_index: Optional[jax.Array] = None) -> Iterator[None]:
  """:func:`precision`, and ``cfg``'s low-rank adapters (``st.adapters.lora``
  on ``cfg.lora_patterns()``; each batch row on adapter ``adapter_index[row]``
  with ``cfg.lora_count``) when ``cfg.lora_rank`` is set."""
  with precision(cfg):
    if not cfg.lora_rank:
      yield
      return
    with st.adapters.lora(cfg.lora_patterns(), rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                          count=cfg.lora_count, index=adapter_index):
      yield


def in_precision(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn(cfg, ...)`` traced under :func:`precision_and_adapters`."""
  @functools.wraps(fn)
  def wrapped(cfg: GPTConfig, *args: Any, **kwargs: Any) -> Any:
    with precision_and_adapters(cfg):
      return fn(cfg, *args, **kwargs)
  return wrapped


def block_stats(x_in: jax.Array, x_out: jax.Array, probs: jax.Array) -> dict[str, jax.Array]:
  """Per-layer numbers for a scan block: what the layer did to the stream.

  One number per sequence (``[B]``), which :func:`forward` averages over
  the batch after the stack: every sequence has as many positions, heads and
  queries, so that is the mean over the whole batch.
  """
  entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)  # [B, H, T]
  update = jnp.linalg.norm(x_out - x_in, axis=-1)  # [B, T]
  stream = jnp.linalg.norm(x_in, axis=-1)
  return {
      # Mean entropy (nats) of each query's attention distribution.
      "attn_entropy": jnp.mean(entropy, axis=(1, 2)),
      # How much the block changed the residual stream, relative to its size.
      "update_ratio": jnp.mean(update / jnp.maximum(stream, 1e-6), axis=1),
  }


def block_stack(cfg: GPTConfig, ys_by_kind: Optional[bool] = None, training: bool = False):
  """The block stack ``h``: one block, or the kinds of ``cfg.pattern``.

  While ``training``, with ``cfg.layer_drop``, layers are skipped at random
  (the stack's ``layer_drop=``, which draws from the transform's rng).
  """
  if cfg.pattern:
    windows = {"L": cfg.window, "G": None}
    make_block = {KINDS[c]: functools.partial(Block, cfg, windows[c])
                  for c in dict.fromkeys(cfg.pattern)}
    config = dict(pattern=tuple(KINDS[c] for c in cfg.pattern), ys_by_kind=ys_by_kind)
  else:
    make_block, config = (lambda: Block(cfg)), {}
  if training and cfg.layer_drop:
    config["layer_drop"] = cfg.drop_rates()
  if cfg.stack == "unrolled":   # a Python loop: nothing to unroll further
    return st.BlockSeq(make_block, cfg.num_layers, remat=cfg.remat, name="h", **config)
  if cfg.pipeline is not None:
    config["pipeline"] = cfg.pipeline
  return st.Stacked(make_block, cfg.num_layers, remat=cfg.remat,
                    unroll=cfg.unroll, name="h", **config)


def embed_and_head(cfg: GPTConfig):
  """The parts around the stack, ``(embed, head)``: modules built once, here.

  Built before they are called, so a 1F1B pipeline (which calls them once
  per microbatch, inside the stack's call) reuses the same modules: the
  parameters keep their names (``tok_embed``, ``pos_embed``, ``ln_f``,
  ``head``) with or without a pipeline.
  """
  init = hk.initializers.RandomNormal(0.02)
  # A one-hot matmul, not a gather: a gather's gradient is a scatter-add, on
  # which jax 0.12.1's SPMD partitioner aborts inside a loss pipeline on a
  # pipe,data,fsdp mesh (docs/guides/troubleshooting.md, "Known JAX bugs").
  # Exact (HIGHEST precision), and as fast for a character vocabulary.
  tok = hk.Embed(cfg.vocab_size, cfg.d_model, w_init=init, lookup_style="ONE_HOT",
                 precision=jax.lax.Precision.HIGHEST, name="tok_embed")
  pos_embed = hk.Embed(cfg.seq_len, cfg.d_model, w_init=init, name="pos_embed")
  ln_f = hk.LayerNorm(-1, create_scale=True, create_offset=cfg.bias, name="ln_f")
  out = Head(cfg.vocab_size, with_bias=cfg.bias, name="head")

  def embed(tokens: jax.Array, pos: jax.Array | int = 0) -> jax.Array:
    return tok(tokens) + pos_embed(pos + jnp.arange(tokens.shape[1]))[None]

  return embed, lambda x: out(ln_f(x))


@in_precision
def forward(cfg: GPTConfig, tokens: jax.Array, training: bool = False
            ) -> tuple[jax.Array, Optional[dict[str, jax.Array]]]:
  """Logits for every position of ``tokens`` (``[B, T]``), and per-layer stats.

  Call inside ``hk.transform``. The logits are float32 whatever
  ``cfg.dtype``. Stats are ``None`` for fold blocks and a dict of
  ``[num_layers]`` arrays for scan blocks (a skipped layer's are 0).
  ``training`` with ``cfg.layer_drop`` needs an rng.
  """
  return _forward(cfg, tokens, training)


def _forward(cfg: GPTConfig, tokens: jax.Array, training: bool
             ) -> tuple[jax.Array, Optional[dict[str, jax.Array]]]:
  """:func:`forward` under the caller's :func:`precision_and_adapters`."""
  embed, head = embed_and_head(cfg)
  x = embed(tokens)
  stack = block_stack(cfg, training=training)
  stats = None
  if cfg.block == "fold":
    x = stack.fold(x)
  else:
    x, stats = stack.scan(x)
    # [num_layers, B] -> [num_layers]: the batch's mean for each layer (in
    # float32 whatever cfg.dtype, as the logits).
    stats = jax.tree_util.tree_map(lambda s: jnp.mean(s, axis=1, dtype=jnp.float32), stats)
  return head(x), stats


def _nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  log_probs = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0])


@in_precision
def loss_fn(cfg: GPTConfig, tokens: jax.Array, training: bool = False):
  """Mean next-token cross entropy (nats) over ``tokens[:, 1:]``, and stats.

  Under a pipeline that computes the loss (``1f1b``, ``interleaved``,
  ``zb``) the whole loss is the stack's call
  (``st.Stacked.loss``/``scan_loss``): the pipeline embeds on its first
  stage and takes the loss on its last, a microbatch at a time. The
  parameters, the loss and its gradients are the same as the plain path's.
  """
  if cfg.pipeline is not None and cfg.pipeline.computes_loss:
    embed, head = embed_and_head(cfg)
    stack = block_stack(cfg, training=training)
    ends = (embed, lambda x, t: _nll(head(x), t), tokens[:, :-1], tokens[:, 1:])
    if cfg.block == "fold":
      return stack.loss(*ends), None
    loss, stats = stack.scan_loss(*ends)
    return loss, jax.tree_util.tree_map(lambda s: jnp.mean(s, axis=1, dtype=jnp.float32),
                                        stats)
  # _forward, not forward: this is traced under precision_and_adapters
  # already, and a second st.adapters.lora context around the blocks would
  # add each adapter twice (st.adapters.lora refuses it).
  logits, stats = _forward(cfg, tokens[:, :-1], training)
  return _nll(logits, tokens[:, 1:]), stats
