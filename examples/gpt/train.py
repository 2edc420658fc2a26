r"""Trains a small character-level GPT whose blocks live in a stacktools stack.

  python examples/gpt/train.py                         # defaults: ~2 minutes on 2 CPU cores
  python examples/gpt/train.py --remat=nested --block=scan
  python examples/gpt/train.py --stack=unrolled        # st.BlockSeq, a Python loop
  python examples/gpt/train.py --remat=full --save_names=attn_out,mlp_hidden

Logs step, train and validation loss, tokens/s and step time, and at start-up
the compiled temp memory of the train step (which is what --remat changes).
Writes metrics.jsonl, checkpoint.npz (every --checkpoint_every steps) and
loss.png (with matplotlib installed) to --workdir, each atomically; a start
removes the temporary files that a killed run's writes left there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Optional

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

# Runnable as a script from anywhere: put the repository root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import stacktools as st  # pylint: disable=g-import-not-at-top
from examples.gpt import checkpoint  # pylint: disable=g-import-not-at-top
from examples.gpt import data as data_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import distributed  # pylint: disable=g-import-not-at-top
from examples.gpt import files  # pylint: disable=g-import-not-at-top
from examples.gpt import model as model_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import sample as sample_lib  # pylint: disable=g-import-not-at-top

REMAT_CHOICES = tuple(st.REMAT_ALIASES)

_REMAT = flags.DEFINE_enum("remat", "full", REMAT_CHOICES, "Checkpoint policy of the block stack.")
_SAVE_NAMES = flags.DEFINE_list(
    "save_names", [], "Checkpoint names to keep on top of --remat (one of "
    f"{', '.join(model_lib.CHECKPOINT_NAMES)}); needs --remat full, nested or offload.")
_NESTED_OUTER = flags.DEFINE_integer(
    "nested_outer", None, "Outer-loop size for --remat=nested (default: the "
    "split that keeps the fewest carries).", lower_bound=1)
_BLOCK = flags.DEFINE_enum("block", "fold", ("fold", "scan"),
                           "fold: blocks return x; scan: blocks return (x, per-layer stats).")
_STACK = flags.DEFINE_enum("stack", "scan", ("scan", "unrolled"),
                           "scan: st.Stacked; unrolled: st.BlockSeq (a Python loop).")
_UNROLL = flags.DEFINE_integer("unroll", 1, "Layers per rolled scan iteration.", lower_bound=1)
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 4, "Transformer blocks.", lower_bound=1)
_NUM_HEADS = flags.DEFINE_integer("num_heads", 4, "Attention heads.", lower_bound=1)
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Residual stream width.", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Characters per training sequence.", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 16, "Sequences per step.", lower_bound=1)
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
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "Steps between validation runs.", lower_bound=1)
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 8, "Batches per validation run.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the init and of the data sampler.")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/gpt", "Where metrics, checkpoints and plots go.")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 0, "Steps between checkpoints (0: only at the end).", lower_bound=0)
_RESUME = flags.DEFINE_bool("resume", False, "Continue from the checkpoint in --workdir.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 50, "Steps between log lines.", lower_bound=1)
_DATA_PATH = flags.DEFINE_string(
    "data_path", None, "A UTF-8 text file to train on (default: this Python's "
    "standard-library sources).")
_SAMPLE_TOKENS = flags.DEFINE_integer(
    "sample_tokens", 200, "Characters to generate with the KV cache after training.",
    lower_bound=0)
_SAMPLE_PROMPT = flags.DEFINE_string("sample_prompt", "def ", "Prompt for the sample.")
_MESH = flags.DEFINE_string(
    "mesh", "", "Device mesh as axis:size pairs over the axes data (batch) and "
    "fsdp (parameters), e.g. data:4,fsdp:2; default: every device on data.")
_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for --num_processes > 1.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes in the run.",
                                      lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, "
                                   "0..--num_processes-1.", lower_bound=0)


flags.register_multi_flags_validator(
    ["d_model", "num_heads"], lambda f: f["d_model"] % f["num_heads"] == 0,
    message="--d_model must be divisible by --num_heads.")
flags.register_validator(
    "save_names", lambda names: set(names) <= set(model_lib.CHECKPOINT_NAMES),
    message=f"--save_names accepts {', '.join(model_lib.CHECKPOINT_NAMES)}.")
flags.register_multi_flags_validator(
    ["save_names", "remat"],
    lambda f: not f["save_names"] or f["remat"] in ("full", "nested", "offload"),
    message="--save_names needs --remat full, nested or offload (none and save_all "
    "keep everything already).")
flags.register_multi_flags_validator(
    ["stop_after", "steps"], lambda f: f["stop_after"] is None or f["stop_after"] <= f["steps"],
    message="--stop_after must be at most --steps.")
flags.register_multi_flags_validator(
    ["nested_outer", "remat"], lambda f: f["nested_outer"] is None or f["remat"] == "nested",
    message="--nested_outer needs --remat=nested.")


def _check_nested_outer(f: dict[str, Any]) -> bool:
  # Raises to put both values in the message, which a fixed one cannot.
  outer, layers = f["nested_outer"], f["num_layers"]
  if outer is not None and outer > layers:
    raise flags.ValidationError(
        f"--nested_outer={outer} is larger than --num_layers={layers}; the outer "
        f"loop takes 1 to {layers} steps: pass --nested_outer<={layers}, or omit "
        "it for the split that keeps the fewest carries.")
  return True


flags.register_multi_flags_validator(["nested_outer", "num_layers"], _check_nested_outer)


def checkpoint_policy(remat: str, save_names: list[str],
                      nested_outer: Optional[int]) -> st.CheckpointPolicy:
  """The policy the flags ask for."""
  policy = st.CheckpointPolicy.from_remat(remat)
  if save_names:
    policy = dataclasses.replace(policy, save_block_internals=tuple(save_names))
  if nested_outer is not None:
    policy = dataclasses.replace(policy, nested=nested_outer)
  return policy


def make_optimizer(steps: int) -> optax.GradientTransformation:
  """AdamW with linear warmup and cosine decay (to a tenth), gradients clipped."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=_LEARNING_RATE.value,
      # At least one step of cosine decay: optax rejects an empty one, which
      # a run with --steps <= --warmup_steps would otherwise ask for.
      warmup_steps=min(_WARMUP_STEPS.value, steps - 1), decay_steps=steps,
      end_value=_LEARNING_RATE.value / 10)
  parts = []
  if _GRAD_CLIP.value > 0:
    parts.append(optax.clip_by_global_norm(_GRAD_CLIP.value))
  parts.append(optax.adamw(schedule, weight_decay=_WEIGHT_DECAY.value))
  return optax.chain(*parts)


