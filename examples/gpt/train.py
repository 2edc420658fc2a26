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
from stacktools import depth  # pylint: disable=g-import-not-at-top
from examples.gpt import checkpoint  # pylint: disable=g-import-not-at-top
from examples.gpt import data as data_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import distributed  # pylint: disable=g-import-not-at-top
from examples.gpt import files  # pylint: disable=g-import-not-at-top
from examples.gpt import model as model_lib  # pylint: disable=g-import-not-at-top
from examples.gpt import sample as sample_lib  # pylint: disable=g-import-not-at-top

#: The --remat aliases that recompute, so that --save_names can keep something.
SAVES_NAMES = ("full", "nested", "offload")
#: --window when --pattern has L layers and no --window is given.
DEFAULT_WINDOW = 32
#: The --depth_map values that name a scheme (the others list blocks: take:...).
DEPTH_MAPS = ("repeat", "stack", "zero_new")
#: The flags that say what the parameters mean: a --resume must give the
#: checkpoint's values (its config records them under the same names).
MODEL_FLAGS = ("num_layers", "num_heads", "d_model", "seq_len", "pattern", "window",
               "stack", "bias")

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
    f"nested or offload (of {', '.join(model_lib.CHECKPOINT_NAMES)}). Default: "
    f"{','.join(model_lib.KEPT_MATMUL_OUTPUTS)}, the outputs of every matmul "
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
    "dtype", "float32", model_lib.DTYPES, "Compute dtype. float32 is right on a "
    "CPU (its bfloat16 matmuls are no faster); bfloat16 on an accelerator (TPU or "
    "GPU): mixed precision through Haiku's jmp policies, with the parameters, "
    "the optimizer state, the layer-norm statistics, the attention softmax and "
    "the loss in float32. Not part of the checkpoint: a run resumes under either.")
_ATTENTION = flags.DEFINE_enum(
    "attention", "auto", model_lib.ATTENTIONS, "How the blocks attend while "
    "training: xla (XLA's attention), splash (the Pallas TPU kernel, which never "
    "forms the [T, T] scores; 2.4x faster at T=1024 on a TPU v5e) or auto (splash "
    "on a single TPU chip for --block=fold when --seq_len is a multiple of 128, "
    "else xla: XLA cannot split the kernel over several devices). Not part of "
    "the checkpoint.")
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
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer", "adamw", ("adamw", "muon"), "adamw: AdamW on every parameter. "
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
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes in the run.",
                                      lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, "
                                   "0..--num_processes-1.", lower_bound=0)


flags.register_multi_flags_validator(
    ["d_model", "num_heads"], lambda f: f["d_model"] % f["num_heads"] == 0,
    message="--d_model must be divisible by --num_heads.")
flags.register_validator(
    "save_names", lambda names: set(names or ()) <= set(model_lib.CHECKPOINT_NAMES),
    message=f"--save_names accepts {', '.join(model_lib.CHECKPOINT_NAMES)}.")


def _check_remat(f: dict[str, Any]) -> bool:
  # The flag combinations are this binary's; the policy itself is read by
  # stacktools, which says what is wrong with it. What needs the depth (the
  # per-depth counts, the nested outer size) is checked when set_up traces
  # the model.
  remat = f["remat"]
  if remat == "auto":
    if f["memory_budget"] is None:
      raise flags.ValidationError(
          "--remat=auto needs --memory_budget (e.g. --memory_budget=48MiB): the "
          "plan is the fastest within that much compiled temp memory.")
    for candidate in f["remat_candidates"] or ():
      if "," in candidate and not all(":" in part for part in candidate.split(",")):
        raise flags.ValidationError(
            f"--remat_candidates: {candidate!r} is not one candidate: separate "
            f"candidates with spaces (--remat_candidates="
            f"{' '.join(p for p in candidate.split(',') if p)!r}); a comma belongs "
            "only inside a per-depth candidate, e.g. none:2,full:2.")
    return True
  if f["memory_budget"] is not None or f["remat_candidates"] is not None:
    raise flags.ValidationError("--memory_budget and --remat_candidates need "
                                "--remat=auto.")
  try:
    checkpoint_policy(remat, None, None)
  except (TypeError, ValueError) as e:
    raise flags.ValidationError(f"--remat: {e}") from None
  return True


flags.register_multi_flags_validator(
    ["remat", "memory_budget", "remat_candidates"], _check_remat)


def _check_save_names(f: dict[str, Any]) -> bool:
  remat = f["remat"]
  if not f["save_names"] or remat in SAVES_NAMES:
    return True
  if remat == "auto":
    why = ("--remat=auto chooses what to keep itself; to have it weigh keeping a "
           "name, give it the candidate save:<name>, e.g. "
           "--remat_candidates='full save:mlp_hidden'")
  elif ":" in remat:
    why = ("a per-depth --remat gives each segment an alias, which keeps no "
           "names; use one policy (e.g. --remat=full) to keep names")
  else:
    why = "none and save_all keep everything already"
  raise flags.ValidationError(
      f"--save_names needs --remat full, nested or offload ({why}).")


flags.register_multi_flags_validator(["save_names", "remat"], _check_save_names)
flags.register_validator(
    "layer_lr_decay", lambda v: 0 < v <= 1,
    message="--layer_lr_decay must be in (0, 1]: 1 is no decay, 0.8 a usual one.")
flags.register_validator(
    "layer_drop", lambda v: 0 <= v < 1,
    message="--layer_drop must be in [0, 1): the last block's drop rate, e.g. 0.1.")


def layer_range(text: str, num_layers: int) -> range:
  """``"A:B"`` -> ``range(A, B)``, checked against the depth (``""``: empty)."""
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


