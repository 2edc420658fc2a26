r"""Trains a small character-level GPT whose blocks live in a stacktools stack.

  python examples/gpt/train.py                         # defaults: ~1.2 minutes on 2 CPU cores
  python examples/gpt/train.py --remat=nested --block=scan
  python examples/gpt/train.py --stack=unrolled        # st.BlockSeq, a Python loop
  python examples/gpt/train.py --remat=full --save_names=attn_out,mlp_hidden
  python examples/gpt/train.py --remat=none:2,full:2   # per-depth segments
  python examples/gpt/train.py --remat=auto --memory_budget=32MiB  # planned
  python examples/gpt/train.py --optimizer=muon --layer_lr_decay=0.8 --freeze_layers=0:1 --layer_drop=0.1
  # Fine-tune an earlier run's parameters; or grow its 2 layers to 4 and go on:
  python examples/gpt/train.py --init_from=workdir/gpt --freeze_layers=0:2 --workdir=workdir/tuned
  python examples/gpt/train.py --init_from=workdir/gpt2 --num_layers=4 --depth_map=zero_new \
      --init_opt_state=mapped --workdir=workdir/gpt4
  # A pipeline of 4 stages x 2 repeats, 8 microbatches, 2-way data parallel:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/gpt/train.py \
      --mesh=pipe:4,data:2 --pipeline=circular --pipeline_repeats=2 --microbatches=8 --num_layers=8

Logs step, train and validation loss, tokens/s and step time (of training
alone: evaluation and checkpoints are left out), with the model TFLOP/s and MFU
where the device's peak is known (a TPU, a GPU; --peak_flops), and at start-up
the compiled temp memory of the train step (which is what --remat changes).
On an accelerator, train in mixed precision: --dtype=bfloat16.
Writes metrics.jsonl and loss.png (with matplotlib installed) to --workdir,
each atomically (with --remat=auto also remat_plan.json, the report of every
candidate and the chosen plan, and remat_plan-<hash>.json, the plan that a
--resume or rerun reuses), and Orbax checkpoints to --workdir/checkpoints/<step>/
(every --checkpoint_every steps and at the end, asynchronously, each process
its own shards, the last --keep_checkpoints kept); a start removes what a
killed run's writes left there. --export_npz also writes the final parameters
as one .npz.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Optional

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np
import optax

# Runnable as a script from anywhere: put the repository root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import stacktools as st  # pylint: disable=g-import-not-at-top
from examples.gpt import data as data_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import decoding  # pylint: disable=g-import-not-at-top
from examples.gpt import distributed  # pylint: disable=g-import-not-at-top
from examples.gpt import files  # pylint: disable=g-import-not-at-top
from examples.gpt import init_from as init_from_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import metrics  # pylint: disable=g-import-not-at-top
from examples.gpt import model_config  # pylint: disable=g-import-not-at-top
from examples.gpt import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import remat as remat_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import resume as resume_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import saving  # pylint: disable=g-import-not-at-top
from examples.gpt import step as step_lib  # pylint: disable=g-import-not-at-top

#: --window when --pattern has L layers and no --window is given.
DEFAULT_WINDOW = 32

_REMAT = flags.DEFINE_string(
    "remat", "full", "Checkpoint policy of the block stack: one of "
    f"{', '.join(st.CheckpointPolicy.ALIASES)}; 'auto' (planned under --memory_budget); or "
    "per-depth segments alias:layers, e.g. none:2,full:6 (the layers add up to "
    "--num_layers).")
_MEMORY_BUDGET = flags.DEFINE_string(
    "memory_budget", None, "With --remat=auto: the most compiled temp memory of "
    "the train step, e.g. 48MiB or bytes; the fastest plan within it is used.")
# Space-separated: a per-depth candidate (none:2,full:2) holds commas.
_REMAT_CANDIDATES = flags.DEFINE_spaceseplist(
    "remat_candidates", None, "With --remat=auto: plan among these candidates "
    "only, separated by spaces (e.g. 'full nested save:mlp_hidden none:2,full:2'), "
    "to plan faster; default: every alias, every tagged name and per-depth mixes.")
_SAVE_NAMES = flags.DEFINE_list(
    "save_names", None, "Checkpoint names to keep on top of --remat full, "
    f"nested or offload (of {', '.join(model_config.CHECKPOINT_NAMES)}). Default: "
    f"{','.join(model_config.KEPT_MATMUL_OUTPUTS)}, the outputs of every matmul "
    "but the attention scores, so the backward pass recomputes no projection; "
    "--save_names= (empty) recomputes everything but the carries.")
_NESTED_OUTER = flags.DEFINE_integer(
    "nested_outer", None, "Outer-loop size for --remat=nested (default: the "
    "split that keeps the fewest carries).", lower_bound=1)
_BLOCK = flags.DEFINE_enum("block", "fold", ("fold", "scan"),
                           "fold: blocks return x; scan: blocks return (x, per-layer stats).")
_STACK = flags.DEFINE_enum("stack", "scan", ("scan", "unrolled"),
                           "scan: st.Stacked; unrolled: st.BlockSeq (a Python loop).")
_UNROLL = flags.DEFINE_integer("unroll", 1, "Layers per rolled scan iteration.", lower_bound=1)
_PATTERN = flags.DEFINE_string(
    "pattern", "", "Mixed layers: the kinds of one period of the stack, one letter "
    "per layer, repeated: L (causal attention over the last --window positions) or "
    "G (full causal attention), e.g. LLLG. Default: one kind of block, global.")
_WINDOW = flags.DEFINE_integer(
    "window", None, "Positions (its own included) an L layer of --pattern attends "
    "to; decoding keeps a ring cache this long for each L layer. Default: "
    f"{DEFAULT_WINDOW}.", lower_bound=1)
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 4, "Transformer blocks.", lower_bound=1)
_NUM_HEADS = flags.DEFINE_integer("num_heads", 4, "Attention heads.", lower_bound=1)
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Residual stream width.", lower_bound=1)
_BIAS = flags.DEFINE_bool("bias", True, "Biases in the linear layers and layer "
                          "norms (--nobias: none, as nanoGPT's default).")
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", model_config.DTYPES, "Compute dtype. float32 is right on a "
    "CPU (its bfloat16 matmuls are no faster); bfloat16 on an accelerator (TPU or "
    "GPU): mixed precision through Haiku's jmp policies, with the parameters, "
    "the optimizer state, the layer-norm statistics, the attention softmax and "
    "the loss in float32. Not part of the checkpoint: a run resumes under either.")
_ATTENTION = flags.DEFINE_enum(
    "attention", "auto", model_config.ATTENTIONS, "How the blocks attend while "
    "training: xla (XLA's attention), splash (the Pallas TPU kernel, which never "
    "forms the [T, T] scores; 2.4x faster at T=1024 on a TPU v5e) or auto (splash "
    "on a single TPU chip for --block=fold when --seq_len is a multiple of 128, "
    "else xla: XLA cannot split the kernel over several devices). Not part of "
    "the checkpoint.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Characters per training sequence.", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 16, "Sequences per step.", lower_bound=1)
_GRAD_ACCUM = flags.DEFINE_integer(
    "grad_accum", 1, "Microbatches each step's batch is cut into, their gradients averaged before "
    "the one update: less memory; on an accelerator, the update's cost over more tokens.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 600, "Training steps.", lower_bound=1)
_STOP_AFTER = flags.DEFINE_integer(
    "stop_after", None, "Stop after this step, evaluating and checkpointing it, "
    "while the learning-rate schedule still spans --steps; a later --resume run "
    "with the same --steps continues exactly where this one stopped (default: "
    "run all --steps).", lower_bound=1)
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 2e-3, "Peak learning rate.", lower_bound=0.0)
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 50, "Linear warmup steps.", lower_bound=0)
_WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.", lower_bound=0.0)
_GRAD_CLIP = flags.DEFINE_float("grad_clip", 1.0, "Global gradient-norm clip (0: off).", lower_bound=0.0)
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer", "adamw", optimizer_lib.OPTIMIZERS, "adamw: AdamW on every parameter. "
    "muon: Muon (optax.contrib.muon) on each block's weight matrices, one layer "
    "at a time (st.over_layers), and AdamW on the rest (embeddings, head, "
    "norms, biases), as modded-nanoGPT does.")
_MUON_LEARNING_RATE = flags.DEFINE_float(
    "muon_learning_rate", 0.02, "With --optimizer=muon: the peak learning rate of "
    "the Muon matrices (the warmup and decay of --learning_rate).", lower_bound=0.0)
_LAYER_LR_DECAY = flags.DEFINE_float(
    "layer_lr_decay", 1.0, "Layer-wise learning-rate decay: the updates of block "
    "i of L are scaled by this to the power L - 1 - i (the last block by 1), "
    "e.g. 0.8 for fine-tuning; 1: none.")
_FREEZE_LAYERS = flags.DEFINE_string(
    "freeze_layers", "", "A:B: blocks A to B-1 do not train (a zero update, no "
    "weight decay, their optimizer state unchanged), e.g. 0:2. Default: none.")
_LAYER_DROP = flags.DEFINE_float(
    "layer_drop", 0.0, "Stochastic depth while training: the last block's drop "
    "rate, linear in depth (block i of L skips with probability rate * (i + 1) / L); "
    "evaluation and sampling run every block. 0: none.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "An earlier run's --workdir: start from the parameters of its "
    "latest checkpoint (fine-tuning), at this run's --num_layers through "
    "--depth_map. The other model flags must be that run's.")
_DEPTH_MAP = flags.DEFINE_string(
    "depth_map", None, "With --init_from, how its N blocks become this run's "
    "--num_layers: repeat (each block in place: 0 0 1 1; the lower blocks take any "
    "extra copies: 4 to 6 blocks is 0 0 1 1 2 3), stack (the whole stack "
    "again: 0 1 0 1), zero_new (fresh blocks after the old ones, their residual "
    "outputs zero: the model computes what it did), or take:I,J,... (the blocks to "
    "keep, in order; 'new' for a fresh one), e.g. take:0,1,2,5. With --pattern, "
    "repeat, stack and zero_new move whole periods. Default: the same blocks.")
_INIT_OPT_STATE = flags.DEFINE_enum(
    "init_opt_state", "fresh", ("fresh", "mapped"), "With --init_from: fresh (a "
    "new run from its first step, with a new optimizer state), or mapped (the checkpoint's "
    "optimizer state, its blocks' rows mapped as the parameters are, and its step, "
    "schedule and data order: the run goes on from that step, e.g. deeper).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "Steps between validation runs.", lower_bound=1)
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 8, "Batches per validation run.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the init and of the data sampler.")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/gpt", "Where metrics, checkpoints and plots go.")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 0, "Steps between checkpoints (0: only at the end).", lower_bound=0)
_RESUME = flags.DEFINE_bool("resume", False, "Continue from the latest committed "
                            "checkpoint in --workdir, on any --mesh.")
_KEEP_CHECKPOINTS = flags.DEFINE_integer(
    "keep_checkpoints", 3, "Checkpoints kept in --workdir/checkpoints (the latest "
    "steps; older ones are deleted).", lower_bound=1)
_EXPORT_NPZ = flags.DEFINE_string(
    "export_npz", "", "After training, also write the final parameters to this "
    "path as one .npz (np.load(path, allow_pickle=False); keys like "
    "'h/block/fc/w'), gathered onto process 0. Default: no export.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 50, "Steps between log lines.", lower_bound=1)
_PEAK_FLOPS = flags.DEFINE_float(
    "peak_flops", None, "One device's peak FLOP/s, for the model TFLOP/s and MFU "
    "that the log lines show beside tokens/s (e.g. 197e12). Default: the dense "
    "bfloat16 peak of the device kind (PEAK_FLOPS: TPU v4, v5e, v5p, v6e, A100, "
    "H100); other devices, a CPU among them, show neither.", lower_bound=0.0)
_DATA_PATH = flags.DEFINE_string(
    "data_path", None, "A UTF-8 text file to train on (default: this Python's "
    "standard-library sources).")
_SAMPLE_TOKENS = flags.DEFINE_integer(
    "sample_tokens", 200, "Characters to generate with the KV cache after training.",
    lower_bound=0)
_SAMPLE_PROMPT = flags.DEFINE_string("sample_prompt", "def ", "Prompt for the sample.")
_MESH = flags.DEFINE_string(
    "mesh", "", "Device mesh as axis:size pairs over the axes pipe (pipeline "
    "stages, with --pipeline), data (batch) and fsdp (parameters), e.g. "
    "data:4,fsdp:2 or pipe:4,data:2; default: every device on data.")
_PIPELINE = flags.DEFINE_enum(
    "pipeline", "none", ("none", "gpipe", "circular", "1f1b", "interleaved", "zb"),
    "Run the block stack as a pipeline over the mesh's pipe axis: gpipe (each "
    "stage holds a contiguous block of layers) or circular (each stage holds "
    "--pipeline_repeats interleaved chunks, a smaller bubble) or 1f1b (gpipe's "
    "stages, each microbatch's backward as soon as its forward is done: "
    "activation memory that does not grow with --microbatches) or interleaved "
    "(1f1b over circular's chunks; --microbatches a multiple of the pipe axis) "
    "or zb (ZB-H1: 1f1b with the weight gradients put off to fill the "
    "bubble). Needs a pipe "
    "axis in --mesh; a pipe axis larger than 1 needs a pipeline. none: no "
    "pipeline.")
_MICROBATCHES = flags.DEFINE_integer(
    "microbatches", None, "With --pipeline: the pieces each step's batch is cut "
    "into, which move through the stages one after another; --batch_size must "
    "divide by it times the data axis, and every schedule but gpipe needs at "
    "least the pipe axis size. Default: the pipe axis size.", lower_bound=1)
_PIPELINE_REPEATS = flags.DEFINE_integer(
    "pipeline_repeats", None, "With --pipeline=circular or interleaved: how many chunks of "
    "layers each stage holds (a microbatch passes the stages this many times); "
    "--num_layers must divide by it times the pipe axis. Default: 1.",
    lower_bound=1)
_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for --num_processes > 1.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes in the run.", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, "
                                   "0..--num_processes-1.", lower_bound=0)


def _validate(names: list[str], check: Callable[..., None]) -> None:
  """Registers ``check(*values of names)`` as a validator of the flags
  ``names``: the one line of its ValueError is absl's message."""

  def validator(values: dict[str, Any]) -> bool:
    try:
      check(*(values[name] for name in names))
    except ValueError as e:
      raise flags.ValidationError(str(e)) from None
    return True

  flags.register_multi_flags_validator(names, validator)