def check_data(dataset: data_lib.CharDataset, batch_size: int, seq_len: int) -> None:
  need = batch_size * (seq_len + 1)
  for split, ids in (("training", dataset.train), ("validation", dataset.valid)):
    if len(ids) < max(need, seq_len + 2):
      sys.exit(f"error: --data_path: the {split} split has {len(ids)} characters, "
               f"fewer than one batch (--batch_size={batch_size} x (--seq_len="
               f"{seq_len} + 1) = {need}); use a longer text or smaller flags.")


def load_data() -> data_lib.CharDataset:
  path = _DATA_PATH.value
  if path is not None:
    if not os.path.isfile(path):
      sys.exit(f"error: --data_path={path!r} does not exist or is not a file; "
               "pass a UTF-8 text file, or omit the flag to train on the "
               "standard-library corpus.")
    try:
      return data_lib.load_dataset(path)
    except UnicodeDecodeError as e:
      sys.exit(f"error: --data_path={path!r} is not UTF-8 text ({e}).")
  return data_lib.load_dataset(None)


def write_metrics(path: str, records: list[dict[str, Any]]) -> None:
  text = "".join(json.dumps(r) + "\n" for r in records)
  files.atomic_write(path, lambda f: f.write(text), mode="w")


def plot_losses(workdir: str, records: list[dict[str, Any]], unigram: float) -> None:
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


def check_workdir(workdir: str) -> None:
  """Exits with one line if the chief cannot write into ``workdir``."""
  problem = files.writable_folder_problem(workdir)
  if problem:
    sys.exit(f"error: --workdir={workdir!r} {problem}; pass a folder you can "
             "write to (it is created if missing).")


