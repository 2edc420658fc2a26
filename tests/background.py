"""The test run's slow subprocesses, started as soon as the tests are collected.

The suite runs in one process, which compiles on one core at a time. A few
tests check what a subprocess of their own computes, and that subprocess
depends on nothing the other tests do:

* ``pipeline_cases``: tests/pipeline_cases.py on 8 virtual devices
  (tests/pipeline_test.py);
* ``docs_on_devices``: the doc examples that build meshes, and the
  docstring examples (tests/docs_test.py);
* ``pipeline_benchmark``: ``benchmarks/pipeline.py --quick``, which needs 8
  devices too (tests/benchmarks_test.py).

``tests/conftest.py`` starts the ones that the selected tests need when the
run's tests are known, one after the other in a thread of this process, so
they run on the other core while the tests before theirs run here; a test's
fixture then waits for its job (:func:`result`). What each computes and
checks is as before: only when it runs changes. A fixture whose job was not
started (no collection, as when a test is called directly) runs it there
and then.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

import doc_examples

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 1200   # seconds, per job


@dataclasses.dataclass
class Job:
  """A command, and what became of it: its exit status, its output and the
  folder it wrote into."""
  argv: list[str]
  env: dict[str, str]
  folder: Path
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  returncode: Optional[int] = None
  stdout: str = ""
  stderr: str = ""
  process: Optional[subprocess.Popen] = None

  def check(self) -> "Job":
    """Itself, or an AssertionError with the end of its output if it failed."""
    if self.returncode != 0:
      raise AssertionError(f"{self.argv[1:3]} exited {self.returncode}:\n"
                           f"{self.stdout[-2000:]}\n{self.stderr[-4000:]}")
    return self


def _python_env(**extra: str) -> dict[str, str]:
  env = dict(os.environ, **extra)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


def _pipeline_cases(folder: Path) -> tuple[list[str], dict[str, str]]:
  return ([sys.executable, str(ROOT / "tests" / "pipeline_cases.py"),
           str(folder / "cases.json")], _python_env())


def _docs_on_devices(folder: Path) -> tuple[list[str], dict[str, str]]:
  del folder   # the results come on stdout
  return doc_examples.on_devices_command(doc_examples.device_items())


#: benchmarks/pipeline.py's main() called, as a test called it, from a process
#: whose JAX has 1 device: main() runs the script again with 8 and returns
#: what that wrote, whose name this prints.
_PIPELINE_BENCHMARK = """
import json, sys
import jax
from benchmarks import pipeline
assert jax.device_count() < pipeline.NUM_DEVICES, jax.device_count()
payload = pipeline.main(["--quick", "--results_dir", sys.argv[1]])
print(json.dumps({"benchmark": payload["benchmark"]}))
"""


def _pipeline_benchmark(folder: Path) -> tuple[list[str], dict[str, str]]:
  return [sys.executable, "-c", _PIPELINE_BENCHMARK, str(folder)], _python_env()


#: name -> what to run, given the job's folder: ``(argv, env)``.
COMMANDS: dict[str, Callable[[Path], tuple[list[str], dict[str, str]]]] = {
    "pipeline_cases": _pipeline_cases,
    "docs_on_devices": _docs_on_devices,
    "pipeline_benchmark": _pipeline_benchmark,
}


def needs(item) -> Optional[str]:
  """The job a collected test waits for, or None."""
  name, test = item.path.name, getattr(item, "originalname", None)
  if name == "pipeline_test.py" and "cases" in getattr(item, "fixturenames", ()):
    return "pipeline_cases"
  if name == "docs_test.py":
    callspec = getattr(item, "callspec", None)
    page = callspec.params.get("page") if callspec is not None else None
    if test == "test_the_docstring_examples_run" or (
        test == "test_the_examples_of_a_page_run" and page and doc_examples.page_devices(page)):
      return "docs_on_devices"
  if name == "benchmarks_test.py" and test == "test_pipeline_quick":
    return "pipeline_benchmark"
  return None


_JOBS: dict[str, Job] = {}
_LOCK = threading.Lock()
_STOPPED = threading.Event()
_WORKER: Optional[threading.Thread] = None
_FOLDER: Optional[Path] = None


def _job(name: str) -> Job:
  """The job ``name``, made (not run) on first use."""
  global _FOLDER
  with _LOCK:
    if name not in _JOBS:
      if _FOLDER is None:
        _FOLDER = Path(tempfile.mkdtemp(prefix="stacktools-test-jobs-"))
        atexit.register(shutil.rmtree, _FOLDER, ignore_errors=True)
      folder = _FOLDER / name
      folder.mkdir()
      argv, env = COMMANDS[name](folder)
      _JOBS[name] = Job(argv, env, folder)
    return _JOBS[name]


def start(items) -> None:
  """Starts, in the order of the tests that need them, the jobs of ``items``."""
  global _WORKER
  names = list(dict.fromkeys(filter(None, map(needs, items))))
  if not names:
    return
  jobs = [_job(n) for n in names]
  _WORKER = threading.Thread(target=lambda: [_run(j) for j in jobs if not _STOPPED.is_set()],
                             name="stacktools-test-jobs", daemon=True)
  _WORKER.start()


def _run(job: Job) -> None:
  with _LOCK:   # the fixture's own run and the thread's never both start it
    if job.process is not None or job.done.is_set():
      return
    out = tempfile.TemporaryFile("w+", encoding="utf-8")
    err = tempfile.TemporaryFile("w+", encoding="utf-8")
    try:
      job.process = subprocess.Popen(job.argv, env=job.env, cwd=ROOT, stdout=out,
                                     stderr=err, text=True)
    except OSError as e:
      job.returncode, job.stderr = -1, f"could not start {job.argv[:3]}: {e}"
      job.done.set()
      return
  try:
    job.returncode = job.process.wait(timeout=TIMEOUT)
  except subprocess.TimeoutExpired:
    job.process.kill()
    job.returncode = job.process.wait()
    err.write(f"\n(killed after {TIMEOUT} s)\n")
  finally:
    for f in (out, err):
      f.seek(0)
    job.stdout, job.stderr = out.read(), err.read()
    out.close()
    err.close()
    job.done.set()


def result(name: str) -> Job:
  """The finished job ``name`` (run here and now if no thread started it)."""
  job = _job(name)
  if _WORKER is None or job.process is None and not _WORKER.is_alive():
    _run(job)
  job.done.wait()
  return job


def stop() -> None:
  """Kills what still runs: the test run ended, or was interrupted."""
  _STOPPED.set()
  for job in list(_JOBS.values()):
    if job.process is not None and job.process.poll() is None:
      job.process.kill()
