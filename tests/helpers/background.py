"""The test run's slow subprocesses, started as soon as the tests are collected.

The suite runs in one process, which compiles on one core at a time. Some
tests check what a subprocess of theirs computes, which depends on nothing
the other tests do:

* ``pipeline_cases``: tests/helpers/pipeline_cases.py on 8 virtual devices
  (tests/library/pipeline_test.py);
* ``docs_on_devices``: the doc examples that build meshes, and the
  docstring examples (tests/docs/docs_test.py);
* ``benchmarks_quick``: each benchmark's ``main(["--quick", ...])``, in turn,
  in one process (tests/build/benchmarks_test.py).

A test module may hand its own subprocesses to the background too:
``BACKGROUND = {fixture: task}`` names a module-scoped fixture whose value
``task(folder)`` builds (it starts the module's processes and returns an
object with ``finish()``, which waits for all of them, and ``close()``,
which kills what still runs); the fixture returns :func:`task_result`'s
(tests/example/gpt_pipeline_test.py, tests/example/distributed_test.py, tests/example/gpt_test.py).

``tests/conftest.py`` starts the jobs that the selected tests need once the
tests are collected: :data:`WORKERS` threads of this process take them in
turn, the commands first (:data:`FIRST`), and the tests that wait for them
run last, in that order: the jobs run while the other tests run here, and a
test's fixture then collects its job's result (:func:`result`). The jobs
but the benchmarks' (which time what they run) run at the lowest priority
(niceness 19, which what they start inherits): they take the CPU that this
process, and the subprocesses that the running test waits for, leave idle. What each computes and what the tests check of
it is as before; only when and where it runs changes. A job that was not
started (a test called without a collection) runs when its result is asked
for.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import doc_examples
import subprocesses

ROOT = Path(__file__).resolve().parents[2]
# Seconds a job may take: the tests' one limit on their subprocesses
# (tests/helpers/subprocesses.py says why it is 40 minutes).
TIMEOUT = subprocesses.TIMEOUT
NICENESS = 19    # of the jobs' threads and processes


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
  #: A test module's task (see the module docstring), run in place of argv;
  #: ``value``: what it built.
  task: Optional[Callable[[Path], Any]] = None
  value: Any = None
  taken: bool = False   # by a thread of :func:`start`

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


def _pipeline_cases(folder: Path, items=()) -> tuple[list[str], dict[str, str]]:
  del items
  return ([sys.executable, str(ROOT / "tests" / "helpers" / "pipeline_cases.py"),
           str(folder / "cases.json")], _python_env())


def _docs_on_devices(folder: Path, items=()) -> tuple[list[str], dict[str, str]]:
  del folder, items   # the results come on stdout
  return doc_examples.on_devices_command(doc_examples.device_items())


#: The benchmarks whose quick runs tests/build/benchmarks_test.py checks
#: (``test_<name>_quick``), and the flags each is given besides ``--quick
#: --results_dir``.
BENCHMARKS = {"memory": (), "mixed_layers": ("--no_plot",), "compile_time": (),
              "step_time": (), "layer_rules": (), "depth_edits": (), "remat_plan": (),
              "pipeline": (), "accelerator_gpt": (), "accelerator_decode": (),
              "accelerator_offload": (), "accelerator_train": (), "decode": (),
              "scan_gap": (), "stash_mlp": (), "lora": ()}
#: Marks the line that says what a benchmark's main() gave back.
DONE = "stacktools-benchmark-done: "
#: Calls each benchmark's main(["--quick", "--results_dir", FOLDER/<name>, ...])
#: in turn, in this one process, as the tests once did in theirs: a process
#: whose JAX has 1 device, so pipeline.py's main() starts the script again
#: with its 8. After each, one line: DONE and what main() returned (its
#: "benchmark"), or the error's traceback.
_BENCHMARKS_QUICK = f"""
import importlib, json, os, sys, traceback
folder, names = sys.argv[1], sys.argv[2:]
for name in names:
  extra = json.loads(os.environ["STACKTOOLS_BENCHMARK_FLAGS"])[name]
  os.makedirs(os.path.join(folder, name))
  try:
    payload = importlib.import_module("benchmarks." + name).main(
        ["--quick", "--results_dir", os.path.join(folder, name)] + extra)
    done = {{"name": name, "benchmark": payload["benchmark"]}}
  except Exception:
    done = {{"name": name, "error": traceback.format_exc()[-4000:]}}
  print({DONE!r} + json.dumps(done), flush=True)
