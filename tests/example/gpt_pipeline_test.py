"""Tests for training the GPT example as a pipeline (--mesh=pipe:..., --pipeline).

JAX fixes its device count when it starts, so every run here is a
subprocess with ``--xla_force_host_platform_device_count`` (virtual CPU
devices), and all of them start together in the background when the tests
are collected:

* three drivers (``gpt_driver.drive``: ``train.train`` in-process, one
  interpreter for several runs, the run's compilation cache):
  on 1 device the plain reference (scan blocks, so that their per-layer
  stats are logged); on 8 devices the start-up errors that need a mesh,
  ``gpipe`` on ``pipe:4,data:2`` with fold blocks, and ``circular`` and
  ``interleaved`` with 2 repeats on ``pipe:2,fsdp:2,data:2`` with scan
  blocks; on 4 devices ``1f1b`` on ``pipe:4`` with fold blocks (also the
  reference of the two-process runs), and one workdir trained plain
  (``data:4``) to step 8, resumed as that 1f1b pipeline to step 16 and
  resumed plain to step 20;
* a pair of ``train.py`` processes joined through ``jax.distributed`` (gloo)
  on 127.0.0.1, 2 devices each, ``--mesh=pipe:4 --pipeline=1f1b``: stages
  0-1 in one process, 2-3 in the other, 20 steps with a checkpoint at step
  10; then a second pair that resumes that checkpoint, in a copy of the
  workdir without the later one, to step 20;
* two command lines, one whose flags contradict each other and one with a
  schedule that does not exist, run in one interpreter (``drive_cli``).

(``tests/helpers/background.py``, ``BACKGROUND``: this module runs last, the runs
at the lowest priority, on the CPU the other tests leave idle.)

One run for each path that the example itself takes. Its code tells the
schedules apart in one place (``model.loss_fn``): a schedule that computes
the loss (``1f1b``, ``interleaved``, ``zb``) embeds and takes the loss inside
the stack's call (``st.Stacked.loss`` or ``scan_loss``), the others
(``gpipe``, ``circular``) run only the blocks in it (``fold`` or ``scan``);
repeats and the meshes are stacktools' layout of the same stack. So gpipe
(blocks only, fold blocks), circular (blocks only, scan blocks, repeats),
1f1b (the loss, fold) and interleaved (the loss, scan, repeats) train here.
Not through the binary, because tests/library/pipeline_test.py
(tests/helpers/pipeline_cases.py) checks every schedule against the plain
stack on these meshes, and the example adds nothing of its own to them:
``zb`` (1f1b's path here; it differs from 1f1b only inside stacktools, in
when the weight gradients run), and 1f1b on ``pipe:4,data:2`` (its path is
the 4-device run's; a data axis under a loss pipeline, interleaved's). A
checkpoint moves between plain and pipelined runs once, through 1f1b: every
schedule keeps the plain stack's tree (``distributed.tree_shardings`` only
places it otherwise), and the loss path is the one whose embedding and head
the example builds around the stack (``model.embed_and_head``).

What is checked, against numbers:

* every pipelined run gives the plain one-device run's per-step training
  losses and final validation loss to 1e-4 (only the order of float
  reductions differs; measured: under 1e-6), and scan blocks' per-layer
  stats come back through the pipeline with the same values;
* each stage holds only its own layers: the logged parameter bytes per
  device are under half the model's;
* a checkpoint moves from a plain run to a pipelined one and back, and the
  losses go on as if nothing changed;
* two processes with a pipe axis across them train like one process with
  four devices, to a few float32 ulps (see :data:`ULPS`), and a pair resumed
  at step 10 ends bit for bit where the uninterrupted pair ends;
* start-up errors (a pipe axis without --pipeline, --pipeline without a pipe
  axis, layers or a batch that do not divide, a circular schedule with too
  few microbatches; pipeline flags with --pipeline=none, which absl's flag
  validation stops): one line, nothing written.

The runs compile with XLA's cheap settings (``gpt_driver.xla_env``: on
jaxlib 0.10 with the CPU backend's older loop emitters too, which compile the
pipelined step about three times faster); every run here, reference
included, uses the same settings.

The pytest process itself never imports JAX.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import background
import gpt_driver
from gpt_driver import as_args, read_metrics, train_losses, xla_env
from subprocesses import TIMEOUT, deadline, free_port, start, wait

REPO, TRAIN = gpt_driver.REPO, gpt_driver.TRAIN
STEPS, STOP = gpt_driver.STEPS, 10
# The tiniest model that 4 stages x 1 and 2 stages x 2 repeats divide; 8
# sequences: 4 microbatches x a data axis of 2.
TINY = {**gpt_driver.TINY, "num_layers": 4, "batch_size": 8}
GPIPE = {"mesh": "pipe:4,data:2", "pipeline": "gpipe", "microbatches": 4}
CIRCULAR = {"mesh": "pipe:2,fsdp:2,data:2", "pipeline": "circular", "microbatches": 4,
            "pipeline_repeats": 2, "block": "scan"}
ONE_F_ONE_B = {"mesh": "pipe:4,data:2", "pipeline": "1f1b", "microbatches": 4}
INTERLEAVED = {**CIRCULAR, "pipeline": "interleaved"}
# The 1f1b run, in one process, and the two-process runs: 1F1B's two
# collectives a tick cross the processes.
MESH_MP = {"mesh": "pipe:4", "pipeline": "1f1b", "microbatches": 4}
# The same workdir, on 4 devices: plain to step 8, 1f1b (from the plain
# checkpoint) to 16, plain again (from 1f1b's) to the end (the 1f1b leg
# reuses the step that the 1f1b run compiled before it, the last leg the
# first's).
CHAIN = (("chain plain", {"mesh": "data:4", "stop_after": 8}),
         ("chain 1f1b", {**MESH_MP, "stop_after": 16, "resume": True}),
         ("chain plain again", {"mesh": "data:4", "resume": True}))
# (devices, name, flags, fragments of the one line) of start-up errors that
# need a mesh; the example's own, or stacktools' when set_up first traces the
# model. None writes anything.
MESH_ERRORS = (
    (1, "no pipe axis", {"pipeline": "gpipe"},
     ["error: --pipeline=gpipe places its stages on a pipe axis, which is missing "
      "from --mesh=''", "--mesh=pipe:4,data:2"]),
    (8, "pipe axis without a pipeline", {"mesh": "pipe:4,data:2"},
     ["error: --mesh='pipe:4,data:2' has a pipe axis of 4", "--pipeline=gpipe"]),
    (8, "layers", {**GPIPE, "num_layers": 6},
     ["error: Stacked: num_layers=6 cannot be split into 4 stages",
      "Make num_layers a multiple of 4"]),
    (8, "batch", {**GPIPE, "batch_size": 12},
     ["error: --batch_size=12 is not divisible by --microbatches (4) x the mesh's "
      "data axis (2) = 8"]),
    (8, "circular with few microbatches", {**GPIPE, "pipeline": "circular", "microbatches": 2},
     ["error: Stacked: a circular schedule needs at least as many microbatches as "
      "stages", "got microbatches=2 for 4 stages"]),
    (8, "1f1b with few microbatches", {**ONE_F_ONE_B, "microbatches": 2},
     ["error: Stacked: a 1f1b schedule needs at least as many microbatches as stages",
      "got microbatches=2 for 4 stages"]),
    (8, "interleaved microbatches", {**ONE_F_ONE_B, "pipeline": "interleaved",
                                     "pipeline_repeats": 2, "num_layers": 8,
                                     "microbatches": 6, "batch_size": 12},
     ["error: Stacked: an interleaved schedule sends microbatches through each chunk in "
      "groups of one per stage", "got microbatches=6", "Use microbatches=4 or 8"]),
    (8, "interleaved layers", {**ONE_F_ONE_B, "pipeline": "interleaved",
                               "pipeline_repeats": 2},
     ["error: Stacked: num_layers=4 cannot be split into 4 stages x 2 repeats"]),
)
ATOL = 1e-4  # float32 losses after 20 steps; only reductions are reordered
# Two processes against one with the same four devices: the same program, but
# compiled for another device layout into other kernels, and at the tests'
# cheap optimisation level 0 (tests/conftest.py) XLA:CPU's fusion emitters
# round tanh (the GELU's) differently in different kernels. Measured on jaxlib
# 0.12: 1-2 ulps at 6 of 20 steps; bit for bit at the default level, and on
# jaxlib 0.10, whose older loop emitters the tests use there.
ULPS = 4


class Runs:
  """Every training subprocess of this module, started at once."""

  def __init__(self, tmp: str):
    self.tmp = tmp
    self.corpus = gpt_driver.write_corpus(os.path.join(tmp, "text.txt"))
    self.procs, self.drivers, self.driver_of = [], {}, {}
    self.driver("one", 1, [(name, flags) for devices, name, flags, _ in MESH_ERRORS
                           if devices == 1] + [("reference", {"block": "scan"})])
    # One driver for the 8-device runs (an interpreter, and its imports,
    # fewer than two), one for the 4-device ones; the chain's 1f1b leg reuses
    # the step that the 1f1b run compiled.
    self.driver("eight", 8, [(name, flags) for devices, name, flags, _ in MESH_ERRORS
                             if devices == 8]
                + [("gpipe", GPIPE), ("circular", CIRCULAR), ("interleaved", INTERLEAVED)])
    self.driver("four", 4, [("1f1b", MESH_MP)]
                + [(name, {**flags, "workdir": self.workdir("chain")}) for name, flags in CHAIN])
    # Flags that contradict each other, and a schedule that does not exist,
    # on the command line: one after another in one interpreter
    # (gpt_driver.drive_cli), as each would run alone.
    self.flag_errors_workdir = os.path.join(tmp, "flag_errors_work")
    specs = {"contradict": as_args({**TINY, "data_path": self.corpus,
                                    "workdir": self.flag_errors_workdir, "microbatches": 4}),
             "no such schedule": as_args({**TINY, "workdir": self.flag_errors_workdir})
                                 + ["--pipeline=zb-h2"]}
    self.flag_errors = gpt_driver.CliRuns(tmp, "flag_errors", specs, xla_env(1))
    self.procs.append(self.flag_errors.driver[0])
    self.straight = self.pair("mp", {"checkpoint_every": STOP})
    self.straight_logs = self.resumed = self.error = None
    self.thread = threading.Thread(target=self._resume_when_done, daemon=True)
    self.thread.start()

  def flags(self, name: str, **extra) -> dict:
    return {**TINY, "data_path": self.corpus, "workdir": self.workdir(name), **extra}

  def workdir(self, name: str) -> str:
    return os.path.join(self.tmp, name.replace(" ", "_"))

  def driver(self, key: str, devices: int, runs: list[tuple[str, dict]]) -> None:
    specs = [{"name": name, "flags": self.flags(name, **flags)} for name, flags in runs]
    proc, out_path = gpt_driver.start_driver(self.tmp, key, specs, xla_env(devices))
    self.procs.append(proc)
    self.drivers[key] = (proc, out_path)
    self.driver_of.update((name, key) for name, _ in runs)

  def pair(self, name: str, extra: dict) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a two-process run in workdir ``name``, 2 devices each."""
    port = free_port()
    procs = []
    for i in range(2):
      flags = self.flags(name, **MESH_MP, **extra, num_processes=2, process_id=i,
                         coordinator_address=f"127.0.0.1:{port}")
      log = os.path.join(self.tmp, f"mp{len(self.procs)}_process{i}.log")
      # train.py as __main__, without matplotlib (no loss.png: a second of
      # CPU), and with one compilation cache for both processes (only
      # process 0 writes it): the resumed pair's processes both load the
      # first pair's programs, so neither waits at the first collective for
      # the other to compile (with a cache per process, process 1 compiled
      # while process 0 waited, and under load gloo's connect timed out).
      # Where loading them would hang (jax 0.12.1), train.py turns the cache
      # off and says so.
      env = xla_env(2, **gpt_driver.cache_env(os.path.join(self.tmp, "jax_cache_mp")))
      code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
      procs.append(start([sys.executable, "-c", code, TRAIN, *as_args(flags)], env, log))
    self.procs.extend(procs)
    return procs

  def driver_run(self, name: str, ok: bool = True) -> dict:
    """The driven run of that name, after checking it raised nothing (and,
    with ``ok``, did not exit)."""
    proc, out_path = self.drivers[self.driver_of[name]]
    wait(proc)
    with open(out_path, encoding="utf-8") as f:
      (run,) = [run for run in json.load(f)["runs"] if run["name"] == name]
    assert run["error"] is None, f"{name} failed:\n{run['error']}"
    if ok:
      assert run["exit"] is None, f"{name} exited: {run['exit']}"
    return run

  def _resume_when_done(self) -> None:
    try:
      self.straight_logs = [wait(p) for p in self.straight]
      # The workdir as a run killed after step 10's checkpoint left it.
      shutil.copytree(self.workdir("mp"), self.workdir("mp resumed"),
                      ignore=lambda folder, names: [str(STEPS)] if folder.endswith(
                          "checkpoints") else [])
      self.resumed = self.pair("mp resumed", {"checkpoint_every": STOP, "resume": True})
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def two_process_logs(self) -> tuple[list[str], list[str]]:
    """The first pair's logs and the resumed pair's, once both finished."""
    self.thread.join(timeout=TIMEOUT)
    if self.error is not None:
      raise self.error
    return self.straight_logs, [wait(p) for p in self.resumed]

  def finish(self) -> None:
    """Waits for every process, the resumed pair's included."""
    left = deadline()   # all of them within the one limit
    self.thread.join(timeout=left())
    for proc in list(self.procs):
      proc.wait(timeout=left())

  def close(self) -> None:
    self.thread.join(timeout=TIMEOUT)
    for proc in self.procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      proc.log.close()


