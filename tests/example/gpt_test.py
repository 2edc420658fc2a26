"""Tests for the GPT example (examples/gpt): training, resume, decoding, CLI.

Training runs go through ``train.train(config, workdir)`` in-process, batched
into two driver subprocesses (``gpt_driver.drive``), which start
with this module's other subprocesses in the background when the tests are
collected (``tests/helpers/background.py``, ``BACKGROUND``: this module runs last,
its subprocesses at the lowest priority, on the CPU the other tests leave
idle). One interpreter then pays the JAX import for many
runs, the two drivers use both cores, and the drivers compile with XLA's
cheap settings (``gpt_driver.xla_env``, which changes how fast the code is
compiled, not what it computes) and the run's persistent compilation cache,
without touching the pytest process. The drivers also report whether
``import stacktools`` imported TensorFlow or Orbax, and whether the runs
imported TensorFlow.

What is checked, against numbers rather than "it runs":

* every ``--remat`` value trains, under fold or scan blocks, its loss falls,
  and it matches ``--remat=none`` under the same blocks (a policy changes
  memory, not math: under both blocks, tests/library/loops_test.py); scan
  blocks log per-layer stats of length ``num_layers``, fold blocks none;
* ``--stack=scan`` (Stacked) and ``--stack=unrolled`` (BlockSeq) give the same
  losses from the same seed;
* ``--save_names`` puts its names in the policy, which then saves those
  activations for the backward pass (``saved_residuals``), and trains;
* 10 steps + ``--resume`` 10 steps is bitwise equal to 20 steps, through
  Orbax checkpoints (checkpoint_test.py adds a kill -9 during a save, and
  distributed_test.py other meshes and two processes);
* KV-cache decoding equals the full forward pass (in this process);
* bad flags, missing, unfinished, corrupt or mismatched checkpoints, a fresh
  start in a workdir with checkpoints: a one-line message, a non-zero exit,
  no traceback, nothing written (command lines, most of them one after
  another in shared interpreters: ``gpt_driver.drive_cli``);
* a --workdir that is a file, lies under one or cannot be written, and a
  --resume on a corpus with other characters, stop at start-up, before the
  data is loaded or the step compiled;
* outputs get the umask's mode, and a start removes the temporary files that
  killed writes left (the ``files`` module itself: gpt_files_test.py);
* ``sample.py`` end to end (its command line in a shared interpreter, as it
  would run alone; gpt_dtype_test.py runs it as a command of its own).
"""

import json
import math
import os
import re
import shutil
import sys
import traceback

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.gpt import attention
from examples.gpt import decoding
from examples.gpt import model as model_lib
from examples.gpt import model_config
from examples.gpt import remat as remat_lib
import background
import gpt_driver
import stacktools as st
from subprocesses import TIMEOUT, Command, deadline, wait

try:  # Public in some JAX versions; only in jax._src in jax 0.10.
  from jax.ad_checkpoint import saved_residuals
except ImportError:
  from jax._src.ad_checkpoint import saved_residuals

TRAIN, SAMPLE = gpt_driver.TRAIN, gpt_driver.SAMPLE
NUM_LAYERS, STEPS, TINY = gpt_driver.NUM_LAYERS, gpt_driver.STEPS, gpt_driver.TINY
WORKDIR_FILES = gpt_driver.WORKDIR_FILES
REMATS = ("none", "full", "nested", "offload", "save_all")
BLOCKS = ("fold", "scan")
# The (remat, block) runs: every --remat value once, and "none" under each
# block as the reference of that block's others. Every policy against no
# remat, under both blocks, is the library's test (tests/library/loops_test.py);
# here each flag value need only train through train.py to none's losses.
# "full-fold" is also the unrolled and save_names runs' reference and the
# checkpoint that Resumes copies, "nested-scan" the one that sample.py
# samples, "none-scan" run A of the resume test.
REMAT_RUNS = (("none", "fold"), ("full", "fold"), ("save_all", "fold"),
              ("none", "scan"), ("nested", "scan"), ("offload", "scan"))
# Left as if by writes killed mid-way, in this run's workdir before it starts.
STALE_RUN = "save_names"
STALE_TEMP_FILES = (".loss.png.0123abcd.tmp", ".metrics.jsonl.89abcdef.tmp")
as_args, listing, assert_only_outputs = (gpt_driver.as_args, gpt_driver.listing,
                                         gpt_driver.assert_only_outputs)
read_metrics, train_losses = gpt_driver.read_metrics, gpt_driver.train_losses
load_checkpoint, load_meta = gpt_driver.load_checkpoint, gpt_driver.load_meta


def _run_name(remat: str, block: str) -> str:
  return f"{remat}-{block}"


def _driver_specs(tmp: str, data_path: str) -> list[list[dict]]:
  """The training runs, split over two drivers; resume runs share a driver."""

  def spec(name, **flags):
    return {"name": name, "flags": {**TINY, "data_path": data_path,
                                    "workdir": os.path.join(tmp, name), **flags}}

  fold, scan = ([spec(_run_name(r, b), remat=r, block=b) for r, b in REMAT_RUNS if b == block]
                for block in BLOCKS)
  fold.append(spec("unrolled", remat="full", block="fold", stack="unrolled",
                   sample_tokens=8, sample_prompt="the "))
  fold.append(spec("save_names", remat="full", block="fold",
                   save_names=["attn_out", "mlp_hidden"]))
  fold.append(spec("per_depth", remat="none:1,full:1", block="fold"))
  # Two candidates keep the planning short; the planner itself is tested in
  # remat_plan_test.py and remat_model_test.py with every kind of candidate.
  # Stopped and resumed: the resumed run reuses the plan from the workdir.
  auto = dict(remat="auto", block="fold", memory_budget="64MiB",
              remat_candidates=["full", "none:1,full:1"])
  fold.append(spec("auto", stop_after=10, **auto))
  fold.append(spec("auto", resume=True, **auto))
  # Run A of the resume test is "none-scan": 20 steps straight. (Resuming
  # under the default --remat=full: checkpoint_test.py.)
  scan.append(spec("resume", remat="none", block="scan", stop_after=10))
  scan.append(spec("resume", remat="none", block="scan", resume=True))
  return [fold, scan]


