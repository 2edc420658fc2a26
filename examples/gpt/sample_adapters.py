"""sample.py's --adapters: several LoRA runs on one base, each batch row on its own.

Each run's latest checkpoint holds its adapters and records their base (the
run, its step and a fingerprint of its parameters, ``lora.recorded``). The
base given (sample.py's --workdir) must be that base, unchanged. Each run's scale (``alpha / rank``) is folded
into its ``lora_b`` and its adapters padded with zeros to the highest rank
and every run's targets, so runs of other alphas, ranks and targets decode
together; the adapters are then stacked on an adapter axis
(``st.adapters.stack``), and ``decoding.generate`` gives each row its own
adapter (``adapter_index``) in one decode loop, over one copy of the base.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import stacktools as st
from examples.gpt import lora
from examples.gpt import model as model_lib
from examples.gpt import restoring
from examples.gpt import saving
from examples.gpt.model_config import GPTConfig
from examples.gpt.resume import StartError


def _adapter_shapes(cfg: GPTConfig) -> Any:
  """The adapters tree of ``cfg`` (with ``lora_rank``), as shapes."""
  model = hk.without_apply_rng(hk.transform(lambda t: model_lib.forward(cfg, t)))
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                          jnp.zeros((1, cfg.seq_len), jnp.int32))
  return st.adapters.split(shapes)[1]


def _read(run: str, cfg: GPTConfig, base_print: str, device: Any
          ) -> tuple[dict[str, Any], Any]:
  """A run's ``lora`` record and its adapters (scale folded into ``lora_b``)."""
  try:
    step, meta = saving.latest(run)
  except saving.CheckpointError as e:
    raise StartError(f"--adapters: {run!r}: {e}") from None
  record = meta.get("lora")
  if record is None:
    raise StartError(f"--adapters: {run!r} holds a whole model's checkpoints, not "
                     "adapters: pass the --workdir of a train.py --lora_rank run.")
  lora.check_base(record, base_print, f"--adapters: {run!r}")
  adapted = dataclasses.replace(cfg, lora_rank=record["rank"], lora_alpha=record["alpha"],
                                lora_targets=record["targets"], lora_count=None)
  try:
    shapes = _adapter_shapes(adapted)
  except ValueError as e:   # targets the base model has no layer of
    raise StartError(f"--adapters: {run!r}: {e}") from None
  template = jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)
  try:
    tree, _ = restoring.restore(run, step, template)
  except saving.CheckpointError as e:
    raise StartError(f"--adapters: {run!r}: {e}") from None
  scale = (record["alpha"] or record["rank"]) / record["rank"]
  return record, {m: {"lora_a": b["lora_a"], "lora_b": b["lora_b"] * scale}
                  for m, b in tree.items()}


def _padded(adapters: Any, shapes: Any) -> Any:
  """``adapters`` in ``shapes`` (a higher rank, more modules): zeros elsewhere,
  which change nothing (``lora_a`` columns and ``lora_b`` rows of zero)."""
  def fill(module, name, shape):
    out = np.zeros(shape.shape, shape.dtype)
    if module in adapters:
      mine = np.asarray(adapters[module][name])
      rank = mine.shape[-1] if name == "lora_a" else mine.shape[-2]
      out[(..., slice(0, rank)) if name == "lora_a" else (..., slice(0, rank), slice(None))] = mine
    return out
  return {m: {n: fill(m, n, s) for n, s in b.items()} for m, b in shapes.items()}


def with_adapters(cfg: GPTConfig, base: Any, runs: Sequence[str], rows_each: int,
                  device: Any) -> tuple[GPTConfig, Any, np.ndarray]:
  """``(cfg, params, adapter_index)`` that decode ``rows_each`` rows on each
  run's adapters, run after run.

  Runs of other ranks or targets decode together: each is padded with zeros
  to the highest rank and to every run's targets.

  Raises:
    StartError: a run that is no LoRA run or was trained on another base;
      one line naming it.
  """
  base_print = lora.fingerprint(base)
  records, trees = zip(*(_read(run, cfg, base_print, device) for run in runs))
  targets = ",".join(dict.fromkeys(
      t.strip() for r in records for t in r["targets"].split(",") if t.strip()))
  one = dataclasses.replace(cfg, lora_rank=max(r["rank"] for r in records),
                            lora_alpha=None, lora_targets=targets, lora_count=None)
  shapes = _adapter_shapes(one)
  stacked = st.adapters.stack([_padded(t, shapes) for t in trees])
  params = st.adapters.join(base, jax.device_put(stacked, device))
  return (dataclasses.replace(one, lora_count=len(runs)), params,
          np.repeat(np.arange(len(runs)), rows_each))
