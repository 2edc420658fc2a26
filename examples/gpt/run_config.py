"""What one run of each binary is told: :class:`TrainConfig` and :class:`SampleConfig`.

Each is frozen and holds its binary's flags under the same names, with the
same defaults: ``flags.py`` (train.py's) and ``sample_flags.py`` (sample.py's)
define every flag from a field's default and build one config from the
parsed flags, the only place that reads them. From Python, skip absl and
build the config yourself::

  from examples.gpt import run_config, train

  config = run_config.TrainConfig(num_layers=2, steps=20, sample_tokens=0)
  params = train.train(config, "workdir/tiny")

The checks between flags (``flags.py``'s validators) run where the command
line is parsed; a config built in Python meets what the run checks as it
starts (the model, the mesh, the corpus, the checkpoints), each in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

#: --window when --pattern has L layers and no --window is given.
DEFAULT_WINDOW = 32


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """train.py's flags but --workdir (``train.train`` takes that beside it).

  See ``python examples/gpt/train.py --helpfull`` (or ``flags.py``) for what
  each one means; the list-valued flags are tuples here.
  """

  # The model and how its stack runs.
  remat: str = "full"
  memory_budget: Optional[str] = None
  remat_candidates: Optional[tuple[str, ...]] = None
  save_names: Optional[tuple[str, ...]] = None
  nested_outer: Optional[int] = None
  block: str = "fold"
  stack: str = "scan"
  unroll: int = 1
  pattern: str = ""
  window: Optional[int] = None
  num_layers: int = 4
  num_heads: int = 4
  d_model: int = 128
  bias: bool = True
  dtype: str = "float32"
  attention: str = "auto"
  seq_len: int = 64
  # Training: the batches, the schedule and the optimizer.
  batch_size: int = 16
  grad_accum: int = 1
  steps: int = 600
  stop_after: Optional[int] = None
  learning_rate: float = 2e-3
  warmup_steps: int = 50
  weight_decay: float = 0.01
  grad_clip: float = 1.0
  optimizer: str = "adamw"
  muon_learning_rate: float = 0.02
  layer_lr_decay: float = 1.0
  freeze_layers: str = ""
  layer_drop: float = 0.0
  # Where the run starts from.
  init_from: Optional[str] = None
  depth_map: Optional[str] = None
  init_opt_state: str = "fresh"
  lora_rank: int = 0
  lora_alpha: Optional[float] = None
  lora_targets: str = "attn,mlp"
  resume: bool = False
  # Evaluation, outputs and logs.
  eval_every: int = 100
  eval_batches: int = 8
  seed: int = 0
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  export_npz: str = ""
  log_every: int = 50
  peak_flops: Optional[float] = None
  data_path: Optional[str] = None
  sample_tokens: int = 200
  sample_prompt: str = "def "
  # Devices and processes.
  mesh: str = ""
  pipeline: str = "none"
  microbatches: Optional[int] = None
  pipeline_repeats: Optional[int] = None
  coordinator_address: Optional[str] = None
  num_processes: int = 1
  process_id: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class SampleConfig:
  """sample.py's flags (see ``python examples/gpt/sample.py --helpfull``)."""

  workdir: str = "workdir/gpt"
  prompt: str = "def "
  num_tokens: int = 300
  temperature: float = 0.8
  top_k: int = 0
  num_samples: int = 1
  seed: int = 0
  dtype: Optional[str] = None   # None: the dtype the run trained in
  adapters: Optional[tuple[str, ...]] = None   # LoRA runs on workdir's model, a row each