class Drivers:
  """The driver subprocesses, started at once; ``result`` waits for them."""

  def __init__(self, tmp: str, data_path: str):
    self.tmp = tmp
    self.data_path = data_path
    os.makedirs(self.workdir(STALE_RUN))
    for name in STALE_TEMP_FILES:
      with open(os.path.join(self.workdir(STALE_RUN), name), "wb") as f:
        f.write(b"half a file")
    self.procs = [gpt_driver.start_driver(tmp, str(i), specs, gpt_driver.xla_env(),
                                          plot=True, check_imports=True)
                  for i, specs in enumerate(_driver_specs(tmp, data_path))]
    self._result = None

  def result(self) -> dict:
    """``{"runs": {name: [runs of that name, in order]}, "tf": [(bool, bool)]}``."""
    if self._result is None:
      runs, tf = {}, []
      for proc, out_path in self.procs:
        wait(proc)
        with open(out_path, encoding="utf-8") as f:
          out = json.load(f)
        for run in out["runs"]:
          runs.setdefault(run["name"], []).append(run)
        tf.append((out["tf_after_import"], out["tf_after_runs"]))
      self._result = {"runs": runs, "tf": tf}
    return self._result

  def run(self, name: str, index: int = -1) -> dict:
    """The named run's log, after checking that it raised nothing."""
    run = self.result()["runs"][name][index]
    assert run["error"] is None, f"run {name} failed:\n{run['error']}"
    assert run["exit"] is None, f"run {name} exited: {run['exit']}"
    return run

  def workdir(self, name: str) -> str:
    return os.path.join(self.tmp, name)

  def finish(self) -> None:
    left = deadline()   # all of them within the one limit
    for proc, _ in self.procs:
      proc.wait(timeout=left())

  def close(self) -> None:
    for proc, _ in self.procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      proc.log.close()


def compiled_temp_mib(log: str) -> float:
  marker = "compiled temp memory "
  assert marker in log, log
  return float(log.split(marker, 1)[1].split(" MiB", 1)[0])


def command(tmp: str, label: str, script: str, *args: str) -> Command:
  """``python script args``, a command of its own, started now; its stdout
  and stderr go to files in ``tmp`` named after ``label``."""
  return Command([sys.executable, script, *args], gpt_driver.xla_env(),
                 os.path.join(tmp, label))


