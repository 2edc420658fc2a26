"""What a train.py run starts from: its own checkpoint (--resume) or another run's (--init_from).

A checkpoint (a saved step of a run, see saving.py) records beside the
arrays the model flags that gave the parameters their meaning
(:func:`recorded_config`), the optimizer flags that shaped the optimizer
state, and the corpus's characters. Before anything is written, a run that starts from one checks
all three against its own flags and corpus: a checkpoint of another model,
optimizer or text could otherwise load and train on silently. An
``--init_from`` run may have another depth: ``--depth_map`` says which of
the checkpoint's blocks go where (``init_from.depth_indices``).

What cannot start raises :class:`StartError` with one line that names the
flag (the flag checks and ``init_from.depth_indices``, a ValueError); train.py
prints it and exits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from absl import logging
import jax
import optax

from examples.gpt import data as data_lib
from examples.gpt import distributed
from examples.gpt import init_from as init_from_lib
from examples.gpt import model_config
from examples.gpt import restoring
from examples.gpt import saving
from examples.gpt.init_from import DepthMap

#: The flags that say what the parameters mean: a --resume must give the
#: checkpoint's values (its config records them under the same names).
MODEL_FLAGS = ("num_layers", "num_heads", "d_model", "seq_len", "pattern", "window",
               "stack", "bias")
#: The config fields that say how the layers run, not what they are: not
#: recorded, so a checkpoint resumes under any of them.
_HOW_LAYERS_RUN = ("remat", "pipeline", "layer_drop", "dtype", "attention")
#: The adapters: a LoRA run records them under "lora" (see lora.py), beside
#: the base model's config.
_ADAPTERS = ("lora_rank", "lora_alpha", "lora_targets", "lora_count")


class StartError(Exception):
  """The run cannot start from the checkpoint it names; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class Start:
  """The checkpoints a run starts from (see :func:`find`), and how."""

  workdir: str   # this run's --workdir
  resume_step: int = 0   # with --resume: this workdir's latest step
  resume_meta: Optional[dict[str, Any]] = None   # and its metadata
  init_from: Optional[str] = None   # --init_from: another run's workdir or export
  init_step: int = 0   # its latest step
  init_meta: Optional[dict[str, Any]] = None   # and its metadata
  depth_map: Optional[str] = None   # --depth_map
  mapped: bool = False   # --init_opt_state=mapped: go on from init_step


def recorded_config(cfg: model_config.GPTConfig) -> dict[str, Any]:
  """The model's config as a checkpoint records it: the model's shape, not
  how its layers run."""
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
          if f.name not in _HOW_LAYERS_RUN + _ADAPTERS}


def find(workdir: str, resume: bool, init_from: Optional[str] = None,
         depth_map: Optional[str] = None, init_opt_state: str = "fresh") -> Start:
  """The checkpoints --resume and --init_from name, their metadata read.

  Reads files only (no JAX): callable before the processes join.

  Example::

    start = find("workdir/gpt4", resume=False, init_from="workdir/gpt2",
                 depth_map="zero_new", init_opt_state="mapped")

  Raises:
    StartError: as :func:`find_resume` and :func:`find_init_from`.
  """
  resume_step, resume_meta = find_resume(workdir, resume)
  init_step, init_meta = find_init_from(init_from)
  return Start(workdir=workdir, resume_step=resume_step, resume_meta=resume_meta,
               init_from=init_from, init_step=init_step, init_meta=init_meta,
               depth_map=depth_map, mapped=init_opt_state == "mapped")


def find_resume(workdir: str, resume: bool) -> tuple[int, Optional[dict[str, Any]]]:
  """The step and metadata --resume continues from; ``(0, None)`` without it.

  Reads files only (no JAX): callable before the processes join.

  Raises:
    StartError: --resume finds no readable checkpoint; or, without it, the
      workdir holds an earlier run's checkpoints, which a fresh run would mix
      with its own.
  """
  if not resume:
    steps = saving.committed_steps(workdir)
    if steps:
      raise StartError(
          f"--workdir={workdir!r} holds the checkpoints of an earlier run "
          f"(steps {', '.join(map(str, steps))}); pass --resume to continue it, "
          "or a new --workdir to start afresh.")
    return 0, None
  try:
    return saving.latest(workdir)
  except saving.NotFoundError as e:
    raise StartError(f"--resume: {e} Train first (with --checkpoint_every > 0), "
                     "or drop --resume to start afresh.") from None
  except saving.CheckpointError as e:
    raise StartError(f"--resume: {e}") from None


