"""Tests for the GPT example's Orbax checkpoints: kill -9 mid-save, rotation, export.

Three ``train.py`` subprocesses of the tests' tiny model (``gpt_driver.TINY``),
20 steps, a checkpoint every 5 steps, the last 2 kept (``--keep_checkpoints=2``):

* ``straight``: uninterrupted, the reference; it also exports its final
  parameters (``--export_npz``);
* ``killed``: the same run, in which Orbax's commit of step 10 (the rename of
  its temporary folder, done by the background thread of the asynchronous
  save) never returns. Once training has gone on to step 12 while that save
  is under way, the test kills the process with SIGKILL;
* ``resumed``: ``train.py --resume`` in the killed run's workdir.

All three share a persistent compilation cache and XLA's cheap settings
(``gpt_driver.xla_env``), and start when the module's first test asks.

What is checked, against numbers:

* rotation: a run keeps exactly the latest ``--keep_checkpoints`` steps;
* a kill during an asynchronous save loses nothing beyond the steps since
  the last committed checkpoint: the killed workdir holds step 5 and an
  unfinished step-10 folder, which :func:`saving.latest` ignores;
  ``--resume`` starts from step 5, removes the unfinished folder, and ends
  bit for bit where the uninterrupted run ends (parameters, optimizer state,
  the loss of every step);
* the ``.npz`` export holds exactly the checkpoint's parameters and reads
  without pickle;
* the asynchronous-save benchmark's quick run.

``import stacktools`` importing no Orbax is checked by gpt_test's drivers;
resume across meshes and processes by distributed_test.
"""

import json
import os
import shutil
import signal
import sys
import threading
import time

import numpy as np
import pytest

import gpt_driver as gpt
from examples.gpt import restoring
from examples.gpt import saving
from subprocesses import TIMEOUT, output, start
from subprocesses import wait as wait_ok

REPO = gpt.REPO
STEPS, EVERY, KEEP, KILL_AT = 20, 5, 2, 10
FLAGS = {**gpt.TINY, "steps": STEPS, "checkpoint_every": EVERY, "keep_checkpoints": KEEP,
         "remat": "full", "block": "fold"}
# Runs train.py with Orbax's commit (the atomic rename of the temporary step
# folder) of step argv[3] hanging, after touching the file argv[2].
HANG_AT_COMMIT = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from orbax.checkpoint._src.path import atomicity
marker, hang_step = sys.argv[2], sys.argv[3]
commit = atomicity.AtomicRenameTemporaryPath.finalize

async def hang_or_commit(self):
  final = self.get_final()
  if final.name == hang_step and final.parent.name == "checkpoints":
    open(marker, "w").close()
    await asyncio.sleep(3600)
  return await commit(self)