def can_create_file_in(folder: str) -> bool:
  try:
    fd = os.open(os.path.join(folder, "probe"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
  except OSError:
    return False
  os.close(fd)
  os.remove(os.path.join(folder, "probe"))
  return True


def remat_candidates_example() -> str:
  """The example in --remat_candidates' help."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from examples.gpt import flags as train_flags  # pylint: disable=g-import-not-at-top,unused-import
  return flags.FLAGS["remat_candidates"].help.split("e.g. '", 1)[1].split("'", 1)[0]


def write_garbage_checkpoint(workdir: str) -> None:
  """A "committed" step folder of garbage: ``checkpoints/7/meta/metadata``."""
  meta = os.path.join(workdir, "checkpoints", "7", "meta")
  os.makedirs(meta)
  with open(os.path.join(meta, "metadata"), "wb") as f:
    f.write(b"this is not a checkpoint\x00\xff" * 40)


# Bad-flag cases run as commands of their own (see the bad-flag test).
BAD_FLAGS_ALONE = {"garbage", "sample_no_workdir"}


def bad_flag_cases(tmp: str, empty: str, sample_garbage: str):
  """The bad-flag test's cases and their files, in ``tmp``: ``(cases,
  garbage, unfinished)``; each case ``(name, script, flags with --workdir,
  fragments)``. sample.py's workdirs ``empty`` (no checkpoint) and
  ``sample_garbage`` are the start-up sample.py runner's."""
  os.makedirs(tmp)
  short = os.path.join(tmp, "short.txt")
  with open(short, "w", encoding="utf-8") as f:
    f.write("the cat sat on the mat.\n" * 4)
  garbage = os.path.join(tmp, "garbage")  # a "committed" step folder of garbage
  write_garbage_checkpoint(garbage)
  unfinished = os.path.join(tmp, "unfinished")  # only a save that never committed
  os.makedirs(os.path.join(unfinished, "checkpoints", "10.orbax-checkpoint-tmp", "params"))

  # (name, script, flags, fragments the message must contain)
  cases = [
      ("remat", TRAIN, {"remat": "bogus"},
       ["--remat", *REMATS]),
      ("block", TRAIN, {"block": "bogus"}, ["--block", "fold", "scan"]),
      ("stack", TRAIN, {"stack": "bogus"}, ["--stack", "scan", "unrolled"]),
      ("heads", TRAIN, {"d_model": 15, "num_heads": 2},
       ["--d_model", "divisible", "--num_heads"]),
      ("layers", TRAIN, {"num_layers": 0}, ["--num_layers", "positive"]),
      ("batch", TRAIN, {"batch_size": 0}, ["--batch_size", "positive"]),
      ("no_data", TRAIN, {"data_path": os.path.join(tmp, "missing.txt")},
       ["--data_path", "missing.txt", "does not exist"]),
      ("short_data", TRAIN, {"data_path": short},
       ["--data_path", "fewer than one batch"]),
      ("save_names", TRAIN, {"save_names": "attn_out,bogus"},
       ["--save_names", ", ".join(model_config.CHECKPOINT_NAMES)]),
      ("save_names_none", TRAIN, {"save_names": "attn_out", "remat": "none"},
       ["--save_names", "--remat"]),
      ("stop_after", TRAIN, {"stop_after": STEPS + 1}, ["--stop_after", "--steps"]),
      ("no_ckpt", TRAIN, {"resume": True}, ["error: --resume: No checkpoint"]),
      ("garbage", TRAIN, {"resume": True, "workdir": garbage},
       ["error: --resume:", "checkpoints/7 is not a readable checkpoint"]),
      ("unfinished", TRAIN, {"resume": True, "workdir": unfinished},
       ["error: --resume: No checkpoint in", "unfinished/checkpoints"]),
      ("fresh_over_checkpoints", TRAIN, {"workdir": garbage},
       ["error: --workdir=", "holds the checkpoints of an earlier run (steps 7)",
        "pass --resume", "new --workdir"]),
      ("sample_no_workdir", SAMPLE, {},
       ["error: --workdir=", "does not exist", "train first with python examples/gpt/train.py"]),
      ("sample_no_ckpt", SAMPLE, {"workdir": empty},
       ["error: No checkpoint", "Train first with python examples/gpt/train.py --workdir="]),
      ("nested_outer", TRAIN, {"remat": "nested", "nested_outer": 7, "num_layers": 2},
       ["error: Stacked: CheckpointPolicy(nested=7)", "only 2 steps", "between 1 and 2"]),
      ("per_depth_count", TRAIN, {"remat": "none:1,full:2", "num_layers": 2},
       ["error: Stacked: st.per_depth(none:1,full:2) covers 3 layers",
        "the stack has 2"]),
      ("per_depth_alias", TRAIN, {"remat": "none:1,bogus:1"},
       ["--remat:", "remat='bogus' is not a checkpoint policy"]),
      ("per_depth_separator", TRAIN, {"remat": "none:1;full:1"},
       ["--remat:", "segments are separated by commas, not ';': write 'none:1,full:1'"]),
      ("auto_no_budget", TRAIN, {"remat": "auto"},
       ["--remat=auto needs --memory_budget"]),
      ("candidates_commas", TRAIN,
       {"remat": "auto", "memory_budget": "24MiB", "remat_candidates": "full,nested"},
       ["--remat_candidates: 'full,nested' is not one candidate",
        "--remat_candidates='full nested'"]),
      ("save_names_auto", TRAIN,
       {"save_names": "attn_out", "remat": "auto", "memory_budget": "24MiB"},
       ["--save_names needs --remat full, nested or offload (--remat=auto chooses",
        "--remat_candidates='full save:mlp_hidden'"]),
      ("save_names_per_depth", TRAIN, {"save_names": "attn_out", "remat": "none:1,full:1"},
       ["--save_names needs", "(a per-depth --remat gives each segment an alias"]),
      ("window_no_pattern", TRAIN, {"window": 16},
       ["window=16, pattern=:", "--window is the span of the L layers of --pattern"]),
      ("warmup", TRAIN, {"warmup_steps": 100, "steps": 4},
       ["warmup_steps=100, steps=4:", "--warmup_steps must be less than --steps"]),
      ("pattern_kind_without_layers", TRAIN,
       {"pattern": "LLLLLG", "num_layers": 4, "window": 8},
       ["error: Stacked: num_layers=4 ends before the first 'global' layer",
        "the kind 'global' has 0 layers", "num_layers >= 6"]),
      ("budget_no_auto", TRAIN, {"memory_budget": "8MiB"},
       ["--memory_budget and --remat_candidates need --remat=auto"]),
      ("sample_garbage", SAMPLE, {"workdir": sample_garbage},
       ["error:", "not a readable checkpoint"]),
  ]
  cases = [(name, script, {"workdir": os.path.join(tmp, "work", name), **flags}, fragments)
           for name, script, flags, fragments in cases]
  return cases, garbage, unfinished


class StartUp:
  """train.py's command lines of the start-up tests below (a workdir that is
  a file, lies under one or cannot be written; an unmeetable memory budget;
  --remat_candidates), run one after another in one interpreter
  (``gpt_driver.drive_cli``) as each would run alone, beside the training
  drivers; and sample.py's start-up errors in another. The bad-flag test
  runs train.py and sample.py as commands of their own too."""

  def __init__(self, tmp: str, data_path: str):
    self.tmp = tmp
    specs = {}
    # A --workdir that is a file or lies under one; --data_path names a
    # missing file (see test_unusable_workdir_stops_at_start_up).
    self.unusable = os.path.join(tmp, "unusable")
    os.makedirs(self.unusable)
    self.a_file = os.path.join(self.unusable, "a_file")
    with open(self.a_file, "w", encoding="utf-8") as f:
      f.write("not a folder\n")
    self.missing_data = {**TINY, "data_path": os.path.join(tmp, "missing.txt")}
    for case, workdir in (("is_file", self.a_file),
                          ("under_file", os.path.join(self.a_file, "sub"))):
      specs[case] = as_args({**self.missing_data, "workdir": workdir})
    # A folder nobody can create files in: mode 0o555, or, for root (whom
    # modes do not stop), a sysfs folder; None if neither works.
    self.read_only_made = os.path.join(tmp, "read_only")
    os.makedirs(self.read_only_made)
    os.chmod(self.read_only_made, 0o555)
    if not can_create_file_in(self.read_only_made):
      self.read_only = self.read_only_made
    elif os.path.isdir("/sys/kernel") and not can_create_file_in("/sys/kernel"):
      self.read_only = "/sys/kernel"
    else:
      self.read_only = None
    if self.read_only is not None:
      self.read_only_before = listing(self.read_only)
      specs["read_only"] = as_args({**self.missing_data, "workdir": self.read_only})
      specs["read_only_new"] = as_args({**self.missing_data,
                                        "workdir": os.path.join(self.read_only, "new")})
    # An unmeetable memory budget.
    specs["budget"] = as_args({**TINY, "data_path": data_path,
                               "workdir": os.path.join(tmp, "budget"), "remat": "auto",
                               "memory_budget": "1KiB", "remat_candidates": ["full"]})
    # --remat_candidates: its help's example, and labels that name no candidate.
    self.example = remat_candidates_example()
    base = {**TINY, "data_path": data_path, "num_layers": 4, "steps": 2, "remat": "auto",
            "memory_budget": "24MiB"}
    for case, candidates in (("help", self.example), ("bogus", "bogus"),
                             ("one_bogus", "full bogus")):
      specs["candidates", case] = as_args({**base, "workdir": self.workdir(case),
                                           "remat_candidates": candidates})
    # The bad-flag test's train.py cases but one (BAD_FLAGS_ALONE).
    self.data_path = data_path
    self.empty = os.path.join(tmp, "empty")
    os.makedirs(self.empty)
    self.garbage = os.path.join(tmp, "garbage")
    write_garbage_checkpoint(self.garbage)
    self.bad_flags = os.path.join(tmp, "bad_flags")
    self.bad_flag_cases = bad_flag_cases(self.bad_flags, self.empty, self.garbage)
    self.bad_flag_before = {}
    self.alone = {}   # name: the case's command of its own
    for name, script, flags, _ in self.bad_flag_cases[0]:
      self.bad_flag_before[name] = listing(flags["workdir"])
      if name in BAD_FLAGS_ALONE:
        args = as_args({**TINY, "data_path": data_path, **flags}) if script == TRAIN \
            else as_args(flags)
        self.alone[name] = command(tmp, f"alone_{name}", script, *args)
      elif script == TRAIN:
        specs["bad_flags", name] = as_args({**TINY, "data_path": data_path, **flags})
    self.runs = gpt_driver.CliRuns(tmp, "start_up", specs, gpt_driver.xla_env())
    # sample.py's start-up errors of the bad-flag test (a workdir without a
    # checkpoint, one with a garbage one) and of the unusable-workdir test,
    # in a sample.py runner of their own; before: each workdir's listing.
    sample_workdirs = {"no_ckpt": self.empty, "garbage": self.garbage,
                       "is_file": self.a_file, "under_file": os.path.join(self.a_file, "sub")}
    self.sample_before = {case: listing(sample_workdirs[case]) for case in ("no_ckpt",
                                                                            "garbage")}
    self.sample_runs = gpt_driver.CliRuns(
        tmp, "start_up_sample",
        {case: as_args({"workdir": workdir}) for case, workdir in sample_workdirs.items()},
        gpt_driver.xla_env(), script=SAMPLE)

  def workdir(self, case: str) -> str:
    return os.path.join(self.tmp, "candidates", case)

  def finish(self) -> None:
    left = deadline()   # all of them within the one limit
    for runs in (self.runs, self.sample_runs):
      runs.driver[0].wait(timeout=left())
    for command in self.alone.values():
      command.finish(timeout=left())

  def close(self) -> None:
    self.runs.close()
    self.sample_runs.close()
    for command in self.alone.values():
      command.close()
    os.chmod(self.read_only_made, 0o755)


# ---------------------------------------------------------------------------
# CLI errors: most cases ran in the start-up runners; the rest run here.


def test_bad_flags_and_checkpoints_fail_cleanly_and_write_nothing(start_up):
  # Two cases run as commands of their own: train.py on a checkpoint Orbax
  # cannot read, and sample.py without a workdir (one line on stderr, no
  # traceback, through absl's exit path of a real interpreter). train.py's
  # others ran as the same commands, one after another in the start-up
  # fixture's train.py runner (gpt_driver.drive_cli), which pays the imports
  # once; sample.py's others in its sample.py runner.
  cases, garbage, unfinished = start_up.bad_flag_cases
  from_start_up = {"sample_no_ckpt": "no_ckpt", "sample_garbage": "garbage"}
  outcomes = []
  for name, script, flags, fragments in cases:
    if name in from_start_up:
      outcomes.append((name, script, flags["workdir"], fragments,
                       start_up.sample_before[from_start_up[name]],
                       start_up.sample_runs[from_start_up[name]][::2]))
    elif name in BAD_FLAGS_ALONE:
      outcomes.append((name, script, flags["workdir"], fragments,
                       start_up.bad_flag_before[name], start_up.alone[name].result()[::2]))
    else:
      assert script == TRAIN, name
      outcomes.append((name, script, flags["workdir"], fragments,
                       start_up.bad_flag_before[name],
                       start_up.runs["bad_flags", name][::2]))
  assert len(outcomes) == len(cases)
  for name, script, workdir, fragments, before, (rc, stderr) in outcomes:
    message = gpt_driver.one_line_error(rc, stderr, fragments, name)
    if script == SAMPLE:  # a flag that sample.py does not have
      assert "--resume" not in message, f"{name}: {message!r}"
    assert listing(workdir) == before, f"{name} wrote to its workdir"
  assert not os.path.exists(os.path.join(start_up.bad_flags, "work"))
  for folder in (garbage, start_up.garbage):
    with open(os.path.join(folder, "checkpoints", "7", "meta", "metadata"), "rb") as f:
      assert f.read().startswith(b"this is not"), folder
  assert listing(os.path.join(unfinished, "checkpoints")) == {"10.orbax-checkpoint-tmp"}


def one_line(rc: int, stderr: str) -> str:
  """The only line on stderr, after checking that the run failed cleanly."""
  assert rc != 0, stderr
  assert "Traceback" not in stderr, stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1, stderr
  return lines[0]


def test_unusable_workdir_stops_at_start_up(start_up):
  """A --workdir that is a file or lies under one: one line naming --workdir.

  --data_path names a missing file, so a message about the data would mean
  the workdir was checked only after loading it (and, before the check, a
  run went on to compile and raised at its first write). train.py's cases
  ran in the start-up driver, sample.py's in the start-up sample.py runner.
  """
  a_file = start_up.a_file
  is_file = ["error: --workdir=", "a_file' is a file, not a directory"]
  under_file = ["error: --workdir=", "sub' lies under", "a_file', which is a file"]
  outcomes = []
  for case, workdir, fragments in (("is_file", a_file, is_file),
                                   ("under_file", os.path.join(a_file, "sub"), under_file)):
    for runs in (start_up.runs, start_up.sample_runs):
      rc, _, stderr = runs[case]
      outcomes.append((workdir, fragments, one_line(rc, stderr)))
  for workdir, fragments, message in outcomes:
    for fragment in fragments:
      assert fragment in message, f"{workdir}: {fragment!r} not in {message!r}"
  with open(a_file, encoding="utf-8") as f:
    assert f.read() == "not a folder\n"
  assert listing(start_up.unusable) == {"a_file"}


def test_read_only_workdir_stops_at_start_up(start_up):
  read_only_dir = start_up.read_only
  if read_only_dir is None:
    pytest.skip("running as root, and no read-only folder found to test with")
  existing, new = (one_line(*start_up.runs[case][::2]) for case in ("read_only",
                                                                    "read_only_new"))
  assert existing.startswith(f"error: --workdir={read_only_dir!r} is a directory that "
                             "cannot be written to"), existing
  assert new.startswith(f"error: --workdir={os.path.join(read_only_dir, 'new')!r} does "
                        f"not exist and cannot be created: {read_only_dir!r}"), new
  assert listing(read_only_dir) == start_up.read_only_before


def data_files(step_dir: str, item: str) -> list[str]:
  """The files of one item's array data (OCDBT's ``d/`` folders)."""
  return sorted(os.path.join(folder, name)
                for folder, _, names in os.walk(os.path.join(step_dir, item))
                if os.path.basename(folder) == "d" for name in names)


class Resumes:
  """train.py's --resume command lines on copies of the "full-fold" run's
  checkpoints (another corpus, other model flags, damaged checkpoints), run
  one after another in one interpreter (``gpt_driver.drive_cli``) as each
  would run alone, started once the training drivers are done; sample.py on
  a damaged one runs in the sample.py runner of :class:`Runs`. ``before``
  holds each workdir's ``sorted(os.walk(...))`` from before the runs."""

  def __init__(self, tmp: str, drivers: Drivers):
    name = _run_name("full", "fold")
    drivers.run(name)
    self.source = os.path.join(drivers.workdir(name), "checkpoints")
    self.workdirs = {}
    flags = {**TINY, "data_path": drivers.data_path, "remat": "full", "block": "fold",
             "resume": True}
    specs = {}
    # As many characters as the checkpoint's, but '!' for '.'.
    self.other_corpus = self.copy(tmp, "corpus")
    other = os.path.join(tmp, "other.txt")
    with open(drivers.data_path, encoding="utf-8") as f:
      text = f.read().replace(".", "!")
    with open(other, "w", encoding="utf-8") as f:
      f.write(text)
    specs["corpus"] = as_args({**flags, "data_path": other, "workdir": self.other_corpus})
    # Other model flags (see test_resume_refuses_other_model_flags).
    self.model_cases = {"heads": ({"num_heads": 4},
                                  "--num_heads=2, but this run has --num_heads=4"),
                        "pattern": ({"pattern": "LG", "window": 8},
                                    "--pattern='', but this run has --pattern=LG")}
    for case, (extra, _) in self.model_cases.items():
      workdir = self.copy(tmp, case)
      specs[case] = as_args({**TINY, "data_path": drivers.data_path, "remat": "full",
                             "resume": True, "workdir": workdir, **extra})
    # Damaged (see test_damaged_real_checkpoints_fail_cleanly).
    for case in ("truncated", "flipped", "missing", "other_model"):
      self.copy(tmp, case)
    step_dir = lambda case: os.path.join(self.workdirs[case], "checkpoints", str(STEPS))
    for path in data_files(step_dir("truncated"), "params"):
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    for path in data_files(step_dir("flipped"), "params"):
      with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)
    shutil.rmtree(os.path.join(step_dir("missing"), "opt_state"))
    for case in ("truncated", "flipped", "missing"):
      specs[case] = as_args({**flags, "workdir": self.workdirs[case]})
    specs["other_model"] = as_args({**flags, "workdir": self.workdirs["other_model"],
                                    "num_layers": NUM_LAYERS + 1})
    self.before = {case: sorted(os.walk(workdir)) for case, workdir in self.workdirs.items()}
    self.runs = gpt_driver.CliRuns(tmp, "resumes", specs, gpt_driver.xla_env())
    self.samples = None   # Runs' sample.py runner, which runs "flipped" too

  def copy(self, tmp: str, case: str) -> str:
    """A workdir for ``case`` holding a copy of the checkpoints."""
    workdir = self.workdirs[case] = os.path.join(tmp, case)
    shutil.copytree(self.source, os.path.join(workdir, "checkpoints"))
    return workdir

  def finish(self) -> None:
    self.runs.driver[0].wait(timeout=TIMEOUT)

  def close(self) -> None:
    self.runs.close()


