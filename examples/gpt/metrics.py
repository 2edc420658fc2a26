"""What train.py reports: throughput, model FLOPs and MFU, metrics.jsonl and loss.png.

The log lines count training alone: a :class:`Stopwatch` runs while steps run
and stops for evaluations and checkpoints. The model FLOPs of a token
(:func:`model_flops_per_token`) over the devices' peak (:data:`PEAK_FLOPS`,
where the device kind is known) give the MFU. The records of the log lines
go to ``metrics.jsonl`` (one JSON object a line) and, with matplotlib
installed, to ``loss.png``; both are written atomically (see files.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Optional

from absl import logging
import jax
import numpy as np

from examples.gpt import files
from examples.gpt import model_config

#: One device's dense bfloat16 peak FLOP/s, by ``jax.Device.device_kind``.
#: JAX names the TPU v5e "TPU v5 lite", the v5p "TPU v5" and the v6e "TPU v6
#: lite". A GPU's kind also names its memory and form ("NVIDIA
#: A100-SXM4-40GB"), so an NVIDIA entry matches the start of the kind.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "NVIDIA H100": 989e12,        # SXM
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA A100": 312e12,
}


def peak_flops(device_kind: str) -> Optional[float]:
  """``device_kind``'s entry of :data:`PEAK_FLOPS`, or None (a CPU, say).

  Example::

    assert peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
  """
  if device_kind in PEAK_FLOPS:
    return PEAK_FLOPS[device_kind]
  gpus = [kind for kind in PEAK_FLOPS
          if kind.startswith("NVIDIA ") and device_kind.startswith(kind)]
  return PEAK_FLOPS[max(gpus, key=len)] if gpus else None


def run_peak_flops(per_device: Optional[float]) -> Optional[float]:
  """The run's peak FLOP/s over all its devices, or None where it is not known.

  Args:
    per_device: one device's peak (--peak_flops), or None for the device
      kind's (:func:`peak_flops`).

  Returns:
    The peak times the device count; None (no MFU is logged) where neither
    is known.
  """
  peak = per_device or peak_flops(jax.devices()[0].device_kind)
  return None if peak is None else peak * jax.device_count()


def model_flops_per_token(cfg: model_config.GPTConfig, num_params: int) -> float:
  """Training FLOPs per token of the model: 6·N + 12·L·d·T.

  The estimate of PaLM's appendix B (and nanoGPT's ``estimate_mfu``): 6·N
  for the forward and backward matmuls with the weights, 12·L·d·T for the
  attention's scores and mix over T positions. N here is every parameter,
  the count of the log's "Parameters:" line, embeddings included (at a
  character vocabulary they are a small part). The attention term counts T
  in full, as the formula does, for causal and windowed layers alike; what
  remat recomputes is not counted (model FLOPs, not hardware FLOPs).
  """
  return 6 * num_params + 12 * cfg.num_layers * cfg.d_model * cfg.seq_len


class Stopwatch:
  """Training seconds between log lines, with evaluation and checkpoints left out.

  Steps run asynchronously, so :meth:`stop` first waits for what was
  dispatched (a step's loss): its time counts before the clock stops.

  Example::

    stopwatch = Stopwatch()          # running
    stopwatch.stop(loss)             # waits for the steps, then stops
    stopwatch.start()
    seconds = stopwatch.lap()        # the training time since the last lap
  """

  def __init__(self):
    self._seconds = 0.0
    self._since: Optional[float] = time.perf_counter()

  def stop(self, pending: Any = None) -> None:
    """Waits for ``pending``, then stops the clock."""
    jax.block_until_ready(pending)
    if self._since is not None:
      self._seconds += time.perf_counter() - self._since
      self._since = None

  def start(self) -> None:
    self._since = time.perf_counter()

  def lap(self) -> float:
    """Seconds the clock ran since the last lap; starts the next one."""
    self.stop()
    seconds, self._seconds = self._seconds, 0.0
    self.start()
    return seconds


@dataclasses.dataclass(frozen=True)
class Throughput:
  """Makes a log line's record and text from the steps since the last one.

  Example::

    throughput = Throughput(tokens_per_step=16 * 64)
    record, line = throughput.record(100, [2.31, 2.29], seconds=0.5, stats=None)
    assert line == "step   100  train loss 2.3000      4096 tokens/s   250.0 ms/step"
  """

  tokens_per_step: int
  flops_per_token: Optional[float] = None   # with peak: TFLOP/s and MFU
  peak: Optional[float] = None   # the run's peak FLOP/s (run_peak_flops)

  def record(self, step: int, losses: list[float], seconds: float,
             stats: Optional[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The record for metrics.jsonl and the log line, of ``losses`` (one a
    step) trained in ``seconds``; ``stats``: the last step's per-layer ones."""
    record = {"step": step, "train_loss": float(np.mean(losses)),
              "step_time_s": seconds / len(losses),
              "tokens_per_s": self.tokens_per_step * len(losses) / seconds}
    message = (f"step {step:5d}  train loss {record['train_loss']:.4f}  "
               f"{record['tokens_per_s']:8.0f} tokens/s  ")
    if self.peak is not None:
      record["model_tflops_per_s"] = record["tokens_per_s"] * self.flops_per_token / 1e12
      record["mfu"] = record["model_tflops_per_s"] * 1e12 / self.peak
      message += (f"{record['model_tflops_per_s']:7.2f} TFLOP/s  "
                  f"MFU {100 * record['mfu']:4.1f}%  ")
    message += f"{1000 * record['step_time_s']:6.1f} ms/step"
    if stats is not None:
      for name, values in stats.items():
        record[name] = [round(float(v), 4) for v in values]
        message += f"\n    {name:>13} per layer: " + " ".join(f"{v:.3f}" for v in record[name])
    return record, message


def write_metrics(path: str, records: list[dict[str, Any]]) -> None:
  """Writes ``records`` to ``path`` as JSON lines, atomically."""
  text = "".join(json.dumps(r) + "\n" for r in records)
  files.atomic_write(path, lambda f: f.write(text), mode="w")


def read_metrics(path: str, last_step: int) -> list[dict[str, Any]]:
  """The records of ``path`` up to ``last_step`` (a resumed run's own); [] if
  there is no file."""
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [r for r in map(json.loads, f) if r["step"] <= last_step]


def plot_losses(workdir: str, records: list[dict[str, Any]], unigram: float) -> None:
  """Plots the train and validation losses to ``workdir/loss.png``.

  Logs a hint instead where matplotlib is not installed.
  """
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    logging.info("matplotlib is not installed: no loss.png (pip install matplotlib).")
    return
  train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
  valid = [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r]
  fig, ax = plt.subplots(figsize=(6, 4))
  if train:
    ax.plot(*zip(*train), label="train")
  if valid:
    ax.plot(*zip(*valid), marker="o", label="validation")
  ax.axhline(unigram, color="gray", linestyle="--", label="unigram entropy")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per character)")
  ax.set_title("stacktools GPT")
  ax.legend()
  fig.tight_layout()
  path = os.path.join(workdir, "loss.png")
  # A file object has no extension to infer the format from.
  files.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
  plt.close(fig)
  logging.info("Wrote %s", path)
