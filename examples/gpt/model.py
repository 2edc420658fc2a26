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

The same block, given a per-layer KV cache through ``st.per_layer(cache,
in_place=True)``, returns ``(x, cache)`` with its new keys and values written
into its row: that is how :func:`decode` generates token by token.

``GPTConfig.pattern`` mixes two kinds of block in one stack (``st.Stacked``
with ``pattern=``): ``L`` layers attend causally over the last ``window``
positions only, ``G`` layers over the whole sequence; ``"LLLG"`` repeats three
local layers and one global one. Decoding then keeps a ring cache of
``window`` positions for each local layer and a full cache for each global
layer, passed per kind with ``st.per_kind``.

The linear layers are :class:`examples.gpt.linear.Linear`: ``hk.Linear``'s
parameters, with a weight gradient that runs faster on CPU.

The attention and MLP intermediates are named with ``st.checkpoint_name``
(:data:`CHECKPOINT_NAMES`) so a policy can keep them;
:data:`KEPT_MATMUL_OUTPUTS` are the ones ``train.py`` keeps by default.

``GPTConfig.pipeline`` (an ``st.Pipeline``) runs the stack as a pipeline
whenever the step is traced under a mesh with that pipeline's axis (``with
jax.set_mesh(mesh)``), and as a plain stack otherwise (init, sampling); the
parameters are the same either way.

``GPTConfig.dtype="bfloat16"`` is mixed precision through Haiku's
``hk.mixed_precision`` policies (:func:`precision_policies`, set by
:func:`precision` while :func:`forward`, :func:`decode` or :func:`loss_fn` is
traced, and cleared after): the parameters, and so the gradients and the
optimizer state, stay float32; the blocks, the embeddings and the head compute
in bfloat16; the layer norms' statistics, the attention softmax and the loss
(the logits' log-softmax over the vocabulary) are float32. The stack's
vmapped init and scanned apply call the blocks inside, so the policies reach
every layer.

``GPTConfig.attention`` chooses how the training forward pass attends:
XLA's attention (the scores and probabilities materialised, ``[B, H, T, T]``
a layer), or the Pallas TPU splash-attention kernel, which never writes them
to memory. On a TPU v5e at the GPT-2-small shape (B=16, H=12, T=1024,
bfloat16) the kernel's forward and backward took 4.2 ms a layer against
XLA's 10.1 ms, with a fifth of the memory. ``"auto"`` takes the kernel on a
single TPU chip wherever it applies (a fold block, the sequence a multiple
of 128) and XLA's attention elsewhere: XLA cannot partition the kernel's
call over a mesh of several devices (it would gather the batch on each).
Decoding always takes XLA's attention (one query a step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import jmp

import stacktools as st
from examples.gpt.linear import Linear

CHECKPOINT_NAMES = ("qkv", "attn_scores", "attn_probs", "attn_mix", "attn_out",
                    "mlp_pre", "mlp_hidden", "mlp_out")
