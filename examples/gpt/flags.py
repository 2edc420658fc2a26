"""train.py's flags: each defined here, with its help and bounds; the rules
between them; and the one frozen config they make.

This is the only module of the example that reads a flag. train.py's ``main``
calls :func:`config` and :func:`workdir` and hands both to ``train.train``;
every other function takes the values it needs as arguments. Each flag has
the name and default of a :class:`run_config.TrainConfig` field (but
--workdir, which ``train.train`` takes beside the config).

The rules between flags are absl validators, checked when the command line is
parsed: a run that breaks one stops with absl's one line before anything is
loaded. Each rule lives in the module of the setting it is about
(``remat.check_remat_flags``, ``optimizer.check_layer_rules``, ...); here it
is registered on the flags it reads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

from absl import flags

import stacktools as st
from examples.gpt import distributed
from examples.gpt import flag_help
from examples.gpt import init_from
from examples.gpt import lora
from examples.gpt import model_config
from examples.gpt import optimizer as optimizer_lib
from examples.gpt import remat as remat_lib
from examples.gpt import step as step_lib
from examples.gpt.run_config import DEFAULT_WINDOW
from examples.gpt.run_config import TrainConfig


#: Where absl files the flags: train.py's own help, when it is the program.
_OWNER = dict(module_name=flag_help.help_owner("train.py"))


def drop_test_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Removes absltest's flags (--test_tmpdir, ...), which Haiku's import of
  haiku.testing defines in every process, so that a binary's --helpfull
  lists only what it takes. Only for a binary run as the program: a test
  process that imports the example keeps them."""
  for flag in list(flag_values.flags_by_module_dict().get("absl.testing.absltest", [])):
    delattr(flag_values, flag.name)


if _OWNER["module_name"] is not None:
  drop_test_flags()

flags.DEFINE_string(
    "remat", "full", "Checkpoint policy of the block stack: one of "
    f"{', '.join(st.CheckpointPolicy.ALIASES)}; 'auto' (planned under --memory_budget); or "
    "per-depth segments alias:layers, e.g. none:2,full:6 (the layers add up to "
    "--num_layers).", **_OWNER)
flags.DEFINE_string(
    "memory_budget", None, "With --remat=auto: the most compiled temp memory of "
    "the train step, e.g. 48MiB or bytes; the fastest plan within it is used.", **_OWNER)
# Space-separated: a per-depth candidate (none:2,full:2) holds commas.
flags.DEFINE_spaceseplist(
    "remat_candidates", None, "With --remat=auto: plan among these candidates "
    "only, separated by spaces (e.g. 'full nested save:mlp_hidden none:2,full:2'), "
    "to plan faster; default: every alias, every tagged name and per-depth mixes.", **_OWNER)
flags.DEFINE_list(
    "save_names", None, "Checkpoint names to keep on top of --remat full, "
    f"nested or offload (of {', '.join(model_config.CHECKPOINT_NAMES)}). Default: "
    f"{','.join(model_config.KEPT_MATMUL_OUTPUTS)}, the outputs of every matmul "
    "but the attention scores, so the backward pass recomputes no projection; "
    "--save_names= (empty) recomputes everything but the carries.", **_OWNER)
flags.DEFINE_integer(
    "nested_outer", None, "Outer-loop size for --remat=nested (default: the "
    "split that keeps the fewest carries).", lower_bound=1, **_OWNER)
flags.DEFINE_enum("block", "fold", ("fold", "scan"),
                  "fold: blocks return x; scan: blocks return (x, per-layer stats).", **_OWNER)
flags.DEFINE_enum("stack", "scan", ("scan", "unrolled"),
                  "scan: st.Stacked; unrolled: st.BlockSeq (a Python loop).", **_OWNER)
flags.DEFINE_integer("unroll", 1, "Layers per rolled scan iteration.", lower_bound=1, **_OWNER)
flags.DEFINE_string(
    "pattern", "", "Mixed layers: the kinds of one period of the stack, one letter "
    "per layer, repeated: L (causal attention over the last --window positions) or "
    "G (full causal attention), e.g. LLLG. Default: one kind of block, global.", **_OWNER)
flags.DEFINE_integer(
    "window", None, "Positions (its own included) an L layer of --pattern attends "
    "to; decoding keeps a ring cache this long for each L layer. Default: "
    f"{DEFAULT_WINDOW}.", lower_bound=1, **_OWNER)
