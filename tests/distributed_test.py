"""Tests for training the GPT example on several devices and processes.

JAX fixes its device count when it starts, so every run here is a
subprocess with ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``
(virtual CPU devices), and all of them start together when the module's
first test asks for them, while the cheap tests run:

* three single-process drivers (``gpt_test.drive``: ``train.main`` in-process
  under absl's flagsaver, XLA's cheap LLVM settings, a private compilation
  cache) on 1 device (the reference), on 4 devices (``data:2,fsdp:2``: the
  reference of the two-process runs) and on 8 devices (meshes ``data:8``,
  ``data:4,fsdp:2`` and ``fsdp:8``, one driver);
* pairs of ``train.py`` processes joined through ``jax.distributed`` (gloo)
  on 127.0.0.1, 2 devices each, ``--mesh=data:2,fsdp:2``: 10 steps straight
  (process 1 given a workdir of its own, which must stay unwritten), and 5
  steps then ``--resume`` to 10 in one shared workdir.

What is checked, against numbers:

* every mesh trains to the 1-device losses and parameters for the same seed
  and global batch (float tolerance: only the order of reductions differs);
* parameters and optimizer state really are sharded: the logged per-device
  bytes are the checkpoint's total over the fsdp size (a few replicated
  leaves, like the 25-entry output bias, cost a few percent more);
* two processes with 2 devices each equal one process with 4 devices; only
  process 0 writes, and only checkpoint.npz and metrics.jsonl (no temp
  files); stop at 5 + resume equals the straight two-process run bitwise;
* bad meshes, batch sizes and process flags: one ``error:`` line, no
  traceback, non-zero exit, nothing written;
* ``benchmarks/sharding.py --quick`` runs and reports sharded bytes.
"""

import json
import math
import os
import re
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import gpt_test as gpt

REPO = gpt.REPO
TRAIN = gpt.TRAIN
BENCHMARK = os.path.join(REPO, "benchmarks", "sharding.py")
STEPS, STOP = 10, 5
# gpt_test's tiny model; 8 sequences so that a data axis of 8 gets one each.
TINY = {**gpt.TINY, "steps": STEPS, "batch_size": 8}
MESHES_8 = ("data:8", "data:4,fsdp:2", "fsdp:8")
MESH_MP = "data:2,fsdp:2"
RTOL = 2e-5  # float32 losses and parameters after 10 steps, reductions reordered


def xla_env(devices: int, **extra: str) -> dict:
  flags = f"{gpt.FAST_XLA} --xla_force_host_platform_device_count={devices}"
  return {**os.environ, "XLA_FLAGS": flags, **extra}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(args: list[str], env: dict, log_path: str) -> subprocess.Popen:
  """A subprocess whose output goes to a file (a pipe nobody reads could fill)."""
  log = open(log_path, "w+", encoding="utf-8")  # pylint: disable=consider-using-with
  proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  proc.log = log
  return proc


