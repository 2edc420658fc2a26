"""Tests for training the GPT example on several devices and processes.

JAX fixes its device count when it starts, so every run here is a
subprocess with ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``
(virtual CPU devices), and all of them start together in the background
when the tests are collected (``tests/helpers/background.py``, ``BACKGROUND``: this
module runs last, its subprocesses at the lowest priority, on the CPU the
other tests leave idle):

* three single-process drivers (``gpt_driver.drive``: ``train.train`` in-process,
  XLA's cheap LLVM settings, the run's compilation
  cache) on 1 device (the reference), on 4 devices (``data:2,fsdp:2``, the
  reference of the two-process runs) and on 8 devices (meshes ``data:8``,
  ``data:4,fsdp:2`` and ``fsdp:8``; then ``--resume`` of the
  ``data:4,fsdp:2`` run's Orbax checkpoint on ``fsdp:8``, exporting what it
  restored);
* once the 8-device driver is done, ``train.py --resume`` of that checkpoint
  on one device, exporting what it restored;
* a pair of ``train.py`` processes joined through ``jax.distributed`` (gloo)
  on 127.0.0.1, 2 devices each, ``--mesh=data:2,fsdp:2``, for 5 steps, then a
  second pair that resumes from their checkpoint to step 10, in one shared
  workdir. (JAX's persistent cache cannot shorten these: process 1's cache
  keys differ from process 0's, and only process 0 writes entries.);
* ``python -m benchmarks.sharding --quick``;
* the bad-flag command lines, one after another in one interpreter on 8
  devices (``gpt_driver.drive_cli``), and a pair of processes given two
  workdirs.

What is checked, against numbers:

* every mesh trains to the 1-device losses and parameters for the same seed
  and global batch (float tolerance: only the order of reductions differs);
* parameters and optimizer state really are sharded: the logged per-device
  bytes are the checkpoint's total over the fsdp size (a few replicated
  leaves, like the 25-entry output bias, cost a few percent more);
* two processes with 2 devices each, stopped at step 5 and resumed, train
  to exactly (bit for bit) the losses, parameters and optimizer state of one
  process with 4 devices and the same mesh; each process writes its own
  shards of every checkpoint, process 0 alone the metrics (no temp files);
* a checkpoint saved on ``data:4,fsdp:2`` restores onto ``fsdp:8`` and onto
  one device with exactly the parameters that run exported (gathered with
  ``process_allgather``, no Orbax);
* bad meshes, batch sizes and process flags: one ``error:`` line, no
  traceback, non-zero exit, nothing written; so do two processes given
  different workdirs (each writes its shards there), at the end of start-up;
* the benchmark's quick run: per-device bytes of each mesh are the total
  over its fsdp size, and its losses equal one device's.
"""

import json
import math
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import background
import gpt_driver as gpt
from benchmarks.common import harness
from subprocesses import TIMEOUT, Command, deadline, free_port, start, wait

REPO = gpt.REPO
TRAIN = gpt.TRAIN
BENCHMARK = "benchmarks.sharding"   # run as a module from the repository root
STEPS, STOP = 10, 5
# The tests' tiny model; 8 sequences so that a data axis of 8 gets one each.
TINY = {**gpt.TINY, "steps": STEPS, "batch_size": 8}
MESHES_8 = ("data:8", "data:4,fsdp:2", "fsdp:8")
SAVED_ON = "data:4,fsdp:2"  # restored onto fsdp:8 and onto one device
MESH_MP = "data:2,fsdp:2"
BENCHMARK_QUICK_MESHES = ("data:4,fsdp:2", "fsdp:8")
RTOL = 2e-5  # float32 losses and parameters after 10 steps, reductions reordered
BAD_FLAGS = [  # (name, flags, fragments of the one line)
    ("unparsable", {"mesh": "data4"}, ["--mesh='data4'", "does not parse", "data:4,fsdp:2"]),
    ("unknown_axis", {"mesh": "data:4,model:2"}, ["'model'", "data, fsdp"]),
    ("wrong_count", {"mesh": "data:4,fsdp:4"}, ["16 devices", "there are 8"]),
    ("batch", {"mesh": "data:8", "batch_size": 12}, ["--batch_size=12", "data axis (8)"]),
    ("no_coordinator", {"num_processes": 2, "process_id": 0},
     ["--num_processes=2", "--coordinator_address"]),
    ("process_id_too_big", {"num_processes": 2, "process_id": 2,
                            "coordinator_address": "127.0.0.1:1"},
     ["--process_id=2", "0..1"]),
    ("no_process_id", {"num_processes": 2, "coordinator_address": "127.0.0.1:1"},
     ["--process_id", "0..1"]),
]