def _check_layer_rules(f: dict[str, Any]) -> bool:
  try:
    frozen = layer_range(f["freeze_layers"], f["num_layers"])
  except ValueError as e:
    raise flags.ValidationError(str(e)) from None
  if f["stack"] == "unrolled" and (frozen or f["layer_lr_decay"] != 1):
    raise flags.ValidationError(
        "--freeze_layers and --layer_lr_decay index the Layers axis of the stacked "
        "parameters, which --stack=unrolled (one parameter per layer) does not "
        "have: use --stack=scan.")
  return True


flags.register_multi_flags_validator(
    ["freeze_layers", "layer_lr_decay", "num_layers", "stack"], _check_layer_rules)


def _check_init_from(f: dict[str, Any]) -> bool:
  if f["init_from"] is None:
    given = (["depth_map"] if f["depth_map"] is not None else []) + (
        ["init_opt_state"] if f["init_opt_state"] != "fresh" else [])
    if given:
      raise flags.ValidationError(f"--{' and --'.join(given)} {'need' if len(given) > 1 else 'needs'} "
                                  "--init_from=DIR, the run to start from.")
    return True
  if f["resume"]:
    raise flags.ValidationError(
        "--init_from starts a new run from another run's checkpoint and --resume "
        "continues this --workdir's: pass one of them.")
  text = f["depth_map"]
  if text is not None and text not in DEPTH_MAPS:
    body = text[len("take:"):] if text.startswith("take:") else None
    if body is None or not all(p == "new" or p.isdigit() for p in body.split(",")):
      raise flags.ValidationError(
          f"--depth_map={text!r} must be one of {', '.join(DEPTH_MAPS)} or take:I,J,... "
          "(block indices of --init_from's run, 'new' for a fresh block), e.g. take:0,1,2,5.")
  return True


flags.register_multi_flags_validator(
    ["init_from", "depth_map", "init_opt_state", "resume"], _check_init_from)


def depth_indices(depth_map: Optional[str], old: int, new: int, period: int,
                  pattern: str = "") -> tuple[list[Optional[int]], tuple[str, ...]]:
  """``--depth_map`` as ``st.take_layers``' indices and ``zero=``, for a stack
  of ``old`` blocks becoming one of ``new``.

  Raises:
    ValueError: one line, when the map does not fit the depths.
  """
  if depth_map is None:
    if old != new:
      raise ValueError(f"its checkpoint has {old} blocks and --num_layers={new}: pass "
                       f"--depth_map ({', '.join(DEPTH_MAPS)} or take:I,J,...) to say "
                       f"which blocks go where, or --num_layers={old}.")
    return list(range(old)), ()
  if depth_map.startswith("take:"):
    indices = [None if p == "new" else int(p) for p in depth_map[len("take:"):].split(",")]
    if len(indices) != new:
      raise ValueError(f"--depth_map={depth_map} lists {len(indices)} blocks but "
                       f"--num_layers={new}; list one index per block.")
    outside = [i for i in indices if i is not None and i >= old]
    if outside:
      raise ValueError(f"--depth_map={depth_map} takes block {outside[0]}, but the "
                       f"checkpoint has {old} blocks (0 to {old - 1}): list blocks 0 "
                       f"to {old - 1}, and new for a fresh one.")
    for p, i in enumerate(indices):   # every position keeps its kind of --pattern
      if i is not None and pattern and pattern[i % period] != pattern[p % period]:
        raise ValueError(f"--depth_map={depth_map} puts block {i}, of kind "
                         f"{pattern[i % period]} in --pattern={pattern}, at position {p}, "
                         f"whose kind is {pattern[p % period]}: take a block of kind "
                         f"{pattern[p % period]} there, or new for a fresh one.")
    return indices, ()
  if new < old:
    raise ValueError(f"--depth_map={depth_map} grows the stack, but --num_layers={new} "
                     f"is less than its {old} blocks: to keep some, list them, e.g. "
                     f"--depth_map=take:{','.join(map(str, range(new)))}.")
  helper = {"repeat": depth.repeat, "stack": depth.tile, "zero_new": depth.insert_new}[depth_map]
  zero = model_lib.RESIDUAL_OUTPUTS if depth_map == "zero_new" else ()
  return helper(old, new, period), zero


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


def _check_unrolled(f: dict[str, Any]) -> bool:
  # --stack=unrolled (st.BlockSeq) is a Python loop: no scan to unroll, nor
  # to split in two levels (nested would act as full).
  if f["stack"] != "unrolled":
    return True
  remat = f["remat"]
  aliases = [p.split(":")[0] for p in remat.split(",")] if ":" in remat else [remat]
  if "nested" in aliases:
    outer = " and --nested_outer" if f["nested_outer"] is not None else ""
    raise flags.ValidationError(
        f"--remat={remat}{outer}: nested splits a scan into two levels, and "
        "--stack=unrolled (st.BlockSeq, a Python loop) has no scan, so it would act "
        "as full: write full in its place, or pass --stack=scan.")
  if f["unroll"] != 1:
    raise flags.ValidationError(
        f"--unroll={f['unroll']} sets the layers per rolled iteration of "
        "--stack=scan's loop; --stack=unrolled (st.BlockSeq, a Python loop) runs "
        "every layer unrolled already: drop --unroll, or pass --stack=scan.")
  return True


flags.register_multi_flags_validator(["stack", "remat", "nested_outer", "unroll"],
                                     _check_unrolled)
flags.register_multi_flags_validator(
    ["muon_learning_rate", "optimizer"],
    lambda f: f["optimizer"] == "muon" or f["muon_learning_rate"] == _MUON_LEARNING_RATE.default,
    message="--muon_learning_rate is the peak learning rate of Muon's matrices, which "
    "only --optimizer=muon has: pass --optimizer=muon, or drop --muon_learning_rate "
    "(--learning_rate sets AdamW's).")


