"""XLA's cheapest CPU code generation: the one definition tests and benchmarks use.

These options change how XLA's CPU backend emits and optimises machine code,
which happens after buffer assignment: not the program XLA builds (its HLO,
its buffers and their sizes), so results and memory measurements hold, and
compiles are several times faster (stacked_test: 61 s -> 10 s; the whole
test suite 12.2 -> 8.7 minutes; a memory measurement about half).

* :data:`CODEGEN`: LLVM at optimisation level 0, without its expensive
  passes. Benchmarks pass it as compile options
  (``lowered.compile(CODEGEN)``) where they measure memory or check values;
  ``memory.py`` checks once per full run that it gives the defaults' temp
  bytes. Benchmarks that time compiles or steps leave it out.
* :data:`TESTS`: :data:`CODEGEN` and the CPU backend's older loop emitters
  (``xla_cpu_use_fusion_emitters=false``), which compile a pipelined step
  about three times faster. ``tests/conftest.py`` puts it in ``XLA_FLAGS``
  before JAX starts; tests give their subprocesses :func:`xla_flags`.

Pure Python, without JAX: conftest imports it before anything starts JAX.
"""

from __future__ import annotations

from typing import Any, Mapping

CODEGEN = {"xla_backend_optimization_level": 0,
           "xla_llvm_disable_expensive_passes": True}
TESTS = {**CODEGEN, "xla_cpu_use_fusion_emitters": False}


def xla_flags(options: Mapping[str, Any] = TESTS) -> str:
  """``options`` as an ``XLA_FLAGS`` value: ``--name=value``, space-separated."""
  def text(value):
    return str(value).lower() if isinstance(value, bool) else str(value)
  return " ".join(f"--{name}={text(value)}" for name, value in options.items())


def with_flags(given: str, options: Mapping[str, Any] = TESTS) -> str:
  """An ``XLA_FLAGS`` value: ``options``' flags that ``given`` does not set,
  then ``given`` (so a flag already there wins)."""
  missing = [flag for flag in xla_flags(options).split() if flag.split("=")[0] not in given]
  return " ".join(missing + [given]).strip()