def check_chars(checkpoint_chars: str, corpus_chars: str, workdir: str) -> None:
  """Exits with one line if the corpus's characters are not the checkpoint's.

  Ids are indices into the sorted character set: with another set the
  checkpoint's ids would stand for other characters, and training would go
  on silently from a model of another text.
  """
  if checkpoint_chars == corpus_chars:
    return
  only_corpus = sorted(set(corpus_chars) - set(checkpoint_chars))
  only_checkpoint = sorted(set(checkpoint_chars) - set(corpus_chars))

  def some(chars: list[str]) -> str:
    shown = "".join(chars[:10])
    return f"{len(chars)} ({shown!r}{', ...' if len(chars) > 10 else ''})" if chars else "0"

  sys.exit(f"error: --resume: the corpus's characters differ from those of the "
           f"checkpoint in {workdir!r}: {some(only_corpus)} only in the corpus, "
           f"{some(only_checkpoint)} only in the checkpoint, so ids would stand "
           "for other characters. Pass the --data_path the checkpoint was "
           "trained on, or a new --workdir to start afresh.")


@dataclasses.dataclass
class Run:
  """What :func:`set_up` makes for :func:`train_loop` and :func:`finish`."""

  workdir: str
  metrics_path: str
  is_chief: bool
  dataset: data_lib.CharDataset
  cfg: model_lib.GPTConfig
  sampler: data_lib.BatchSampler
  batch_sharding: Any
  compiled_step: Any  # params, opt_state, batch -> params, opt_state, loss, stats
  evaluate: Callable[[Any], float]  # params -> mean validation loss
  # Gathers (params, opt_state) to the host and, on the chief, writes them
  # with this step's metadata.
  save_checkpoint: Callable[[int, Any, Any], None]
  params: Any  # at start_step
  opt_state: Any
  start_step: int
  last_step: int
  records: list[dict[str, Any]]  # metrics so far; train_loop appends to it


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
  # Only process 0 writes (jax.process_index() is --process_id once the
  # processes have joined); checked now, before the slow joining and loading.
  if _NUM_PROCESSES.value == 1 or _PROCESS_ID.value == 0:
    check_workdir(workdir)
  resume_meta = None
  if _RESUME.value:
    try:
      resume_meta = checkpoint.load_meta(workdir)
    except checkpoint.NotFoundError as e:
      sys.exit(f"error: --resume: {e} Train first (with --checkpoint_every > 0), "
               "or drop --resume to start afresh.")
    except checkpoint.CheckpointError as e:
      sys.exit(f"error: --resume: {e}")
  try:
    distributed.initialize(_COORDINATOR_ADDRESS.value, _NUM_PROCESSES.value,
                           _PROCESS_ID.value)
    mesh_sizes = distributed.parse_mesh(_MESH.value, distributed.device_count())
  except distributed.SetupError as e:
    sys.exit(f"error: {e}")
  if _BATCH_SIZE.value % mesh_sizes["data"]:
    sys.exit(f"error: --batch_size={_BATCH_SIZE.value} is not divisible by the "
             f"mesh's data axis ({mesh_sizes['data']}); each data shard needs "
             "the same number of sequences.")
  is_chief = jax.process_index() == 0
  dataset = load_data()
  check_data(dataset, _BATCH_SIZE.value, _SEQ_LEN.value)
  if resume_meta is not None and "chars" in resume_meta:
    check_chars(resume_meta["chars"], dataset.chars, workdir)
  if is_chief:
    # A run killed mid-write left these; no write is under way now.
    stale = files.remove_stale_temp_files(workdir)
    if stale:
      logging.info("Removed %d stale temporary file(s) of an interrupted write "
                   "from %s: %s", len(stale), workdir, ", ".join(stale))
  policy = checkpoint_policy(_REMAT.value, _SAVE_NAMES.value, _NESTED_OUTER.value)
  cfg = model_lib.GPTConfig(
      vocab_size=dataset.vocab_size, seq_len=_SEQ_LEN.value,
      num_layers=_NUM_LAYERS.value, num_heads=_NUM_HEADS.value,
      d_model=_D_MODEL.value, block=_BLOCK.value, stack=_STACK.value,
      remat=policy, unroll=_UNROLL.value)
  steps = _STEPS.value
  last_step = steps if _STOP_AFTER.value is None else _STOP_AFTER.value
  logging.info("Corpus: %d training and %d validation characters, %d symbols; "
               "unigram entropy %.3f nats.", len(dataset.train),
               len(dataset.valid), dataset.vocab_size, dataset.unigram_entropy())
  logging.info("Model: %s", cfg)

  model = hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)))
  optimizer = make_optimizer(steps)
  eval_sampler = data_lib.BatchSampler(dataset.valid, _BATCH_SIZE.value,
                                       _SEQ_LEN.value, _SEED.value + 1)
  eval_batches = [eval_sampler.next() for _ in range(_EVAL_BATCHES.value)]

  sampler = data_lib.BatchSampler(dataset.train, _BATCH_SIZE.value, _SEQ_LEN.value,
                                  _SEED.value)
  # Every process samples the same global batch (cheap: indices into the
  # text) and transfers only the rows its own devices hold.
  mesh = distributed.make_mesh(mesh_sizes)
  batch_sharding = distributed.batch_sharding(mesh)
  eval_batches = [distributed.put_global(b, batch_sharding) for b in eval_batches]
  init_key = jax.random.PRNGKey(_SEED.value)
  param_shapes = jax.eval_shape(model.init, init_key, sampler_peek(sampler))
  opt_shapes = jax.eval_shape(optimizer.init, param_shapes)
  param_shardings = distributed.tree_shardings(mesh, param_shapes)
  opt_shardings = distributed.tree_shardings(mesh, opt_shapes)
  params = jax.jit(model.init, out_shardings=param_shardings)(init_key, sampler_peek(sampler))
  opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
  start_step, records = 0, []
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if _RESUME.value:
    try:
      trees, meta = checkpoint.load(workdir, {"params": param_shapes,
                                              "opt_state": opt_shapes})
    except checkpoint.CheckpointError as e:
      sys.exit(f"error: --resume: {e}")
    params = distributed.put_tree(trees["params"], param_shardings)
    opt_state = distributed.put_tree(trees["opt_state"], opt_shardings)
    start_step = meta["step"]
    sampler.set_state(meta["sampler_state"])
    if os.path.exists(metrics_path):
      with open(metrics_path, encoding="utf-8") as f:
        records = [r for r in map(json.loads, f) if r["step"] <= start_step]
    logging.info("Resumed from step %d.", start_step)
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  logging.info("Parameters: %d; mesh %s over %d devices in %d processes; "
               "%.1f KiB of parameters and %.1f KiB of optimizer state per device.",
               num_params, dict(mesh.shape), jax.device_count(), jax.process_count(),
               distributed.per_device_bytes(params) / 1024,
               distributed.per_device_bytes(opt_state) / 1024)

  def train_step(params, opt_state, tokens):
    (loss, stats), grads = jax.value_and_grad(model.apply, has_aux=True)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, stats

  replicated = distributed.replicated(mesh)
  compiled_step = jax.jit(
      train_step, in_shardings=(param_shardings, opt_shardings, batch_sharding),
      out_shardings=(param_shardings, opt_shardings, replicated, replicated),
  ).lower(params, opt_state,
          jax.ShapeDtypeStruct(sampler_peek(sampler).shape, np.int32,
                               sharding=batch_sharding)).compile()
  memory = compiled_step.memory_analysis()
  logging.info("Train step: compiled temp memory %.2f MiB (remat=%s%s, stack=%s, block=%s).",
               memory.temp_size_in_bytes / 2**20, _REMAT.value,
               f", save_names={','.join(_SAVE_NAMES.value)}" if _SAVE_NAMES.value else "",
               cfg.stack, cfg.block)
  eval_loss = jax.jit(lambda p, t: model.apply(p, t)[0])

  def evaluate(params) -> float:
    return float(np.mean([eval_loss(params, b) for b in eval_batches]))

  def save_checkpoint(step, params, opt_state):
    # Gathering is a collective: every process takes part, one writes.
    trees = distributed.to_host({"params": params, "opt_state": opt_state})
    if not is_chief:
      return
    checkpoint.save(workdir, trees, {
        "step": step, "sampler_state": sampler.get_state(),
        "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                   if f.name != "remat"},
        "chars": dataset.chars})

  if is_chief:
    os.makedirs(workdir, exist_ok=True)
    write_metrics(metrics_path, records)
  return Run(workdir=workdir, metrics_path=metrics_path, is_chief=is_chief,
             dataset=dataset, cfg=cfg, sampler=sampler,
             batch_sharding=batch_sharding, compiled_step=compiled_step,
             evaluate=evaluate, save_checkpoint=save_checkpoint, params=params,
             opt_state=opt_state, start_step=start_step, last_step=last_step,
             records=records)