def _check_window(f: dict[str, Any]) -> bool:
  window, seq_len = f["window"], f["seq_len"]
  if "L" not in f["pattern"] or (window or DEFAULT_WINDOW) <= seq_len:
    return True
  what = (f"--window={window} is" if window is not None else
          f"--window, not given, defaults to {DEFAULT_WINDOW},")
  raise flags.ValidationError(
      f"--pattern={f['pattern']} has L layers, which attend to the last --window "
      f"positions, but {what} more than --seq_len={seq_len}: pass --window={seq_len} "
      "or less.")


flags.register_multi_flags_validator(["window", "pattern", "seq_len"], _check_window)


def _check_pipeline(f: dict[str, Any]) -> bool:
  # What the flags alone rule out; what needs the mesh is checked in set_up,
  # and what needs the depth when set_up traces the model.
  pipeline = f["pipeline"]
  if pipeline == "none":
    given = [name for name in ("microbatches", "pipeline_repeats") if f[name] is not None]
    if given:
      raise flags.ValidationError(
          f"--{' and --'.join(given)} {'need' if len(given) > 1 else 'needs'} "
          "a --pipeline (e.g. gpipe, circular or interleaved) and a pipe axis in "
          "--mesh (e.g. "
          "--mesh=pipe:4,data:2).")
    return True
  if f["remat"] == "auto":
    # The planner's candidates include per-depth mixes, which a pipeline
    # refuses; refused here rather than after compiling the first of them.
    raise flags.ValidationError(
        f"--pipeline={pipeline} runs every stage with one checkpoint policy, which "
        "--remat=auto does not fix: pass --remat as one policy (e.g. full or nested).")
  return True


flags.register_multi_flags_validator(
    ["pipeline", "microbatches", "pipeline_repeats", "remat"], _check_pipeline)


def checkpoint_policy(remat: str, save_names: Optional[list[str]],
                      nested_outer: Optional[int]) -> Any:
  """The remat value the flags ask for: a policy, per-depth segments or "auto".

  ``save_names=None`` (the flag's default) keeps
  ``model.KEPT_MATMUL_OUTPUTS`` under the aliases that recompute (``full``,
  ``nested``, ``offload``).

  Raises:
    ValueError, TypeError: stacktools' own, for a --remat it does not accept.
  """
  if remat == "auto":
    return remat
  if ":" in remat:
    return st.per_depth(remat)
  policy = st.CheckpointPolicy.from_remat(remat)
  if save_names is None:
    save_names = list(model_lib.KEPT_MATMUL_OUTPUTS) if remat in SAVES_NAMES else []
  if save_names:
    policy = dataclasses.replace(policy, save_block_internals=tuple(save_names))
  if nested_outer is not None:
    policy = dataclasses.replace(policy, nested=nested_outer)
  return policy


def remat_text(remat: Any) -> str:
  """A remat value as the log shows it: an alias (with the names it keeps),
  or per_depth(...)."""
  if not isinstance(remat, st.CheckpointPolicy):
    return f"per_depth({remat})"
  names = remat.save_block_internals
  if isinstance(names, bool) or not names:
    return str(remat)
  return f"{dataclasses.replace(remat, save_block_internals=False)}, save_names={','.join(names)}"


def transform(cfg: model_lib.GPTConfig) -> hk.Transformed:
  """The model's loss: ``(params, tokens, training=False) -> (loss, stats)``.

  While ``training``, ``cfg.layer_drop`` skips blocks at random, with a key
  drawn from the batch itself: a resumed run skips the blocks an
  uninterrupted one would, with no key to pass or checkpoint.
  """
  def loss(tokens, training=False):
    if not (training and cfg.layer_drop):
      return model_lib.loss_fn(cfg, tokens)
    # A hash of the tokens, position-weighted (odd multipliers mod 2^32).
    weights = jnp.arange(1, 2 * tokens.size, 2, dtype=jnp.uint32).reshape(tokens.shape)
    digest = jnp.sum(tokens.astype(jnp.uint32) * weights * jnp.uint32(2654435761))
    with hk.with_rng(jax.random.fold_in(jax.random.PRNGKey(0), digest)):
      return model_lib.loss_fn(cfg, tokens, training=True)

  return hk.without_apply_rng(hk.transform(loss))


def trace_model(cfg: model_lib.GPTConfig, mesh: jax.sharding.Mesh, key: jax.Array,
                tokens: np.ndarray) -> Any:
  """Traces init and loss once, abstractly, under the mesh; returns the
  parameters' shapes.

  Compiles and allocates nothing; what stacktools refuses in the model's
  stack raises here (ValueError or TypeError, one line). ``remat="auto"``
  is traced as "none", the planner's business being the candidates.
  """
  if cfg.remat == "auto":
    cfg = dataclasses.replace(cfg, remat="none")
  model = transform(cfg)
  with jax.set_mesh(mesh):   # a pipelined stack checks itself against the mesh
    shapes = jax.eval_shape(model.init, key, tokens)
    jax.eval_shape(lambda p, t: model.apply(p, t, training=True), shapes, tokens)
  return shapes


def make_train_step(model: hk.Transformed,
                    optimizer: optax.GradientTransformation) -> Callable[..., Any]:
  """``(params, opt_state, tokens) -> (params, opt_state, loss, stats)``."""

  def train_step(params, opt_state, tokens):
    (loss, stats), grads = jax.value_and_grad(model.apply, has_aux=True)(
        params, tokens, training=True)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, stats

  return train_step