class Runs:
  """Every subprocess of this module, started in the background when the
  tests are collected (``BACKGROUND``): the training drivers and the
  start-up command lines at once; once the drivers are done, the resumes of
  their checkpoints, and in one sample.py runner (``gpt_driver.drive_cli``)
  sample.py end to end on one of them and on a damaged copy (``samples``:
  "end to end" and "flipped")."""

  def __init__(self, tmp: str):
    self.tmp = tmp
    os.makedirs(os.path.join(tmp, "data"))
    corpus = gpt_driver.write_corpus(os.path.join(tmp, "data", "text.txt"))
    self.drivers = self.start_up = self.resumes = self.samples = None
    self.resumes_error = None
    self.drivers = Drivers(os.path.join(tmp, "runs"), corpus)
    self.start_up = StartUp(self.folder("start_up"), corpus)

  def folder(self, name: str) -> str:
    path = os.path.join(self.tmp, name)
    os.makedirs(path)
    return path

  def finish(self) -> None:
    self.drivers.finish()
    try:
      self.resumes = Resumes(self.folder("resumes"), self.drivers)
    except Exception:  # pylint: disable=broad-except
      self.resumes_error = traceback.format_exc()   # for the tests that need it
    workdir = self.drivers.workdir(_run_name("nested", "scan"))
    specs = {"end to end": [f"--workdir={workdir}", "--prompt=the ", "--num_tokens=20"]}
    if self.resumes is not None:
      specs["flipped"] = [f"--workdir={self.resumes.workdirs['flipped']}", "--prompt=the "]
    self.samples = gpt_driver.CliRuns(self.tmp, "samples", specs, gpt_driver.xla_env(),
                                      script=SAMPLE)
    if self.resumes is not None:
      self.resumes.samples = self.samples
    self.start_up.finish()
    if self.resumes is not None:
      self.resumes.finish()
    self.samples.driver[0].wait(timeout=TIMEOUT)

  def close(self) -> None:
    for part in (self.drivers, self.start_up, self.resumes, self.samples):
      if part is not None:
        part.close()


