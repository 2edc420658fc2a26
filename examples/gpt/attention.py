"""The GPT's causal self-attention, with its KV cache, and the splash kernel.

:class:`CausalSelfAttention` attends over a sequence (training, prefill), or
over one layer's KV cache plus the new positions (decoding, see
``decoding.py``). With a ``window`` (an ``L`` layer of ``GPTConfig.pattern``)
each query sees the last ``window`` positions only, and the cache is a ring of
``window`` slots. Where ``GPTConfig.uses_splash`` says so, the training pass
runs the Pallas TPU splash kernel instead of XLA's attention.

The cache lays heads side by side in a row of lanes
(:func:`cache_head_group`): on a TPU in bfloat16 a write then touches one row
of tiles.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp

import stacktools as st
from examples.gpt.linear import Linear
from examples.gpt.model_config import GPTConfig
from examples.gpt.model_config import SPLASH_TILE

#: One layer's KV cache: ``{"k": ..., "v": ...}``.
Cache = dict[str, jax.Array]


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
    group * head_dim]``, ``decoding.init_cache``), or the view of its row that
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