xla_env = gpt.xla_env


def kill(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    proc.kill()
    proc.wait()
  proc.log.close()


class Runs:
  """Every training subprocess of this module, started at once."""

  def __init__(self, tmp: str):
    self.tmp = tmp
    self.corpus = gpt.write_corpus(os.path.join(tmp, "text.txt"))
    self.procs = []
    self.drivers = {}
    self.driver(1, [("one", {})])
    self.driver(4, [("four", {"mesh": MESH_MP})])
    # The SAVED_ON run exports its final parameters; "fsdp:8 restore" resumes
    # its checkpoint (step 10 of 10: nothing left to train) on fsdp:8.
    self.driver(8, [(mesh, {"mesh": mesh, **({"export_npz": self.export(mesh)}
                                             if mesh == SAVED_ON else {})})
                    for mesh in MESHES_8]
                + [("fsdp:8 restore", {"mesh": "fsdp:8", "resume": True,
                                       "workdir": self.workdir(SAVED_ON),
                                       "export_npz": self.export("fsdp:8 restore")})])
    self.benchmark = start(
        [sys.executable, "-m", BENCHMARK, "--quick", "--results_dir", self.workdir("bench")],
        gpt.xla_env(), os.path.join(tmp, "bench.log"))
    self.procs.append(self.benchmark)
    # The bad-flag command lines (test_bad_mesh_batch_and_process_flags_fail_cleanly).
    os.makedirs(os.path.join(tmp, "bad_flags"))
    self.bad_flags = gpt.CliRuns(
        os.path.join(tmp, "bad_flags"), "devices8",
        {name: gpt.as_args({**TINY, "data_path": self.corpus,
                            "workdir": self.bad_flag_workdir(name), **flags})
         for name, flags, _ in BAD_FLAGS}, xla_env(8))
    self.procs.append(self.bad_flags.driver[0])
    # Two processes given two workdirs
    # (test_processes_with_different_workdirs_stop_with_one_line).
    self.two_workdirs_folder = os.path.join(tmp, "two_workdirs")
    os.makedirs(self.two_workdirs_folder)
    corpus = gpt.write_corpus(os.path.join(self.two_workdirs_folder, "text.txt"))
    port = free_port()
    self.two_workdirs = []
    for i in range(2):
      args = gpt.as_args({**TINY, "data_path": corpus,
                          "workdir": os.path.join(self.two_workdirs_folder, f"work{i}"),
                          "num_processes": 2, "process_id": i,
                          "coordinator_address": f"127.0.0.1:{port}"})
      self.two_workdirs.append(Command([sys.executable, TRAIN, *args], xla_env(1),
                                       os.path.join(tmp, f"two_workdirs_process{i}")))
    self.procs.extend(c.proc for c in self.two_workdirs)
    self.stopped = self.pair({"stop_after": STOP})
    self.resumed = None
    self.after_stop = None
    self.error = None
    self.thread = threading.Thread(target=self._resume_when_stopped, daemon=True)
    self.thread.start()
    self.one_device_restore = None
    self.restore_thread = threading.Thread(target=self._restore_on_one_device, daemon=True)
    self.restore_thread.start()

  def flags(self, name: str, **extra) -> dict:
    return {**TINY, "data_path": self.corpus, "workdir": self.workdir(name), **extra}

  def workdir(self, name: str) -> str:
    return os.path.join(self.tmp, name.replace(":", "_").replace(",", "_").replace(" ", "_"))

  def bad_flag_workdir(self, name: str) -> str:
    return os.path.join(self.tmp, "bad_flags", "work", name)

  def export(self, name: str) -> str:
    """Where the run ``name`` exports its final parameters (--export_npz)."""
    return os.path.join(self.workdir("exports"), self.workdir(name)[len(self.tmp) + 1:] + ".npz")

  def driver(self, devices: int, runs: list[tuple[str, dict]]) -> None:
    specs = [{"name": name, "flags": self.flags(name, **flags)} for name, flags in runs]
    # No loss.png from the drivers (matplotlib's import and drawing are a
    # second of CPU per run); the two-process runs still plot.
    self.drivers[devices] = gpt.start_driver(self.tmp, str(devices), specs, xla_env(devices))
    self.procs.append(self.drivers[devices][0])

  def pair(self, extra: dict) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a two-process run in workdir "mp", 2 devices each.

    With the run's persistent compilation cache, as a user's run would have
    it: where a program loaded from it would hang (jax 0.12.1: the resumed
    pair's train step, which the first pair's process 0 wrote), train.py
    turns the cache off and says so.
    """
    port = free_port()
    env = xla_env(2)
    procs = []
    for i in range(2):
      flags = self.flags("mp", **extra, mesh=MESH_MP, num_processes=2, process_id=i,
                         coordinator_address=f"127.0.0.1:{port}")
      log = os.path.join(self.tmp, f"mp{len(self.procs)}_process{i}.log")
      procs.append(start([sys.executable, TRAIN, *gpt.as_args(flags)], env, log))
    self.procs.extend(procs)
    return procs

  def _resume_when_stopped(self) -> None:
    try:
      logs = [wait(p) for p in self.stopped]
      workdir = self.workdir("mp")
      step_dir = os.path.join(workdir, "checkpoints", str(STOP))
      self.after_stop = {"logs": logs, "listing": gpt.listing(workdir),
                         "records": gpt.read_metrics(workdir),
                         "steps": sorted(gpt.listing(os.path.join(workdir, "checkpoints"))),
                         "shards": {item: sorted(gpt.listing(os.path.join(step_dir, item)))
                                    for item in ("params", "opt_state")},
                         "meta": gpt.load_meta(workdir)}
      self.resumed = self.pair({"resume": True})
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def _restore_on_one_device(self) -> None:
    """``train.py --resume`` of the SAVED_ON checkpoint on one device, once the
    8-device driver (which restores it on fsdp:8 too) is done with it.

    Its command line runs as it would alone (``gpt_driver.drive_cli``), but
    without matplotlib, as the drivers do: no loss.png redrawn into the
    SAVED_ON workdir (a second of CPU), which no test reads.
    """
    try:
      self.drivers[8][0].wait(timeout=TIMEOUT)
      flags = self.flags(SAVED_ON, resume=True, export_npz=self.export("one device restore"))
      self.one_device_restore = gpt.start_cli_driver(self.tmp, "restore1",
                                                     [gpt.as_args(flags)], xla_env(1))
      self.procs.append(self.one_device_restore[0])
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def driver_runs(self, devices: int, name: str) -> list[dict]:
    """A driver's runs of that name (their logs), after checking they raised nothing."""
    proc, out_path = self.drivers[devices]
    wait(proc)
    with open(out_path, encoding="utf-8") as f:
      runs = [run for run in json.load(f)["runs"] if run["name"] == name]
    assert runs, name
    for run in runs:
      assert run["error"] is None, f"{name} failed:\n{run['error']}"
      assert run["exit"] is None, f"{name} exited: {run['exit']}"
    return runs

  def driver_run(self, devices: int, name: str) -> dict:
    return self.driver_runs(devices, name)[-1]

  def two_process_logs(self) -> list[str]:
    """The resumed pair's logs, once it finished (the stopped pair's are in after_stop)."""
    self.thread.join(timeout=TIMEOUT)
    if self.error is not None:
      raise self.error
    return [wait(p) for p in self.resumed]

  def one_device_restore_log(self) -> str:
    """What the one-device restore logged (its stderr), after checking it succeeded."""
    self.restore_thread.join(timeout=TIMEOUT)
    if self.error is not None:
      raise self.error
    (result,) = gpt.cli_results(self.one_device_restore)
    assert result["rc"] == 0, f"one device restore failed:\n{result['stderr'][-5000:]}"
    return result["stderr"]

  def finish(self) -> None:
    """Waits for every process, the resumed pair and the restore included."""
    left = deadline()   # all of them within the one limit
    self.thread.join(timeout=left())
    self.restore_thread.join(timeout=left())
    for proc in list(self.procs):
      proc.wait(timeout=left())

  def close(self) -> None:
    self.thread.join(timeout=TIMEOUT)
    self.restore_thread.join(timeout=TIMEOUT)
    for command in self.two_workdirs:
      command.close()
    for proc in self.procs:
      if hasattr(proc, "log"):
        kill(proc)


def start_runs(folder) -> Runs:
  return Runs(str(folder))


BACKGROUND = {"runs": start_runs}


@pytest.fixture(scope="module")
def runs():
  """Every run, finished (they started when the tests were collected)."""
  r = background.task_result(start_runs)
  yield r
  r.close()


def param_arrays(workdir: str, prefix: str = "params") -> dict[str, np.ndarray]:
  return {k: v for k, v in gpt.load_checkpoint(workdir).items() if k.startswith(prefix)}


def kib_per_device(log: str) -> tuple[float, float]:
  """(parameters, optimizer state) KiB per device, from the start-up log line."""
  match = re.search(r"([\d.]+) KiB of parameters and ([\d.]+) KiB of optimizer "
                    r"state per device", log)
  assert match, log
  return float(match.group(1)), float(match.group(2))


def fsdp_size(mesh: str) -> int:
  sizes = dict(part.split(":") for part in mesh.split(","))
  return int(sizes.get("fsdp", 1))


def without_key_bias(key: str, array: np.ndarray) -> np.ndarray:
  """Drops the key projection's bias from the fused qkv bias (and its moments).

  Adding a constant to every key shifts all of a query's scores alike, which
  softmax ignores: that bias's gradient is zero up to rounding noise, which
  Adam's normalisation turns into full-size steps of arbitrary sign. Its
  values differ between any two reduction orders and affect no output.
  """
  if key.endswith("h/block/attn/qkv/b"):  # params/... and opt_state/.../mu|nu/...
    d = TINY["d_model"]
    return np.delete(array, np.s_[d:2 * d], axis=-1)
  return array


def assert_trees_close(actual: dict, expected: dict, rtol: float = RTOL) -> None:
  assert sorted(actual) == sorted(expected)
  for key in expected:
    np.testing.assert_allclose(without_key_bias(key, actual[key]),
                               without_key_bias(key, expected[key]),
                               rtol=rtol, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------------------
# CLI errors (started together, while the runs train).


def test_bad_mesh_batch_and_process_flags_fail_cleanly(runs):
  # The command lines ran one after another in one interpreter on 8 devices
  # (gpt_driver.drive_cli), as each would run alone (Runs.bad_flags). The
  # process flags are checked (distributed.initialize) before any device is
  # counted or joined, so they stop the same on 8 devices as on 2.
  outcomes = [(name, runs.bad_flag_workdir(name), fragments, *runs.bad_flags[name][::2])
              for name, _, fragments in BAD_FLAGS]
  for name, workdir, fragments, returncode, stderr in outcomes:
    assert returncode != 0, name
    assert "Traceback" not in stderr, f"{name}:\n{stderr}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}:\n{stderr}"
    for fragment in fragments:
      assert fragment in lines[0], f"{name}: {fragment!r} not in {lines[0]!r}"
    assert not os.path.exists(workdir), f"{name} wrote {gpt.listing(workdir)}"
  assert not os.path.exists(os.path.dirname(runs.bad_flag_workdir("any")))


def test_processes_with_different_workdirs_stop_with_one_line(runs):
  """Each process writes its shards into --workdir, so all must share one:
  two processes given two folders (as on hosts without a shared file
  system) stop at start-up, each with the same last line, leaving nothing."""
  folder = runs.two_workdirs_folder
  for i, command in enumerate(runs.two_workdirs):
    returncode, _, stderr = command.result()
    assert returncode != 0 and "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --workdir={os.path.join(folder, f'work{i}')!r}: process 1 "
                           "of 2 does not see the files that process 0 writes"), last
    assert "the same --workdir, on a file system they share" in last, last
  assert sorted(os.listdir(folder)) == ["text.txt"]


# ---------------------------------------------------------------------------
# One process, several devices.


def test_one_device_reference_trains(runs):
  log = runs.driver_run(1, "one")["log"]
  assert "mesh {'data': 1, 'fsdp': 1} over 1 devices in 1 processes" in log
  losses = gpt.train_losses(runs.workdir("one"))
  assert len(losses) == STEPS and np.all(np.isfinite(losses))
  assert losses[-3:].mean() < losses[:3].mean() - 0.2, losses


@pytest.mark.parametrize("mesh", MESHES_8)
def test_mesh_gives_the_one_device_losses_and_params(runs, mesh):
  log = runs.driver_run(8, mesh)["log"]
  sizes = dict(part.split(":") for part in mesh.split(","))
  shown = {"data": int(sizes.get("data", 1)), "fsdp": int(sizes.get("fsdp", 1))}
  assert f"mesh {shown} over 8 devices in 1 processes" in log
  runs.driver_run(1, "one")
  one, here = runs.workdir("one"), runs.workdir(mesh)
  np.testing.assert_allclose(gpt.train_losses(here), gpt.train_losses(one), rtol=RTOL)
  np.testing.assert_allclose(gpt.read_metrics(here)[-1]["valid_loss"],
                             gpt.read_metrics(one)[-1]["valid_loss"], rtol=RTOL)
  assert_trees_close(param_arrays(here), param_arrays(one))
  gpt.assert_only_outputs(here)


@pytest.mark.parametrize("mesh", MESHES_8)
def test_params_and_optimizer_state_are_sharded(runs, mesh):
  log = runs.driver_run(8, mesh)["log"]
  params_kib, opt_kib = kib_per_device(log)
  total_kib = sum(a.nbytes for a in param_arrays(runs.workdir(mesh)).values()) / 1024
  share = total_kib / fsdp_size(mesh)
  # The log rounds to 0.1 KiB; leaves that no axis of which the fsdp size
  # divides stay replicated (the output bias of 25 floats): a few percent.
  assert share - 0.05 <= params_kib <= 1.05 * share + 0.05, (params_kib, total_kib)
  # AdamW keeps two moments per parameter, sharded alike (+ step counts).
  assert 2 * params_kib - 0.15 <= opt_kib <= 2 * params_kib + 0.15, (params_kib, opt_kib)
  if mesh == "data:8":
    assert abs(params_kib - total_kib) <= 0.05


# ---------------------------------------------------------------------------
# Two processes.


def assert_trees_equal(actual: dict, expected: dict) -> None:
  assert sorted(actual) == sorted(expected)
  for key in expected:
    assert actual[key].dtype == expected[key].dtype, key
    np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


def test_two_processes_equal_one_process_with_four_devices(runs):
  """Stopped at step 5 and resumed: bit for bit the 10 straight steps of one
  process on the same mesh. Every cross-device sum of data:2,fsdp:2 has two
  operands, whose order cannot change a float sum, so the two runs compute
  the same numbers, and any difference would be the resume's."""
  resumed_logs = runs.two_process_logs()
  after_stop = runs.after_stop
  runs.driver_run(4, "four")
  four = runs.workdir("four")
  for log in after_stop["logs"] + resumed_logs:
    assert "mesh {'data': 2, 'fsdp': 2} over 4 devices in 2 processes" in log
  # Steps 1-5, trained by two processes: the 4-device losses.
  stopped = after_stop["records"]
  assert [r["step"] for r in stopped] == list(range(1, STOP + 1))
  np.testing.assert_array_equal([r["train_loss"] for r in stopped],
                                gpt.train_losses(four)[:STOP])
  assert after_stop["meta"]["step"] == STOP
  # Steps 6-10, resumed by two processes: the same losses, parameters and
  # optimizer state as 10 straight steps of one process.
  workdir = runs.workdir("mp")
  records = gpt.read_metrics(workdir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  np.testing.assert_array_equal(gpt.train_losses(workdir), gpt.train_losses(four))
  np.testing.assert_array_equal(records[-1]["valid_loss"],
                                gpt.read_metrics(four)[-1]["valid_loss"])
  assert_trees_equal(param_arrays(workdir), param_arrays(four))
  assert_trees_equal(param_arrays(workdir, "opt_state"), param_arrays(four, "opt_state"))
  assert gpt.load_meta(workdir)["step"] == STEPS
  # Both processes evaluated the same loss.
  finals = [re.findall(r"Final validation loss ([\d.]+)", log) for log in resumed_logs]
  assert finals[0] and finals[0] == finals[1], finals


def test_each_process_writes_its_shards_and_resume_continues(runs):
  resumed_logs = runs.two_process_logs()
  after_stop = runs.after_stop
  # One checkpoint, step 5, in which each process wrote its own shards
  # (Orbax's OCDBT: one ocdbt.process_<i> folder per process) of both items;
  # process 0 alone wrote the metrics; no temporary files.
  assert after_stop["listing"] - {"loss.png"} == gpt.WORKDIR_FILES, after_stop["listing"]
  assert after_stop["steps"] == [str(STOP)], after_stop["steps"]
  for item, names in after_stop["shards"].items():
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(names), (item, names)
  gpt.assert_only_outputs(runs.workdir("mp"))
  for log in after_stop["logs"]:
    assert "Resumed" not in log
  for log in resumed_logs:  # both read the checkpoint
    assert f"Resumed from step {STOP}." in log
  for log in after_stop["logs"] + resumed_logs:
    gpt.assert_cache_off_where_it_hangs(log)
  assert sorted(gpt.listing(os.path.join(runs.workdir("mp"), "checkpoints"))) == [
      str(STEPS), str(STOP)]


def test_restore_onto_another_mesh(runs):
  """Saved on data:4,fsdp:2; resumed on fsdp:8 and on one device, each
  exporting what it restored: exactly the saving run's own export, which
  gathered the parameters with process_allgather and wrote them without Orbax."""
  runs.driver_run(8, SAVED_ON)
  fsdp8_log = runs.driver_run(8, "fsdp:8 restore")["log"]
  one_log = runs.one_device_restore_log()
  assert "mesh {'data': 1, 'fsdp': 8} over 8 devices in 1 processes" in fsdp8_log
  assert "mesh {'data': 1, 'fsdp': 1} over 1 devices in 1 processes" in one_log
  from examples.gpt import saving  # pylint: disable=import-outside-toplevel
  saved = saving.load_npz(runs.export(SAVED_ON))
  assert len(saved) > 5 and any(k.startswith("h/") for k in saved), sorted(saved)
  for name, log in (("fsdp:8 restore", fsdp8_log), ("one device restore", one_log)):
    assert f"Resumed from step {STEPS}." in log, name
    assert_trees_equal(saving.load_npz(runs.export(name)), saved)
  # On fsdp:8 the restored parameters really are split 8 ways.
  params_kib, _ = kib_per_device(fsdp8_log)
  total_kib = sum(a.nbytes for a in saved.values()) / 1024
  assert params_kib <= 1.05 * total_kib / 8 + 0.05, (params_kib, total_kib)


# ---------------------------------------------------------------------------
# The benchmark's smoke test.


def test_sharding_benchmark_quick(runs):
  output = wait(runs.benchmark)
  results = runs.workdir("bench")
  result = json.loads(open(os.path.join(results, "sharding.json"), encoding="utf-8").read())
  assert result["benchmark"] == "sharding" and result["quick"] is True
  rows = {row["mesh"]: row for row in result["meshes"]}
  assert set(rows) == set(BENCHMARK_QUICK_MESHES), rows
  total = result["total_bytes"]
  for mesh, row in rows.items():
    for key in ("param_bytes_per_device", "opt_bytes_per_device", "temp_bytes",
                "step_seconds"):
      assert row[key] > 0 and math.isfinite(row[key]), (mesh, key)
    share = (total["params"] + total["opt_state"]) / fsdp_size(mesh)
    per_device = row["param_bytes_per_device"] + row["opt_bytes_per_device"]
    assert share <= per_device <= 1.1 * share, (mesh, per_device, share)
    assert row["loss_rel_diff"] < 1e-5, row
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel,unused-import
    assert os.path.getsize(os.path.join(results, "sharding.png")) > 0
  except ImportError:
    assert harness.NO_MATPLOTLIB in output
    assert not os.path.exists(os.path.join(results, "sharding.png"))