#: What the example's remat keeps by default: the outputs of the block's
#: matmuls but the attention scores (the query/key/value projection, the
#: attention's mix of the values, the output projection and the MLP's first
#: layer before its GELU). The backward pass then recomputes the layer norms,
#: the GELU, the softmax and the scores (``q @ k.T``: about 4% of the block's
#: forward FLOPs at T=64, and cheaper to redo than to stack ``[L, B, H, T, T]``
#: of them), but no projection; the step needs about a third of ``none``'s
#: temp memory.
KEPT_MATMUL_OUTPUTS = ("qkv", "attn_mix", "attn_out", "mlp_pre")
#: The kinds of a pattern: a letter of --pattern, and the name its parameters
#: live under (``h/local/...``, ``h/global/...``).
KINDS = {"L": "local", "G": "global"}
#: The block's residual-branch outputs: the two linear layers whose outputs
#: are added to the residual stream. A block whose weights (and biases) there
#: are zero adds nothing: it is the identity, so a stack grown with such
#: blocks computes what it did (``st.take_layers(..., zero=RESIDUAL_OUTPUTS)``,
#: ``train.py --depth_map=zero_new``).
RESIDUAL_OUTPUTS = ("attn/proj", "fc_out")
#: The values of ``GPTConfig.dtype`` (``train.py --dtype``): the compute dtype.
DTYPES = ("float32", "bfloat16")
#: The values of ``GPTConfig.attention`` (``train.py --attention``).
ATTENTIONS = ("auto", "xla", "splash")
#: The splash kernel's blocks tile the sequence in multiples of this.
SPLASH_TILE = 128
Cache = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model shape and how its blocks are stacked.

  Attributes:
    vocab_size: number of token ids.
    seq_len: the longest sequence (the size of the position table).
    num_layers: number of blocks.
    num_heads: attention heads; must divide ``d_model``.
    d_model: residual stream width.
    mlp_ratio: MLP hidden width over ``d_model``.
    block: ``"fold"`` or ``"scan"`` (see the module docstring).
    stack: ``"scan"`` (``st.Stacked``) or ``"unrolled"`` (``st.BlockSeq``).
    remat: a checkpoint policy or alias for the stack.
    unroll: layers per rolled loop iteration of the stack.
    pattern: ``""`` for a stack of one block; otherwise the kinds of one
      period, one letter per layer: ``L`` (sliding-window attention) or ``G``
      (full attention), e.g. ``"LLLG"``.
    window: how many positions (its own included) an ``L`` layer attends to.
    bias: whether the linear layers and layer norms have biases (offsets);
      nanoGPT's default is without.
    pipeline: an ``st.Pipeline`` for the stack (``stack="scan"``), or
      ``None``. Not part of the model's shape: checkpoints
      leave it out, and a pipelined run resumes a plain one's and back.
    layer_drop: stochastic depth while training: the drop rate of the last
      layer, linear in depth (layer ``i`` of ``L`` skips with probability
      ``layer_drop * (i + 1) / L``, as in Huang et al. 2016). Evaluation
      and decoding run every layer. Not part of the model's shape either.
    dtype: the compute dtype, one of :data:`DTYPES`: ``"float32"``, or
      ``"bfloat16"`` with float32 parameters, layer-norm statistics, softmax
      and loss (see the module docstring). Not part of the model's shape
      either: the parameters are float32 under both.
    attention: one of :data:`ATTENTIONS`: ``"xla"``, ``"splash"`` (the
      Pallas TPU kernel; interpreted, slowly, off a TPU) or ``"auto"``
      (the kernel on one TPU chip where it applies). Not part of the model's
      shape.
  """

  vocab_size: int
  seq_len: int = 128
  num_layers: int = 4
  num_heads: int = 4
  d_model: int = 128
  mlp_ratio: int = 4
  block: str = "fold"
  stack: str = "scan"
  remat: Any = False
  unroll: int = 1
  pattern: str = ""
  window: int = 0
  bias: bool = True
  pipeline: Optional[st.Pipeline] = None
  layer_drop: float = 0.0
  dtype: str = "float32"
  attention: str = "auto"

  def __post_init__(self):
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} is not divisible by "
                       f"num_heads={self.num_heads}.")
    if self.block not in ("fold", "scan"):
      raise ValueError(f"block={self.block!r}: use 'fold' or 'scan'.")
    if self.stack not in ("scan", "unrolled"):
      raise ValueError(f"stack={self.stack!r}: use 'scan' or 'unrolled'.")
    unknown = sorted(set(self.pattern) - set(KINDS))
    if unknown:
      raise ValueError(f"pattern={self.pattern!r} has {unknown}: use the letters L "
                       "(sliding-window attention) and G (full attention), e.g. LLLG.")
    if "L" in self.pattern and not 1 <= self.window <= self.seq_len:
      raise ValueError(f"pattern={self.pattern!r} has L layers, which need a window "
                       f"between 1 and seq_len={self.seq_len}; got window={self.window}.")
    if self.window and "L" not in self.pattern:
      raise ValueError(f"window={self.window} is the span of L layers, but "
                       f"pattern={self.pattern!r} has none; drop the window or "
                       "add L layers to the pattern.")
    if not 0 <= self.layer_drop < 1:
      raise ValueError(f"layer_drop={self.layer_drop} must be in [0, 1).")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype={self.dtype!r}: use one of {', '.join(DTYPES)} (float32 "
                       "on CPU, bfloat16 on an accelerator).")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"attention={self.attention!r}: use one of {', '.join(ATTENTIONS)}.")
    if self.attention == "splash" and self.block != "fold":
      raise ValueError("attention='splash' needs block='fold': a scan block returns "
                       "statistics of the attention probabilities, which the kernel "
                       "never forms. Use attention='xla' (or 'auto') with block='scan'.")
    if self.attention == "splash" and self.seq_len % SPLASH_TILE:
      raise ValueError(f"attention='splash' needs seq_len to be a multiple of "
                       f"{SPLASH_TILE} (got {self.seq_len}): its blocks tile the "
                       "sequence. Use attention='auto', which falls back to XLA's.")
    if self.pipeline is not None and self.stack != "scan":
      raise ValueError(f"pipeline= needs stack='scan' (got stack={self.stack!r}): "
                       "a pipeline splits the layers of one st.Stacked; st.BlockSeq "
                       "has none.")

  def drop_rates(self) -> list[float]:
    """Each layer's drop rate while training: linear in depth up to ``layer_drop``."""
    return [self.layer_drop * (i + 1) / self.num_layers for i in range(self.num_layers)]

  def kind_count(self, letter: str) -> int:
    """How many layers of the stack are of kind ``letter`` (``L`` or ``G``)."""
    period = len(self.pattern)
    return sum(self.pattern[i % period] == letter for i in range(self.num_layers))

  def uses_splash(self, length: int) -> bool:
    """Whether a forward pass over ``length`` positions (no cache) takes the
    splash kernel."""
    if self.attention == "xla" or length % SPLASH_TILE:
      return False
    if self.attention == "splash":
      return True
    # One chip: XLA's partitioner cannot split the kernel's custom call, so
    # on a mesh of several it would gather the whole batch on every device.
    return (self.block == "fold" and jax.default_backend() == "tpu"
            and jax.device_count() == 1)

  @property
  def compute_dtype(self) -> jnp.dtype:
    """``dtype`` as a JAX dtype: the activations' and the KV cache's."""
    return jnp.dtype(self.dtype)


