"""What train.py does before its first step: :func:`set_up` checks, loads, builds and compiles.

A sequence of small steps, each its own function: check the outputs and the
checkpoints the run starts from, join the processes, load the corpus, trace
the model, restore or initialise, plan (--remat=auto), open the checkpoint
manager, compile. Each takes the run's :class:`run_config.TrainConfig` (no
flag is read here) and exits with one line where a check fails, before
anything is written.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Optional

from absl import logging
import jax
import numpy as np
import optax

import stacktools as st
from examples.gpt import data as data_lib
from examples.gpt import distributed
from examples.gpt import files
from examples.gpt import init_from
from examples.gpt import lora
from examples.gpt import metrics
from examples.gpt import model_config
from examples.gpt import optimizer as optimizer_lib
from examples.gpt import remat as remat_lib
from examples.gpt import resume as resume_lib
from examples.gpt import saving
from examples.gpt import step as step_lib
from examples.gpt.run_config import DEFAULT_WINDOW
from examples.gpt.run_config import TrainConfig


def optimizer_config(config: TrainConfig) -> optimizer_lib.OptimizerConfig:
  """The optimizer's settings, as optimizer.py takes them (under the same names)."""
  return optimizer_lib.OptimizerConfig(**{
      field.name: getattr(config, field.name)
      for field in dataclasses.fields(optimizer_lib.OptimizerConfig)})


@dataclasses.dataclass
class Run:
  """What :func:`set_up` makes for train.py's ``train_loop`` and ``finish``."""

  config: TrainConfig  # what the run was told; the loop reads its settings here
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
  # The whole model's parameters from what trains (a LoRA run trains adapters:
  # lora_start.py merges them into the base), for the export and the sample.
  merged: Callable[[Any], Any] = lambda params: params


def check_outputs(config: TrainConfig, workdir: str) -> resume_lib.Start:
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
  if config.export_npz and (config.num_processes == 1 or config.process_id == 0):
    problem = files.writable_folder_problem(os.path.dirname(os.path.abspath(config.export_npz)))
    if problem:
      sys.exit(f"error: --export_npz={config.export_npz!r}: its folder {problem}; "
               "pass a path in a folder you can write to.")
  try:
    start = resume_lib.find(workdir, config.resume, config.init_from, config.depth_map,
                            config.init_opt_state)
    lora.check_start(start, config.lora_rank, config.lora_alpha, config.lora_targets)
  except resume_lib.StartError as e:
    sys.exit(f"error: {e}")
  return start


def cpu_dtype_warning(dtype: str, backend: str) -> Optional[str]:
  """What to say of --dtype on this backend: bfloat16 on a CPU is slower
  than float32 there (its bfloat16 matmuls are no faster, and every
  conversion costs); None where there is nothing to say."""
  if dtype == "bfloat16" and backend == "cpu":
    return ("--dtype=bfloat16 on a CPU: its bfloat16 matmuls are no faster than "
            "float32's and the conversions cost, so the step is slower here; pass "
            "--dtype=float32 on a CPU (bfloat16 is for a TPU or GPU).")
  return None


def join_processes(config: TrainConfig) -> tuple[dict[str, int], Optional[st.Pipeline]]:
  """Joins the run's processes; returns the mesh's axis sizes and the pipeline.

  Exits with one line when the process flags, --mesh, --batch_size and
  --pipeline do not fit together.
  """
  try:
    distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
    mesh_sizes = distributed.parse_mesh(config.mesh, distributed.device_count())
    distributed.check_batch_size(config.batch_size, mesh_sizes, config.grad_accum)
    pipeline = distributed.make_pipeline(
        config.pipeline, mesh_sizes, config.mesh, config.batch_size,
        config.microbatches, config.pipeline_repeats)
  except distributed.SetupError as e:
    sys.exit(f"error: {e}")
  warning = cpu_dtype_warning(config.dtype, jax.default_backend())
  if warning:
    logging.warning(warning)
  return mesh_sizes, pipeline


def load_corpus(config: TrainConfig, start: resume_lib.Start) -> data_lib.CharDataset:
  """The corpus, checked against the batch and the checkpoints' characters."""
  try:
    dataset = data_lib.load_dataset(config.data_path)
    data_lib.check_batches(dataset, config.batch_size, config.seq_len)
    resume_lib.check_corpus(start, dataset.chars)
  except (ValueError, resume_lib.StartError) as e:
    sys.exit(f"error: {e}")
  return dataset


