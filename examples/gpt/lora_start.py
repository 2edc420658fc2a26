"""What train.py does before the first step of a LoRA run (``--lora_rank``).

``start_up.set_up``'s steps, with the model's parameters cut in two by
``st.adapters.split``: the base, read from ``--init_from``'s latest
checkpoint (or, on ``--resume``, from the run and step the checkpoint
recorded, its fingerprint checked) and never written; and the adapters,
fresh from the model's init (``lora_a`` random, ``lora_b`` zero: the run
starts from the base's loss) or resumed. The optimizer, the train step, the
checkpoints and their optimizer state are the adapters' alone; the export
and the sample after training take ``st.adapters.merge``'s parameters, a
plain model's.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from absl import logging
import jax

import stacktools as st
from examples.gpt import data as data_lib
from examples.gpt import distributed
from examples.gpt import lora
from examples.gpt import metrics
from examples.gpt import model_config
from examples.gpt import optimizer as optimizer_lib
from examples.gpt import restoring
from examples.gpt import resume as resume_lib
from examples.gpt import saving
from examples.gpt import start_up
from examples.gpt import step as step_lib
from examples.gpt.run_config import TrainConfig


def _base_run(start: resume_lib.Start) -> tuple[str, int, dict[str, Any]]:
  """The run, step and metadata of the base: --init_from's, or on --resume
  the one the checkpoint recorded."""
  if start.resume_meta is None:
    return start.init_from, start.init_step, start.init_meta
  recorded = start.resume_meta["lora"]
  try:
    _, meta = saving.latest(recorded["base"])
  except saving.CheckpointError as e:
    sys.exit(f"error: --resume: the adapters' base {recorded['base']!r}: {e}")
  return recorded["base"], recorded["base_step"], meta


def _read_base(base_dir: str, base_step: int, base_meta: dict[str, Any],
               cfg: model_config.GPTConfig, shapes: Any, shardings: Any) -> Any:
  """The base's parameters on the mesh; exits with one line when its run is
  another model's or unreadable."""
  try:
    resume_lib.check_model_flags(base_meta.get("config", {}), cfg, base_dir, "--init_from")
    params, _ = restoring.restore(base_dir, base_step,
                                  distributed.abstract_tree(shapes, shardings))
  except resume_lib.StartError as e:
    sys.exit(f"error: {e}")
  except saving.CheckpointError as e:
    sys.exit(f"error: --init_from={base_dir!r}: {e}")
  return params


def _adapters_and_state(config: TrainConfig, start: resume_lib.Start,
                        cfg: model_config.GPTConfig, optimizer: Any, init_key: jax.Array,
                        sampler: data_lib.BatchSampler, shapes: tuple[Any, Any],
                        shardings: tuple[Any, Any]) -> tuple[Any, Any, int]:
  """The adapters, their optimizer state and the step they are after: resumed,
  or fresh (the model's init, its base dropped)."""
  if start.resume_meta is not None:
    adapters, opt_state = resume_lib.restore_resume(
        start, *map(distributed.abstract_tree, shapes, shardings),
        start_up.optimizer_config(config).recorded())
    sampler.set_state(start.resume_meta["sampler_state"])
    logging.info("Resumed the adapters from step %d.", start.resume_step)
    return adapters, opt_state, start.resume_step
  init = jax.jit(lambda key, tokens: st.adapters.split(
      step_lib.transform(cfg).init(key, tokens))[1], out_shardings=shardings[0])
  adapters = init(init_key, sampler.zeros())
  opt_state = jax.jit(optimizer.init, out_shardings=shardings[1])(adapters)
  return adapters, opt_state, 0