class CausalSelfAttention(hk.Module):
  """Multi-head causal self-attention, with an optional KV cache.

  With a ``window``, each query attends to the last ``window`` positions (its
  own included), and the cache is a ring of ``window`` slots: position ``p``
  lives in slot ``p % window``.
  """

  def __init__(self, cfg: GPTConfig, window: Optional[int] = None,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.cfg = cfg
    self.window = window

  def __call__(self, x: jax.Array, cache: Any = None,
               pos: Optional[jax.Array] = None):
    """Attends over ``x`` (``[B, T, D]``), or over ``cache`` plus ``x``.

    ``cache`` is one layer's ``{"k", "v"}`` (``[B, heads / group, length,
    group * head_dim]``, :func:`init_cache`), or the view of its row that
    ``st.per_layer(..., in_place=True)`` gives.

    Returns:
      ``(out, probs, new_cache)``; ``new_cache`` is ``None`` without a cache,
      and ``probs`` is ``None`` with one.
    """
    cfg = self.cfg
    b, t, _ = x.shape
    head_dim = cfg.d_model // cfg.num_heads
    qkv = st.checkpoint_name(
        Linear(3 * cfg.d_model, with_bias=cfg.bias, name="qkv")(x), "qkv")
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * cfg.num_heads, head_dim), 3, axis=2)
    # Scaling the queries touches half the elements that scaling the
    # scores would (T = 2 * head_dim here); with the mask added as a bias the
    # step took 0.96x the time of scaling and masking the scores.
    q = q * (1 / head_dim**0.5)
    probs = new_cache = None
    if cache is not None:
      mixed, new_cache = self._cached(q, k, v, cache, pos)
    elif cfg.uses_splash(t):
      mixed = _splash(cfg.num_heads, t, self.window)(q, k, v)
    else:
      mask = _visible(jnp.arange(t), jnp.arange(t), self.window)
      # The softmax in float32 (the scores upcast), its probabilities back in
      # the compute dtype for their matmul with the values.
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
      scores = st.checkpoint_name(
          scores + jnp.where(mask, 0.0, jnp.finfo(scores.dtype).min), "attn_scores")
      probs = st.checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(v.dtype),
                                 "attn_probs")
      mixed = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    out = st.checkpoint_name(mixed.reshape(b, t, cfg.d_model), "attn_mix")
    out = st.checkpoint_name(Linear(cfg.d_model, with_bias=cfg.bias, name="proj")(out), "attn_out")
    return out, probs, new_cache

  def _cached(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any,
              pos: jax.Array) -> tuple[jax.Array, Any]:
    """``t`` new positions from ``pos`` attend to the cache and to themselves.

    The cache is read as it was and the new keys and values are attended to
    beside it (one softmax over both), so no layer copies its cache to add
    them; they are then written at ``pos`` (a ring: at ``pos % window``).

    Returns:
      ``(out [B, t, heads, head_dim], new_cache)``.
    """
    old = cache if isinstance(cache, dict) else cache.read()
    dtype = old["k"].dtype
    group = q.shape[2] // old["k"].shape[1]   # heads a cache row holds
    # Into the cache's layout (init_cache): the dots over head_dim then read
    # the cache as it lies.
    k, v = (_rows(a.astype(dtype), group) for a in (k, v))
    q_rows = _query_rows(q.astype(dtype), group)
    t, slots = q.shape[1], old["k"].shape[2]
    query_pos = pos + jnp.arange(t)
    if self.window is None:   # position s in slot s, written if before pos
      held = jnp.where(jnp.arange(slots) < pos, jnp.arange(slots), -1)
    else:   # slot s: the latest position before pos that is s modulo slots
      held = pos - 1 - (pos - 1 - jnp.arange(slots)) % slots
    neg = jnp.finfo(jnp.float32).min

    def dot_keys(keys):   # [B, H, t, positions], float32
      scores = jnp.einsum("bgql,bgkl->bgqk", q_rows, keys).astype(jnp.float32)
      return _heads(scores, group)

    # Tagged as in the forward pass: a policy that names them holds in decode.
    # The softmax in float32, as there.
    scores = st.checkpoint_name(jnp.concatenate([
        dot_keys(old["k"]) + jnp.where(_visible(query_pos, held, self.window), 0.0, neg),
        dot_keys(k) + jnp.where(_visible(query_pos, query_pos, self.window), 0.0, neg)],
                                                axis=-1), "attn_scores")
    probs = st.checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(dtype), "attn_probs")
    prob_rows = probs.reshape(probs.shape[0], -1, group * t, probs.shape[-1])
    out = _out_of_rows(jnp.einsum("bgqk,bgkl->bgql", prob_rows[..., :slots], old["v"])
                       + jnp.einsum("bgqk,bgkl->bgql", prob_rows[..., slots:], v), group)
    new = {"k": k, "v": v}
    if self.window is None:
      return out, _write(cache, new, pos)
    newest = min(t, slots)          # only the last ``slots`` new ones survive
    if newest == 1:
      return out, _write(cache, new, pos % slots)
    where = (pos + t - newest + jnp.arange(newest)) % slots
    ring = {name: old[name].at[:, :, where].set(new[name][:, :, t - newest:])
            for name in new}
    return out, ring if isinstance(cache, dict) else cache.write(ring)


