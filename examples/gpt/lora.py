"""Low-rank adapters in the example: their flags' checks, what a checkpoint
records of them, the base's fingerprint and the train step over adapters.

A LoRA run (``train.py --init_from=RUN --lora_rank=R``) trains only the
adapters that ``st.adapters.lora`` adds to the blocks' linear layers
(``--lora_targets``: ``attn``, ``mlp`` or module-path patterns); the base's
parameters are read from ``RUN`` and never change. Its checkpoints hold the
adapters and their optimizer state, and their metadata records where the base
is (:func:`recorded`): the run, its step and a fingerprint of its
parameters, which a ``--resume`` and ``sample.py --adapters`` check.

What cannot start raises ``resume.StartError`` (checkpoints) or ValueError
(flags) with one line naming the flags.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Optional

import haiku as hk
import jax
import numpy as np
import optax

import stacktools as st
from examples.gpt import distributed
from examples.gpt import step as step_lib
from examples.gpt.resume import Start
from examples.gpt.resume import StartError

#: The --lora_targets default: every linear layer of the blocks.
DEFAULT_TARGETS = "attn,mlp"


def check_lora_flags(lora_rank: int, lora_alpha: Optional[float], lora_targets: str,
                     init_from: Optional[str], resume: bool, depth_map: Optional[str],
                     init_opt_state: str) -> None:
  """Checks the --lora flags together, before anything is read.

  Raises:
    ValueError: one line naming the flags.
  """
  if not lora_rank:
    given = (["lora_alpha"] if lora_alpha is not None else []) + (
        ["lora_targets"] if lora_targets != DEFAULT_TARGETS else [])
    if given:
      raise ValueError(f"--{' and --'.join(given)} {'need' if len(given) > 1 else 'needs'} "
                       "--lora_rank=R, the adapters' rank (e.g. 8).")
    return
  if init_from is None and not resume:
    raise ValueError(f"--lora_rank={lora_rank} needs --init_from=DIR, the trained run whose "
                     "parameters the adapters fine-tune (or --resume, to continue a LoRA run).")
  if depth_map is not None or init_opt_state != "fresh":
    raise ValueError("--lora_rank fine-tunes adapters on --init_from's model as it is: "
                     "drop --depth_map and --init_opt_state.")
  if lora_alpha is not None and not lora_alpha > 0:
    raise ValueError(f"--lora_alpha={lora_alpha} must be above 0 (the scale is "
                     "alpha / rank); drop it for a scale of 1.")
  if not [t for t in lora_targets.split(",") if t.strip()]:
    raise ValueError("--lora_targets names no layer: pass attn, mlp or both (attn,mlp).")


def flags_text(lora: dict[str, Any]) -> str:
  """The --lora flags a checkpoint's ``lora`` record stands for."""
  alpha = "" if lora["alpha"] is None else f" --lora_alpha={lora['alpha']:g}"
  return f"--lora_rank={lora['rank']}{alpha} --lora_targets={lora['targets']}"


def check_start(start: Start, lora_rank: int, lora_alpha: Optional[float],
                lora_targets: str) -> None:
  """Raises unless the checkpoints ``start`` names fit the --lora flags: a
  --resume of a LoRA run under its own flags, of another run without them;
  an --init_from of a whole model, never of adapters."""
  mine = ({"rank": lora_rank, "alpha": lora_alpha, "targets": lora_targets}
          if lora_rank else None)
  saved = (start.resume_meta or {}).get("lora")
  if start.resume_meta is not None and saved is None and mine is not None:
    raise StartError(
        f"--resume: the checkpoint in {start.workdir!r} is a whole model's, not "
        f"adapters: drop --lora_rank to resume it, or fine-tune it with "
        f"--init_from={start.workdir!r} --lora_rank={lora_rank} and a new --workdir.")
  if saved is not None:
    saved_flags = {k: saved[k] for k in ("rank", "alpha", "targets")}
    if mine is None or saved_flags != mine:
      given = flags_text(mine) if mine else "no --lora_rank"
      raise StartError(
          f"--resume: the checkpoint in {start.workdir!r} holds adapters of "
          f"{flags_text(saved)}, but this run has {given}: pass its values to resume it.")
  if start.init_meta is not None and "lora" in start.init_meta:
    raise StartError(
        f"--init_from={start.init_from!r} holds low-rank adapters, not a whole model: "
        f"start from their base, --init_from={start.init_meta['lora']['base']!r}, or "
        "from their merged parameters, the .npz of that run's --export_npz.")