# The rules between flags, in the order absl reports them; each lives with the
# setting it is about. What needs the depth, set_up's trace of the model says.
flags.register_multi_flags_validator(
    ["d_model", "num_heads"], lambda f: f["d_model"] % f["num_heads"] == 0,
    message="--d_model must be divisible by --num_heads.")
flags.register_validator(
    "save_names", lambda names: set(names or ()) <= set(model_config.CHECKPOINT_NAMES),
    message=f"--save_names accepts {', '.join(model_config.CHECKPOINT_NAMES)}.")
_validate(["remat", "memory_budget", "remat_candidates"], remat_lib.check_remat_flags)
_validate(["save_names", "remat"], remat_lib.check_save_names)
flags.register_validator(
    "layer_lr_decay", lambda v: 0 < v <= 1,
    message="--layer_lr_decay must be in (0, 1]: 1 is no decay, 0.8 a usual one.")
flags.register_validator(
    "layer_drop", lambda v: 0 <= v < 1,
    message="--layer_drop must be in [0, 1): the last block's drop rate, e.g. 0.1.")
_validate(["freeze_layers", "layer_lr_decay", "num_layers", "stack"],
          optimizer_lib.check_layer_rules)
_validate(["init_from", "depth_map", "init_opt_state", "resume"], init_from_lib.check_init_flags)
flags.register_multi_flags_validator(
    ["stop_after", "steps"], lambda f: f["stop_after"] is None or f["stop_after"] <= f["steps"],
    message="--stop_after must be at most --steps.")