def plan_remat(cfg: model_lib.GPTConfig, optimizer: optax.GradientTransformation,
               params: Any, opt_state: Any, batch: jax.Array, workdir: str,
               is_chief: bool) -> model_lib.GPTConfig:
  """--remat=auto: the plan chosen within --memory_budget, logged and saved.

  Every candidate is predicted from one trace of the train step; a few are
  compiled and two timed (see st.plan_remat). The plan is remembered in the
  workdir, so a --resume or a rerun with the same flags reuses it after one
  trace. The report and the chosen plan go to the log and to remat_plan.json
  in the workdir. A budget no candidate meets stops here.

  Returns:
    ``cfg`` with the chosen remat in place of "auto".
  """
  model = transform(cfg)
  logging.info("Planning --remat=auto within --memory_budget=%s.", _MEMORY_BUDGET.value)
  try:
    # Donated as the step that trains donates them: the budget is that
    # step's temp memory.
    plan = st.plan_remat(make_train_step(model, optimizer), params, opt_state, batch,
                         budget=_MEMORY_BUDGET.value, only=_REMAT_CANDIDATES.value,
                         cache_dir=workdir, donate_argnums=(0, 1))
  except ValueError as e:
    # What the planner says of only= is about the labels, --remat_candidates;
    # the rest is about the budget.
    flag = (f"--remat_candidates={' '.join(_REMAT_CANDIDATES.value)!r}"
            if "only=" in str(e) else f"--memory_budget={_MEMORY_BUDGET.value}")
    sys.exit(f"error: {flag}: {e}")
  labels = dict(plan.labels)
  if jax.process_count() > 1:
    # Each process plans (or reads a remembered plan) itself, and timing can
    # call a close race either way: every process runs the chief's plan.
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    plans = [dict(r.plan) for r in plan.report.rows]
    labels = plans[int(multihost_utils.broadcast_one_to_all(
        np.int32(plans.index(labels))))]
  ((key, label),) = labels.items()   # the model has one stack
  chosen = plan.report.remats[key][label]
  if plan.reused:
    logging.info("Remat plan reused from %s in %.2f s (planned earlier in %.1f s with "
                 "%d compiles).", plan.cache_path, plan.seconds, plan.report.seconds,
                 plan.report.compiles)
  else:
    logging.info("%s", plan.report)
    logging.info("Planning took %.1f s for %d candidates, %d compiled (compiling and "
                 "timing: %.1f s).", plan.seconds, len(plan.report.rows),
                 plan.report.compiles, plan.report.compile_seconds)
  logging.info("Remat plan: %s (%s=%s).", remat_text(chosen), key, label)
  if is_chief:
    os.makedirs(workdir, exist_ok=True)
    text = json.dumps(plan.to_json(), indent=1, default=str)
    files.atomic_write(os.path.join(workdir, "remat_plan.json"),
                       lambda f: f.write(text), mode="w")
  return dataclasses.replace(cfg, remat=chosen)


def make_pipeline(mesh_sizes: dict[str, int], mesh_spec: str,
                  batch_size: int) -> Optional[st.Pipeline]:
  """The ``st.Pipeline`` that --pipeline asks for, checked against the mesh.

  Exits with one line when the mesh and the flags do not fit together: a
  pipeline without a pipe axis, a pipe axis larger than 1 without a pipeline
  (it would only replicate the work; refused rather than made a gpipe, so
  that the schedule and --microbatches are always chosen, never guessed), a
  batch that the microbatches x data axis do not divide, or what
  ``st.Pipeline`` refuses. What needs the depth (layers that the stages x
  repeats do not divide, a circular schedule with fewer microbatches than
  stages) stacktools says when set_up traces the model.

  Args:
    mesh_sizes: from ``distributed.parse_mesh``.
    mesh_spec: --mesh as given, for the messages.
    batch_size: --batch_size.

  Returns:
    The pipeline, or ``None`` for --pipeline=none.
  """
  kind, pipe = _PIPELINE.value, mesh_sizes.get(distributed.PIPE)
  if kind == "none":
    if pipe is not None and pipe > 1:
      sys.exit(f"error: --mesh={mesh_spec!r} has a pipe axis of {pipe}, which only a "
               "pipeline uses: pass --pipeline=gpipe or --pipeline=circular (and "
               "--microbatches), or leave the pipe axis out of --mesh.")
    return None
  if pipe is None:
    sys.exit(f"error: --pipeline={kind} places its stages on a pipe axis, which is "
             f"missing from --mesh={mesh_spec!r}; add one, e.g. "
             "--mesh=pipe:4,data:2 (the sizes multiply to the device count).")
  try:
    pipeline = st.Pipeline(axis=distributed.PIPE, microbatches=_MICROBATCHES.value or pipe,
                           schedule=kind, repeats=_PIPELINE_REPEATS.value or 1)
  except (TypeError, ValueError) as e:
    sys.exit(f"error: {e}")
  # The batch is split over the data axis (distributed.batch_sharding), then
  # each shard into microbatches: this binary's layout, not the stack's.
  microbatches, data = pipeline.microbatches, mesh_sizes["data"]
  if batch_size % (microbatches * data):
    sys.exit(f"error: --batch_size={batch_size} is not divisible by --microbatches "
             f"({microbatches}) x the mesh's data axis ({data}) = {microbatches * data}; "
             "each microbatch of each data shard needs the same number of sequences.")
  return pipeline