flags.DEFINE_integer("num_layers", 4, "Transformer blocks.", lower_bound=1, **_OWNER)
flags.DEFINE_integer("num_heads", 4, "Attention heads.", lower_bound=1, **_OWNER)
flags.DEFINE_integer("d_model", 128, "Residual stream width.", lower_bound=1, **_OWNER)
flags.DEFINE_bool("bias", True, "Biases in the linear layers and layer "
                  "norms (--nobias: none, as nanoGPT's default).", **_OWNER)
flags.DEFINE_enum(
    "dtype", "float32", model_config.DTYPES, "Compute dtype. float32 is right on a "
    "CPU (its bfloat16 matmuls are no faster); bfloat16 on an accelerator (TPU or "
    "GPU): mixed precision through Haiku's jmp policies, with the parameters, "
    "the optimizer state, the layer-norm statistics, the attention softmax and "
    "the loss in float32. Not part of the checkpoint: a run resumes under either.", **_OWNER)
flags.DEFINE_enum(
    "attention", "auto", model_config.ATTENTIONS, "How the blocks attend while "
    "training: xla (XLA's attention), splash (the Pallas TPU kernel, which never "
    "forms the [T, T] scores; 2.4x faster at T=1024 on a TPU v5e) or auto (splash "
    "on a single TPU chip for --block=fold when --seq_len is a multiple of 128, "
    "else xla: XLA cannot split the kernel over several devices). Not part of "
    "the checkpoint.", **_OWNER)
flags.DEFINE_integer("seq_len", 64, "Characters per training sequence.", lower_bound=1, **_OWNER)
flags.DEFINE_integer("batch_size", 16, "Sequences per step.", lower_bound=1, **_OWNER)
flags.DEFINE_integer(
    "grad_accum", 1, "Microbatches each step's batch is cut into, their gradients averaged before "
    "the one update: less memory; on an accelerator, the update's cost over more tokens.", lower_bound=1, **_OWNER)
flags.DEFINE_integer("steps", 600, "Training steps.", lower_bound=1, **_OWNER)
flags.DEFINE_integer(
    "stop_after", None, "Stop after this step, evaluating and checkpointing it, "
    "while the learning-rate schedule still spans --steps; a later --resume run "
    "with the same --steps continues exactly where this one stopped (default: "
    "run all --steps).", lower_bound=1, **_OWNER)
flags.DEFINE_float("learning_rate", 2e-3, "Peak learning rate.", lower_bound=0.0, **_OWNER)
flags.DEFINE_integer("warmup_steps", 50, "Linear warmup steps.", lower_bound=0, **_OWNER)
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.", lower_bound=0.0, **_OWNER)
flags.DEFINE_float("grad_clip", 1.0, "Global gradient-norm clip (0: off).", lower_bound=0.0, **_OWNER)
flags.DEFINE_enum(
    "optimizer", "adamw", optimizer_lib.OPTIMIZERS, "adamw: AdamW on every parameter. "
    "muon: Muon (optax.contrib.muon) on each block's weight matrices, one layer "
    "at a time (st.over_layers), and AdamW on the rest (embeddings, head, "
    "norms, biases), as modded-nanoGPT does.", **_OWNER)
flags.DEFINE_float(
    "muon_learning_rate", 0.02, "With --optimizer=muon: the peak learning rate of "
    "the Muon matrices (the warmup and decay of --learning_rate).", lower_bound=0.0, **_OWNER)
flags.DEFINE_float(
    "layer_lr_decay", 1.0, "Layer-wise learning-rate decay: the updates of block "
    "i of L are scaled by this to the power L - 1 - i (the last block by 1), "
    "e.g. 0.8 for fine-tuning; 1: none.", **_OWNER)
flags.DEFINE_string(
    "freeze_layers", "", "A:B: blocks A to B-1 do not train (a zero update, no "
    "weight decay, their optimizer state unchanged), e.g. 0:2. Default: none.", **_OWNER)
flags.DEFINE_float(
    "layer_drop", 0.0, "Stochastic depth while training: the last block's drop "
    "rate, linear in depth (block i of L skips with probability rate * (i + 1) / L); "
    "evaluation and sampling run every block. 0: none.", **_OWNER)