@functools.lru_cache(maxsize=None)
def _splash(num_heads: int, length: int,
            window: Optional[int]) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
  """Causal attention through the Pallas TPU splash kernel: ``(q, k, v) ->
  out``, each ``[B, T, H, head_dim]``, the queries already scaled.

  The kernel skips the blocks the causal (or sliding-window) mask hides and
  keeps only each row's softmax statistics for the backward pass. Off a TPU
  it runs in Pallas's interpreter, which only tests need.
  """
  # Imported here: Pallas's TPU modules are needed only where the kernel runs.
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)
  if window is None:
    one_head = mask_lib.CausalMask((length, length))
  else:   # the query's own position and the window - 1 before it
    one_head = mask_lib.LocalMask((length, length), window_size=(window - 1, 0), offset=0)
  # 512-position blocks measured fastest at T=1024 (4.2 ms forward and
  # backward a layer, against 4.9 to 7.7 ms for the other sizes tried), with
  # the fused backward kernel.
  block = max(b for b in (512, 256, SPLASH_TILE) if length % b == 0)
  sizes = kernel_lib.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
      block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
  # Built eagerly, whatever is being traced: the kernel's mask tables are
  # arrays, kept (cached) for every later trace.
  # The kernel's output and softmax statistics, what its backward pass reads,
  # are tagged "attn_mix": a policy that keeps attn_mix keeps them, and the
  # backward pass does not run the kernel's forward pass again for them.
  with jax.ensure_compile_time_eval():
    attend = kernel_lib.make_splash_mha(
        mask_lib.MultiHeadMask([one_head] * num_heads), block_sizes=sizes, head_shards=1,
        q_seq_shards=1, residual_checkpoint_name="attn_mix",
        interpret=jax.default_backend() != "tpu")

  def heads_first(a):
    return a.transpose(0, 2, 1, 3)

  def run(q, k, v):
    return heads_first(jax.vmap(attend)(heads_first(q), heads_first(k), heads_first(v)))
  return run


