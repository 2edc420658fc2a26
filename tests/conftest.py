"""Puts the repository root and tests/helpers on sys.path, so tests import
stacktools, examples and benchmarks, and the shared helpers by their bare
names (``import gpt_driver``) from any folder under tests/.

Also compiles with XLA's cheapest CPU code generation
(``benchmarks/common/fast_compile.py``, ``TESTS``): the tests compile hundreds of
small programs, and these settings cut their time about 5x. They change how
the generated code is emitted and optimised, not the program XLA builds (its
HLO, its buffers and their sizes), so memory measurements and results hold;
a flag already in XLA_FLAGS wins. Only those the installed XLA knows are set
(``fast_compile.known``: XLA aborts on a flag it does not know, and jaxlib
0.12 lacks one of them). They are decided and set here, once, before any test
imports JAX, and subprocesses that tests start inherit them.

Every program compiled in the run is kept in a persistent compilation cache
of the run's own (a new temporary folder, inherited by subprocesses), so a
program that several tests or processes build is compiled once: the tests
build many of the same small models. An executable loaded from the cache is
the one compiled (same HLO, same buffers). A ``JAX_COMPILATION_CACHE_DIR``
already set wins.

Once the tests are collected, the slow subprocesses that some of them check
(pipelines and doc examples on 8 devices, the pipeline benchmark) start in
the background, one after the other (``tests/helpers/background.py``): this process
compiles on one core, and they run on the other; the modules that wait for
them run last. The Haiku layer_stack tests run first (see
``pytest_collection_modifyitems``).
"""

import atexit
import os
import shutil
import sys
import tempfile

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_TESTS), os.path.join(_TESTS, "helpers")]

from benchmarks.common import fast_compile  # pylint: disable=wrong-import-position

os.environ["XLA_FLAGS"] = fast_compile.with_flags(os.environ.get("XLA_FLAGS", ""))
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = tempfile.mkdtemp(prefix="stacktools-test-compilation-cache-")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  os.environ.update({"JAX_COMPILATION_CACHE_DIR": _CACHE_DIR,
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})

import background  # pylint: disable=wrong-import-position


def pytest_collection_modifyitems(items):
  """Runs tests/library/haiku_layer_stack_test.py first, and last the modules
  that wait for a background job (tests/helpers/background.py), which
  meanwhile runs.

  Some of Haiku's tests run with ``jax.check_tracer_leaks``, which collects
  garbage at the end of every trace: a collection walks every live object,
  and after the rest of the suite has run there are many more (a
  leak-checked test took 0.9 s at the start and 6.4 s at the end). The tests
  are independent of their order.
  """
  background.order(items)


def pytest_collection_finish(session):
  """Starts the subprocesses that the selected tests wait for (tests/helpers/background.py)."""
  if not session.config.option.collectonly:
    background.start(session.items)


def pytest_unconfigure(config):
  del config
  background.stop()


def pytest_terminal_summary(terminalreporter):
  """Counts the doc examples the run ran (tests/docs/docs_test.py), if any."""
  doc_examples = sys.modules.get("doc_examples")
  if doc_examples is not None and any(doc_examples.COUNTS.values()):
    counts = doc_examples.COUNTS
    terminalreporter.write_line(
        f"doc examples: {sum(counts.values())} blocks run "
        f"({counts['page blocks']} from README.md and docs/, "
        f"{counts['docstring blocks']} from docstrings)")
