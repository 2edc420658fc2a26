"""Starting and collecting the training subprocesses that tests run.

Each process writes its output to a file rather than a pipe (a pipe nobody
reads could fill and block it); :func:`wait` reads the file back.
"""

import os
import socket
import subprocess
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Seconds that the tests wait for their subprocesses, and that a background
# job (tests/helpers/background.py) may take, all of its processes together.
# The background jobs run at the lowest priority, so on a machine that other
# work loads they wait long for the CPU: at 1200 s, pipeline_cases and the
# benchmarks' quick runs were killed under a load average of 10 to 16 on 2
# cores, and at 600 s a distributed_test driver. 40 minutes still stops a
# hung job inside CI's 90.
TIMEOUT = 2400


def deadline(seconds: float = TIMEOUT) -> Callable[[], float]:
  """A clock started now: each call gives the seconds left of ``seconds``
  (0 once they ran out), for waiting on several things within one limit."""
  end = time.monotonic() + seconds
  return lambda: max(0.0, end - time.monotonic())


def free_port() -> int:
  """A TCP port nothing listens on now, for a jax.distributed coordinator."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(args: list[str], env: dict, log_path: str) -> subprocess.Popen:
  """Starts ``args`` in the repository root, its output going to ``log_path``."""
  log = open(log_path, "w+", encoding="utf-8")  # pylint: disable=consider-using-with
  proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  proc.log = log
  return proc


def output(proc: subprocess.Popen) -> str:
  """What ``proc`` has written so far."""
  proc.log.seek(0)
  return proc.log.read()


def wait(proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
  """Waits for ``proc``; returns its output, after checking it succeeded."""
  proc.wait(timeout=timeout)
  text = output(proc)
  assert proc.returncode == 0, f"{proc.args[:4]} failed:\n{text[-5000:]}"
  return text


class Command:
  """``args`` started now in the repository root, a command of its own, its
  stdout and stderr going to two files, ``<log_path>.stdout`` and
  ``<log_path>.stderr``."""

  def __init__(self, args: list[str], env: dict, log_path: str):
    self.files = [open(f"{log_path}.{name}", "w+", encoding="utf-8")  # pylint: disable=consider-using-with
                  for name in ("stdout", "stderr")]
    self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=self.files[0],
                                 stderr=self.files[1], text=True)

  def finish(self, timeout: float = TIMEOUT) -> None:
    self.proc.wait(timeout=timeout)

  def result(self) -> tuple[int, str, str]:
    """Its exit status, stdout and stderr, once it ended."""
    self.finish()
    texts = []
    for f in self.files:
      f.seek(0)
      texts.append(f.read())
    return self.proc.returncode, texts[0], texts[1]

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()
    for f in self.files:
      f.close()