atomicity.AtomicRenameTemporaryPath.finalize = hang_or_commit
from absl import app
from examples.gpt import train
app.run(train.main, argv=["train.py"] + sys.argv[4:])
"""


def env(cache_dir: str) -> dict:
  return gpt.xla_env(**gpt.cache_env(cache_dir))


def last_step(workdir: str) -> int:
  try:
    return gpt.read_metrics(workdir)[-1]["step"]
  except (FileNotFoundError, IndexError):
    return 0


class Runs:
  """The three runs; the kill and the resume happen in a thread."""

  def __init__(self, tmp: str):
    self.tmp = tmp
    corpus = gpt.write_corpus(os.path.join(tmp, "text.txt"))
    # The test run's compilation cache (tests/conftest.py's), where gpt_test's
    # drivers may have compiled the same programs; else one of its own.
    self.env = env(os.environ.get("JAX_COMPILATION_CACHE_DIR")
                   or os.path.join(tmp, "jax_cache"))
    self.export = os.path.join(tmp, "exports", "straight.npz")
    self.flags = lambda name, **extra: gpt.as_args(
        {**FLAGS, "data_path": corpus, "workdir": self.workdir(name), **extra})
    self.marker = os.path.join(tmp, "commit_hangs")
    self.straight = start([sys.executable, gpt.TRAIN,
                           *self.flags("straight", export_npz=self.export)],
                          self.env, os.path.join(tmp, "straight.log"))
    self.killed = start([sys.executable, "-c", HANG_AT_COMMIT, REPO, self.marker,
                         str(KILL_AT), *self.flags("killed")],
                        self.env, os.path.join(tmp, "killed.log"))
    self.procs = [self.straight, self.killed]
    self.at_kill = None
    self.resumed = None
    self.error = None
    self.thread = threading.Thread(target=self._kill_then_resume, daemon=True)
    self.thread.start()

  def workdir(self, name: str) -> str:
    return os.path.join(self.tmp, name)

  def _kill_then_resume(self) -> None:
    try:
      workdir = self.workdir("killed")
      deadline = time.monotonic() + 300
      # The save of step 10 hangs in its commit, and training goes on.
      while not (os.path.exists(self.marker) and last_step(workdir) >= KILL_AT + 2):
        assert self.killed.poll() is None, f"exited early:\n{output(self.killed)[-5000:]}"
        assert time.monotonic() < deadline, f"no hang:\n{output(self.killed)[-5000:]}"
        time.sleep(0.05)
      os.kill(self.killed.pid, signal.SIGKILL)
      self.killed.wait(timeout=60)
      snapshot = os.path.join(self.tmp, "killed_snapshot")
      shutil.copytree(workdir, snapshot)
      self.at_kill = {"returncode": self.killed.returncode, "last_step": last_step(workdir),
                      "snapshot": snapshot}
      self.resumed = start([sys.executable, gpt.TRAIN, *self.flags("killed", resume=True)],
                           self.env, os.path.join(self.tmp, "resumed.log"))
      self.procs.append(self.resumed)
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def resumed_log(self) -> str:
    self.thread.join(timeout=TIMEOUT)
    if self.error is not None:
      raise self.error
    return wait_ok(self.resumed)

  def close(self) -> None:
    self.thread.join(timeout=TIMEOUT)
    for proc in self.procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      proc.log.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  r = Runs(str(tmp_path_factory.mktemp("ckpt")))
  yield r
  r.close()


@pytest.fixture(scope="module", autouse=True)
def start_runs_early(request):
  """Starts the runs before the first test (only when a selected test needs them)."""
  if any("runs" in item.fixturenames for item in request.session.items
         if item.module is request.module):
    request.getfixturevalue("runs")


def assert_same_arrays(actual: dict, expected: dict) -> None:
  assert sorted(actual) == sorted(expected) and expected
  for key in expected:
    assert actual[key].dtype == expected[key].dtype, key
    np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


def test_keep_checkpoints_rotates_old_steps(runs):
  wait_ok(runs.straight)
  workdir = runs.workdir("straight")
  assert saving.committed_steps(workdir) == [STEPS - EVERY, STEPS]
  assert sorted(os.listdir(saving.folder(workdir))) == [str(STEPS - EVERY), str(STEPS)]
  step, meta = saving.latest(workdir)
  assert step == meta["step"] == STEPS
  # dtype: what sample.py decodes in by default (not in config: a run
  # resumes under either).
  assert set(meta) == {"step", "sampler_state", "config", "chars", "optimizer", "dtype"}
  assert meta["dtype"] == "float32"
  assert meta["config"]["num_layers"] == gpt.NUM_LAYERS
  json.loads(meta["sampler_state"])  # the data sampler's generator state


def test_kill_during_an_async_save_loses_only_the_steps_since_the_last_commit(runs):
  resumed_log = runs.resumed_log()
  at_kill = runs.at_kill
  assert at_kill["returncode"] == -signal.SIGKILL
  # Training had gone on past step 10 while its save was under way.
  assert at_kill["last_step"] >= KILL_AT + 2, at_kill
  snapshot = at_kill["snapshot"]
  assert saving.committed_steps(snapshot) == [EVERY]
  assert saving.unfinished(snapshot) == [f"{KILL_AT}{saving.UNFINISHED_SUFFIX}"]
  assert saving.latest(snapshot)[0] == EVERY
  # The resume starts from the last committed step, clears the half-written
  # one, and ends bit for bit where the uninterrupted run ends.
  assert f"Resumed from step {EVERY}." in resumed_log
  assert ("Removed the unfinished checkpoint(s) of an interrupted save from "
          f"{saving.folder(runs.workdir('killed'))}: {KILL_AT}"
          f"{saving.UNFINISHED_SUFFIX}") in resumed_log
  killed, straight = runs.workdir("killed"), runs.workdir("straight")
  wait_ok(runs.straight)
  assert saving.committed_steps(killed) == [STEPS - EVERY, STEPS]
  assert saving.unfinished(killed) == []
  for item in ("params", "opt_state"):
    assert_same_arrays(restoring.read_arrays(killed, item=item),
                       restoring.read_arrays(straight, item=item))
  assert [r["step"] for r in gpt.read_metrics(killed)] == list(range(1, STEPS + 1))
  np.testing.assert_array_equal(gpt.train_losses(killed), gpt.train_losses(straight))
  assert gpt.read_metrics(killed)[-1]["valid_loss"] == gpt.read_metrics(straight)[-1]["valid_loss"]
  assert saving.latest(killed)[1]["sampler_state"] == saving.latest(straight)[1][
      "sampler_state"]


def test_export_npz_holds_the_checkpoint_parameters(runs):
  log = wait_ok(runs.straight)
  assert f"Wrote {runs.export}" in log
  with np.load(runs.export, allow_pickle=False) as data:   # no Orbax, no pickle
    exported = {k: data[k] for k in data.files if k != saving.EXPORT_META}
    meta = json.loads(str(data[saving.EXPORT_META]))
  assert any(k.startswith("h/block/") for k in exported), sorted(exported)
  saved = saving.latest(runs.workdir("straight"))[1]   # what sample.py and --init_from need
  assert meta["step"] == STEPS and all(meta[k] == saved[k] for k in ("config", "dtype", "chars"))
  assert_same_arrays(exported, restoring.read_arrays(runs.workdir("straight")))
  assert not os.listdir(saving.folder(runs.workdir("straight"))) == []
  assert sorted(os.listdir(os.path.dirname(runs.export))) == ["straight.npz"]  # no temp file


def test_async_save_benchmark_quick(tmp_path):
  """benchmarks/checkpoint_cost.py --quick, in this process."""
  from benchmarks import checkpoint_cost  # pylint: disable=import-outside-toplevel
  result = checkpoint_cost.main(["--quick", "--no_plot",
                                 "--results_dir", str(tmp_path)])
  on_disk = json.loads((tmp_path / "checkpoint_cost.json").read_text())
  assert on_disk["benchmark"] == "checkpoint_cost" and on_disk["quick"] is True
  assert on_disk["markdown"] == result["markdown"] and "| async |" in result["markdown"]
  summary = result["summary"]
  assert summary["baseline_seconds"] > 0 and summary["quiet_steps"] > 0
  assert summary["async"]["saves"] == 2 and summary["sync"]["saves"] == 1
  for kind in ("async", "sync"):
    for key in ("save_step_ratio", "window_step_ratio", "save_step_seconds"):
      assert summary[kind][key] > 0, (kind, key)
  assert len(result["step_seconds"]) == 14 and result["checkpoint_bytes"] > 0