def start_runs(folder) -> Runs:
  return Runs(str(folder))


BACKGROUND = {"runs": start_runs}


@pytest.fixture(scope="module")
def runs():
  """Every run, finished (they started when the tests were collected)."""
  r = background.task_result(start_runs)
  yield r
  r.close()


def kib_per_device(log: str) -> float:
  """Parameter KiB per device, from the start-up log line."""
  match = re.search(r"([\d.]+) KiB of parameters and", log)
  assert match, log
  return float(match.group(1))


# ---------------------------------------------------------------------------
# Start-up errors.


def test_pipeline_flag_errors_stop_with_one_line(runs):
  # Flags that contradict each other, and a schedule that does not exist, on
  # the command line (Runs.flag_errors). gpt_test.py runs train.py's flag
  # errors as commands of their own too.
  cli = runs.flag_errors
  # stderr holds one line (and absl's hint) and nothing else.
  returncode, _, stderr = cli["contradict"]
  gpt_driver.one_line_error(
      returncode, stderr, ["--microbatches needs a --pipeline (e.g. gpipe, circular or interleaved)"])
  # absl's enum names the schedules that exist.
  returncode, _, stderr = cli["no such schedule"]
  assert returncode != 0 and "Traceback" not in stderr, stderr
  assert "value should be one of <none|gpipe|circular|1f1b|interleaved|zb>" in stderr
  assert not os.path.exists(runs.flag_errors_workdir)
  # Those that need a mesh ran in the drivers, which record the message
  # that sys.exit prints (alone on stderr, as the line above).
  for devices, name, _, fragments in MESH_ERRORS:
    message = runs.driver_run(name, ok=False)["exit"]
    assert message and "\n" not in message, f"{name}: {message!r}"
    for fragment in fragments:
      assert fragment in message, f"{name}: {fragment!r} not in {message!r}"
    assert not os.path.exists(runs.workdir(name)), name


