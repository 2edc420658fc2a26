"""Runs one pytest file as a Bazel test.

Every `py_test` in the top-level BUILD has this file as its `main` and the
test file as its first argument, so the tests stay plain pytest files (test_*
functions, parametrize, fixtures such as tmp_path, conftest.py) and run
unchanged under both `python -m pytest` and `bazel test`:

  python tools/bazel/pytest_runner.py tests/library/loops_test.py [pytest args...]

Under Bazel it also wires pytest into what Bazel provides: the JUnit XML that
Bazel reads per test case ($XML_OUTPUT_FILE), the per-test scratch directory
($TEST_TMPDIR, for tmp_path, and as $HOME, which Bazel 4 leaves unset so that
~ would be the read-only real home) and `bazel test --test_filter=EXPR`
(passed to pytest as `-k EXPR`). It exits with pytest's exit status.
"""

import os
import sys

import pytest


def pytest_args(test_file, extra, env):
  """The pytest command line for one test file under the environment `env`."""
  # The cache provider would write .pytest_cache into Bazel's runfiles tree.
  args = [test_file, "-q", "-p", "no:cacheprovider"]
  if env.get("XML_OUTPUT_FILE"):
    args.append("--junitxml=" + env["XML_OUTPUT_FILE"])
  if env.get("TEST_TMPDIR"):
    args.append("--basetemp=" + os.path.join(env["TEST_TMPDIR"], "pytest"))
  if env.get("TESTBRIDGE_TEST_ONLY"):
    args += ["-k", env["TESTBRIDGE_TEST_ONLY"]]
  return args + list(extra)


def main(argv):
  if len(argv) < 2:
    sys.stderr.write("usage: %s TEST_FILE [PYTEST_ARGS...]\n" % argv[0])
    return 2
  if os.environ.get("TEST_TMPDIR"):
    # In Bazel's sandbox only the test's own directories are writable; caches
    # under ~ (~/.cache, matplotlib's ~/.config) go to its scratch directory.
    os.environ.setdefault("HOME", os.environ["TEST_TMPDIR"])
  return int(pytest.main(pytest_args(argv[1], argv[2:], os.environ)))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