def make_optimizer(steps: int, cfg: model_lib.GPTConfig) -> optax.GradientTransformation:
  """AdamW (or Muon on the blocks' matrices and AdamW on the rest) with linear
  warmup and cosine decay (to a tenth), gradients clipped; --layer_lr_decay
  and --freeze_layers act on the block stack's layers."""
  def schedule(peak):
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak,
        # --warmup_steps < --steps (a flag validator): at least one step of
        # cosine decay, which optax needs.
        warmup_steps=_WARMUP_STEPS.value, decay_steps=steps,
        end_value=peak / 10)
  parts = []
  if _GRAD_CLIP.value > 0:
    parts.append(optax.clip_by_global_norm(_GRAD_CLIP.value))
  tx = optax.adamw(schedule(_LEARNING_RATE.value), weight_decay=_WEIGHT_DECAY.value)
  if _OPTIMIZER.value == "muon":
    def labels(params):   # the blocks' weight matrices (one per layer), and the rest
      return jax.tree_util.tree_map_with_path(
          lambda path, _: "muon" if (str(path[0].key).startswith("h/")
                                     and path[-1].key == "w") else "adamw", params)
    muon = optax.contrib.muon(schedule(_MUON_LEARNING_RATE.value),
                              weight_decay=_WEIGHT_DECAY.value)
    tx = optax.partition({"muon": muon, "adamw": tx}, labels)
  L, decay = cfg.num_layers, _LAYER_LR_DECAY.value  # pylint: disable=invalid-name
  frozen = layer_range(_FREEZE_LAYERS.value, L)
  # AdamW alone is elementwise: per layer or not, the same steps. BlockSeq's
  # layers are separate leaves already.
  if cfg.stack == "scan" and (_OPTIMIZER.value == "muon" or decay != 1 or frozen):
    tx = st.over_layers(
        tx, stacked={"h": tuple(model_lib.KINDS[c] for c in cfg.pattern) or None},
        scale=(lambda i: decay ** (L - 1 - i)) if decay != 1 else None, frozen=frozen)
  parts.append(tx)
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


