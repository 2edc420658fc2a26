"""Training runs of the GPT example for tests: one tiny model, one driver.

gpt_test.py, gpt_pipeline_test.py, distributed_test.py and checkpoint_test.py
train ``examples/gpt/train.py`` in subprocesses, and share what is here:

* :data:`TINY`: the flags of a tiny model that trains 20 steps in seconds;
* :func:`xla_env`: the environment of a run, compiled with XLA's cheap
  settings (``benchmarks/common/fast_compile.py``: how fast the code compiles, not
  what it computes), on as many virtual CPU devices as asked;
* a *driver* (:func:`start_driver`): a fresh interpreter that calls
  ``train.train(config, workdir)`` in-process once per spec, with no absl
  flags involved (:func:`drive`), so that one interpreter pays the JAX
  import for many runs, with the test run's persistent compilation cache
  (``tests/conftest.py``'s), so that runs, and drivers, share the programs
  they have in common;
* readers of what a run leaves in its workdir.

A helper, not a test module: no test module imports another one. It
imports no JAX at module level (gpt_pipeline_test's pytest process never
imports JAX).
"""

import json
import os
import sys
import traceback
from typing import Optional

import numpy as np

from benchmarks.common import fast_compile
from subprocesses import start, wait

HELPERS = os.path.dirname(os.path.abspath(__file__))   # tests/helpers
REPO = os.path.dirname(os.path.dirname(HELPERS))
TRAIN = os.path.join(REPO, "examples", "gpt", "train.py")
SAMPLE = os.path.join(REPO, "examples", "gpt", "sample.py")

NUM_LAYERS = 2
STEPS = 20
# A tiny model; one record per step; evaluation only at the last step.
TINY = dict(num_layers=NUM_LAYERS, d_model=16, num_heads=2, seq_len=16,
            batch_size=4, steps=STEPS, learning_rate=1e-2, warmup_steps=1,
            log_every=1, eval_every=1000, eval_batches=1, sample_tokens=0)
WORKDIR_FILES = {"checkpoints", "metrics.jsonl"}  # and loss.png, with matplotlib
SENTENCES = (
    "the cat sat on the mat.", "a dog ran to the red ball.",
    "we like to read a good book at night.", "she sang a song in the garden.",
    "it is a fine day for a walk by the river.", "he drank a cup of hot tea.",
)


def xla_env(devices: Optional[int] = None, **extra: str) -> dict:
  """This process's environment with ``XLA_FLAGS`` set to the cheap settings
  this XLA knows (``fast_compile.known``, decided once per process: conftest
  has), ``devices`` virtual CPU devices when given, and ``extra``."""
  flags = fast_compile.xla_flags(fast_compile.known())
  if devices is not None:
    flags += f" --xla_force_host_platform_device_count={devices}"
  return {**os.environ, "XLA_FLAGS": flags, **extra}