flags.register_multi_flags_validator(
    ["warmup_steps", "steps"], lambda f: f["warmup_steps"] < f["steps"],
    message="--warmup_steps must be less than --steps: the learning rate rises to "
    "--learning_rate over the warmup, which a shorter run never finishes. Lower "
    "--warmup_steps (0: no warmup) or raise --steps.")
flags.register_multi_flags_validator(
    ["window", "pattern"], lambda f: f["window"] is None or "L" in f["pattern"],
    message="--window is the span of the L layers of --pattern, and there are "
    "none: drop --window, or give --pattern L layers (e.g. --pattern=LLLG).")
flags.register_multi_flags_validator(
    ["nested_outer", "remat"], lambda f: f["nested_outer"] is None or f["remat"] == "nested",
    message="--nested_outer needs --remat=nested.")
_validate(["stack", "remat", "nested_outer", "unroll"], remat_lib.check_unrolled_stack)
flags.register_multi_flags_validator(
    ["muon_learning_rate", "optimizer"],
    lambda f: f["optimizer"] == "muon" or f["muon_learning_rate"] == _MUON_LEARNING_RATE.default,
    message="--muon_learning_rate is the peak learning rate of Muon's matrices, which "
    "only --optimizer=muon has: pass --optimizer=muon, or drop --muon_learning_rate "
    "(--learning_rate sets AdamW's).")