def build_model(config: TrainConfig, vocab_size: int, pipeline: Optional[st.Pipeline],
                mesh: jax.sharding.Mesh, init_key: jax.Array, tokens: np.ndarray
                ) -> tuple[model_config.GPTConfig, Any]:
  """The model the config describes, traced once: its config and parameter shapes.

  What stacktools refuses in it (per-depth counts or a nested outer size
  against the depth, layers the pipeline stages do not divide, ...) it says
  here, in one line, before anything is compiled or written.
  """
  try:
    cfg = model_config.GPTConfig(
        vocab_size=vocab_size, seq_len=config.seq_len,
        num_layers=config.num_layers, num_heads=config.num_heads,
        d_model=config.d_model, block=config.block, stack=config.stack,
        remat=remat_lib.checkpoint_policy(config.remat, config.save_names,
                                          config.nested_outer),
        unroll=config.unroll, pattern=config.pattern,
        window=(config.window or DEFAULT_WINDOW) if "L" in config.pattern else 0,
        bias=config.bias, pipeline=pipeline, layer_drop=config.layer_drop,
        dtype=config.dtype, attention=config.attention, lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha, lora_targets=config.lora_targets)
    return cfg, step_lib.trace_model(cfg, mesh, init_key, tokens)
  except (TypeError, ValueError) as e:
    sys.exit(f"error: {e}")


def _check_start(start: resume_lib.Start, cfg: model_config.GPTConfig,
                 last_step: int) -> Optional[init_from.DepthMap]:
  """--init_from's depth map (None without it); exits with one line when the
  checkpoints do not fit this run's model flags."""
  try:
    return resume_lib.check_model(start, cfg, last_step)
  except resume_lib.StartError as e:
    sys.exit(f"error: {e}")


def _initial_state(config: TrainConfig, start: resume_lib.Start,
                   init_map: Optional[init_from.DepthMap],
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
        start, init_map, cfg, init_params, optimizer, optimizer_config(config).recorded(),
        sampler, shapes, shardings)
  except resume_lib.StartError as e:
    sys.exit(f"error: {e}")
  return params, opt_state, step, shardings


def log_layout(config: TrainConfig, params: Any, opt_state: Any, mesh: jax.sharding.Mesh,
               cfg: model_config.GPTConfig) -> None:
  """Logs the batch, the parameter count, their bytes per device and the pipeline's layout."""
  logging.info("Batch: %d sequences of %d characters per step, in %d microbatch(es) of %d "
               "(--grad_accum=%d), their gradients averaged before the one update.",
               config.batch_size, config.seq_len, config.grad_accum,
               config.batch_size // config.grad_accum, config.grad_accum)
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
                 pipeline.microbatches, config.batch_size // pipeline.microbatches,
                 cfg.num_layers // (stages * pipeline.repeats),
                 100 * pipeline.table(stages).bubble)


def _plan_remat(config: TrainConfig, workdir: str, cfg: model_config.GPTConfig,
                optimizer: optax.GradientTransformation, params: Any, opt_state: Any,
                batch: jax.Array, is_chief: bool) -> model_config.GPTConfig:
  """``cfg`` with --remat=auto's plan in place of "auto" (see remat.plan).

  Before the checkpoint folder is made: a --memory_budget that stacktools
  refuses (or that no plan meets) leaves nothing behind.
  """
  train_step = step_lib.make_train_step(step_lib.transform(cfg), optimizer, config.grad_accum)
  try:
    remat = remat_lib.plan(train_step, params, opt_state, batch,
                           budget=config.memory_budget, candidates=config.remat_candidates,
                           workdir=workdir, is_chief=is_chief)
  except ValueError as e:
    sys.exit(f"error: {e}")
  return dataclasses.replace(cfg, remat=remat)


def open_checkpoints(config: TrainConfig, workdir: str) -> saving.Manager:
  """The run's checkpoint manager; every process makes one.

  The first start after a kill removes the step folder that the killed save
  left unfinished.
  """
  try:
    checkpoints = saving.Manager(workdir, keep=config.keep_checkpoints)
  except saving.CheckpointError as e:
    sys.exit(f"error: --workdir={workdir!r}: {e}")
  if checkpoints.removed_unfinished:
    logging.info("Removed the unfinished checkpoint(s) of an interrupted save from "
                 "%s: %s", checkpoints.root, ", ".join(checkpoints.removed_unfinished))
  return checkpoints


def _compile(config: TrainConfig, cfg: model_config.GPTConfig,
             optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh, params: Any, opt_state: Any,
             batch_shape: tuple[int, ...], shardings: tuple[Any, Any, Any]) -> Any:
  """The train step compiled for the mesh; logs its temp memory."""
  train_step = step_lib.make_train_step(step_lib.transform(cfg), optimizer, config.grad_accum)
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