def train_loop(run: Run) -> Any:
  """Trains from ``run.start_step`` to ``run.last_step``.

  Logs, evaluates, appends to ``run.records`` (and writes them) and saves
  checkpoints as the flags say.

  Args:
    run: what :func:`set_up` made.

  Returns:
    The final parameters.
  """
  params, opt_state = run.params, run.opt_state
  last_step = run.last_step
  window_losses, window_start = [], time.perf_counter()
  tokens_per_step = _BATCH_SIZE.value * _SEQ_LEN.value
  for step in range(run.start_step + 1, last_step + 1):
    batch = distributed.put_global(run.sampler.next(), run.batch_sharding)
    params, opt_state, loss, stats = run.compiled_step(params, opt_state, batch)
    window_losses.append(loss)
    record = None
    if step % _LOG_EVERY.value == 0 or step == last_step:
      losses = [float(l) for l in window_losses]
      elapsed = time.perf_counter() - window_start
      record = {"step": step, "train_loss": float(np.mean(losses)),
                "step_time_s": elapsed / len(losses),
                "tokens_per_s": tokens_per_step * len(losses) / elapsed}
      message = (f"step {step:5d}  train loss {record['train_loss']:.4f}  "
                 f"{record['tokens_per_s']:8.0f} tokens/s  "
                 f"{1000 * record['step_time_s']:6.1f} ms/step")
      if stats is not None:
        for name, values in stats.items():
          record[name] = [round(float(v), 4) for v in values]
          message += f"\n    {name:>13} per layer: " + " ".join(f"{v:.3f}" for v in record[name])
      logging.info(message)
      window_losses, window_start = [], time.perf_counter()
    if step % _EVAL_EVERY.value == 0 or step == last_step:
      record = record or {"step": step}
      record["valid_loss"] = run.evaluate(params)
      logging.info("step %5d  validation loss %.4f", step, record["valid_loss"])
      window_start = time.perf_counter()  # evaluation is not training time
    if record is not None:
      run.records.append(record)
      if run.is_chief:
        write_metrics(run.metrics_path, run.records)
    if (_CHECKPOINT_EVERY.value and step % _CHECKPOINT_EVERY.value == 0) or step == last_step:
      run.save_checkpoint(step, params, opt_state)
  return params