def _check_window(window: Optional[int], pattern: str, seq_len: int) -> None:
  if "L" not in pattern or (window or DEFAULT_WINDOW) <= seq_len:
    return
  what = (f"--window={window} is" if window is not None else
          f"--window, not given, defaults to {DEFAULT_WINDOW},")
  raise ValueError(
      f"--pattern={pattern} has L layers, which attend to the last --window "
      f"positions, but {what} more than --seq_len={seq_len}: pass --window={seq_len} "
      "or less.")


_validate(["window", "pattern", "seq_len"], _check_window)
_validate(["pipeline", "microbatches", "pipeline_repeats", "remat"],
          distributed.check_pipeline_flags)
_validate(["grad_accum", "batch_size", "pipeline"], step_lib.check_grad_accum)


def _optimizer_config() -> optimizer_lib.OptimizerConfig:
  """The optimizer flags, as optimizer.py takes them (under the same names)."""
  return optimizer_lib.OptimizerConfig(**{
      field.name: flags.FLAGS[field.name].value
      for field in dataclasses.fields(optimizer_lib.OptimizerConfig)})


@dataclasses.dataclass
class Run:
  """What :func:`set_up` makes for :func:`train_loop` and :func:`finish`."""

  workdir: str
  metrics_path: str
  is_chief: bool
  dataset: data_lib.CharDataset
  cfg: model_config.GPTConfig
  batches: data_lib.Prefetched  # the training batches, on the devices a step ahead
  compiled_step: Any  # params, opt_state, batch -> params, opt_state, loss, stats
  evaluate: Callable[[Any], float]  # params -> mean validation loss
  # Starts an asynchronous save of (params, opt_state) with this step's
  # metadata: every process writes its own shards.
  save_checkpoint: Callable[[int, Any, Any], None]
  checkpoints: saving.Manager  # finish() waits for its last save
  params: Any  # at start_step
  opt_state: Any
  start_step: int
  last_step: int
  records: list[dict[str, Any]]  # metrics so far; train_loop appends to it