def start_runs(folder) -> Runs:
  return Runs(str(folder))


BACKGROUND = {"runs": start_runs}


@pytest.fixture(scope="module")
def runs():
  """Every subprocess of this module, finished."""
  r = background.task_result(start_runs)
  yield r
  r.close()


@pytest.fixture(scope="module")
def drivers(runs):
  return runs.drivers


@pytest.fixture(scope="module")
def start_up(runs):
  return runs.start_up


@pytest.fixture(scope="module")
def resumes(runs):
  if runs.resumes_error is not None:
    pytest.fail(f"the resumes could not start:\n{runs.resumes_error}")
  return runs.resumes


def test_resume_refuses_a_corpus_with_other_characters(resumes):
  """As many characters as the checkpoint's, but '!' for '.': before the check,
  every id from '!' on silently stood for another character, and it trained."""
  message = one_line(*resumes.runs["corpus"][::2])
  for fragment in ("error: --resume:", "1 ('!') only in the corpus",
                   "1 ('.') only in the checkpoint", "--data_path", "new --workdir"):
    assert fragment in message, f"{fragment!r} not in {message!r}"
  assert listing(resumes.other_corpus) == {"checkpoints"}
  assert sorted(os.walk(resumes.other_corpus)) == resumes.before["corpus"]


def test_resume_refuses_other_model_flags(resumes):
  """--num_heads leaves every parameter's shape as it was: before the check
  of MODEL_FLAGS, a resume with another --num_heads trained on as another
  model. A flag whose change the shapes show (--pattern) is named too."""
  for case, (_, fragment) in resumes.model_cases.items():
    workdir = resumes.workdirs[case]
    message = one_line(*resumes.runs[case][::2])
    for part in (f"error: --resume: the checkpoint in {workdir!r} was trained with",
                 fragment, "--num_layers, --num_heads, --d_model, --seq_len, --pattern, "
                 "--window, --stack, --bias must be the checkpoint's", "new --workdir"):
      assert part in message, f"{part!r} not in {message!r}"
    assert sorted(os.walk(workdir)) == resumes.before[case]


def test_remat_candidates_help_example_plans_among_all_of_them(start_up):
  """The example in --remat_candidates' help, as a shell passes it: once, its
  per-depth candidate was split at its comma into two labels that were
  dropped without a word, and it planned among 3. A label that names no
  candidate stops the run, named after --remat_candidates."""
  example = remat_candidates_example()
  assert example == start_up.example == "full nested save:mlp_hidden none:2,full:2"
  code, _, stderr = start_up.runs["candidates", "help"]
  assert code == 0, stderr
  assert "remat report: 4 candidate plans" in stderr, stderr
  with open(os.path.join(start_up.workdir("help"), "remat_plan.json"),
            encoding="utf-8") as f:
    rows = json.load(f)["report"]["rows"]
  assert sorted(label for r in rows for label in r["plan"].values()) == sorted(
      example.split())
  expected = {"bogus": ["error: --remat_candidates='bogus': st.plan_remat: "
                        "only=['bogus'] keeps no candidate"],
              "one_bogus": ["error: --remat_candidates='full bogus': st.plan_remat: "
                            "only=['full', 'bogus'] names 'bogus', which is no candidate",
                            "'save:mlp_hidden'", "'none:2,full:2'"]}
  for case, fragments in expected.items():
    code, _, stderr = start_up.runs["candidates", case]
    # Progress is logged up to the planning; then one line, no traceback.
    errors = [line for line in stderr.splitlines() if not line.startswith(("I", "W"))]
    assert code != 0 and len(errors) == 1, stderr
    for fragment in fragments:
      assert fragment in errors[0], f"{case}: {fragment!r} not in {errors[0]!r}"
    assert not os.path.exists(start_up.workdir(case)), case