flags.DEFINE_string(
    "init_from", None, "An earlier run's --workdir: start from the parameters of its "
    "latest checkpoint (fine-tuning), at this run's --num_layers through "
    "--depth_map; or the .npz of its --export_npz (its parameters alone: "
    "--init_opt_state=fresh). The other model flags must be that run's.", **_OWNER)
flags.DEFINE_string(
    "depth_map", None, "With --init_from, how its N blocks become this run's "
    "--num_layers: repeat (each block in place: 0 0 1 1; the lower blocks take any "
    "extra copies: 4 to 6 blocks is 0 0 1 1 2 3), stack (the whole stack "
    "again: 0 1 0 1), zero_new (fresh blocks after the old ones, their residual "
    "outputs zero: the model computes what it did), or take:I,J,... (the blocks to "
    "keep, in order; 'new' for a fresh one), e.g. take:0,1,2,5. With --pattern, "
    "repeat, stack and zero_new move whole periods. Default: the same blocks.", **_OWNER)
flags.DEFINE_enum(
    "init_opt_state", "fresh", ("fresh", "mapped"), "With --init_from: fresh (a "
    "new run from its first step, with a new optimizer state), or mapped (the checkpoint's "
    "optimizer state, its blocks' rows mapped as the parameters are, and its step, "
    "schedule and data order: the run goes on from that step, e.g. deeper).", **_OWNER)
flags.DEFINE_integer(
    "lora_rank", 0, "With --init_from: fine-tune low-rank adapters of this rank "
    "(st.adapters.lora) on its model, which stays as it is; checkpoints hold the "
    "adapters and their optimizer state alone. 0: no adapters, every parameter "
    "trains.", lower_bound=0, **_OWNER)
flags.DEFINE_float(
    "lora_alpha", None, "With --lora_rank: the adapters' scale is alpha / rank. "
    "Default: the rank (a scale of 1).", **_OWNER)
flags.DEFINE_string(
    "lora_targets", "attn,mlp", "With --lora_rank: the block's linear layers that get "
    "adapters: attn (the attention's qkv and proj), mlp (fc and fc_out), or both; "
    "other names are module-path patterns (e.g. attn/qkv).", **_OWNER)
flags.DEFINE_integer("eval_every", 100, "Steps between validation runs.", lower_bound=1, **_OWNER)
flags.DEFINE_integer("eval_batches", 8, "Batches per validation run.", lower_bound=1, **_OWNER)
flags.DEFINE_integer("seed", 0, "Seed of the init and of the data sampler.", **_OWNER)
flags.DEFINE_string("workdir", "workdir/gpt", "Where metrics, checkpoints and plots go.", **_OWNER)
flags.DEFINE_integer(
    "checkpoint_every", 0, "Steps between checkpoints (0: only at the end).", lower_bound=0, **_OWNER)
flags.DEFINE_bool("resume", False, "Continue from the latest committed "
                  "checkpoint in --workdir, on any --mesh.", **_OWNER)
flags.DEFINE_integer(
    "keep_checkpoints", 3, "Checkpoints kept in --workdir/checkpoints (the latest "
    "steps; older ones are deleted).", lower_bound=1, **_OWNER)
flags.DEFINE_string(
    "export_npz", "", "After training, also write the final parameters to this "
    "path as one .npz (np.load(path, allow_pickle=False); keys like "
    "'h/block/fc/w', and 'meta': the model's config and characters as JSON), "
    "gathered onto process 0; a --lora_rank run writes its base with the adapters "
    "merged in. sample.py --workdir and --init_from read it as a run. Default: "
    "no export.", **_OWNER)
flags.DEFINE_integer("log_every", 50, "Steps between log lines.", lower_bound=1, **_OWNER)
flags.DEFINE_float(
    "peak_flops", None, "One device's peak FLOP/s, for the model TFLOP/s and MFU "
    "that the log lines show beside tokens/s (e.g. 197e12). Default: the dense "
    "bfloat16 peak of the device kind (PEAK_FLOPS: TPU v4, v5e, v5p, v6e, A100, "
    "H100); other devices, a CPU among them, show neither.", lower_bound=0.0, **_OWNER)
flags.DEFINE_string(
    "data_path", None, "A UTF-8 text file to train on (default: this Python's "
    "standard-library sources).", **_OWNER)