"""


def _benchmarks_quick(folder: Path, items=()) -> tuple[list[str], dict[str, str]]:
  selected = {_benchmark_of(item) for item in items}
  names = [n for n in BENCHMARKS if n in selected] or list(BENCHMARKS)
  flags = json.dumps({n: list(f) for n, f in BENCHMARKS.items()})
  return ([sys.executable, "-c", _BENCHMARKS_QUICK, str(folder), *names],
          _python_env(STACKTOOLS_BENCHMARK_FLAGS=flags))


def benchmark_outcome(job: Job, name: str) -> dict:
  """What benchmark ``name``'s main() gave back in ``job`` (its "benchmark", or
  its "error"), and the folder it wrote into."""
  job.check()
  for line in job.stdout.splitlines():
    if line.startswith(DONE):
      done = json.loads(line[len(DONE):])
      if done["name"] == name:
        return dict(done, folder=job.folder / name)
  raise AssertionError(f"benchmarks/{name}.py did not run:\n{job.stdout[-2000:]}")


def _benchmark_of(item) -> Optional[str]:
  test = getattr(item, "originalname", "") or ""
  if item.path.name == "benchmarks_test.py" and test.startswith("test_") and \
      test.endswith("_quick") and test[len("test_"):-len("_quick")] in BENCHMARKS:
    return test[len("test_"):-len("_quick")]
  return None


#: name -> what to run, given the job's folder and the selected tests:
#: ``(argv, env)``.
COMMANDS: dict[str, Callable[..., tuple[list[str], dict[str, str]]]] = {
    "pipeline_cases": _pipeline_cases,
    "docs_on_devices": _docs_on_devices,
    "benchmarks_quick": _benchmarks_quick,
}


#: name -> a test module's task (see the module docstring).
_TASKS: dict[str, Callable[[Path], Any]] = {}


def _task_name(task: Callable[[Path], Any]) -> str:
  name = f"{task.__module__}.{task.__name__}"
  _TASKS.setdefault(name, task)
  return name


def needs(item) -> Optional[str]:
  """The job a collected test waits for, or None."""
  name, test = item.path.name, getattr(item, "originalname", None)
  module = getattr(item, "module", None)
  for fixture, task in getattr(module, "BACKGROUND", {}).items():
    if fixture in getattr(item, "fixturenames", ()):
      return _task_name(task)
  if name == "pipeline_test.py" and "cases" in getattr(item, "fixturenames", ()):
    return "pipeline_cases"
  if name == "docs_test.py":
    callspec = getattr(item, "callspec", None)
    page = callspec.params.get("page") if callspec is not None else None
    if test == "test_the_docstring_examples_run" or (
        test == "test_the_examples_of_a_page_run" and page and doc_examples.page_devices(page)):
      return "docs_on_devices"
  if _benchmark_of(item):
    return "benchmarks_quick"
  return None


#: The commands, in the order they start (the longest first); the tasks
#: come after them, in the order of their modules.
FIRST = ("benchmarks_quick", "pipeline_cases", "docs_on_devices")
#: How many jobs run at once (each in a thread of its own, one after another).
WORKERS = 2
#: The jobs that run at the usual priority: the benchmarks time what they
#: run, and some of their checks compare two timings.
AT_USUAL_PRIORITY = ("benchmarks_quick",)


def _queue(names) -> list[str]:
  """``names`` in the order the jobs start: :data:`FIRST`, then the rest."""
  return sorted(names, key=lambda n: FIRST.index(n) if n in FIRST else len(FIRST))


def order(items) -> None:
  """Sorts ``items`` in place: tests/library/haiku_layer_stack_test.py first (see
  tests/conftest.py), the tests that wait for a job last, in the order the
  jobs start, the rest in between; else in their order."""
  queue = _queue(dict.fromkeys(filter(None, map(needs, items))))

  def key(item):
    job = needs(item)
    return (0 if item.path.name == "haiku_layer_stack_test.py" else
            1 if job is None else 2 + queue.index(job))
  items.sort(key=key)


_JOBS: dict[str, Job] = {}
_QUEUED: set[str] = set()   # the jobs the thread runs
_LOCK = threading.Lock()
_STOPPED = threading.Event()
_WORKERS: list[threading.Thread] = []
_FOLDER: Optional[Path] = None


def _job(name: str, items=()) -> Job:
  """The job ``name`` for the selected tests ``items``, made (not run) on first use."""
  global _FOLDER
  with _LOCK:
    if name not in _JOBS:
      if _FOLDER is None:
        _FOLDER = Path(tempfile.mkdtemp(prefix="stacktools-test-jobs-"))
        atexit.register(shutil.rmtree, _FOLDER, ignore_errors=True)
      folder = _FOLDER / name
      folder.mkdir()
      if name in _TASKS:
        _JOBS[name] = Job([], {}, folder, task=_TASKS[name])
      else:
        argv, env = COMMANDS[name](folder, items)
        _JOBS[name] = Job(argv, env, folder)
    return _JOBS[name]


def start(items) -> None:
  """Starts the jobs of ``items``: :data:`WORKERS` threads take them in turn,
  in :func:`_queue`'s order."""
  names = _queue(dict.fromkeys(filter(None, map(needs, items))))
  if not names:
    return
  jobs = [_job(n, items) for n in names]
  _QUEUED.update(names)
  for _ in range(min(WORKERS, len(jobs))):
    worker = threading.Thread(target=_work, args=(jobs,), name="stacktools-test-jobs",
                              daemon=True)
    _WORKERS.append(worker)
    worker.start()