def test_outputs_get_the_umask_mode(drivers):
  """Not 0o600, as tempfile.mkstemp would leave them; Orbax's checkpoint
  files and folders too."""
  umask = os.umask(0)
  os.umask(umask)
  name = _run_name("full", "fold")
  drivers.run(name)
  workdir = drivers.workdir(name)
  seen = 0
  for folder, folders, file_names in os.walk(workdir):
    for entry, expected in ([(n, 0o777) for n in folders] + [(n, 0o666) for n in file_names]):
      path = os.path.join(folder, entry)
      mode = os.stat(path).st_mode & 0o777
      assert mode == expected & ~umask, f"{path}: {oct(mode)} with umask {oct(umask)}"
      seen += 1
  assert seen > 10  # checkpoints/<step>/{params,opt_state,meta}/...


def test_start_removes_stale_temp_files(drivers):
  log = drivers.run(STALE_RUN)["log"]
  assert (f"Removed 2 stale temporary file(s) of an interrupted write from "
          f"{drivers.workdir(STALE_RUN)}: {', '.join(sorted(STALE_TEMP_FILES))}") in log
  assert_only_outputs(drivers.workdir(STALE_RUN))


def test_damaged_real_checkpoints_fail_cleanly(resumes):
  """A real checkpoint with its parameter data cut short or one byte flipped,
  with its optimizer state missing, or resumed with other model flags."""
  unreadable = ["error: --resume:", f"checkpoints/{STEPS} is not a readable checkpoint",
                "delete that folder"]
  cases = [  # (case, (exit status, stderr), fragments of the last line of stderr)
      ("truncated", resumes.runs["truncated"][::2], unreadable),
      ("flipped", resumes.runs["flipped"][::2], unreadable),
      ("flipped", resumes.samples["flipped"][::2], ["error:", "not a readable checkpoint"]),
      ("missing", resumes.runs["missing"][::2], unreadable + ["opt_state"]),
      ("other_model", resumes.runs["other_model"][::2],
       # Named from the checkpoint's config, before its arrays are read (the
       # arrays' own check: gpt_linear_test.py).
       ["error: --resume:", f"was trained with --num_layers={NUM_LAYERS}, but this "
        f"run has --num_layers={NUM_LAYERS + 1}", "must be the checkpoint's"]),
  ]
  for case, (rc, stderr), fragments in cases:
    assert rc != 0 and "Traceback" not in stderr, stderr
    # Reading the arrays comes after start-up logging; the error is the last line.
    last = stderr.strip().splitlines()[-1]
    for fragment in fragments:
      assert fragment in last, f"{case}: {fragment!r} not in {last!r}"
  for case in ("truncated", "flipped", "missing", "other_model"):  # left as they were
    assert sorted(os.walk(resumes.workdirs[case])) == resumes.before[case], case


# ---------------------------------------------------------------------------
# Training runs (in the drivers).


@pytest.mark.parametrize("remat, block", REMAT_RUNS)
def test_every_remat_and_block_trains(drivers, remat, block):
  name = _run_name(remat, block)
  drivers.run(name)
  workdir = drivers.workdir(name)
  records = read_metrics(workdir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  losses = np.array([r["train_loss"] for r in records])
  assert np.all(np.isfinite(losses))
  assert losses[-3:].mean() < losses[:3].mean() - 0.3, losses
  vocab_size = len(load_meta(workdir)["chars"])
  assert records[-1]["valid_loss"] < math.log(vocab_size), records[-1]
  # A policy changes what is kept, not the numbers.
  np.testing.assert_allclose(losses, train_losses(drivers.workdir(_run_name("none", block))),
                             rtol=1e-4)
  for r in records:
    if block == "scan":
      for stat in ("attn_entropy", "update_ratio"):
        assert len(r[stat]) == NUM_LAYERS and all(map(math.isfinite, r[stat])), r
    else:
      assert "attn_entropy" not in r and "update_ratio" not in r
  assert_only_outputs(workdir)


def test_unmeetable_memory_budget_stops_with_one_line(start_up):
  code, _, stderr = start_up.runs["budget"]
  # Progress is logged up to the planning; then one line, no traceback.
  errors = [line for line in stderr.splitlines() if not line.startswith(("I", "W"))]
  assert code != 0 and len(errors) == 1, stderr
  assert errors[0].startswith("error: --memory_budget=1KiB: No remat plan fits "
                              "budget='1KiB'"), stderr
  assert "bytes), with plan full. Raise the budget" in errors[0]


def test_per_depth_and_auto_remat_train_like_none(drivers):
  reference = train_losses(drivers.workdir(_run_name("none", "fold")))
  for name in ("per_depth", "auto"):
    np.testing.assert_allclose(train_losses(drivers.workdir(name)), reference,
                               rtol=1e-4, err_msg=name)
  assert "remat=per_depth(none:1,full:1)" in drivers.run("per_depth")["log"]
  first, resumed = drivers.run("auto", 0)["log"], drivers.run("auto", 1)["log"]
  assert "remat report: 2 candidate plans" in first and "Remat plan:" in first, first
  planned = float(first.split("Planning took ", 1)[1].split(" s", 1)[0])
  # The resumed run reads the plan the first one remembered in the workdir.
  assert "remat report" not in resumed, resumed
  reuse = resumed.split("Remat plan reused from ", 1)[1]
  assert reuse.startswith(os.path.join(drivers.workdir("auto"), "remat_plan-")), reuse
  assert float(reuse.split(" in ", 1)[1].split(" s", 1)[0]) < planned
  assert first.split("Remat plan: ", 1)[1].split("\n")[0] == (
      resumed.split("Remat plan: ", 1)[1].split("\n")[0])
  with open(os.path.join(drivers.workdir("auto"), "remat_plan.json"), encoding="utf-8") as f:
    plan = json.load(f)
  assert plan["reused"]
  chosen = plan["report"]["chosen"]
  assert plan["plan"] == chosen["plan"]
  assert chosen["temp_bytes"] <= plan["report"]["budget_bytes"] == 64 * 2**20
  # The step that trains is the chosen candidate's, in both runs. It takes the
  # parameters and optimizer state donated, which the planner's compiles do
  # not: its temp memory may differ from the candidate's by at most their bytes.
  for log in (first, resumed):
    chosen_text = log.split("Remat plan: ", 1)[1].split("\n", 1)[0].rsplit(" (", 1)[0]
    assert f"(remat={chosen_text}, stack=" in log, log
    donated_mib = sum(map(float, re.findall(
        r"([\d.]+) KiB of (?:parameters|optimizer state) per device", log))) / 1024
    assert donated_mib > 0, log
    assert abs(compiled_temp_mib(log) - chosen["temp_bytes"] / 2**20) <= donated_mib + 0.01


def test_stacked_and_blockseq_give_the_same_losses(drivers):
  log = drivers.run("unrolled")["log"]
  assert "stack='unrolled'" in log
  stacked = read_metrics(drivers.workdir(_run_name("full", "fold")))
  unrolled = read_metrics(drivers.workdir("unrolled"))
  np.testing.assert_allclose([r["train_loss"] for r in unrolled],
                             [r["train_loss"] for r in stacked], rtol=1e-4)
  np.testing.assert_allclose(unrolled[-1]["valid_loss"], stacked[-1]["valid_loss"], rtol=1e-4)
  # train.py's own sampling decodes through BlockSeq with a KV cache.
  assert "Sample (KV-cache decoding" in log
  assert_only_outputs(drivers.workdir("unrolled"))


def tiny_loss(policy, batch: int = 4, seq_len: int = 16):
  """The tiny model's loss under ``policy`` as a function of the parameters,
  and zero parameters for it."""
  cfg = model_config.GPTConfig(vocab_size=19, seq_len=seq_len, num_layers=NUM_LAYERS,
                               num_heads=2, d_model=16, remat=policy)
  loss = hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)[0]))
  tokens = jnp.zeros((batch, seq_len + 1), jnp.int32)
  params = jax.eval_shape(loss.init, jax.random.PRNGKey(0), tokens)
  params = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), params)
  return (lambda p: loss.apply(p, tokens)), params