def check_model_flags(saved: dict[str, Any], cfg: model_lib.GPTConfig,
                      workdir: str, flag: str = "--resume", depth_too: bool = True) -> None:
  """Exits with one line if a --resume run's MODEL_FLAGS differ from the
  checkpoint's (an --init_from run's, ``flag``, but --num_layers when not
  ``depth_too``).

  Some (--num_heads, --window) leave every parameter's shape as it was: the
  checkpoint would load and train on as another model, silently.
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
  sys.exit(f"error: {flag}: the checkpoint in {workdir!r} was trained with "
           f"{' '.join(show(n, saved[n]) for n in differ)}, but this run has "
           f"{' '.join(show(n, getattr(cfg, n)) for n in differ)}; the flags "
           f"{', '.join('--' + n for n in names)} must be the checkpoint's. "
           f"Pass its values{', or a new --workdir to start afresh' if flag == '--resume' else ''}.")


#: The flags that shape the optimizer state, as a checkpoint records them: a
#: --resume with other values finds another optimizer's state.
OPTIMIZER_FLAGS = {"optimizer": _OPTIMIZER, "freeze_layers": _FREEZE_LAYERS,
                   "layer_lr_decay": _LAYER_LR_DECAY, "grad_clip": _GRAD_CLIP}


def optimizer_flags_advice(meta: dict[str, Any], workdir: str) -> str:
  """What to do when --resume finds another optimizer's state: the values
  the checkpoint recorded, where they differ from this run's. Never to
  delete it: the checkpoint is fine."""
  saved = meta.get("optimizer", {})
  differ = [n for n, flag in OPTIMIZER_FLAGS.items() if n in saved and saved[n] != flag.value]

  def show(name: str, value: Any) -> str:
    return f"--{name}={value if value != '' else repr(value)}"

  fresh = (f"or, to train on with this run's optimizer, start a new run from its "
           f"parameters: drop --resume, pass --init_from={workdir!r} and a new --workdir")
  if not differ:
    return f"Pass the values it was trained with, {fresh}."
  return (f"It was trained with {' '.join(show(n, saved[n]) for n in differ)}, but this "
          f"run has {' '.join(show(n, OPTIMIZER_FLAGS[n].value) for n in differ)}: pass "
          f"its values, {fresh}.")


def check_chars(checkpoint_chars: str, corpus_chars: str, workdir: str,
                flag: str = "--resume") -> None:
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

  sys.exit(f"error: {flag}: the corpus's characters differ from those of the "
           f"checkpoint in {workdir!r}: {some(only_corpus)} only in the corpus, "
           f"{some(only_checkpoint)} only in the checkpoint, so ids would stand "
           "for other characters. Pass the --data_path the checkpoint was "
           f"trained on{', or a new --workdir to start afresh' if flag == '--resume' else ''}.")


def check_init_from(init_step: int, init_meta: dict[str, Any], cfg: model_lib.GPTConfig
                    ) -> tuple[list[Optional[int]], tuple[str, ...]]:
  """Exits with one line unless --init_from's checkpoint fits this run's flags.

  Returns:
    ``(indices, zero)`` for ``st.take_layers``: --depth_map at these depths.
  """
  saved = init_meta.get("config", {})
  check_model_flags(saved, cfg, _INIT_FROM.value, "--init_from", depth_too=False)
  old = saved.get("num_layers", cfg.num_layers)
  try:
    init_map = depth_indices(_DEPTH_MAP.value, old, cfg.num_layers, len(cfg.pattern) or 1,
                             cfg.pattern)
  except ValueError as e:
    sys.exit(f"error: --init_from={_INIT_FROM.value!r}: {e}")
  last = _STEPS.value if _STOP_AFTER.value is None else _STOP_AFTER.value
  if _INIT_OPT_STATE.value == "mapped" and init_step >= last:
    sys.exit(f"error: --init_opt_state=mapped goes on from step {init_step} of "
             f"--init_from={_INIT_FROM.value!r}, but this run ends at step {last}: "
             "raise --steps (the schedule's length), or use --init_opt_state=fresh.")
  return init_map


def restore_init_from(init_step: int, init_map: tuple[list[Optional[int]], tuple[str, ...]],
                      cfg: model_lib.GPTConfig, params: Any,
                      optimizer: optax.GradientTransformation, param_shardings: Any,
                      opt_shardings: Any) -> tuple[Any, Optional[Any]]:
  """--init_from's parameters (and, mapped, optimizer state) at this depth.

  ``params`` is this run's fresh init: its blocks fill the map's fresh
  layers. Every process reads the whole checkpoint on its host and keeps the
  shards of its devices.

  Returns:
    ``(params, opt_state)``; ``opt_state`` None with --init_opt_state=fresh.
  """
  indices, zero = init_map
  mapped = _INIT_OPT_STATE.value == "mapped"
  fresh_opt = (distributed.to_host(jax.jit(optimizer.init)(params)) if mapped else None)
  try:
    host_params, host_opt = checkpoint.restore_across_depth(
        _INIT_FROM.value, init_step, distributed.to_host(params), fresh_opt, stack="h",
        indices=indices, pattern=tuple(model_lib.KINDS[c] for c in cfg.pattern) or None,
        zero=zero)
  except checkpoint.CheckpointError as e:
    sys.exit(f"error: --init_from={_INIT_FROM.value!r}: {e}")
  except ValueError as e:
    sys.exit(f"error: --init_from={_INIT_FROM.value!r} --depth_map={_DEPTH_MAP.value}: {e}")
  logging.info("Initialized from %s, step %d: blocks %s (None: fresh%s); optimizer "
               "state %s.", _INIT_FROM.value, init_step, indices,
               ", residual outputs zero" if zero else "", _INIT_OPT_STATE.value)
  return (distributed.put_tree(host_params, param_shardings),
          distributed.put_tree(host_opt, opt_shardings) if mapped else None)


@dataclasses.dataclass
class Run:
  """What :func:`set_up` makes for :func:`train_loop` and :func:`finish`."""

  workdir: str
  metrics_path: str
  is_chief: bool
  dataset: data_lib.CharDataset
  cfg: model_lib.GPTConfig
  batches: data_lib.Prefetched  # the training batches, on the devices a step ahead
  compiled_step: Any  # params, opt_state, batch -> params, opt_state, loss, stats
  evaluate: Callable[[Any], float]  # params -> mean validation loss
  # Starts an asynchronous save of (params, opt_state) with this step's
  # metadata: every process writes its own shards.
  save_checkpoint: Callable[[int, Any, Any], None]
  checkpoints: checkpoint.Manager  # finish() waits for its last save
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
  # Every process writes its checkpoint shards there (process 0 alone the
  # metrics, the plot and the export); checked now, before the slow joining
  # and loading.
  check_workdir(workdir)
  if _EXPORT_NPZ.value and (_NUM_PROCESSES.value == 1 or _PROCESS_ID.value == 0):
    problem = files.writable_folder_problem(os.path.dirname(os.path.abspath(_EXPORT_NPZ.value)))
    if problem:
      sys.exit(f"error: --export_npz={_EXPORT_NPZ.value!r}: its folder {problem}; "
               "pass a path in a folder you can write to.")
  resume_step, resume_meta = 0, None
  if _RESUME.value:
    try:
      resume_step, resume_meta = checkpoint.latest(workdir)
    except checkpoint.NotFoundError as e:
      sys.exit(f"error: --resume: {e} Train first (with --checkpoint_every > 0), "
               "or drop --resume to start afresh.")
    except checkpoint.CheckpointError as e:
      sys.exit(f"error: --resume: {e}")
  elif checkpoint.committed_steps(workdir):
    steps = checkpoint.committed_steps(workdir)
    sys.exit(f"error: --workdir={workdir!r} holds the checkpoints of an earlier run "
             f"(steps {', '.join(map(str, steps))}); pass --resume to continue it, "
             "or a new --workdir to start afresh.")
  init_step, init_meta = 0, None
  if _INIT_FROM.value is not None:
    try:
      init_step, init_meta = checkpoint.latest(_INIT_FROM.value)
    except checkpoint.NotFoundError as e:
      sys.exit(f"error: --init_from={_INIT_FROM.value!r}: {e} Pass the --workdir of "
               "a run that saved a checkpoint.")
    except checkpoint.CheckpointError as e:
      sys.exit(f"error: --init_from={_INIT_FROM.value!r}: {e}")
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
  pipeline = make_pipeline(mesh_sizes, _MESH.value, _BATCH_SIZE.value)
  is_chief = jax.process_index() == 0
  dataset = load_data()
  check_data(dataset, _BATCH_SIZE.value, _SEQ_LEN.value)
  if resume_meta is not None and "chars" in resume_meta:
    check_chars(resume_meta["chars"], dataset.chars, workdir)
  if init_meta is not None and "chars" in init_meta:
    check_chars(init_meta["chars"], dataset.chars, _INIT_FROM.value, "--init_from")
  sampler = data_lib.BatchSampler(dataset.train, _BATCH_SIZE.value, _SEQ_LEN.value,
                                  _SEED.value)
  mesh = distributed.make_mesh(mesh_sizes)
  init_key = jax.random.PRNGKey(_SEED.value)
  # What stacktools refuses in the model the flags describe (per-depth counts
  # or a nested outer size against the depth, layers the pipeline stages do
  # not divide, ...) it says here, before anything is compiled or written.
  try:
    cfg = model_lib.GPTConfig(
        vocab_size=dataset.vocab_size, seq_len=_SEQ_LEN.value,
        num_layers=_NUM_LAYERS.value, num_heads=_NUM_HEADS.value,
        d_model=_D_MODEL.value, block=_BLOCK.value, stack=_STACK.value,
        remat=checkpoint_policy(_REMAT.value, _SAVE_NAMES.value, _NESTED_OUTER.value),
        unroll=_UNROLL.value, pattern=_PATTERN.value,
        window=(_WINDOW.value or DEFAULT_WINDOW) if "L" in _PATTERN.value else 0,
        bias=_BIAS.value, pipeline=pipeline, layer_drop=_LAYER_DROP.value,
        dtype=_DTYPE.value, attention=_ATTENTION.value)
    param_shapes = trace_model(cfg, mesh, init_key, sampler_peek(sampler))
  except (TypeError, ValueError) as e:
    sys.exit(f"error: {e}")
  if resume_meta is not None:
    check_model_flags(resume_meta.get("config", {}), cfg, workdir)
  init_map = None
  if init_meta is not None:
    init_map = check_init_from(init_step, init_meta, cfg)
  if is_chief:
    # A run killed mid-write left these; no write is under way now.
    stale = files.remove_stale_temp_files(workdir)
    if stale:
      logging.info("Removed %d stale temporary file(s) of an interrupted write "
                   "from %s: %s", len(stale), workdir, ", ".join(stale))
  steps = _STEPS.value
  last_step = steps if _STOP_AFTER.value is None else _STOP_AFTER.value
  logging.info("Corpus: %d training and %d validation characters, %d symbols; "
               "unigram entropy %.3f nats.", len(dataset.train),
               len(dataset.valid), dataset.vocab_size, dataset.unigram_entropy())
  logging.info("Model: %s", cfg)

  model = transform(cfg)
  optimizer = make_optimizer(steps, cfg)
  eval_sampler = data_lib.BatchSampler(dataset.valid, _BATCH_SIZE.value,
                                       _SEQ_LEN.value, _SEED.value + 1)
  eval_batches = [eval_sampler.next() for _ in range(_EVAL_BATCHES.value)]
  # Every process samples the same global batch (cheap: indices into the
  # text) and transfers only the rows its own devices hold.
  batch_sharding = distributed.batch_sharding(mesh)
  eval_batches = [distributed.put_global(b, batch_sharding) for b in eval_batches]
  opt_shapes = jax.eval_shape(optimizer.init, param_shapes)
  # A pipelined stack's Layers axis is split over the pipe axis: each stage
  # holds its own layers (and their AdamW moments). Same tree as a plain run.
  pipelined = pipeline is not None
  param_shardings = distributed.tree_shardings(mesh, param_shapes, pipelined)
  opt_shardings = distributed.tree_shardings(mesh, opt_shapes, pipelined)
  start_step, records = 0, []
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if not _RESUME.value:
    params = jax.jit(model.init, out_shardings=param_shardings)(init_key, sampler_peek(sampler))
    opt_state = None
    if init_map is not None:
      # Before anything is written: a map that does not fit stops here.
      params, opt_state = restore_init_from(init_step, init_map, cfg, params, optimizer,
                                            param_shardings, opt_shardings)
      if _INIT_OPT_STATE.value == "mapped":   # the run goes on from that step
        start_step = init_step
        sampler.set_state(init_meta["sampler_state"])
    if opt_state is None:
      opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
  else:
    # Each process reads the shards of the current mesh, whichever mesh saved.
    try:
      params, opt_state = checkpoint.restore(
          workdir, resume_step, distributed.abstract_tree(param_shapes, param_shardings),
          distributed.abstract_tree(opt_shapes, opt_shardings))
    except checkpoint.OptimizerStateError as e:
      sys.exit(f"error: --resume: {e} {optimizer_flags_advice(resume_meta, workdir)}")
    except checkpoint.CheckpointError as e:
      sys.exit(f"error: --resume: {e}")
    start_step = resume_step
    sampler.set_state(resume_meta["sampler_state"])
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
  if pipeline is not None:
    stages = distributed.pipe_size(mesh)
    logging.info("Pipeline: %s over %d stages x %d repeats, %d microbatches of %d "
                 "sequences, %d layers per stage and repeat; bubble %.1f%% of "
                 "stage-ticks.", pipeline.schedule, stages, pipeline.repeats,
                 pipeline.microbatches, _BATCH_SIZE.value // pipeline.microbatches,
                 cfg.num_layers // (stages * pipeline.repeats),
                 100 * pipeline.table(stages).bubble)

  if cfg.remat == "auto":
    # Before the checkpoint folder is made: a --memory_budget that stacktools
    # refuses (or that no plan meets) leaves nothing behind.
    example_batch = distributed.put_global(sampler_peek(sampler), batch_sharding)
    cfg = plan_remat(cfg, optimizer, params, opt_state, example_batch, workdir,
                     is_chief)
    model = transform(cfg)
  # Every process joins; the first start after a kill removes the step
  # folder that the killed save left unfinished.
  try:
    checkpoints = checkpoint.Manager(workdir, keep=_KEEP_CHECKPOINTS.value)
  except checkpoint.CheckpointError as e:
    sys.exit(f"error: --workdir={workdir!r}: {e}")
  if checkpoints.removed_unfinished:
    logging.info("Removed the unfinished checkpoint(s) of an interrupted save from "
                 "%s: %s", checkpoints.root, ", ".join(checkpoints.removed_unfinished))
  train_step = make_train_step(model, optimizer)

  replicated = distributed.replicated(mesh)
  # Traced under the mesh: a pipelined stack reads its pipe axis from it (and
  # runs as a plain stack where there is none).
  compile_start = time.perf_counter()
  with jax.set_mesh(mesh):
    # The parameters and optimizer state are donated: the update writes
    # them in place (a checkpoint's save has copied them off the devices).
    compiled_step = jax.jit(
        train_step, in_shardings=(param_shardings, opt_shardings, batch_sharding),
        donate_argnums=(0, 1),
        out_shardings=(param_shardings, opt_shardings, replicated, replicated),
    ).lower(params, opt_state,
            jax.ShapeDtypeStruct(sampler_peek(sampler).shape, np.int32,
                                 sharding=batch_sharding)).compile()
  memory = compiled_step.memory_analysis()
  logging.info("Train step: compiled temp memory %.2f MiB, compiled in %.1f s (remat=%s, "
               "stack=%s, block=%s).", memory.temp_size_in_bytes / 2**20,
               time.perf_counter() - compile_start, remat_text(cfg.remat),
               cfg.stack, cfg.block)
  eval_loss = jax.jit(lambda p, t: model.apply(p, t)[0])

  def evaluate(params) -> float:
    with jax.set_mesh(mesh):   # traced on the first call: see the train step
      return float(np.mean([eval_loss(params, b) for b in eval_batches]))

  # The training batches, each put on the devices a step ahead (as the
  # evaluation's: every process samples the whole batch, puts its rows).
  batches = data_lib.Prefetched(
      sampler, lambda batch: distributed.put_global(batch, batch_sharding))

  def save_checkpoint(step, params, opt_state):
    # A collective: every process writes its own shards, in the background.
    # The config is the model's shape; how its layers run (remat, pipeline,
    # dtype, attention) is not, so a checkpoint resumes under any of them.
    checkpoints.save(step, params, opt_state, {
        "sampler_state": batches.get_state(),
        "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                   if f.name not in ("remat", "pipeline", "layer_drop", "dtype", "attention")},
        "optimizer": {name: flag.value for name, flag in OPTIMIZER_FLAGS.items()},
        "chars": dataset.chars})

  if is_chief:
    os.makedirs(workdir, exist_ok=True)
    write_metrics(metrics_path, records)
  return Run(workdir=workdir, metrics_path=metrics_path, is_chief=is_chief,
             dataset=dataset, cfg=cfg, batches=batches, compiled_step=compiled_step,
             evaluate=evaluate, save_checkpoint=save_checkpoint,
             checkpoints=checkpoints, params=params,
             opt_state=opt_state, start_step=start_step, last_step=last_step,
             records=records)


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
  """``device_kind``'s entry of :data:`PEAK_FLOPS`, or None (a CPU, say)."""
  if device_kind in PEAK_FLOPS:
    return PEAK_FLOPS[device_kind]
  gpus = [kind for kind in PEAK_FLOPS
          if kind.startswith("NVIDIA ") and device_kind.startswith(kind)]
  return PEAK_FLOPS[max(gpus, key=len)] if gpus else None