def saver(config: TrainConfig, checkpoints: saving.Manager, batches: data_lib.Prefetched,
          cfg: model_config.GPTConfig, chars: str,
          **extra: Any) -> Callable[[int, Any, Any], None]:
  """``Run.save_checkpoint``: the arrays, with what a --resume checks them by
  (and ``extra`` metadata: a LoRA run's ``lora``)."""

  def save_checkpoint(step: int, params: Any, opt_state: Any) -> None:
    # A collective: every process writes its own shards, in the background.
    checkpoints.save(step, params, opt_state, {
        "sampler_state": batches.get_state(), **model_meta(cfg, chars),
        "optimizer": optimizer_config(config).recorded(), **extra})

  return save_checkpoint


def model_meta(cfg: model_config.GPTConfig, chars: str) -> dict[str, Any]:
  """What the metadata of a checkpoint and of an export say of the model:
  its config (a LoRA run's: the base's), its characters, and the dtype it
  trained in (not in "config": a run resumes under either; sample.py decodes
  in it by default)."""
  return {"config": resume_lib.recorded_config(cfg), "dtype": cfg.dtype, "chars": chars}


def feeds(config: TrainConfig, cfg, dataset, sampler, mesh, batch_sharding):
  """``(evaluate, batches)``: the compiled evaluation over the validation
  batches, and the training batches, each put on the devices a step ahead."""
  eval_sampler = data_lib.BatchSampler(dataset.valid, config.batch_size,
                                       config.seq_len, config.seed + 1)
  evaluate = step_lib.make_evaluate(step_lib.transform(cfg), mesh, [
      distributed.put_global(eval_sampler.next(), batch_sharding)
      for _ in range(config.eval_batches)])
  batches = data_lib.Prefetched(
      sampler, lambda batch: distributed.put_global(batch, batch_sharding))
  return evaluate, batches


def set_up(config: TrainConfig, workdir: str) -> Run:
  """Checks the config and the workdir, then loads, builds and compiles.

  Everything is checked before anything is written. A check that fails exits
  with one line (``SystemExit``), before the data is loaded where it can.

  Args:
    config: what the run is told (train.py's flags but --workdir).
    workdir: where its metrics, checkpoints and plots go (--workdir).

  Returns:
    The run's pieces, with the workdir created and metrics.jsonl written (on
    the chief).
  """
  start = check_outputs(config, workdir)
  mesh_sizes, pipeline = join_processes(config)
  is_chief = jax.process_index() == 0
  dataset = load_corpus(config, start)
  sampler = data_lib.BatchSampler(dataset.train, config.batch_size, config.seq_len,
                                  config.seed)
  mesh = distributed.make_mesh(mesh_sizes)
  init_key = jax.random.PRNGKey(config.seed)
  cfg, param_shapes = build_model(config, dataset.vocab_size, pipeline, mesh, init_key,
                                  sampler.zeros())
  last_step = config.steps if config.stop_after is None else config.stop_after
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

  optimizer = optimizer_lib.make_optimizer(optimizer_config(config), config.steps, cfg)
  params, opt_state, start_step, shardings = _initial_state(
      config, start, init_map, cfg, optimizer, init_key, sampler, mesh, param_shapes)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  records = metrics.read_metrics(metrics_path, start_step) if config.resume else []
  log_layout(config, params, opt_state, mesh, cfg)
  # Every process samples the global batch (indices: cheap) and moves only its devices' rows.
  batch_sharding = distributed.batch_sharding(mesh)
  if cfg.remat == "auto":
    cfg = _plan_remat(config, workdir, cfg, optimizer, params, opt_state,
                      distributed.put_global(sampler.zeros(), batch_sharding), is_chief)
  checkpoints = open_checkpoints(config, workdir)
  compiled_step = _compile(config, cfg, optimizer, mesh, params, opt_state,
                           sampler.zeros().shape, (*shardings, batch_sharding))
  evaluate, batches = feeds(config, cfg, dataset, sampler, mesh, batch_sharding)
  if is_chief:
    os.makedirs(workdir, exist_ok=True)
    metrics.write_metrics(metrics_path, records)
  return Run(config=config, workdir=workdir, metrics_path=metrics_path, is_chief=is_chief,
             dataset=dataset, cfg=cfg, batches=batches, compiled_step=compiled_step,
             evaluate=evaluate,
             save_checkpoint=saver(config, checkpoints, batches, cfg, dataset.chars),
             checkpoints=checkpoints, params=params, opt_state=opt_state,
             start_step=start_step, last_step=last_step, records=records)