def _visible(query_pos: jax.Array, key_pos: jax.Array,
             window: Optional[int]) -> jax.Array:
  """``[queries, keys]``: which keys each query attends to (causal, within
  ``window`` when given; a negative key position was never written)."""
  mask = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] >= 0)
  if window is not None:
    mask &= key_pos[None, :] > query_pos[:, None] - window
  return mask


def _write(cache: Any, kv: Cache, at: jax.Array) -> Any:
  """``kv`` (in the cache's layout, ``[B, H / group, t, group * D]`` each)
  written at position ``at`` of a layer's cache.

  A new slice with ``st.per_layer(cache)``; with ``in_place=True``, the view
  the block was handed, with only the new positions written.
  """
  if isinstance(cache, dict):
    return {name: jax.lax.dynamic_update_slice(cache[name], kv[name], (0, 0, at, 0))
            for name in kv}
  return cache.write(kv, at=(0, 0, at))


# ---------------------------------------------------------------------------
# The KV cache's layout: heads side by side in a row of lanes.

#: A TPU tile's minor dimension: 128 lanes.
TPU_LANES = 128


def cache_head_group(cfg: GPTConfig, dtype: Any = None,
                     backend: Optional[str] = None) -> int:
  """How many heads share a row of a KV cache in ``dtype`` (by default the
  compute dtype): on a TPU, in a 2-byte dtype, as many as fill its 128 lanes
  (2 at a head size of 64); otherwise 1.

  With a head size under 128, a cache laid out ``[B, H, T, head_dim]`` does
  not fill a TPU tile's lanes, so XLA lays it out with the positions
  minor-most, and writing one position touches a partial tile in every row:
  on a TPU v5e (L=24, B=8, T=4096, bfloat16) the writes took 0.87 ms of a
  7.5 ms token. Packing ``group`` heads into a row of ``group * head_dim``
  lanes keeps the positions major, and a write touches one row of tiles
  (0.09 ms; the token 6.1 ms). A float32 cache stays a head a row: packed,
  its dots with the queries go to the matrix unit, which takes bfloat16,
  and XLA converted the whole cache before the loop over layers (23.5 ms a
  token against 14.8 ms at L=24, B=8, T=4096).
  """
  head_dim = cfg.d_model // cfg.num_heads
  dtype = jnp.dtype(cfg.compute_dtype if dtype is None else dtype)
  if ((backend or jax.default_backend()) != "tpu" or dtype.itemsize != 2
      or TPU_LANES % head_dim):
    return 1
  group = TPU_LANES // head_dim
  while cfg.num_heads % group:
    group //= 2
  return group


