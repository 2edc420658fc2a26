"""The optimizer of train.py: AdamW, or Muon on the blocks' matrices, and its layer rules.

Both run a linear warmup and a cosine decay (to a tenth of the peak), after
clipping the gradients' global norm. Muon (``optax.contrib.muon``) takes each
block's weight matrices one layer at a time, AdamW the rest, as
modded-nanoGPT does. ``--layer_lr_decay`` and ``--freeze_layers`` act on the
layers of the block stack, through ``st.over_layers``.

:meth:`OptimizerConfig.recorded` is what a checkpoint records of it: the
settings that shape the optimizer state, which a ``--resume`` must repeat.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

import stacktools as st
from examples.gpt import model_config

#: The optimizers by --optimizer name.
OPTIMIZERS = ("adamw", "muon")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer flags of train.py, by the same names (their defaults are
  the flags')."""

  optimizer: str   # one of OPTIMIZERS
  learning_rate: float
  muon_learning_rate: float
  warmup_steps: int
  weight_decay: float
  grad_clip: float   # 0: off
  layer_lr_decay: float   # 1: none
  freeze_layers: str   # "A:B", or "" for none

  def recorded(self) -> dict[str, Any]:
    """The settings that shape the optimizer state, as a checkpoint records
    them: a --resume with other values finds another optimizer's state."""
    return {"optimizer": self.optimizer, "freeze_layers": self.freeze_layers,
            "layer_lr_decay": self.layer_lr_decay, "grad_clip": self.grad_clip}


def layer_range(text: str, num_layers: int) -> range:
  """``"A:B"`` -> ``range(A, B)``, checked against the depth (``""``: empty).

  Example::

    assert layer_range("0:2", 4) == range(0, 2)

  Raises:
    ValueError: one line naming --freeze_layers, for text that is not A:B
      within the depth.
  """
  if not text:
    return range(0)
  parts = text.split(":")
  try:
    start, stop = (int(p) for p in parts)
  except ValueError:
    start = stop = None
  if start is None or not 0 <= start < stop <= num_layers:
    raise ValueError(f"--freeze_layers={text!r} must be A:B with 0 <= A < B <= "
                     f"--num_layers={num_layers} (blocks A to B-1), e.g. 0:2.")
  return range(start, stop)


def check_layer_rules(freeze_layers: str, layer_lr_decay: float, num_layers: int,
                      stack: str) -> None:
  """Checks that the per-layer rules fit the depth and the stack.

  Raises:
    ValueError: one line naming the flags.
  """
  frozen = layer_range(freeze_layers, num_layers)
  if stack == "unrolled" and (frozen or layer_lr_decay != 1):
    raise ValueError(
        "--freeze_layers and --layer_lr_decay index the Layers axis of the stacked "
        "parameters, which --stack=unrolled (one parameter per layer) does not "
        "have: use --stack=scan.")


def make_optimizer(config: OptimizerConfig, steps: int,
                   cfg: model_config.GPTConfig) -> optax.GradientTransformation:
  """AdamW (or Muon on the blocks' matrices and AdamW on the rest) with linear
  warmup and cosine decay (to a tenth), gradients clipped; the layer rules
  act on the block stack's layers.

  Example::

    config = OptimizerConfig(
        optimizer="muon", learning_rate=2e-3, muon_learning_rate=0.02,
        warmup_steps=50, weight_decay=0.01, grad_clip=1.0, layer_lr_decay=1.0,
        freeze_layers="")
    tx = make_optimizer(config, 600, cfg)
    opt_state = tx.init(params)

  Args:
    config: the optimizer flags.
    steps: the schedule's length (--steps).
    cfg: the model, whose stack ``h`` the layer rules index.
  """
  def schedule(peak):
    if not config.warmup_steps:
      # optax's warmup of 0 steps is a linear schedule of none, which it
      # logs as a warning-like line; the cosine decay alone is the same
      # schedule (warmup_cosine_decay_schedule joins the two at step 0).
      return optax.cosine_decay_schedule(peak, decay_steps=steps, alpha=0.1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak,
        # --warmup_steps < --steps (a flag validator): at least one step of
        # cosine decay, which optax needs.
        warmup_steps=config.warmup_steps, decay_steps=steps,
        end_value=peak / 10)
  parts = []
  if config.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(config.grad_clip))
  tx = optax.adamw(schedule(config.learning_rate), weight_decay=config.weight_decay)
  if config.optimizer == "muon":
    def labels(params):   # the blocks' weight matrices (one per layer), and the rest
      return jax.tree_util.tree_map_with_path(
          lambda path, _: "muon" if (str(path[0].key).startswith("h/")
                                     and path[-1].key == "w") else "adamw", params)
    muon = optax.contrib.muon(schedule(config.muon_learning_rate),
                              weight_decay=config.weight_decay)
    tx = optax.partition({"muon": muon, "adamw": tx}, labels)
  L, decay = cfg.num_layers, config.layer_lr_decay  # pylint: disable=invalid-name
  frozen = layer_range(config.freeze_layers, L)
  # AdamW alone is elementwise: per layer or not, the same steps. BlockSeq's
  # layers are separate leaves already.
  if cfg.stack == "scan" and (config.optimizer == "muon" or decay != 1 or frozen):
    tx = st.over_layers(
        tx, stacked={"h": tuple(model_config.KINDS[c] for c in cfg.pattern) or None},
        scale=(lambda i: decay ** (L - 1 - i)) if decay != 1 else None, frozen=frozen)
  parts.append(tx)
  return optax.chain(*parts)
