"""The GPT example's model config: its shape, and how its blocks are stacked and run.

:class:`GPTConfig` says what the model is (vocabulary, depth, width, heads,
``pattern`` and ``window``, biases) and how its layers run (fold or scan
blocks, ``st.Stacked`` or ``st.BlockSeq``, remat, pipeline, layer drop,
compute dtype, attention); the constants beside it are the values those
fields and train.py's flags take.

``GPTConfig.pattern`` mixes two kinds of block in one stack (``st.Stacked``
with ``pattern=``): ``L`` layers attend causally over the last ``window``
positions only, ``G`` layers over the whole sequence; ``"LLLG"`` repeats three
local layers and one global one.

The attention and MLP intermediates are named with ``st.checkpoint_name``
(:data:`CHECKPOINT_NAMES`) so a remat policy can keep them;
:data:`KEPT_MATMUL_OUTPUTS` are the ones ``train.py`` keeps by default.

``GPTConfig.pipeline`` (an ``st.Pipeline``) runs the stack as a pipeline
whenever the step is traced under a mesh with that pipeline's axis (``with
jax.set_mesh(mesh)``), and as a plain stack otherwise (init, sampling); the
parameters are the same either way.

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

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

import stacktools as st

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
#: ``--lora_targets``' names for the block's linear layers, as the module-path
#: patterns ``st.adapters.lora`` takes; any other target is taken as a pattern.
LORA_TARGETS = {"attn": ("attn",), "mlp": ("fc", "fc_out")}


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
    block: ``"fold"`` or ``"scan"`` (see ``model.py``'s docstring).
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
      and loss (see ``model.py``'s docstring). Not part of the model's shape
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
  lora_rank: int = 0
  lora_alpha: Optional[float] = None
  lora_targets: str = "attn,mlp"
  lora_count: Optional[int] = None

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

  def lora_patterns(self) -> tuple[str, ...]:
    """``lora_targets`` as the module-path patterns ``st.adapters.lora`` takes."""
    names = [t.strip() for t in self.lora_targets.split(",") if t.strip()]
    return tuple(p for t in names for p in LORA_TARGETS.get(t, (t,)))

  def without_adapters(self) -> "GPTConfig":
    """The base model: this config with no adapters (for merged parameters)."""
    return dataclasses.replace(self, lora_rank=0, lora_alpha=None, lora_count=None)

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
