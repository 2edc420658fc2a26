"""XLA's cheapest CPU code generation: the one definition tests and benchmarks use.

These options change how XLA's CPU backend emits and optimises machine code,
which happens after buffer assignment: not the program XLA builds (its HLO,
its buffers and their sizes), so results and memory measurements hold, and
compiles are several times faster (stacked_test: 61 s -> 10 s; the whole
test suite 12.2 -> 8.7 minutes; a memory measurement about half). One
exception to the last bit: at level 0, XLA:CPU's fusion emitters (jaxlib
0.12 has no others) round tanh differently in different kernels, so two
programs of the same operations can differ by an ulp where the default
level gives equal bits (tests/library/in_place_test.py, gpt_pipeline_test.py).

* :data:`CODEGEN`: LLVM at optimisation level 0, without its expensive
  passes. Benchmarks pass it as compile options
  (``lowered.compile(CODEGEN)``) where they measure memory or check values;
  ``memory.py`` checks once per full run that it gives the defaults' temp
  bytes. Benchmarks that time compiles or steps leave it out.
* :data:`TESTS`: :data:`CODEGEN` and the CPU backend's older loop emitters
  (``xla_cpu_use_fusion_emitters=false``), which compile a pipelined step
  about three times faster where XLA still has them (jaxlib 0.10; gone by
  0.11.2). :func:`known` keeps the ones the running XLA knows;
  ``tests/conftest.py`` puts those in ``XLA_FLAGS`` before JAX starts, and
  tests give their subprocesses the same (``gpt_driver.xla_env``).

Pure Python, without JAX: conftest imports it before anything starts JAX.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import subprocess
import sys
from typing import Any, Mapping

CODEGEN = {"xla_backend_optimization_level": 0,
           "xla_llvm_disable_expensive_passes": True}
TESTS = {**CODEGEN, "xla_cpu_use_fusion_emitters": False}


def xla_flags(options: Mapping[str, Any] = TESTS) -> str:
  """``options`` as an ``XLA_FLAGS`` value: ``--name=value``, space-separated."""
  def text(value):
    return str(value).lower() if isinstance(value, bool) else str(value)
  return " ".join(f"--{name}={text(value)}" for name, value in options.items())


@functools.lru_cache(maxsize=None)
def _starts_with(flags: str) -> bool:
  """Whether a fresh interpreter starts JAX's CPU backend with ``flags``.

  XLA reads ``XLA_FLAGS`` once, when its first backend starts, and aborts
  the process on a flag it does not know: nothing in this process could
  catch that, and once JAX has started here it is too late to change the
  flags. Its flags come and go between jaxlib releases, so no version table
  is kept: a child interpreter tries them (about a second, once per process
  and set of flags).
  """
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300,
                         check=False)
  return probe.returncode == 0


def known(options: Mapping[str, Any] = TESTS) -> dict[str, Any]:
  """The ``options`` that the installed XLA accepts in ``XLA_FLAGS``.

  Example::

    known()   # TESTS on jaxlib 0.10; CODEGEN alone on 0.12

  Args:
    options: XLA option name -> value.

  Returns:
    ``options`` without those XLA would refuse (one probe when it accepts
    them all, else one per option).
  """
  if _starts_with(xla_flags(options)):
    return dict(options)
  with concurrent.futures.ThreadPoolExecutor() as pool:
    ok = list(pool.map(lambda item: _starts_with(xla_flags(dict([item]))), options.items()))
  return {k: v for (k, v), keep in zip(options.items(), ok) if keep}


def with_flags(given: str, options: Mapping[str, Any] = TESTS) -> str:
  """An ``XLA_FLAGS`` value: the flags of ``options`` that XLA knows and
  ``given`` does not set, then ``given`` (so a flag already there wins)."""
  missing = [flag for flag in xla_flags(known(options)).split()
             if flag.split("=")[0] not in given]
  return " ".join(missing + [given]).strip()