def finish(run: Run, params: Any) -> None:
  """Logs the final loss; on the chief, plots the losses and samples.

  Args:
    run: what :func:`set_up` made, its records filled by :func:`train_loop`.
    params: the final parameters.
  """
  dataset, records = run.dataset, run.records
  host_params = distributed.to_host(params) if _SAMPLE_TOKENS.value else None
  logging.info("Final validation loss %.4f (unigram entropy %.4f).",
               records[-1].get("valid_loss", float("nan")) if records else float("nan"),
               dataset.unigram_entropy())
  if not run.is_chief:
    return
  plot_losses(run.workdir, records, dataset.unigram_entropy())
  if _SAMPLE_TOKENS.value:
    # Sampling is small: it runs on process 0 alone, from host copies.
    prompt = "".join(c for c in _SAMPLE_PROMPT.value if c in dataset.chars)
    if prompt != _SAMPLE_PROMPT.value:
      logging.warning("--sample_prompt has characters outside the corpus; "
                      "sampling from %r instead.", prompt or dataset.chars[0])
    text = sample_lib.generate(run.cfg, host_params, dataset, prompt or dataset.chars[0],
                               _SAMPLE_TOKENS.value, temperature=0.8, seed=_SEED.value)
    logging.info("Sample (KV-cache decoding through scan blocks):\n%s", text)


def main(argv):
  run = set_up(argv)
  params = train_loop(run)
  finish(run, params)


def sampler_peek(sampler: data_lib.BatchSampler) -> np.ndarray:
  """A batch of the right shape, without advancing the sampler."""
  return np.zeros((sampler.batch_size, sampler.seq_len + 1), np.int32)


if __name__ == "__main__":
  app.run(main)