def find_init_from(init_from: Optional[str]) -> tuple[int, Optional[dict[str, Any]]]:
  """The step and metadata of --init_from's latest checkpoint (or of its
  export, ``saving.export_npz``'s); ``(0, None)`` without it.

  Raises:
    StartError: no readable checkpoint there.
  """
  if init_from is None:
    return 0, None
  try:
    return saving.latest(init_from)
  except saving.NotFoundError as e:
    raise StartError(f"--init_from={init_from!r}: {e} Pass the --workdir of a run "
                     "that saved a checkpoint, or the .npz of its --export_npz.") from None
  except saving.CheckpointError as e:
    raise StartError(f"--init_from={init_from!r}: {e}") from None


def check_chars(checkpoint_chars: str, corpus_chars: str, workdir: str,
                flag: str = "--resume") -> None:
  """Raises unless the corpus's characters are the checkpoint's.

  Ids are indices into the sorted character set: with another set the
  checkpoint's ids would stand for other characters, and training would go
  on silently from a model of another text.

  Raises:
    StartError: the sets differ; the message shows some of each.
  """
  if checkpoint_chars == corpus_chars:
    return
  only_corpus = sorted(set(corpus_chars) - set(checkpoint_chars))
  only_checkpoint = sorted(set(checkpoint_chars) - set(corpus_chars))

  def some(chars: list[str]) -> str:
    shown = "".join(chars[:10])
    return f"{len(chars)} ({shown!r}{', ...' if len(chars) > 10 else ''})" if chars else "0"

  raise StartError(
      f"{flag}: the corpus's characters differ from those of the "
      f"checkpoint in {workdir!r}: {some(only_corpus)} only in the corpus, "
      f"{some(only_checkpoint)} only in the checkpoint, so ids would stand "
      "for other characters. Pass the --data_path the checkpoint was "
      f"trained on{', or a new --workdir to start afresh' if flag == '--resume' else ''}.")


def check_corpus(start: Start, chars: str) -> None:
  """Raises unless the corpus's characters are those of the checkpoints
  ``start`` names (see :func:`check_chars`)."""
  if start.resume_meta is not None and "chars" in start.resume_meta:
    check_chars(start.resume_meta["chars"], chars, start.workdir)
  if start.init_meta is not None and "chars" in start.init_meta:
    check_chars(start.init_meta["chars"], chars, start.init_from, "--init_from")


def check_model(start: Start, cfg: model_config.GPTConfig,
                last_step: int) -> Optional[DepthMap]:
  """Raises unless the checkpoints ``start`` names fit this run's model.

  Returns:
    --init_from's depth map (:func:`check_init_from`), or None without it.

  Raises:
    StartError: naming the flags that do not fit.
  """
  if start.resume_meta is not None:
    check_model_flags(start.resume_meta.get("config", {}), cfg, start.workdir)
  if start.init_meta is None:
    return None
  return check_init_from(start, cfg, last_step)


def check_model_flags(saved: dict[str, Any], cfg: model_config.GPTConfig,
                      workdir: str, flag: str = "--resume", depth_too: bool = True) -> None:
  """Raises if a --resume run's MODEL_FLAGS differ from the checkpoint's
  (an --init_from run's, ``flag``, but --num_layers when not ``depth_too``).

  Some (--num_heads, --window) leave every parameter's shape as it was: the
  checkpoint would load and train on as another model, silently.

  Raises:
    StartError: naming the flags that differ, with both values.
  """
  differ = [name for name in MODEL_FLAGS
            if name in saved and saved[name] != getattr(cfg, name)
            and (depth_too or name != "num_layers")]
  if "pattern" in differ and "window" in differ:   # a window is its pattern's
    differ.remove("window")
  if not differ:
    return

  def show(name: str, value: Any) -> str:
    if isinstance(value, bool):
      return f"--{'' if value else 'no'}{name}"
    return f"--{name}={value if value != '' else repr(value)}"

  names = [n for n in MODEL_FLAGS if depth_too or n != "num_layers"]
  raise StartError(
      f"{flag}: the checkpoint in {workdir!r} was trained with "
      f"{' '.join(show(n, saved[n]) for n in differ)}, but this run has "
      f"{' '.join(show(n, getattr(cfg, n)) for n in differ)}; the flags "
      f"{', '.join('--' + n for n in names)} must be the checkpoint's. "
      f"Pass its values{', or a new --workdir to start afresh' if flag == '--resume' else ''}.")