def fingerprint(params: Any) -> str:
  """A short hash of parameters (names, shapes, dtypes and bytes): the base
  that adapters were trained on, checked where they are used again. A
  collective in a multi-process run (the arrays are gathered)."""
  digest = hashlib.sha256()
  host = distributed.to_host(params)
  for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(host)[0],
                           key=lambda item: jax.tree_util.keystr(item[0])):
    leaf = np.ascontiguousarray(leaf)
    digest.update(f"{jax.tree_util.keystr(path)}{leaf.shape}{leaf.dtype}".encode())
    digest.update(leaf.tobytes())
  return digest.hexdigest()[:16]


def recorded(lora_rank: int, lora_alpha: Optional[float], lora_targets: str,
             base: str, base_step: int, base_fingerprint: str) -> dict[str, Any]:
  """What a LoRA run's checkpoints record of its adapters and their base."""
  return {"rank": lora_rank, "alpha": lora_alpha, "targets": lora_targets,
          "base": os.path.abspath(base), "base_step": base_step,
          "fingerprint": base_fingerprint}


def check_base(lora: dict[str, Any], base_fingerprint: str, where: str) -> None:
  """Raises unless the base's fingerprint is the one the adapters recorded."""
  if lora["fingerprint"] != base_fingerprint:
    raise StartError(
        f"{where}: these adapters were trained on the parameters of {lora['base']!r} at "
        f"step {lora['base_step']} (fingerprint {lora['fingerprint']}), and the base "
        f"given has fingerprint {base_fingerprint}: pass that base, unchanged.")


def on_base(model: hk.Transformed, base: Any) -> hk.Transformed:
  """``model`` as a function of the adapters alone: ``base`` joined in."""
  return hk.Transformed(
      init=model.init,
      apply=lambda adapters, *a, **k: model.apply(st.adapters.join(base, adapters), *a, **k))


def make_train_step(model: hk.Transformed, optimizer: optax.GradientTransformation,
                    grad_accum: int = 1) -> Callable[..., Any]:
  """``(adapters, opt_state, tokens, base) -> (adapters, opt_state, loss, stats)``.

  ``step.make_train_step`` over the adapters: only they are differentiated
  and updated, and ``optimizer`` holds state for them alone; the base is an
  argument (not a constant of the program), read and never written.
  """
  def train_step(adapters, opt_state, tokens, base):
    inner = step_lib.make_train_step(on_base(model, base), optimizer, grad_accum)
    return inner(adapters, opt_state, tokens)
  return train_step


def compile_train_step(train_step: Callable[..., Any], mesh: jax.sharding.Mesh,
                       adapters: Any, opt_state: Any, base: Any,
                       batch_shape: tuple[int, ...], shardings: tuple[Any, ...]) -> Any:
  """``train_step`` compiled for the run's shardings, the adapters and their
  optimizer state donated (the base is not: it is read by every step)."""
  adapter_shardings, opt_shardings, batch_sharding, base_shardings = shardings
  replicated = distributed.replicated(mesh)
  with jax.set_mesh(mesh):
    return jax.jit(
        train_step, in_shardings=(adapter_shardings, opt_shardings, batch_sharding,
                                  base_shardings),
        donate_argnums=(0, 1),
        out_shardings=(adapter_shardings, opt_shardings, replicated, replicated),
    ).lower(adapters, opt_state,
            jax.ShapeDtypeStruct(batch_shape, np.int32, sharding=batch_sharding),
            base).compile()