def residual_shapes(policy) -> list[tuple[int, ...]]:
  """Shapes of what the backward pass of the tiny model's loss keeps."""
  return [tuple(r.shape) for r, _ in saved_residuals(*tiny_loss(policy))]


def test_save_names_keeps_the_named_activations(drivers):
  policy = remat_lib.checkpoint_policy("full", ["attn_out", "mlp_hidden"], None)
  assert policy.save_block_internals == ("attn_out", "mlp_hidden")
  full = residual_shapes(remat_lib.checkpoint_policy("full", [], None))
  saved = residual_shapes(policy)
  # One stacked [layers, batch, time, width] array more for each name.
  extra = [s for s in saved if s not in full or saved.count(s) > full.count(s)]
  assert sorted(set(extra)) == [(NUM_LAYERS, 4, 16, 16), (NUM_LAYERS, 4, 16, 64)]
  assert saved.count((NUM_LAYERS, 4, 16, 16)) == full.count((NUM_LAYERS, 4, 16, 16)) + 1
  assert saved.count((NUM_LAYERS, 4, 16, 64)) == full.count((NUM_LAYERS, 4, 16, 64)) + 1
  # The binary trains with it, to the same losses, and logs the policy.
  log = drivers.run("save_names")["log"]
  assert "save_names=attn_out,mlp_hidden" in log
  assert compiled_temp_mib(log) > 0
  np.testing.assert_allclose(train_losses(drivers.workdir("save_names")),
                             train_losses(drivers.workdir(_run_name("full", "fold"))),
                             rtol=1e-4)
  assert_only_outputs(drivers.workdir("save_names"))


def _count_dots(jaxpr) -> int:
  """dot_general equations in ``jaxpr`` and every jaxpr nested in it."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general"
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
        if hasattr(inner, "eqns"):
          count += _count_dots(inner)
  return count


def gradient_dots(policy) -> int:
  """dot_general equations in the tiny model's gradient under ``policy``."""
  loss, params = tiny_loss(policy)
  return _count_dots(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)


def test_default_save_names_recompute_no_projection():
  # The flag's default keeps the matmul outputs under the aliases that
  # recompute, and nothing more under none and save_all (which keep all).
  for remat in remat_lib.SAVES_NAMES:
    assert (remat_lib.checkpoint_policy(remat, None, None).save_block_internals
            == model_config.KEPT_MATMUL_OUTPUTS)
  assert remat_lib.checkpoint_policy("none", None, None) == st.REMAT_ALIASES["none"]
  assert remat_lib.checkpoint_policy("save_all", None, None) == st.REMAT_ALIASES["save_all"]
  assert remat_lib.checkpoint_policy("full", [], None) == st.REMAT_ALIASES["full"]
  # Keeping them, the gradient has one matmul more than without
  # checkpointing: the attention scores, recomputed. (The stack's scan body
  # appears once in the jaxpr, whatever the depth.) Keeping the scores too
  # recomputes none. Full remat repeats five of the block's six matmuls (the
  # two projections, the two attention products and the MLP's first layer:
  # its output layer is read by nothing in the backward pass), and leaving
  # out any one kept name repeats at least one more.
  none = gradient_dots(st.REMAT_ALIASES["none"])
  kept = list(model_config.KEPT_MATMUL_OUTPUTS)
  assert gradient_dots(remat_lib.checkpoint_policy("full", None, None)) == none + 1
  assert gradient_dots(remat_lib.checkpoint_policy("full", kept + ["attn_scores"], None)) == none
  assert gradient_dots(remat_lib.checkpoint_policy("full", [], None)) == none + 5
  for left_out in kept:
    names = [n for n in kept if n != left_out]
    assert gradient_dots(remat_lib.checkpoint_policy("full", names, None)) > none + 1, left_out


def test_resume_is_bitwise_identical(drivers):
  first = drivers.run("resume", 0)
  second = drivers.run("resume", 1)
  assert "Resumed from step 10." in second["log"]
  straight = load_checkpoint(drivers.workdir(_run_name("none", "scan")))
  resumed = load_checkpoint(drivers.workdir("resume"))
  assert sorted(straight) == sorted(resumed)
  assert any(k.startswith("params/") for k in straight)
  assert any(k.startswith("opt_state/") for k in straight)
  for key in straight:
    assert straight[key].dtype == resumed[key].dtype, key
    np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)
  # The stopped run saved step 10, the resumed one step 20, beside it.
  from examples.gpt import saving  # pylint: disable=g-import-not-at-top
  assert saving.committed_steps(drivers.workdir("resume")) == [10, STEPS]
  assert load_meta(drivers.workdir("resume"))["step"] == STEPS
  # The same batches and losses, step by step (metrics kept across the resume).
  np.testing.assert_array_equal(train_losses(drivers.workdir("resume")),
                                train_losses(drivers.workdir(_run_name("none", "scan"))))
  assert "Resumed" not in first["log"]
  assert_only_outputs(drivers.workdir("resume"))


def test_training_never_imports_tensorflow(drivers):
  for tf_after_import, tf_after_runs in drivers.result()["tf"]:
    # import stacktools, in a fresh interpreter, imports neither TensorFlow nor
    # Orbax (a dependency of the example only) ...
    assert tf_after_import == [], tf_after_import
    assert not tf_after_runs    # ... then the example's training and sampling
                                # (Orbax's checkpoints included) no TensorFlow