# ---------------------------------------------------------------------------
# One process, 8 devices, against one device.


@pytest.mark.parametrize("name,flags", [("gpipe", GPIPE), ("circular", CIRCULAR),
                                        ("1f1b", MESH_MP), ("interleaved", INTERLEAVED)])
def test_pipelined_run_gives_the_one_device_losses(runs, name, flags):
  log = runs.driver_run(name)["log"]
  sizes = {"pipe": 1, "data": 1, "fsdp": 1,
           **{k: int(v) for k, v in (p.split(":") for p in flags["mesh"].split(","))}}
  assert f"mesh {sizes} over {math.prod(sizes.values())} devices in 1 processes" in log, log
  repeats = flags.get("pipeline_repeats", 1)
  assert (f"Pipeline: {flags['pipeline']} over {sizes['pipe']} stages x {repeats} repeats, "
          f"4 microbatches of 2 sequences") in log, log
  reference_log = runs.driver_run("reference")["log"]
  here, reference = runs.workdir(name), runs.workdir("reference")
  assert [r["step"] for r in read_metrics(here)] == list(range(1, STEPS + 1))
  np.testing.assert_allclose(train_losses(here), train_losses(reference), rtol=0, atol=ATOL)
  np.testing.assert_allclose(read_metrics(here)[-1]["valid_loss"],
                             read_metrics(reference)[-1]["valid_loss"], rtol=0, atol=ATOL)
  # Each stage holds its own layers; the embeddings and head are whole.
  assert kib_per_device(log) < 0.5 * kib_per_device(reference_log), (log, reference_log)