flags.DEFINE_integer(
    "sample_tokens", 200, "Characters to generate with the KV cache after training.",
    lower_bound=0, **_OWNER)
flags.DEFINE_string("sample_prompt", "def ", "Prompt for the sample.", **_OWNER)
flags.DEFINE_string(
    "mesh", "", "Device mesh as axis:size pairs over the axes pipe (pipeline "
    "stages, with --pipeline), data (batch) and fsdp (parameters), e.g. "
    "data:4,fsdp:2 or pipe:4,data:2; default: every device on data.", **_OWNER)
flags.DEFINE_enum(
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
    "pipeline.", **_OWNER)
flags.DEFINE_integer(
    "microbatches", None, "With --pipeline: the pieces each step's batch is cut "
    "into, which move through the stages one after another; --batch_size must "
    "divide by it times the data axis, and every schedule but gpipe needs at "
    "least the pipe axis size. Default: the pipe axis size.", lower_bound=1, **_OWNER)
flags.DEFINE_integer(
    "pipeline_repeats", None, "With --pipeline=circular or interleaved: how many chunks of "
    "layers each stage holds (a microbatch passes the stages this many times); "
    "--num_layers must divide by it times the pipe axis. Default: 1.",
    lower_bound=1, **_OWNER)
flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for --num_processes > 1.", **_OWNER)
flags.DEFINE_integer("num_processes", 1, "Processes in the run.", lower_bound=1, **_OWNER)
flags.DEFINE_integer("process_id", None, "This process's index, "
                     "0..--num_processes-1.", lower_bound=0, **_OWNER)


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
# setting it is about. What needs the depth, start_up.set_up's trace of the model says.
flags.register_multi_flags_validator(
    ["d_model", "num_heads"], lambda f: f["d_model"] % f["num_heads"] == 0,
    message="--d_model must be divisible by --num_heads.")
flags.register_validator(
    "save_names", lambda names: set(names or ()) <= set(model_config.CHECKPOINT_NAMES),
    message=f"--save_names accepts {', '.join(model_config.CHECKPOINT_NAMES)}.")
_validate(["remat", "memory_budget", "remat_candidates"], remat_lib.check_remat_flags)
_validate(["save_names", "remat"], remat_lib.check_save_names)
flags.register_validator(
    "peak_flops", lambda v: v is None or (math.isfinite(v) and v > 0),
    message="--peak_flops must be a finite number of FLOP/s above 0, e.g. 197e12; "
    "drop it for the device kind's own peak (none on a CPU: no MFU).")
flags.register_validator(
    "layer_lr_decay", lambda v: 0 < v <= 1,
    message="--layer_lr_decay must be in (0, 1]: 1 is no decay, 0.8 a usual one.")
flags.register_validator(
    "layer_drop", lambda v: 0 <= v < 1,
    message="--layer_drop must be in [0, 1): the last block's drop rate, e.g. 0.1.")
_validate(["freeze_layers", "layer_lr_decay", "num_layers", "stack"],
          optimizer_lib.check_layer_rules)
_validate(["init_from", "depth_map", "init_opt_state", "resume"], init_from.check_init_flags)
_validate(["lora_rank", "lora_alpha", "lora_targets", "init_from", "resume", "depth_map",
           "init_opt_state"], lora.check_lora_flags)
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
    ["nested_outer", "remat"], lambda f: f["nested_outer"] is None
    or remat_lib.alias(f["remat"]) == "nested",
    message="--nested_outer needs --remat=nested.")
_validate(["stack", "remat", "nested_outer", "unroll"], remat_lib.check_unrolled_stack)
flags.register_multi_flags_validator(
    ["muon_learning_rate", "optimizer"],
    lambda f: f["optimizer"] == "muon" or f["muon_learning_rate"] == flags.FLAGS["muon_learning_rate"].default,
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


#: The list flags, as the frozen config holds them: tuples.
_LISTS = ("remat_candidates", "save_names")


def config() -> TrainConfig:
  """The parsed flags (all but --workdir) as one frozen config."""
  values = {field.name: flags.FLAGS[field.name].value
            for field in dataclasses.fields(TrainConfig)}
  for name in _LISTS:
    if values[name] is not None:
      values[name] = tuple(values[name])
  return TrainConfig(**values)


def workdir() -> str:
  """--workdir: where the run's metrics, checkpoints and plots go."""
  return flags.FLAGS["workdir"].value