def wait(proc: subprocess.Popen, timeout: float = 300) -> str:
  """Waits for ``proc``; returns its output, after checking it succeeded."""
  proc.wait(timeout=timeout)
  proc.log.seek(0)
  output = proc.log.read()
  assert proc.returncode == 0, f"{proc.args[:3]} failed:\n{output[-5000:]}"
  return output


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
    self.driver(8, [(mesh, {"mesh": mesh}) for mesh in MESHES_8])
    self.straight = self.pair("mp_straight", {}, own_workdir_for_1=True)
    self.stopped = self.pair("mp_resume", {"stop_after": STOP})
    self.resumed = None
    self.after_stop = None
    self.error = None
    self.thread = threading.Thread(target=self._resume_when_stopped, daemon=True)
    self.thread.start()

  def flags(self, name: str, **extra) -> dict:
    return {**TINY, "data_path": self.corpus, "workdir": self.workdir(name), **extra}

  def workdir(self, name: str) -> str:
    return os.path.join(self.tmp, name.replace(":", "_").replace(",", "_"))

  def driver(self, devices: int, runs: list[tuple[str, dict]]) -> None:
    specs = [{"name": name, "flags": self.flags(name, **flags)} for name, flags in runs]
    spec_path = os.path.join(self.tmp, f"driver{devices}.json")
    out_path = os.path.join(self.tmp, f"driver{devices}.out.json")
    with open(spec_path, "w", encoding="utf-8") as f:
      json.dump(specs, f)
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; import gpt_test; "
            "gpt_test.drive(sys.argv[3], sys.argv[4], False, sys.argv[5])")
    proc = start([sys.executable, "-c", code, REPO, os.path.dirname(os.path.abspath(__file__)),
                  spec_path, out_path, os.path.join(self.tmp, f"jax_cache{devices}")],
                 xla_env(devices), os.path.join(self.tmp, f"driver{devices}.log"))
    self.procs.append(proc)
    self.drivers[devices] = (proc, out_path)

  def pair(self, name: str, extra: dict, own_workdir_for_1: bool = False,
           resume: bool = False) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a two-process run with 2 devices each."""
    port = free_port()
    procs = []
    for i in range(2):
      workdir = self.workdir(name + ("_process1" if i and own_workdir_for_1 else ""))
      flags = self.flags(name, **extra, mesh=MESH_MP, num_processes=2, process_id=i,
                         coordinator_address=f"127.0.0.1:{port}", workdir=workdir)
      if resume:
        flags["resume"] = True
      # The pairs share a compilation cache: the resumed pair finds its programs.
      env = xla_env(2, JAX_COMPILATION_CACHE_DIR=os.path.join(self.tmp, "jax_cache_mp"),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
      log = os.path.join(self.tmp, f"{name}{'_resume' if resume else ''}_process{i}.log")
      procs.append(start([sys.executable, TRAIN, *gpt.as_args(flags)], env, log))
    self.procs.extend(procs)
    return procs

  def _resume_when_stopped(self) -> None:
    try:
      logs = [wait(p) for p in self.stopped]
      workdir = self.workdir("mp_resume")
      self.after_stop = {"logs": logs, "listing": gpt.listing(workdir),
                         "steps": [r["step"] for r in gpt.read_metrics(workdir)]}
      self.resumed = self.pair("mp_resume", {}, resume=True)
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def driver_run(self, devices: int, name: str) -> dict:
    """A driver's run (its log), after checking that it raised nothing."""
    proc, out_path = self.drivers[devices]
    wait(proc)
    with open(out_path, encoding="utf-8") as f:
      runs = {run["name"]: run for run in json.load(f)["runs"]}
    assert runs[name]["error"] is None, f"{name} failed:\n{runs[name]['error']}"
    return runs[name]

  def resume_logs(self) -> list[str]:
    self.thread.join(timeout=600)
    if self.error is not None:
      raise self.error
    return [wait(p) for p in self.resumed]

  def close(self) -> None:
    self.thread.join(timeout=600)
    for proc in self.procs:
      kill(proc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  r = Runs(str(tmp_path_factory.mktemp("dist")))
  yield r
  r.close()


@pytest.fixture(scope="module", autouse=True)
def start_runs_early(request):
  """Starts the training runs before the first test, so the cheap tests run
  while they train (only when some selected test needs them)."""
  if any("runs" in item.fixturenames for item in request.session.items
         if item.module is request.module):
    request.getfixturevalue("runs")


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


def assert_trees_close(actual: dict, expected: dict, rtol: float = RTOL) -> None:
  assert sorted(actual) == sorted(expected)
  for key in expected:
    np.testing.assert_allclose(actual[key], expected[key], rtol=rtol, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------------------
# CLI errors (started together, while the runs train).


def test_bad_mesh_batch_and_process_flags_fail_cleanly(tmp_path):
  cases = [  # (name, devices, flags, fragments of the one line)
      ("unparsable", 8, {"mesh": "data4"}, ["--mesh='data4'", "does not parse", "data:4,fsdp:2"]),
      ("unknown_axis", 8, {"mesh": "data:4,model:2"}, ["'model'", "data, fsdp"]),
      ("wrong_count", 8, {"mesh": "data:4,fsdp:4"}, ["16 devices", "there are 8"]),
      ("too_many_for_one", 1, {"mesh": "data:2"}, ["2 devices", "there are 1"]),
      ("batch", 8, {"mesh": "data:8", "batch_size": 12},
       ["--batch_size=12", "data axis (8)"]),
      ("no_coordinator", 2, {"num_processes": 2, "process_id": 0},
       ["--num_processes=2", "--coordinator_address"]),
      ("process_id_too_big", 2, {"num_processes": 2, "process_id": 2,
                                 "coordinator_address": "127.0.0.1:1"},
       ["--process_id=2", "0..1"]),
      ("no_process_id", 2, {"num_processes": 2, "coordinator_address": "127.0.0.1:1"},
       ["--process_id", "0..1"]),
      ("coordinator_alone", 2, {"coordinator_address": "127.0.0.1:1"},
       ["--coordinator_address", "--num_processes"]),
  ]
  corpus = gpt.write_corpus(str(tmp_path / "text.txt"))
  started = []
  for name, devices, flags, fragments in cases:
    workdir = tmp_path / "work" / name
    args = gpt.as_args({**TINY, "data_path": corpus, "workdir": workdir, **flags})
    proc = subprocess.Popen([sys.executable, TRAIN, *args], cwd=REPO, env=xla_env(devices),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started.append((name, workdir, fragments, proc))
  for name, workdir, fragments, proc in started:
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0, name
    assert "Traceback" not in stderr, f"{name}:\n{stderr}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}:\n{stderr}"
    for fragment in fragments:
      assert fragment in lines[0], f"{name}: {fragment!r} not in {lines[0]!r}"
    assert not workdir.exists(), f"{name} wrote {gpt.listing(str(workdir))}"
  assert not (tmp_path / "work").exists()


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
  # The log rounds to 0.1 KiB; replicated leaves (the output bias of 25
  # floats, LayerNorm offsets when not divisible) add a few percent.
  assert share - 0.05 <= params_kib <= 1.05 * share + 0.05, (params_kib, total_kib)
  # AdamW keeps two moments per parameter, sharded alike (+ step counts).
  assert 2 * params_kib - 0.15 <= opt_kib <= 2 * params_kib + 0.15, (params_kib, opt_kib)
  if mesh == "data:8":
    assert abs(params_kib - total_kib) <= 0.05


# ---------------------------------------------------------------------------
# Two processes.


def test_two_processes_equal_one_process_with_four_devices(runs):
  logs = [wait(p) for p in runs.straight]
  runs.driver_run(4, "four")
  for i, log in enumerate(logs):
    assert f"mesh {{'data': 2, 'fsdp': 2}} over 4 devices in 2 processes" in log, i
  workdir, four = runs.workdir("mp_straight"), runs.workdir("four")
  records = gpt.read_metrics(workdir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # one writer
  np.testing.assert_allclose(gpt.train_losses(workdir), gpt.train_losses(four), rtol=RTOL)
  np.testing.assert_allclose(records[-1]["valid_loss"],
                             gpt.read_metrics(four)[-1]["valid_loss"], rtol=RTOL)
  assert_trees_close(param_arrays(workdir), param_arrays(four))
  assert_trees_close(param_arrays(workdir, "opt_state"), param_arrays(four, "opt_state"))
  meta = json.loads(str(gpt.load_checkpoint(workdir)["__meta__"]))
  assert meta["step"] == STEPS
  # Both processes saw the same validation loss; only process 0 wrote.
  finals = [re.findall(r"Final validation loss ([\d.]+)", log) for log in logs]
  assert finals[0] and finals[0] == finals[1], finals
  gpt.assert_only_outputs(workdir)
  assert not os.path.exists(runs.workdir("mp_straight_process1"))


def test_two_process_resume_equals_the_straight_run(runs):
  logs = runs.resume_logs()
  after_stop = runs.after_stop
  assert after_stop["listing"] - {"loss.png"} == gpt.WORKDIR_FILES, after_stop["listing"]
  assert after_stop["steps"] == list(range(1, STOP + 1))
  for log in logs:
    assert f"Resumed from step {STOP}." in log
  for log in after_stop["logs"]:
    assert "Resumed" not in log
  [wait(p) for p in runs.straight]  # pylint: disable=expression-not-assigned
  straight = gpt.load_checkpoint(runs.workdir("mp_straight"))
  resumed = gpt.load_checkpoint(runs.workdir("mp_resume"))
  assert sorted(straight) == sorted(resumed)
  for key in straight:
    assert np.array_equal(straight[key], resumed[key]), key
  np.testing.assert_array_equal(gpt.train_losses(runs.workdir("mp_resume")),
                                gpt.train_losses(runs.workdir("mp_straight")))
  gpt.assert_only_outputs(runs.workdir("mp_resume"))


# ---------------------------------------------------------------------------
# The benchmark's smoke test.


def test_sharding_benchmark_quick(tmp_path):
  proc = subprocess.run([sys.executable, BENCHMARK, "--quick", "--results_dir", str(tmp_path)],
                        cwd=REPO, env={**os.environ, "XLA_FLAGS": gpt.FAST_XLA},
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  result = json.loads((tmp_path / "sharding.json").read_text())
  assert result["benchmark"] == "sharding" and result["quick"] is True
  rows = {row["mesh"]: row for row in result["meshes"]}
  assert set(rows) == {"data:8", "data:4,fsdp:2", "data:2,fsdp:4", "fsdp:8"}
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
    assert (tmp_path / "sharding.png").stat().st_size > 0
  except ImportError:
    assert not (tmp_path / "sharding.png").exists()