def test_scan_block_stats_come_back_through_the_pipeline(runs):
  """Scan blocks return per-sequence stats, put back together over the
  microbatches: every step's per-layer stats of the circular run are the
  reference's (written rounded to 4 decimals)."""
  runs.driver_run("circular")
  runs.driver_run("reference")
  here, reference = read_metrics(runs.workdir("circular")), read_metrics(runs.workdir("reference"))
  for stat in ("attn_entropy", "update_ratio"):
    ours = np.array([r[stat] for r in here])
    theirs = np.array([r[stat] for r in reference])
    assert ours.shape == (STEPS, TINY["num_layers"]), ours.shape
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-4, err_msg=stat)


def test_checkpoints_move_between_plain_and_pipelined_runs(runs):
  """Plain to step 8, 1f1b (from the plain checkpoint) to step 16, plain
  again (from 1f1b's) to 20: the reference's losses."""
  logs = [runs.driver_run(name)["log"] for name, _ in CHAIN]
  assert "Pipeline:" not in logs[0] and "Pipeline:" not in logs[2]
  assert "Pipeline: 1f1b over 4 stages" in logs[1], logs[1]
  for log, step in zip(logs[1:], (8, 16)):
    assert f"Resumed from step {step}." in log, log
  runs.driver_run("reference")
  chain = runs.workdir("chain")
  assert [r["step"] for r in read_metrics(chain)] == list(range(1, STEPS + 1))
  np.testing.assert_allclose(train_losses(chain), train_losses(runs.workdir("reference")),
                             rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------
# Two processes, a pipe axis across them.


def test_two_processes_equal_one_process_and_resume_exactly(runs):
  """Stages 0-1 in process 0, 2-3 in process 1: the 20 steps of one process
  with 4 devices to :data:`ULPS`, which are the one-device losses to 1e-4;
  resumed from step 10's checkpoint, bit for bit the uninterrupted pair."""
  straight_logs, resumed_logs = runs.two_process_logs()
  runs.driver_run("1f1b")
  four, mp, resumed = (runs.workdir(name) for name in ("1f1b", "mp", "mp resumed"))
  for log in straight_logs + resumed_logs:
    assert "mesh {'pipe': 4, 'data': 1, 'fsdp': 1} over 4 devices in 2 processes" in log, log
    assert "Pipeline: 1f1b over 4 stages" in log, log
  for log in resumed_logs:
    assert f"Resumed from step {STOP}." in log, log
  for log in straight_logs + resumed_logs:
    gpt_driver.assert_cache_off_where_it_hangs(log)
  for workdir in (mp, resumed):
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, STEPS + 1))
  np.testing.assert_array_max_ulp(train_losses(mp).astype(np.float32),
                                  train_losses(four).astype(np.float32), maxulp=ULPS)
  valid = lambda workdir: np.float32(read_metrics(workdir)[-1]["valid_loss"])  # noqa: E731
  np.testing.assert_array_max_ulp(valid(mp), valid(four), maxulp=ULPS)
  # Steps 11-20 after the resume, and the evaluation at the end.
  np.testing.assert_array_equal(train_losses(resumed), train_losses(mp))
  assert valid(resumed) == valid(mp)
  runs.driver_run("reference")
  np.testing.assert_allclose(train_losses(four), train_losses(runs.workdir("reference")),
                             rtol=0, atol=ATOL)
