"""The --remat glue of train.py: the remat its flags ask for, and --remat=auto's plan.

stacktools reads every remat value itself (``st.CheckpointPolicy.from_remat``,
``st.per_depth``, ``st.plan_remat``) and says what is wrong with one. What is
here is the binary's own: which names ``--save_names`` keeps by default,
which flag combinations it refuses, how a remat reads on a log line, and what
a run does with a plan (log it, save its report, run the chief's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Optional, Sequence

from absl import logging
import jax

import stacktools as st
from examples.gpt import files
from examples.gpt import model_config

#: The --remat aliases that recompute, so that --save_names can keep something.
SAVES_NAMES = ("full", "nested", "offload")

#: What --remat accepts, as its error lists it: the command line takes names
#: (any case, as stacktools reads them), not the library's True/False/None.
ACCEPTED = (f"{', '.join(st.CheckpointPolicy.ALIASES)}, auto, or per-depth segments "
            "alias:layers,... (e.g. none:2,full:2)")

#: --memory_budget's units, as st.plan_remat reads them (any case).
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}

#: What a --remat flag becomes: an ``st.CheckpointPolicy``, ``st.per_depth``
#: segments, or "auto".
Remat = Any


def alias(remat: str) -> str:
  """--remat as stacktools compares policy names: in lower case (``Full`` is
  ``full``), so that every rule of the binary reads the policy that runs."""
  return remat.lower()


def checkpoint_policy(remat: str, save_names: Optional[Sequence[str]],
                      nested_outer: Optional[int]) -> Remat:
  """The remat value the flags ask for: a policy, per-depth segments or "auto".

  ``save_names=None`` (the flag's default) keeps
  ``model.KEPT_MATMUL_OUTPUTS`` under the aliases that recompute (``full``,
  ``nested``, ``offload``).

  Example::

    policy = checkpoint_policy("full", ["attn_out"], None)
    assert policy.save_block_internals == ("attn_out",)

  Raises:
    ValueError, TypeError: stacktools' own, for a --remat it does not accept.
  """
  remat = alias(remat)
  if remat == "auto":
    return remat
  if ":" in remat:
    return st.per_depth(remat)
  policy = st.CheckpointPolicy.from_remat(remat)
  if save_names is None:
    save_names = list(model_config.KEPT_MATMUL_OUTPUTS) if remat in SAVES_NAMES else []
  if save_names:
    policy = dataclasses.replace(policy, save_block_internals=tuple(save_names))
  if nested_outer is not None:
    policy = dataclasses.replace(policy, nested=nested_outer)
  return policy


def remat_text(remat: Remat) -> str:
  """A remat value as the log shows it: an alias (with the names it keeps),
  or per_depth(...).

  Example::

    assert remat_text(checkpoint_policy("full", ["attn_out"], None)) == (
        "full, save_names=attn_out")
  """
  if not isinstance(remat, st.CheckpointPolicy):
    return f"per_depth({remat})"
  names = remat.save_block_internals
  if isinstance(names, bool) or not names:
    return str(remat)
  return f"{dataclasses.replace(remat, save_block_internals=False)}, save_names={','.join(names)}"


def check_remat_flags(remat: str, memory_budget: Optional[str],
                      remat_candidates: Optional[Sequence[str]]) -> None:
  """Checks --remat, --memory_budget and --remat_candidates together.

  The flag combinations are this binary's; the policy itself is read by
  stacktools, which says what is wrong with it. What needs the depth (the
  per-depth counts, the nested outer size) is checked when train.py traces
  the model.

  Raises:
    ValueError: one line, naming the flags.
  """
  given, remat = remat, alias(remat)
  if remat == "auto":
    if memory_budget is None:
      raise ValueError(
          "--remat=auto needs --memory_budget (e.g. --memory_budget=48MiB): the "
          "plan is the fastest within that much compiled temp memory.")
    check_memory_budget(memory_budget)
    for candidate in remat_candidates or ():
      if "," in candidate and not all(":" in part for part in candidate.split(",")):
        raise ValueError(
            f"--remat_candidates: {candidate!r} is not one candidate: separate "
            f"candidates with spaces (--remat_candidates="
            f"{' '.join(p for p in candidate.split(',') if p)!r}); a comma belongs "
            "only inside a per-depth candidate, e.g. none:2,full:2.")
    return
  if memory_budget is not None or remat_candidates is not None:
    raise ValueError("--memory_budget and --remat_candidates need --remat=auto.")
  if ":" not in remat and remat not in st.CheckpointPolicy.ALIASES:
    # stacktools' own list names Python values (False, None, a
    # CheckpointPolicy) that no command line can give.
    raise ValueError(f"--remat={given!r} is not a checkpoint policy: pass {ACCEPTED}.")
  try:
    checkpoint_policy(remat, None, None)
  except (TypeError, ValueError) as e:
    raise ValueError(f"--remat: {e}") from None


def check_memory_budget(memory_budget: str) -> None:
  """Refuses a --memory_budget that is not a size, as the command line is
  parsed: st.plan_remat would say so only after the corpus and the
  parameters are loaded.

  Raises:
    ValueError: one line naming the flag and the sizes it takes.
  """
  match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", memory_budget)
  if not match or match.group(2).lower() not in _UNITS or (
      float(match.group(1)) * _UNITS[match.group(2).lower()] < 1):
    raise ValueError(
        f"--memory_budget={memory_budget!r} is not a size: pass bytes, or a number "
        "with a unit, e.g. 48MiB or 1.5GB (units: B, KB, MB, GB, KiB, MiB, GiB).")


def check_save_names(save_names: Optional[Sequence[str]], remat: str) -> None:
  """Checks that --save_names goes with a --remat that recomputes one policy.

  Raises:
    ValueError: one line, saying why this --remat keeps no names.
  """
  remat = alias(remat)
  if not save_names or remat in SAVES_NAMES:
    return
  if remat == "auto":
    why = ("--remat=auto chooses what to keep itself; to have it weigh keeping a "
           "name, give it the candidate save:<name>, e.g. "
           "--remat_candidates='full save:mlp_hidden'")
  elif ":" in remat:
    why = ("a per-depth --remat gives each segment an alias, which keeps no "
           "names; use one policy (e.g. --remat=full) to keep names")
  else:
    why = "none and save_all keep everything already"
  raise ValueError(f"--save_names needs --remat full, nested or offload ({why}).")


def check_unrolled_stack(stack: str, remat: str, nested_outer: Optional[int],
                         unroll: int) -> None:
  """Refuses what would do nothing with --stack=unrolled.

  ``st.BlockSeq`` is a Python loop: no scan to unroll, nor to split in two
  levels (``nested`` would act as ``full``).

  Raises:
    ValueError: one line naming the flags.
  """
  if stack != "unrolled":
    return
  named = alias(remat)   # the message quotes the flag as given
  aliases = [p.split(":")[0] for p in named.split(",")] if ":" in named else [named]
  if "nested" in aliases:
    outer = " and --nested_outer" if nested_outer is not None else ""
    raise ValueError(
        f"--remat={remat}{outer}: nested splits a scan into two levels, and "
        "--stack=unrolled (st.BlockSeq, a Python loop) has no scan, so it would act "
        "as full: write full in its place, or pass --stack=scan.")
  if unroll != 1:
    raise ValueError(
        f"--unroll={unroll} sets the layers per rolled iteration of "
        "--stack=scan's loop; --stack=unrolled (st.BlockSeq, a Python loop) runs "
        "every layer unrolled already: drop --unroll, or pass --stack=scan.")


def plan(train_step: Callable[..., Any], params: Any, opt_state: Any, batch: jax.Array,
         *, budget: str, candidates: Optional[Sequence[str]], workdir: str,
         is_chief: bool) -> Remat:
  """--remat=auto: the plan chosen within --memory_budget, logged and saved.

  Every candidate is predicted from one trace of the train step; a few are
  compiled and two timed (see st.plan_remat). The plan is remembered in the
  workdir, so a --resume or a rerun with the same flags reuses it after one
  trace. The report and the chosen plan go to the log and to remat_plan.json
  in the workdir (written by the chief).

  Args:
    train_step: ``(params, opt_state, tokens) -> ...``, whose model's stack
      has ``remat="auto"``.
    params: the parameters, donated as the step that trains donates them.
    opt_state: the optimizer state, the same.
    batch: a batch of the run's shape and sharding.
    budget: --memory_budget: the train step's most compiled temp memory.
    candidates: --remat_candidates, or None for the planner's own.
    workdir: where the plan is remembered and its report written.
    is_chief: whether this process writes the report.

  Returns:
    The chosen remat, to stand in the model's config for "auto".

  Raises:
    ValueError: one line naming the flag, for a budget no candidate meets
      or candidates the planner does not know.
  """
  logging.info("Planning --remat=auto within --memory_budget=%s.", budget)
  try:
    # Donated as the step that trains donates them: the budget is that
    # step's temp memory.
    remat_plan = st.plan_remat(train_step, params, opt_state, batch, budget=budget,
                               only=candidates, cache_dir=workdir, donate_argnums=(0, 1))
  except ValueError as e:
    # What the planner says of only= is about the labels, --remat_candidates;
    # the rest is about the budget.
    flag = (f"--remat_candidates={' '.join(candidates)!r}"
            if "only=" in str(e) else f"--memory_budget={budget}")
    raise ValueError(f"{flag}: {e}") from None
  # In a run of several processes, plan_remat gives each process 0's choice.
  ((key, label),) = remat_plan.labels.items()   # the model has one stack
  chosen = remat_plan.report.remats[key][label]
  _log_plan(remat_plan)
  logging.info("Remat plan: %s (%s=%s).", remat_text(chosen), key, label)
  if is_chief:
    os.makedirs(workdir, exist_ok=True)
    text = json.dumps(remat_plan.to_json(), indent=1, default=str)
    files.atomic_write(os.path.join(workdir, "remat_plan.json"),
                       lambda f: f.write(text), mode="w")
  return chosen


def _log_plan(remat_plan: Any) -> None:
  """Logs how the plan was made: reused from the workdir, or the report."""
  report = remat_plan.report
  if remat_plan.reused:
    logging.info("Remat plan reused from %s in %.2f s (planned earlier in %.1f s with "
                 "%d compiles).", remat_plan.cache_path, remat_plan.seconds, report.seconds,
                 report.compiles)
  else:
    logging.info("%s", report)
    logging.info("Planning took %.1f s for %d candidates, %d compiled (compiling and "
                 "timing: %.1f s).", remat_plan.seconds, len(report.rows),
                 report.compiles, report.compile_seconds)