def optimizer_flags_advice(meta: dict[str, Any], current: dict[str, Any], workdir: str) -> str:
  """What to do when --resume finds another optimizer's state: the values
  the checkpoint recorded, where they differ from this run's (``current``,
  ``OptimizerConfig.recorded()``). Never to delete it: the checkpoint is fine."""
  saved = meta.get("optimizer", {})
  differ = [n for n in current if n in saved and saved[n] != current[n]]

  def show(name: str, value: Any) -> str:
    return f"--{name}={value if value != '' else repr(value)}"

  fresh = (f"or, to train on with this run's optimizer, start a new run from its "
           f"parameters: drop --resume, pass --init_from={workdir!r} and a new --workdir")
  if not differ:
    return f"Pass the values it was trained with, {fresh}."
  return (f"It was trained with {' '.join(show(n, saved[n]) for n in differ)}, but this "
          f"run has {' '.join(show(n, current[n]) for n in differ)}: pass "
          f"its values, {fresh}.")


def restore_resume(start: Start, params: Any, opt_state: Any,
                   optimizer: dict[str, Any]) -> tuple[Any, Any]:
  """--resume's parameters and optimizer state, read onto the current mesh.

  Each process reads the shards of the current mesh, whichever mesh saved.

  Args:
    start: from :func:`find`, with --resume.
    params, opt_state: ``jax.ShapeDtypeStruct``s with shardings: where each
      array goes.
    optimizer: this run's ``OptimizerConfig.recorded()``, for the advice
      when the checkpoint's optimizer state is another optimizer's.

  Raises:
    StartError: unreadable, or written by another model or optimizer.
  """
  try:
    return restoring.restore(start.workdir, start.resume_step, params, opt_state)
  except saving.OptimizerStateError as e:
    advice = optimizer_flags_advice(start.resume_meta, optimizer, start.workdir)
    raise StartError(f"--resume: {e} {advice}") from None
  except saving.CheckpointError as e:
    raise StartError(f"--resume: {e}") from None


def check_init_from(start: Start, cfg: model_config.GPTConfig, last_step: int) -> DepthMap:
  """Raises unless --init_from's checkpoint fits this run's flags.

  Args:
    start: from :func:`find`, with --init_from.
    cfg: this run's model.
    last_step: the step this run ends at.

  Returns:
    ``(indices, zero)`` for ``st.take_layers``: --depth_map at these depths.

  Raises:
    StartError: other model flags, a map that does not fit, or a mapped
      run that would end before it starts.
  """
  init_from, init_step = start.init_from, start.init_step
  saved = start.init_meta.get("config", {})
  check_model_flags(saved, cfg, init_from, "--init_from", depth_too=False)
  old = saved.get("num_layers", cfg.num_layers)
  try:
    init_map = init_from_lib.depth_indices(start.depth_map, old, cfg.num_layers,
                                           len(cfg.pattern) or 1, cfg.pattern)
  except ValueError as e:
    raise StartError(f"--init_from={init_from!r}: {e}") from None
  if start.mapped and saving.is_export(init_from):
    raise StartError(f"--init_opt_state=mapped goes on with a checkpoint's optimizer state, "
                     f"and --init_from={init_from!r} is an export of parameters alone: pass "
                     "--init_opt_state=fresh, or the --workdir of the run that exported it.")
  if start.mapped and init_step >= last_step:
    raise StartError(
        f"--init_opt_state=mapped goes on from step {init_step} of "
        f"--init_from={init_from!r}, but this run ends at step {last_step}: "
        "raise --steps (the schedule's length), or use --init_opt_state=fresh.")
  return init_map