def _work(jobs: list[Job]) -> None:
  """Runs the jobs that no other thread took yet, in turn, each in a thread
  of its own at its priority (:func:`_niced`)."""
  while True:
    with _LOCK:
      job = next((j for j in jobs if not j.taken), None)
      if job is None:
        return
      job.taken = True
    if _STOPPED.is_set():
      job.returncode, job.stderr = -1, "the test run stopped first"
      job.done.set()
    else:
      thread = threading.Thread(target=_niced, args=(job,), name="stacktools-test-job")
      thread.start()
      thread.join()


def _niced(job: Job) -> None:
  """Runs ``job`` in this thread, at the lowest priority unless it measures
  time (:data:`AT_USUAL_PRIORITY`).

  On Linux a thread has a priority of its own, which the processes and
  threads it starts inherit.
  """
  if _name(job) not in AT_USUAL_PRIORITY:
    try:
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except (AttributeError, OSError):   # elsewhere: at the usual priority
      pass
  _run(job)


def _name(job: Job) -> str:
  return next(name for name, j in _JOBS.items() if j is job)


def _run(job: Job) -> None:
  if job.task is not None:
    _run_task(job)
    return
  with _LOCK:   # the fixture's own run and the thread's never both start it
    if job.process is not None or job.done.is_set():
      return
    out = tempfile.TemporaryFile("w+", encoding="utf-8")
    err = tempfile.TemporaryFile("w+", encoding="utf-8")
    try:
      job.process = subprocess.Popen(job.argv, env=job.env, cwd=ROOT, stdout=out,
                                     stderr=err, text=True)
    except OSError as e:
      out.close()
      err.close()
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


def _run_task(job: Job) -> None:
  """Builds the task's value (its processes start) and waits for them; an
  error is kept for the tests that use the value."""
  with _LOCK:
    if job.returncode is not None or job.done.is_set():
      return
    job.returncode = -1   # started
  try:
    job.value = job.task(job.folder)
    job.value.finish()
    job.returncode = 0
  except BaseException:  # pylint: disable=broad-except
    job.returncode, job.stderr = -1, traceback.format_exc()
  finally:
    job.done.set()


def result(name: str) -> Job:
  """The finished job ``name`` (run here and now if the thread does not run it)."""
  job = _job(name)
  if name not in _QUEUED:
    _run(job)
  job.done.wait()
  return job


def task_result(task: Callable[[Path], Any]) -> Any:
  """What a test module's ``task`` built, once its processes finished (see
  the module docstring); close it when the module is done with it."""
  job = result(_task_name(task))
  if job.value is None or job.returncode != 0:
    if job.value is not None:
      job.value.close()
    raise AssertionError(f"{_task_name(task)} failed:\n{job.stderr[-4000:]}")
  return job.value


def stop() -> None:
  """Kills what still runs: the test run ended, or was interrupted."""
  _STOPPED.set()
  for job in list(_JOBS.values()):
    if job.process is not None and job.process.poll() is None:
      job.process.kill()
    if job.value is not None:
      job.value.close()