def run_peak_flops() -> Optional[float]:
  """The run's peak FLOP/s over all its devices (--peak_flops, or the device
  kind's), or None where it is not known: then no MFU is logged."""
  peak = _PEAK_FLOPS.value or peak_flops(jax.devices()[0].device_kind)
  return None if peak is None else peak * jax.device_count()


def model_flops_per_token(cfg: model_lib.GPTConfig, num_params: int) -> float:
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
  # The losses of the steps since the last log line, and the seconds they
  # took: the clock runs while steps run and stops (once the steps dispatched
  # so far are done) for evaluation and checkpoints.
  window_losses, stopwatch = [], Stopwatch()
  tokens_per_step = _BATCH_SIZE.value * _SEQ_LEN.value
  peak = run_peak_flops()   # None: no MFU on the log lines
  if peak is not None:
    flops_per_token = model_flops_per_token(
        run.cfg, sum(x.size for x in jax.tree_util.tree_leaves(params)))
  for step in range(run.start_step + 1, last_step + 1):
    batch = run.batches.next()
    params, opt_state, loss, stats = run.compiled_step(params, opt_state, batch)
    window_losses.append(loss)
    record = None
    if step % _LOG_EVERY.value == 0 or step == last_step:
      losses = [float(l) for l in window_losses]  # waits for the steps
      elapsed = stopwatch.lap()
      record = {"step": step, "train_loss": float(np.mean(losses)),
                "step_time_s": elapsed / len(losses),
                "tokens_per_s": tokens_per_step * len(losses) / elapsed}
      message = (f"step {step:5d}  train loss {record['train_loss']:.4f}  "
                 f"{record['tokens_per_s']:8.0f} tokens/s  ")
      if peak is not None:
        record["model_tflops_per_s"] = record["tokens_per_s"] * flops_per_token / 1e12
        record["mfu"] = record["model_tflops_per_s"] * 1e12 / peak
        message += (f"{record['model_tflops_per_s']:7.2f} TFLOP/s  "
                    f"MFU {100 * record['mfu']:4.1f}%  ")
      message += f"{1000 * record['step_time_s']:6.1f} ms/step"
      if stats is not None:
        for name, values in stats.items():
          record[name] = [round(float(v), 4) for v in values]
          message += f"\n    {name:>13} per layer: " + " ".join(f"{v:.3f}" for v in record[name])
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
        write_metrics(run.metrics_path, run.records)
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
  # Host copies of the parameters, for sampling and the export only (a
  # collective that gathers every shard; checkpoints never gather).
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
    logging.info("Wrote %s", checkpoint.export_npz(_EXPORT_NPZ.value, host_params))
  plot_losses(run.workdir, records, dataset.unigram_entropy())
  if _SAMPLE_TOKENS.value:
    # Sampling is small: it runs on process 0 alone, from host copies.
    prompt = "".join(c for c in _SAMPLE_PROMPT.value if c in dataset.chars)
    if prompt != _SAMPLE_PROMPT.value:
      logging.warning("--sample_prompt has characters outside the corpus; "
                      "sampling from %r instead.", prompt or dataset.chars[0])
    sample_lib.warn_if_cut(prompt, run.cfg.seq_len, "--sample_prompt")
    (text,) = sample_lib.generate(run.cfg, host_params, dataset, prompt or dataset.chars[0],
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