def _rows(a: jax.Array, group: int) -> jax.Array:
  """Keys or values, ``[B, t, H, D]`` -> the cache's ``[B, H / group, t,
  group * D]``: head ``g * group + j`` in lanes ``j * D`` to ``(j + 1) * D``
  of row ``g``."""
  b, t, heads, d = a.shape
  return a.reshape(b, t, heads // group, group * d).swapaxes(1, 2)


def _query_rows(q: jax.Array, group: int) -> jax.Array:
  """Queries, ``[B, t, H, D]`` -> ``[B, H / group, group * t, group * D]``,
  block diagonal: query row ``i * t + s`` of group ``g`` holds head ``g *
  group + i``'s query at ``s`` in that head's lanes and zeros elsewhere, so a
  dot with a cache row over all its lanes gives that head's scores alone.
  (``group`` times the dot's FLOPs, on a step that reads memory.)"""
  if group == 1:
    return q.swapaxes(1, 2)
  b, t, heads, d = q.shape
  q = q.reshape(b, t, heads // group, group, d)
  blocks = jnp.einsum("bsgid,ij->bgisjd", q, jnp.eye(group, dtype=q.dtype))
  return blocks.reshape(b, heads // group, group * t, group * d)


def _heads(scores: jax.Array, group: int) -> jax.Array:
  """``[B, H / group, group * t, K]`` -> ``[B, H, t, K]``."""
  b, g, rows, k = scores.shape
  return scores.reshape(b, g * group, rows // group, k)


def _out_of_rows(out: jax.Array, group: int) -> jax.Array:
  """The mixed values, ``[B, H / group, group * t, group * D]`` (query row
  ``i * t + s`` has head ``g * group + i``'s output in that head's lanes) ->
  ``[B, t, H, D]``."""
  if group == 1:
    return out.swapaxes(1, 2)
  b, g, rows, lanes = out.shape
  t, d = rows // group, lanes // group
  out = out.reshape(b, g, group, t, group, d)
  out = jnp.einsum("bgisjd,ij->bsgid", out, jnp.eye(group, dtype=out.dtype))
  return out.reshape(b, t, g * group, d)


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
  :func:`forward`, :func:`decode` and :func:`loss_fn` enter it themselves;
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


def _in_precision(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn(cfg, ...)`` traced under :func:`precision`."""
  @functools.wraps(fn)
  def wrapped(cfg: GPTConfig, *args: Any, **kwargs: Any) -> Any:
    with precision(cfg):
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


def _stack(cfg: GPTConfig, ys_by_kind: Optional[bool] = None, training: bool = False):
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


def _ends(cfg: GPTConfig):
  """The parts around the stack, ``(embed, head)``: modules built once, here.

  Built before they are called, so a 1F1B pipeline (which calls them once
  per microbatch, inside the stack's call) reuses the same modules: the
  parameters keep their names (``tok_embed``, ``pos_embed``, ``ln_f``,
  ``head``) with or without a pipeline.
  """
  init = hk.initializers.RandomNormal(0.02)
  tok = hk.Embed(cfg.vocab_size, cfg.d_model, w_init=init, name="tok_embed")
  pos_embed = hk.Embed(cfg.seq_len, cfg.d_model, w_init=init, name="pos_embed")
  ln_f = hk.LayerNorm(-1, create_scale=True, create_offset=cfg.bias, name="ln_f")
  out = Head(cfg.vocab_size, with_bias=cfg.bias, name="head")

  def embed(tokens: jax.Array, pos: jax.Array | int = 0) -> jax.Array:
    return tok(tokens) + pos_embed(pos + jnp.arange(tokens.shape[1]))[None]

  return embed, lambda x: out(ln_f(x))


@_in_precision
def forward(cfg: GPTConfig, tokens: jax.Array, training: bool = False
            ) -> tuple[jax.Array, Optional[dict[str, jax.Array]]]:
  """Logits for every position of ``tokens`` (``[B, T]``), and per-layer stats.

  Call inside ``hk.transform``. The logits are float32 whatever
  ``cfg.dtype``. Stats are ``None`` for fold blocks and a dict of
  ``[num_layers]`` arrays for scan blocks (a skipped layer's are 0).
  ``training`` with ``cfg.layer_drop`` needs an rng.
  """
  embed, head = _ends(cfg)
  x = embed(tokens)
  stack = _stack(cfg, training=training)
  stats = None
  if cfg.block == "fold":
    x = stack.fold(x)
  else:
    x, stats = stack.scan(x)
    # [num_layers, B] -> [num_layers]: the batch's mean for each layer (in
    # float32 whatever cfg.dtype, as the logits).
    stats = jax.tree_util.tree_map(lambda s: jnp.mean(s, axis=1, dtype=jnp.float32), stats)
  return head(x), stats


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


@_in_precision
def decode(cfg: GPTConfig, tokens: jax.Array, cache: Cache,
           pos: jax.Array, *, in_place: bool = True) -> tuple[jax.Array, Cache]:
  """Logits for ``tokens`` placed at ``pos``, attending to the cache.

  Call inside ``hk.transform`` (same parameters as :func:`forward`). The
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

  Returns:
    ``(logits [B, T, vocab], new_cache)``.
  """
  embed, head = _ends(cfg)
  x = embed(tokens, pos)
  if cfg.pattern:
    x, cache = _stack(cfg, ys_by_kind=True).scan(
        x, st.per_kind(cache, in_place=in_place), pos)
  else:
    x, cache = _stack(cfg).scan(x, st.per_layer(cache, in_place=in_place), pos)
  return head(x), cache


def _nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  log_probs = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0])


@_in_precision
def loss_fn(cfg: GPTConfig, tokens: jax.Array, training: bool = False):
  """Mean next-token cross entropy (nats) over ``tokens[:, 1:]``, and stats.

  Under a pipeline that computes the loss (``1f1b``, ``interleaved``,
  ``zb``) the whole loss is the stack's call
  (``st.Stacked.loss``/``scan_loss``): the pipeline embeds on its first
  stage and takes the loss on its last, a microbatch at a time. The
  parameters, the loss and its gradients are the same as the plain path's.
  """
  if cfg.pipeline is not None and cfg.pipeline.computes_loss:
    embed, head = _ends(cfg)
    stack = _stack(cfg, training=training)
    ends = (embed, lambda x, t: _nll(head(x), t), tokens[:, :-1], tokens[:, 1:])
    if cfg.block == "fold":
      return stack.loss(*ends), None
    loss, stats = stack.scan_loss(*ends)
    return loss, jax.tree_util.tree_map(lambda s: jnp.mean(s, axis=1, dtype=jnp.float32),
                                        stats)
  logits, stats = forward(cfg, tokens[:, :-1], training)
  return _nll(logits, tokens[:, 1:]), stats