def test_sample_cli_end_to_end(runs, drivers):
  workdir = drivers.workdir(_run_name("nested", "scan"))
  drivers.run(_run_name("nested", "scan"))
  # sample.py's command line, as it would run alone, in the runner that
  # also samples a damaged checkpoint (test_damaged_real_checkpoints_fail_cleanly);
  # gpt_dtype_test runs sample.py as a command of its own.
  rc, stdout, stderr = runs.samples["end to end"]
  assert rc == 0, stderr
  assert stdout.endswith("\n")
  text = stdout[:-1]
  assert text.startswith("the ") and len(text) == len("the ") + 20, repr(text)
  chars = load_meta(workdir)["chars"]
  assert set(text) <= set(chars)
  assert_only_outputs(workdir)


# ---------------------------------------------------------------------------
# KV-cache decoding (in this process).


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("stack, head_group", [("scan", 1), ("unrolled", 1), ("scan", 2)])
def test_kv_cache_decode_matches_forward(stack, head_group, block):
  """Prefill and token-by-token decoding give the forward pass's logits; with
  ``head_group=2`` (a TPU's layout) both heads share a row of the cache."""
  cfg = model_config.GPTConfig(vocab_size=11, seq_len=16, num_layers=NUM_LAYERS,
                               num_heads=2, d_model=16, block=block, stack=stack)
  batch, length, prompt = 2, 12, 5
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (batch, length)).astype(np.int32)
  forward = hk.without_apply_rng(hk.transform(lambda t: model_lib.forward(cfg, t)))
  decode = hk.without_apply_rng(hk.transform(
      lambda t, c, p: decoding.decode(cfg, t, c, p)))
  # Any parameters will do (decode and forward share them): random ones, a
  # different draw for every layer; eval_shape spares compiling an init.
  shapes = jax.eval_shape(forward.init, jax.random.PRNGKey(0), tokens)
  params = jax.tree_util.tree_map(
      lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)

  @jax.jit  # One compile: the forward pass, the prefill and the decode steps.
  def forward_and_decode(params, tokens):
    expected, _ = forward.apply(params, tokens)
    cache = decoding.init_cache(cfg, batch, head_group=head_group)
    prefill, cache = decode.apply(params, tokens[:, :prompt], cache, 0)

    def one_token(cache, pos):
      token = jax.lax.dynamic_slice_in_dim(tokens, pos, 1, axis=1)
      logits, cache = decode.apply(params, token, cache, pos)
      return cache, logits[:, 0]

    cache, steps = jax.lax.scan(one_token, cache, jnp.arange(prompt, length))
    return expected, jnp.concatenate([prefill, steps.swapaxes(0, 1)], axis=1), cache

  expected, decoded, cache = forward_and_decode(params, tokens)
  assert decoded.shape == expected.shape == (batch, length, cfg.vocab_size)
  np.testing.assert_allclose(decoded, expected, atol=1e-5, rtol=1e-5)
  # The cache holds every layer's keys at the positions decoded, zeros after.
  keys = np.asarray(cache["k"])
  # [L, B, H / group, T, group * D]
  assert keys.shape == (NUM_LAYERS, batch, 2 // head_group, cfg.seq_len, 8 * head_group)
  assert not np.any(keys[:, :, :, length:])
  assert np.all(np.any(keys[:, :, :, :length] != 0, axis=(2, 4)))
  assert not np.allclose(keys[0], keys[1])  # the layers differ


def test_kv_cache_packs_heads_into_a_tpus_lanes():
  """On a TPU, in bfloat16, a row of the cache holds as many heads as fill 128
  lanes (and divide the heads); elsewhere one."""
  def group(d_model, num_heads, dtype=jnp.bfloat16, backend="tpu"):
    cfg = model_config.GPTConfig(vocab_size=11, d_model=d_model, num_heads=num_heads)
    return attention.cache_head_group(cfg, dtype, backend)

  assert group(1024, 16) == group(768, 12) == 2          # head size 64
  assert group(1024, 8) == group(768, 16) == 1           # 128; 48 does not divide 128
  assert group(192, 6) == 2                              # 32: 4 would not divide 6 heads
  assert group(1024, 16, backend="cpu") == 1
  assert group(1024, 16, dtype=jnp.float32) == 1
  cfg = model_config.GPTConfig(vocab_size=11, d_model=16, num_heads=2)
  assert decoding.init_cache(cfg, 3)["k"].shape == (4, 3, 2, 128, 8)  # on this CPU
  with pytest.raises(ValueError, match="head_group=3 must divide num_heads=2"):
    decoding.init_cache(cfg, 3, head_group=3)


# ---------------------------------------------------------------------------
# The logged throughput (train_loop in this process, with a fake clock).


def test_logged_tokens_per_s_leaves_out_evaluation_and_checkpoints(monkeypatch):
  """Every step takes 1 s, an evaluation 100 s and a checkpoint 50 s (on a
  fake clock): each log line must say 1 s per step, whatever happened in its
  window. The window after an evaluation once counted its steps over only
  the time since the evaluation (twice the tokens/s)."""
  from types import SimpleNamespace  # pylint: disable=g-import-not-at-top
  from examples.gpt import metrics  # pylint: disable=g-import-not-at-top
  from examples.gpt import run_config  # pylint: disable=g-import-not-at-top
  from examples.gpt import train  # pylint: disable=g-import-not-at-top
  now = [0.0]
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])

  def takes(seconds, result=None):
    now[0] += seconds
    return result

  def step(params, opt_state, batch):
    del batch
    return params, opt_state, takes(1.0, jnp.float32(2.5)), None

  batch_size, seq_len = 2, 3
  config = run_config.TrainConfig(log_every=4, eval_every=6, checkpoint_every=5,
                                  batch_size=batch_size, seq_len=seq_len)
  run = SimpleNamespace(
      config=config, params={}, opt_state={}, start_step=0, last_step=12, records=[],
      is_chief=False, metrics_path=None, compiled_step=step,
      batches=SimpleNamespace(next=lambda: np.zeros((batch_size, seq_len + 1), np.int32)),
      evaluate=lambda params: takes(100.0, 3.0),
      save_checkpoint=lambda step, params, opt_state: takes(50.0))
  train.train_loop(run)
  logged = [r for r in run.records if "tokens_per_s" in r]
  assert [r["step"] for r in logged] == [4, 8, 12]
  assert [r["step"] for r in run.records if "valid_loss" in r] == [6, 12]
  for record in logged:
    assert record["step_time_s"] == pytest.approx(1.0), record
    assert record["tokens_per_s"] == pytest.approx(batch_size * seq_len), record