def cache_env(cache_dir: str) -> dict:
  """Environment variables that give a ``train.py`` process a persistent
  compilation cache in ``cache_dir`` that keeps every program."""
  return {"JAX_COMPILATION_CACHE_DIR": cache_dir,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


# The line a multi-process CPU train.py logs where it turns the persistent
# compilation cache off (examples/gpt/distributed.py: avoid_cache_hang), and
# the first jax that it does so on: a program with cross-process collectives
# loaded from the cache hangs there (docs/guides/troubleshooting.md).
CACHE_OFF = "Persistent compilation cache off in this run"
CACHE_HANGS_FROM = (0, 12, 1)


def jax_version() -> tuple[int, ...]:
  """The installed jax's version, ``(0, 12, 0, 1)``, read without importing it."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  parts = []
  for part in importlib.metadata.version("jax").split("."):
    if not part.isdigit():
      break
    parts.append(int(part))
  return tuple(parts)


def assert_cache_off_where_it_hangs(log: str) -> None:
  """A multi-process run's log says that the cache is off exactly where
  loading from it hangs: from :data:`CACHE_HANGS_FROM` on."""
  assert (CACHE_OFF in log) == (jax_version() >= CACHE_HANGS_FROM), log


# ---------------------------------------------------------------------------
# Drivers.


def drive(spec_path: str, out_path: str, cache_dir: str, tf_after_import=False) -> None:
  """Runs ``train.train`` once per spec in this process; writes logs and errors.

  A spec's flags (train.py's, by name) become a ``run_config.TrainConfig``
  and its workdir, as train.py's ``main`` makes them from the command line.

  Called in a fresh interpreter (see :func:`start_driver`). Programs that
  several runs share (the init, most evaluations, a resumed run's step)
  compile once, through the persistent compilation cache ``cache_dir``
  (the test run's, which the other drivers and processes of the run
  share: a program with the same HLO, options and device count compiles
  once in the run). Per run it records the raised traceback (``error``), the message
  of a run that exits as the binary's start-up errors do (``exit``) and the
  absl log (``log``); and whether the runs imported TensorFlow, beside
  ``tf_after_import``: what ``import stacktools`` imported of TensorFlow
  and Orbax (a list), or False when not checked.
  """
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  from examples.gpt import run_config  # pylint: disable=g-import-not-at-top
  from examples.gpt import train  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.INFO)
  lines = []
  handler = py_logging.Handler()
  handler.emit = lambda record: lines.append(record.getMessage())
  py_logging.getLogger("absl").addHandler(handler)
  with open(spec_path, encoding="utf-8") as f:
    specs = json.load(f)
  results = []
  for spec in specs:
    del lines[:]
    error = exit_message = None
    values = dict(spec["flags"])
    workdir = values.pop("workdir", "workdir/gpt")   # --workdir's default
    # The list flags are tuples in the frozen config, as flags.config() makes them.
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
      train.train(run_config.TrainConfig(**values), workdir)
    except SystemExit as e:
      exit_message = str(e.code)
    except BaseException:  # pylint: disable=broad-except
      error = traceback.format_exc()
    results.append({"name": spec["name"], "error": error, "exit": exit_message,
                    "log": "\n".join(lines)})
  out = {"runs": results, "tf_after_import": tf_after_import,
         "tf_after_runs": "tensorflow" in sys.modules}
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(out, f)


def drive_cli(spec_path: str, out_path: str, script: str = TRAIN) -> None:
  """Runs ``script``'s command lines in this process, as each would run alone.

  Called in a fresh interpreter (see :func:`start_cli_driver`), so that one
  interpreter pays the imports for many short runs (a run that stops at
  start-up costs little beside them). ``script`` is :data:`TRAIN` or
  :data:`SAMPLE`; each spec is a list of arguments. Per run, what
  ``python SCRIPT ARGS`` would write to file descriptors 1 (``stdout``:
  sample.py's text) and 2 (``stderr``: absl's log, Python's exit message or
  traceback, XLA's own lines) and its exit status:
  ``{"rc": int, "stdout": str, "stderr": str}``. The flags are reset between
  runs; absl's app.run parses them again on each.
  """
  import tempfile  # pylint: disable=g-import-not-at-top
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  if script == SAMPLE:
    from examples.gpt import sample as binary  # pylint: disable=g-import-not-at-top
    from examples.gpt import sample_flags  # pylint: disable=g-import-not-at-top
    sample_flags.define()   # as sample.py does as __main__
  else:
    from examples.gpt import train as binary  # pylint: disable=g-import-not-at-top

  def parse(argv):   # as app.run's first parse: INFO unless --verbosity is given
    args = app.parse_flags_with_usage(argv)
    if flags.FLAGS["verbosity"].using_default_value:
      flags.FLAGS.verbosity = 0
    return args

  with open(spec_path, encoding="utf-8") as f:
    specs = json.load(f)
  results = []
  for args in specs:
    flags.FLAGS.unparse_flags()
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out, \
        tempfile.TemporaryFile("w+", encoding="utf-8") as err:
      sys.stdout.flush()
      sys.stderr.flush()
      saved = os.dup(1), os.dup(2)
      os.dup2(out.fileno(), 1)
      os.dup2(err.fileno(), 2)
      rc = 0
      try:
        app.run(binary.main, argv=[script, *args], flags_parser=parse)
      except SystemExit as e:   # as the interpreter reports it at exit
        if isinstance(e.code, int):
          rc = e.code
        elif e.code is not None:
          print(e.code, file=sys.stderr)
          rc = 1
      except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        rc = 1
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved_fd in zip((1, 2), saved):
          os.dup2(saved_fd, fd)
          os.close(saved_fd)
      out.seek(0)
      err.seek(0)
      results.append({"rc": rc, "stdout": out.read(), "stderr": err.read()})
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(results, f)


def start_cli_driver(tmp: str, label: str, specs: list[list[str]], env: dict,
                     script: str = TRAIN):
  """Starts :func:`drive_cli` on ``specs`` (argument lists of ``script``, run
  in order).

  Returns:
    ``(process, out_path)``, as :func:`start_driver`.
  """
  spec_path = os.path.join(tmp, f"cli_driver_{label}.json")
  out_path = os.path.join(tmp, f"cli_driver_{label}.out.json")
  with open(spec_path, "w", encoding="utf-8") as f:
    json.dump(specs, f)
  code = ("import sys; sys.modules['matplotlib'] = None; sys.path[:0] = sys.argv[1:3]; "
          "import gpt_driver; gpt_driver.drive_cli(*sys.argv[3:6])")
  proc = start([sys.executable, "-c", code, REPO, HELPERS, spec_path, out_path, script], env,
               os.path.join(tmp, f"cli_driver_{label}.log"))
  return proc, out_path


def cli_results(driver) -> list[dict]:
  """What :func:`start_cli_driver`'s ``driver`` (``(process, out_path)``)
  recorded, once it finished: one ``{"rc", "stdout", "stderr"}`` per spec."""
  proc, out_path = driver
  wait(proc)
  with open(out_path, encoding="utf-8") as f:
    return json.load(f)


class CliRuns:
  """The runs of a :func:`start_cli_driver` started on ``specs`` (``{key:
  arguments}``), read when first asked for, so that a test computes its own
  side while the driver runs: ``runs[key]`` is ``(exit status, stdout,
  stderr)``."""

  def __init__(self, tmp: str, label: str, specs: dict, env: dict, script: str = TRAIN):
    self.keys = list(specs)
    self.driver = start_cli_driver(tmp, label, list(specs.values()), env, script)
    self._runs = None

  def __getitem__(self, key) -> tuple[int, str, str]:
    if self._runs is None:
      try:
        results = cli_results(self.driver)
      finally:
        self.close()
      self._runs = {key: (r["rc"], r["stdout"], r["stderr"])
                    for key, r in zip(self.keys, results)}
    return self._runs[key]

  def close(self) -> None:
    proc = self.driver[0]
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    proc.log.close()


def one_line_error(returncode: int, stderr: str, fragments=(), what: str = "") -> str:
  """The one line a command that stopped at start-up printed, after checking
  it: a non-zero exit, no traceback, one line on stderr besides absl's "Pass
  --helpshort" hint, holding every fragment. ``what`` names the case in the
  assertion messages."""
  assert returncode != 0, f"{what}: exited 0"
  assert "Traceback" not in stderr, f"{what}:\n{stderr}"
  lines = [l for l in stderr.strip().splitlines() if not l.startswith("Pass --helpshort")]
  assert len(lines) == 1, f"{what}:\n{stderr}"
  for fragment in fragments:
    assert fragment in lines[0], f"{what}: {fragment!r} not in {lines[0]!r}"
  return lines[0]


def bad_flag_runs(tmp: str, label: str, cases: list, base: dict) -> CliRuns:
  """train.py's command line of each ``(flags, fragments)`` of ``cases``
  (``base`` then ``flags``, in workdir ``tmp/work<i>``), run one after
  another in one interpreter, as each would run alone; ``runs[i]`` is the
  i-th case's ``(exit status, stdout, stderr)``."""
  specs = {i: as_args({**base, "workdir": os.path.join(tmp, f"work{i}"), **flags})
           for i, (flags, _) in enumerate(cases)}
  return CliRuns(tmp, label, specs, xla_env())


def start_driver(tmp: str, label: str, specs: list[dict], env: dict, *,
                 plot: bool = False, check_imports: bool = False):
  """Starts a driver of ``specs`` (``{"name": ..., "flags": {...}}``, run in order).

  Its files go in ``tmp``, named after ``label``. ``plot=False`` blocks
  matplotlib (no loss.png: its import and drawing cost a second of CPU per
  run); ``check_imports`` imports stacktools first and records what that
  imported of TensorFlow and Orbax. Its compilation cache is the test run's
  (``JAX_COMPILATION_CACHE_DIR``, which ``tests/conftest.py`` sets; else one
  of its own in ``tmp``): the tests' drivers build many of the same programs
  of the tiny model (measured: gpt_dtype, gpt_layers and gpt_depth_test's
  drivers 12.6 s of CPU less, about 8%).

  Returns:
    ``(process, out_path)``: collect the process with ``subprocesses.wait``,
    then read the runs from ``out_path`` (see :func:`drive`).
  """
  label = label.replace(" ", "_")
  spec_path = os.path.join(tmp, f"driver_{label}.json")
  out_path = os.path.join(tmp, f"driver_{label}.out.json")
  with open(spec_path, "w", encoding="utf-8") as f:
    json.dump(specs, f)
  code = "import sys; "
  if not plot:
    code += "sys.modules['matplotlib'] = None; "
  if check_imports:
    code += ("import stacktools; "
             "tf = [m for m in ('tensorflow', 'orbax') if m in sys.modules]; ")
  else:
    code += "tf = False; "
  code += ("sys.path[:0] = sys.argv[1:3]; import gpt_driver; "
           "gpt_driver.drive(*sys.argv[3:6], tf)")
  proc = start([sys.executable, "-c", code, REPO, HELPERS, spec_path, out_path,
                os.environ.get("JAX_COMPILATION_CACHE_DIR")
                or os.path.join(tmp, f"jax_cache_{label}")],
               env, os.path.join(tmp, f"driver_{label}.log"))
  return proc, out_path


# ---------------------------------------------------------------------------
# Inputs and outputs of a run.


def write_corpus(path: str, repeats: int = 120) -> str:
  """A few KB of simple English, deterministic."""
  lines = [" ".join(SENTENCES[(i * k) % len(SENTENCES)] for k in (1, 2, 5))
           for i in range(repeats)]
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  return path


def as_args(flags: dict) -> list[str]:
  """Command-line flags: ``--name=value``, a list as comma-separated values."""
  return [f"--{k}={','.join(v) if isinstance(v, list) else v}" for k, v in flags.items()]


def read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def train_losses(workdir: str) -> np.ndarray:
  return np.array([r["train_loss"] for r in read_metrics(workdir)])


def load_checkpoint(workdir: str) -> dict[str, np.ndarray]:
  """The latest checkpoint's arrays on the host, read through Orbax whatever
  mesh saved them: ``{"params/h/block/fc/w": ..., "opt_state/...": ...}``."""
  from examples.gpt import restoring  # pylint: disable=g-import-not-at-top
  return {f"{item}/{key}": value for item in ("params", "opt_state")
          for key, value in restoring.read_arrays(workdir, item=item).items()}


def load_meta(workdir: str) -> dict:
  """The latest checkpoint's metadata (step, sampler state, config, chars)."""
  from examples.gpt import saving  # pylint: disable=g-import-not-at-top
  return saving.latest(workdir)[1]


def load_export(path: str) -> tuple[dict[str, np.ndarray], dict]:
  """What ``--export_npz`` wrote: the parameters by key, and the run's metadata."""
  from examples.gpt import saving  # pylint: disable=g-import-not-at-top
  return saving.load_npz(path), saving.read_export(path)[1]


def listing(path: str) -> set[str]:
  return set(os.listdir(path)) if os.path.exists(path) else set()


def assert_only_outputs(workdir: str) -> None:
  """The run's outputs and no temporary or partial files."""
  assert listing(workdir) - {"loss.png"} == WORKDIR_FILES, listing(workdir)