def set_up(config: TrainConfig, workdir: str) -> start_up.Run:
  """``start_up.set_up`` for a LoRA run: the same checks, outputs and loop,
  over the adapters (see the module docstring).

  Raises:
    SystemExit: a check failed; the message is its one line.
  """
  start = start_up.check_outputs(config, workdir)
  base_dir, base_step, base_meta = _base_run(start)
  mesh_sizes, pipeline = start_up.join_processes(config)
  is_chief = jax.process_index() == 0
  dataset = start_up.load_corpus(config, start)
  if start.resume_meta is not None:
    try:
      resume_lib.check_chars(base_meta["chars"], dataset.chars, base_dir, "--init_from")
    except resume_lib.StartError as e:
      sys.exit(f"error: {e}")
  sampler = data_lib.BatchSampler(dataset.train, config.batch_size, config.seq_len,
                                  config.seed)
  mesh = distributed.make_mesh(mesh_sizes)
  init_key = jax.random.PRNGKey(config.seed)
  cfg, param_shapes = start_up.build_model(config, dataset.vocab_size, pipeline, mesh,
                                           init_key, sampler.zeros())
  base_shapes, adapter_shapes = st.adapters.split(param_shapes)
  pipelined = cfg.pipeline is not None
  base = _read_base(base_dir, base_step, base_meta, cfg, base_shapes,
                    distributed.tree_shardings(mesh, base_shapes, pipelined))
  base_print = lora.fingerprint(base)
  if start.resume_meta is not None:
    try:
      lora.check_base(start.resume_meta["lora"], base_print, "--resume")
    except resume_lib.StartError as e:
      sys.exit(f"error: {e}")
  logging.info("Model: %s; adapters on %s over the base %s at step %d (fingerprint %s).",
               cfg, ", ".join(sorted(adapter_shapes)), base_dir, base_step, base_print)
  optimizer = optimizer_lib.make_optimizer(start_up.optimizer_config(config), config.steps, cfg)
  shapes = (adapter_shapes, jax.eval_shape(optimizer.init, adapter_shapes))
  shardings = tuple(distributed.tree_shardings(mesh, tree, pipelined) for tree in shapes)
  adapters, opt_state, start_step = _adapters_and_state(
      config, start, cfg, optimizer, init_key, sampler, shapes, shardings)
  start_up.log_layout(config, adapters, opt_state, mesh, cfg)
  last_step = config.steps if config.stop_after is None else config.stop_after
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  records = metrics.read_metrics(metrics_path, start_step) if config.resume else []
  batch_sharding = distributed.batch_sharding(mesh)
  if cfg.remat == "auto":
    sys.exit("error: --remat=auto plans a whole model's step; with --lora_rank pass a "
             "named remat (full, nested, ...).")
  checkpoints = start_up.open_checkpoints(config, workdir)
  compile_start = time.perf_counter()
  base_shardings = jax.tree_util.tree_map(lambda a: a.sharding, base)
  compiled = lora.compile_train_step(
      lora.make_train_step(step_lib.transform(cfg), optimizer, config.grad_accum), mesh,
      adapters, opt_state, base, sampler.zeros().shape,
      (*shardings, batch_sharding, base_shardings))
  logging.info("Train step over the adapters: compiled temp memory %.2f MiB, compiled "
               "in %.1f s.", compiled.memory_analysis().temp_size_in_bytes / 2**20,
               time.perf_counter() - compile_start)
  evaluate, batches = start_up.feeds(config, cfg, dataset, sampler, mesh, batch_sharding)
  if is_chief:
    os.makedirs(workdir, exist_ok=True)
    metrics.write_metrics(metrics_path, records)
  recorded = lora.recorded(config.lora_rank, config.lora_alpha, config.lora_targets,
                           base_dir, base_step, base_print)
  return start_up.Run(
      config=config, workdir=workdir, metrics_path=metrics_path, is_chief=is_chief,
      dataset=dataset, cfg=cfg, batches=batches,
      compiled_step=lambda a, o, b: compiled(a, o, b, base),
      evaluate=lambda a: evaluate(st.adapters.join(base, a)),
      save_checkpoint=start_up.saver(config, checkpoints, batches, cfg, dataset.chars,
                                     lora=recorded),
      checkpoints=checkpoints, params=adapters, opt_state=opt_state,
      start_step=start_step, last_step=last_step, records=records,
      merged=lambda a: st.adapters.merge(st.adapters.join(base, a), alpha=cfg.lora_alpha))