def _check_outputs(workdir: str) -> resume_lib.Start:
  """Exits with one line unless the run can write its outputs and start.

  Every process writes its checkpoint shards into ``workdir`` (process 0
  alone the metrics, the plot and the export); checked, with the
  checkpoints that --resume and --init_from name, before the slow joining
  and loading.
  """
  problem = files.writable_folder_problem(workdir)
  if problem:
    sys.exit(f"error: --workdir={workdir!r} {problem}; pass a folder you can "
             "write to (it is created if missing).")
  if _EXPORT_NPZ.value and (_NUM_PROCESSES.value == 1 or _PROCESS_ID.value == 0):
    problem = files.writable_folder_problem(os.path.dirname(os.path.abspath(_EXPORT_NPZ.value)))
    if problem:
      sys.exit(f"error: --export_npz={_EXPORT_NPZ.value!r}: its folder {problem}; "
               "pass a path in a folder you can write to.")
  try:
    return resume_lib.find(workdir, _RESUME.value, _INIT_FROM.value, _DEPTH_MAP.value,
                           _INIT_OPT_STATE.value)
  except resume_lib.StartError as e:
    sys.exit(f"error: {e}")


def _join_processes() -> tuple[dict[str, int], Optional[st.Pipeline]]:
  """Joins the run's processes; returns the mesh's axis sizes and the pipeline.

  Exits with one line when the process flags, --mesh, --batch_size and
  --pipeline do not fit together.
  """
  try:
    distributed.initialize(_COORDINATOR_ADDRESS.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    mesh_sizes = distributed.parse_mesh(_MESH.value, distributed.device_count())
    distributed.check_batch_size(_BATCH_SIZE.value, mesh_sizes, _GRAD_ACCUM.value)
    pipeline = distributed.make_pipeline(
        _PIPELINE.value, mesh_sizes, _MESH.value, _BATCH_SIZE.value,
        _MICROBATCHES.value, _PIPELINE_REPEATS.value)
  except distributed.SetupError as e:
    sys.exit(f"error: {e}")
  return mesh_sizes, pipeline


def _load_corpus(start: resume_lib.Start) -> data_lib.CharDataset:
  """The corpus, checked against the batch and the checkpoints' characters."""
  try:
    dataset = data_lib.load_dataset(_DATA_PATH.value)
    data_lib.check_batches(dataset, _BATCH_SIZE.value, _SEQ_LEN.value)
    resume_lib.check_corpus(start, dataset.chars)
  except (ValueError, resume_lib.StartError) as e:
    sys.exit(f"error: {e}")
  return dataset


def _build_model(vocab_size: int, pipeline: Optional[st.Pipeline], mesh: jax.sharding.Mesh,
                 init_key: jax.Array, tokens: np.ndarray) -> tuple[model_config.GPTConfig, Any]:
  """The model the flags describe, traced once: its config and parameter shapes.

  What stacktools refuses in it (per-depth counts or a nested outer size
  against the depth, layers the pipeline stages do not divide, ...) it says
  here, in one line, before anything is compiled or written.
  """
  try:
    cfg = model_config.GPTConfig(
        vocab_size=vocab_size, seq_len=_SEQ_LEN.value,
        num_layers=_NUM_LAYERS.value, num_heads=_NUM_HEADS.value,
        d_model=_D_MODEL.value, block=_BLOCK.value, stack=_STACK.value,
        remat=remat_lib.checkpoint_policy(_REMAT.value, _SAVE_NAMES.value,
                                          _NESTED_OUTER.value),
        unroll=_UNROLL.value, pattern=_PATTERN.value,
        window=(_WINDOW.value or DEFAULT_WINDOW) if "L" in _PATTERN.value else 0,
        bias=_BIAS.value, pipeline=pipeline, layer_drop=_LAYER_DROP.value,
        dtype=_DTYPE.value, attention=_ATTENTION.value)
    return cfg, step_lib.trace_model(cfg, mesh, init_key, tokens)
  except (TypeError, ValueError) as e:
    sys.exit(f"error: {e}")


def _check_start(start: resume_lib.Start, cfg: model_config.GPTConfig,
                 last_step: int) -> Optional[init_from_lib.DepthMap]:
  """--init_from's depth map (None without it); exits with one line when the
  checkpoints do not fit this run's model flags."""
  try:
    return resume_lib.check_model(start, cfg, last_step)
  except resume_lib.StartError as e:
    sys.exit(f"error: {e}")


def _initial_state(start: resume_lib.Start, init_map: Optional[init_from_lib.DepthMap],
                   cfg: model_config.GPTConfig, optimizer: optax.GradientTransformation,
                   init_key: jax.Array, sampler: data_lib.BatchSampler,
                   mesh: jax.sharding.Mesh, param_shapes: Any
                   ) -> tuple[Any, Any, int, tuple[Any, Any]]:
  """The parameters, optimizer state and step training starts from (see
  resume.initial_state), and the shardings of the first two.

  Exits with one line when a checkpoint cannot be read into this run.
  """
  # A pipelined stack's Layers axis is split over the pipe axis: each stage
  # holds its own layers (and their AdamW moments). Same tree as a plain run.
  shapes = (param_shapes, jax.eval_shape(optimizer.init, param_shapes))
  shardings = tuple(distributed.tree_shardings(mesh, tree, cfg.pipeline is not None)
                    for tree in shapes)

  def init_params() -> Any:
    return jax.jit(step_lib.transform(cfg).init, out_shardings=shardings[0])(
        init_key, sampler.zeros())

  try:
    params, opt_state, step = resume_lib.initial_state(
        start, init_map, cfg, init_params, optimizer, _optimizer_config().recorded(),
        sampler, shapes, shardings)
  except resume_lib.StartError as e:
    sys.exit(f"error: {e}")
  return params, opt_state, step, shardings


def _log_layout(params: Any, opt_state: Any, mesh: jax.sharding.Mesh,
                cfg: model_config.GPTConfig) -> None:
  """Logs the parameter count, their bytes per device and the pipeline's layout."""
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  logging.info("Parameters: %d; mesh %s over %d devices in %d processes; "
               "%.1f KiB of parameters and %.1f KiB of optimizer state per device.",
               num_params, dict(mesh.shape), jax.device_count(), jax.process_count(),
               distributed.per_device_bytes(params) / 1024,
               distributed.per_device_bytes(opt_state) / 1024)
  pipeline = cfg.pipeline
  if pipeline is not None:
    stages = distributed.pipe_size(mesh)
    logging.info("Pipeline: %s over %d stages x %d repeats, %d microbatches of %d "
                 "sequences, %d layers per stage and repeat; bubble %.1f%% of "
                 "stage-ticks.", pipeline.schedule, stages, pipeline.repeats,
                 pipeline.microbatches, _BATCH_SIZE.value // pipeline.microbatches,
                 cfg.num_layers // (stages * pipeline.repeats),
                 100 * pipeline.table(stages).bubble)


def _plan_remat(workdir: str, cfg: model_config.GPTConfig,
                optimizer: optax.GradientTransformation, params: Any, opt_state: Any,
                batch: jax.Array, is_chief: bool) -> model_config.GPTConfig:
  """``cfg`` with --remat=auto's plan in place of "auto" (see remat.plan).

  Before the checkpoint folder is made: a --memory_budget that stacktools
  refuses (or that no plan meets) leaves nothing behind.
  """
  train_step = step_lib.make_train_step(step_lib.transform(cfg), optimizer, _GRAD_ACCUM.value)
  try:
    remat = remat_lib.plan(train_step, params, opt_state, batch,
                           budget=_MEMORY_BUDGET.value, candidates=_REMAT_CANDIDATES.value,
                           workdir=workdir, is_chief=is_chief)
  except ValueError as e:
    sys.exit(f"error: {e}")
  return dataclasses.replace(cfg, remat=remat)


def _open_checkpoints(workdir: str) -> saving.Manager:
  """The run's checkpoint manager; every process makes one.

  The first start after a kill removes the step folder that the killed save
  left unfinished.
  """
  try:
    checkpoints = saving.Manager(workdir, keep=_KEEP_CHECKPOINTS.value)
  except saving.CheckpointError as e:
    sys.exit(f"error: --workdir={workdir!r}: {e}")
  if checkpoints.removed_unfinished:
    logging.info("Removed the unfinished checkpoint(s) of an interrupted save from "
                 "%s: %s", checkpoints.root, ", ".join(checkpoints.removed_unfinished))
  return checkpoints


def _compile(cfg: model_config.GPTConfig, optimizer: optax.GradientTransformation,
             mesh: jax.sharding.Mesh, params: Any, opt_state: Any,
             batch_shape: tuple[int, ...], shardings: tuple[Any, Any, Any]) -> Any:
  """The train step compiled for the mesh; logs its temp memory."""
  train_step = step_lib.make_train_step(step_lib.transform(cfg), optimizer, _GRAD_ACCUM.value)
  compile_start = time.perf_counter()
  try:   # a step too big for the device is refused in one line
    compiled_step = step_lib.compile_train_step(train_step, mesh, params, opt_state,
                                                batch_shape, shardings)
  except ValueError as e:
    sys.exit(f"error: {e}")
  logging.info("Train step: compiled temp memory %.2f MiB, compiled in %.1f s (remat=%s, "
               "stack=%s, block=%s).", compiled_step.memory_analysis().temp_size_in_bytes / 2**20,
               time.perf_counter() - compile_start, remat_lib.remat_text(cfg.remat),
               cfg.stack, cfg.block)
  return compiled_step


def _saver(checkpoints: saving.Manager, batches: data_lib.Prefetched,
           cfg: model_config.GPTConfig, chars: str) -> Callable[[int, Any, Any], None]:
  """``Run.save_checkpoint``: the arrays, with what a --resume checks them by."""

  def save_checkpoint(step: int, params: Any, opt_state: Any) -> None:
    # A collective: every process writes its own shards, in the background.
    checkpoints.save(step, params, opt_state, {
        "sampler_state": batches.get_state(),
        "config": resume_lib.recorded_config(cfg),
        "optimizer": _optimizer_config().recorded(),
        "chars": chars})

  return save_checkpoint


def set_up(argv) -> Run:
  """Checks the flags and the workdir, then loads, builds and compiles.

  Everything is checked before anything is written. A check that fails exits
  with one line, before the data is loaded where it can.

  Args:
    argv: the arguments absl left; only the program name is allowed.

  Returns:
    The run's pieces, with the workdir created and metrics.jsonl written (on
    the chief).
  """
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments {argv[1:]}; every option is a --flag.")
  workdir = _WORKDIR.value
  start = _check_outputs(workdir)
  mesh_sizes, pipeline = _join_processes()
  is_chief = jax.process_index() == 0
  dataset = _load_corpus(start)
  sampler = data_lib.BatchSampler(dataset.train, _BATCH_SIZE.value, _SEQ_LEN.value,
                                  _SEED.value)
  mesh = distributed.make_mesh(mesh_sizes)
  init_key = jax.random.PRNGKey(_SEED.value)
  cfg, param_shapes = _build_model(dataset.vocab_size, pipeline, mesh, init_key,
                                   sampler.zeros())
  last_step = _STEPS.value if _STOP_AFTER.value is None else _STOP_AFTER.value
  init_map = _check_start(start, cfg, last_step)
  if is_chief:
    # A run killed mid-write left these; no write is under way now.
    stale = files.remove_stale_temp_files(workdir)
    if stale:
      logging.info("Removed %d stale temporary file(s) of an interrupted write "
                   "from %s: %s", len(stale), workdir, ", ".join(stale))
  logging.info("Corpus: %d training and %d validation characters, %d symbols; "
               "unigram entropy %.3f nats.", len(dataset.train),
               len(dataset.valid), dataset.vocab_size, dataset.unigram_entropy())
  logging.info("Model: %s", cfg)

  optimizer = optimizer_lib.make_optimizer(_optimizer_config(), _STEPS.value, cfg)
  params, opt_state, start_step, shardings = _initial_state(
      start, init_map, cfg, optimizer, init_key, sampler, mesh, param_shapes)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  records = metrics.read_metrics(metrics_path, start_step) if _RESUME.value else []
  _log_layout(params, opt_state, mesh, cfg)
  # Every process samples the global batch (indices: cheap) and moves only its devices' rows.
  batch_sharding = distributed.batch_sharding(mesh)
  if cfg.remat == "auto":
    cfg = _plan_remat(workdir, cfg, optimizer, params, opt_state,
                      distributed.put_global(sampler.zeros(), batch_sharding), is_chief)
  checkpoints = _open_checkpoints(workdir)
  compiled_step = _compile(cfg, optimizer, mesh, params, opt_state, sampler.zeros().shape,
                           (*shardings, batch_sharding))
  eval_sampler = data_lib.BatchSampler(dataset.valid, _BATCH_SIZE.value,
                                       _SEQ_LEN.value, _SEED.value + 1)
  evaluate = step_lib.make_evaluate(step_lib.transform(cfg), mesh, [
      distributed.put_global(eval_sampler.next(), batch_sharding)
      for _ in range(_EVAL_BATCHES.value)])
  # The training batches, each put on the devices a step ahead.
  batches = data_lib.Prefetched(
      sampler, lambda batch: distributed.put_global(batch, batch_sharding))
  if is_chief:
    os.makedirs(workdir, exist_ok=True)
    metrics.write_metrics(metrics_path, records)
  return Run(workdir=workdir, metrics_path=metrics_path, is_chief=is_chief,
             dataset=dataset, cfg=cfg, batches=batches, compiled_step=compiled_step,
             evaluate=evaluate, save_checkpoint=_saver(checkpoints, batches, cfg, dataset.chars),
             checkpoints=checkpoints, params=params, opt_state=opt_state,
             start_step=start_step, last_step=last_step, records=records)


def train_loop(run: Run) -> Any:
  """Trains from ``run.start_step`` to ``run.last_step``.

  Logs, evaluates, appends to ``run.records`` (and writes them) and saves
  checkpoints as the flags say.

  Args:
    run: what :func:`set_up` made.

  Returns:
    The final parameters.
  """
  params, opt_state, last_step = run.params, run.opt_state, run.last_step
  # The losses of the steps since the last log line, and the seconds they
  # took: the clock runs while steps run and stops (once the steps dispatched
  # so far are done) for evaluation and checkpoints.
  window_losses, stopwatch = [], metrics.Stopwatch()
  peak = metrics.run_peak_flops(_PEAK_FLOPS.value)   # None: no MFU on the log lines
  throughput = metrics.Throughput(
      _BATCH_SIZE.value * _SEQ_LEN.value, peak=peak, flops_per_token=None if peak is None
      else metrics.model_flops_per_token(
          run.cfg, sum(x.size for x in jax.tree_util.tree_leaves(params))))
  for step in range(run.start_step + 1, last_step + 1):
    batch = run.batches.next()
    params, opt_state, loss, stats = run.compiled_step(params, opt_state, batch)
    window_losses.append(loss)
    record = None
    if step % _LOG_EVERY.value == 0 or step == last_step:
      losses = [float(l) for l in window_losses]  # waits for the steps
      record, message = throughput.record(step, losses, stopwatch.lap(), stats)
      logging.info(message)
      window_losses = []
    if step % _EVAL_EVERY.value == 0 or step == last_step:
      stopwatch.stop(loss)  # evaluation is not training time
      record = record or {"step": step}
      record["valid_loss"] = run.evaluate(params)
      logging.info("step %5d  validation loss %.4f", step, record["valid_loss"])
      stopwatch.start()
    if record is not None:
      run.records.append(record)
      if run.is_chief:
        metrics.write_metrics(run.metrics_path, run.records)
    if (_CHECKPOINT_EVERY.value and step % _CHECKPOINT_EVERY.value == 0) or step == last_step:
      stopwatch.stop(loss)  # nor is writing a checkpoint
      run.save_checkpoint(step, params, opt_state)
      stopwatch.start()
  return params


def finish(run: Run, params: Any) -> None:
  """Logs the final loss, waits for the last checkpoint; on the chief, exports
  (--export_npz), plots the losses and samples.

  Args:
    run: what :func:`set_up` made, its records filled by :func:`train_loop`.
    params: the final parameters.
  """
  dataset, records = run.dataset, run.records
  # Host copies, for sampling and the export (a collective; checkpoints never gather).
  host_params = (distributed.to_host(params)
                 if _SAMPLE_TOKENS.value or _EXPORT_NPZ.value else None)
  logging.info("Final validation loss %.4f (unigram entropy %.4f).",
               records[-1].get("valid_loss", float("nan")) if records else float("nan"),
               dataset.unigram_entropy())
  # Every process waits until the last save is committed.
  run.checkpoints.close()
  if not run.is_chief:
    return
  if _EXPORT_NPZ.value:
    logging.info("Wrote %s", saving.export_npz(_EXPORT_NPZ.value, host_params))
  metrics.plot_losses(run.workdir, records, dataset.unigram_entropy())
  if _SAMPLE_TOKENS.value:
    # Sampling is small: it runs on process 0 alone, from host copies.
    prompt = "".join(c for c in _SAMPLE_PROMPT.value if c in dataset.chars)
    if prompt != _SAMPLE_PROMPT.value:
      logging.warning("--sample_prompt has characters outside the corpus; "
                      "sampling from %r instead.", prompt or dataset.chars[0])
    decoding.warn_if_cut(prompt, run.cfg.seq_len, "--sample_prompt")
    (text,) = decoding.generate(run.cfg, host_params, dataset, prompt or dataset.chars[0],
                                _SAMPLE_TOKENS.value, temperature=0.8, seed=_SEED.value)
    logging.info("Sample (KV-cache decoding through scan blocks):\n%s", text)


def main(argv):
  run = set_up(argv)
  params = train_loop(run)
  finish(run, params)


if __name__ == "__main__":
  app.run(main)
