"""The tests' compile settings (benchmarks/common/fast_compile.py) on the running XLA.

``tests/conftest.py`` puts :data:`fast_compile.TESTS` in ``XLA_FLAGS`` before
JAX starts, keeping only the options this XLA knows: XLA aborts the process
on a flag it does not know, and its flags come and go between jaxlib
releases, so this runs on every JAX that CI tests (not only where the
benchmarks run).
"""

from benchmarks.common import fast_compile


def test_fast_compile_keeps_only_flags_xla_knows():
  # CODEGEN's options are XLA's own (benchmarks pass them as compile options);
  # a made-up one would abort XLA at start-up, so it is dropped.
  options = {**fast_compile.CODEGEN, "xla_cpu_no_such_option": True}
  assert fast_compile.known(options) == fast_compile.CODEGEN
  flags = fast_compile.with_flags("--xla_backend_optimization_level=2", options)
  assert flags == ("--xla_llvm_disable_expensive_passes=true "
                   "--xla_backend_optimization_level=2"), flags