def restore_init_from(start: Start, init_map: DepthMap, cfg: model_config.GPTConfig,
                      params: Any, optimizer: Optional[optax.GradientTransformation],
                      shardings: tuple[Any, Any]) -> tuple[Any, Optional[Any]]:
  """--init_from's parameters (and, mapped, optimizer state) at this depth.

  ``params`` is this run's fresh init: its blocks fill the map's fresh
  layers. Every process reads the whole checkpoint on its host and keeps the
  shards of its devices.

  Args:
    start: from :func:`find`, with --init_from.
    init_map: from :func:`check_init_from`.
    cfg: this run's model.
    params: this run's fresh parameters, on the devices.
    optimizer: this run's optimizer, to map the checkpoint's optimizer state
      into (--init_opt_state=mapped); None for a fresh optimizer state.
    shardings: of the parameters and of the optimizer state.

  Returns:
    ``(params, opt_state)``; ``opt_state`` None without ``optimizer``.

  Raises:
    StartError: unreadable, or written by another model or optimizer, or a
      map that ``st.take_layers`` refuses.
  """
  indices, zero = init_map
  param_shardings, opt_shardings = shardings
  mapped = optimizer is not None
  fresh_opt = distributed.to_host(jax.jit(optimizer.init)(params)) if mapped else None
  try:
    host_params, host_opt = restoring.restore_across_depth(
        start.init_from, start.init_step, distributed.to_host(params), fresh_opt, stack="h",
        indices=indices, pattern=tuple(model_config.KINDS[c] for c in cfg.pattern) or None,
        zero=zero)
  except saving.CheckpointError as e:
    raise StartError(f"--init_from={start.init_from!r}: {e}") from None
  except ValueError as e:
    raise StartError(f"--init_from={start.init_from!r} --depth_map={start.depth_map}: "
                     f"{e}") from None
  logging.info("Initialized from %s, step %d: blocks %s (None: fresh%s); optimizer "
               "state %s.", start.init_from, start.init_step, indices,
               ", residual outputs zero" if zero else "", "mapped" if mapped else "fresh")
  return (distributed.put_tree(host_params, param_shardings),
          distributed.put_tree(host_opt, opt_shardings) if mapped else None)


def initial_state(start: Start, init_map: Optional[DepthMap], cfg: model_config.GPTConfig,
                  init_params: Callable[[], Any], optimizer: optax.GradientTransformation,
                  recorded: dict[str, Any], sampler: data_lib.BatchSampler,
                  shapes: tuple[Any, Any], shardings: tuple[Any, Any]
                  ) -> tuple[Any, Any, int]:
  """The parameters and optimizer state a run starts from, on the mesh.

  With --resume, this workdir's latest checkpoint; with --init_from, this
  run's fresh init with that checkpoint's blocks mapped in (and its
  optimizer state when mapped); else the fresh init and a fresh optimizer
  state. ``sampler`` is set to the data order of the step started from.

  Args:
    start: from :func:`find`.
    init_map: from :func:`check_model`.
    cfg: this run's model.
    init_params: makes the fresh parameters, on the devices.
    optimizer: this run's optimizer.
    recorded: what a checkpoint records of it (``OptimizerConfig.recorded()``).
    sampler: the training batches' sampler.
    shapes: of the parameters and of the optimizer state.
    shardings: of the parameters and of the optimizer state.

  Returns:
    ``(params, opt_state, step)``: ``step`` is the one they are after.

  Raises:
    StartError: a checkpoint that cannot be read into this run.
  """
  if start.resume_meta is not None:
    params, opt_state = restore_resume(
        start, *map(distributed.abstract_tree, shapes, shardings), recorded)
    sampler.set_state(start.resume_meta["sampler_state"])
    logging.info("Resumed from step %d.", start.resume_step)
    return params, opt_state, start.resume_step
  params, opt_state, step = init_params(), None, 0
  if init_map is not None:
    # Before anything is written: a map that does not fit stops here.
    params, opt_state = restore_init_from(start, init_map, cfg, params,
                                          optimizer if start.mapped else None, shardings)
    if start.mapped:   # the run goes on from that step
      step = start.init_step
      sampler.set_state(start.init_meta["sampler_state"])
  if opt_state is None:
    opt_state = jax.jit(optimizer.init, out_shardings=shardings[1])(params)
  return params, opt_state, step
