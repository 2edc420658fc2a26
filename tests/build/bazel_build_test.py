"""The top-level BUILD covers every module and every test, so none is forgotten.

BUILD is Starlark, whose syntax is a subset of Python's, so the test evaluates
it with Python stand-ins for `glob()` (Bazel's pattern rules, over this tree)
and for the rules it calls, and then checks the targets it declares against the
files on disk: each ``stacktools/**/*.py`` module is in ``//:stacktools``, each
``tests/<folder>/*_test.py`` has its own ``py_test`` (named after the file,
as ``//:stacked_test``) run by the shared pytest runner,
the GPT example is built, no test imports another test module (what tests
share is in helper modules, which ``//:test_support`` holds with what they
import), and nothing named in BUILD is missing.

Under ``bazel test`` the tree it sees is the test's runfiles, which hold BUILD
and every test file (see ``_TEST_DATA`` in BUILD); under pytest, the checkout.
"""

import ast
import collections
import importlib.util
import os
import re

import pytest

pytestmark = pytest.mark.jax_independent   # see pytest.ini

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = "//tools/bazel:pytest_runner.py"
#: Every test file: tests/<folder>/<topic>_test.py (the folders: house_test.py).
TEST_FILES = "tests/*/*_test.py"
RULES = ("py_library", "py_binary", "py_test", "filegroup", "alias",
         "test_suite", "sh_test", "genrule")
SIZES = ("small", "medium", "large", "enormous")

Rule = collections.namedtuple("Rule", ["kind", "attrs"])


def _tree_files():
  """Every file under ROOT, as a POSIX path relative to it."""
  files = []
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames
                   if not d.startswith(("bazel-", ".git"))]
    rel = os.path.relpath(dirpath, ROOT)
    for name in filenames:
      path = name if rel == "." else os.path.join(rel, name)
      files.append(path.replace(os.sep, "/"))
  return sorted(files)


def _glob_regex(pattern):
  """A regex for one Bazel glob pattern: `*` stays within a directory, `**`
  matches any number of directories."""
  parts = pattern.split("/")
  out = []
  for i, part in enumerate(parts):
    last = i == len(parts) - 1
    if part == "**":
      out.append("(?:[^/]+/)*[^/]+" if last else "(?:[^/]+/)*")
    else:
      seg = "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else
                    re.escape(c) for c in part)
      out.append(seg if last else seg + "/")
  return re.compile("".join(out) + r"\Z")


def _evaluate_build():
  """Runs BUILD; returns ({target name: Rule}, BUILD's globals)."""
  files = _tree_files()
  rules = {}

  def glob(include, exclude=(), allow_empty=True, **unused_kwargs):
    inc = [_glob_regex(p) for p in include]
    exc = [_glob_regex(p) for p in exclude]
    found = [f for f in files
             if any(r.match(f) for r in inc) and not any(r.match(f) for r in exc)]
    assert found or allow_empty, f"glob({include!r}) matches nothing"
    return found

  def rule(kind):
    def define(name, **attrs):
      assert name not in rules, f"BUILD defines :{name} twice"
      rules[name] = Rule(kind, attrs)
    return define

  env = {kind: rule(kind) for kind in RULES}
  env.update(
      glob=glob,
      load=lambda *args: None,
      package=lambda **kwargs: None,
      exports_files=lambda *args, **kwargs: None,
      licenses=lambda *args: None,
  )
  with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
    code = compile(f.read(), "BUILD", "exec")
  exec(code, env)  # pylint: disable=exec-used
  return rules, env


@pytest.fixture(scope="module")
def build():
  return _evaluate_build()


@pytest.fixture(scope="module")
def rules(build):
  return build[0]


def _files(pattern):
  regex = _glob_regex(pattern)
  return [f for f in _tree_files() if regex.match(f)]


def _target(test_file):
  """The py_test of ``test_file``: tests/library/stacked_test.py is
  //:stacked_test (test files' names are unique across the folders)."""
  return os.path.basename(test_file)[:-len(".py")]


def _srcs(rules, *kinds):
  return {src for r in rules.values() if r.kind in kinds
          for src in r.attrs.get("srcs", [])}


def test_every_module_is_in_the_library(rules):
  modules = _files("stacktools/**/*.py")
  assert {"stacktools/__init__.py", "stacktools/remat/_loops.py"} <= set(modules)
  assert "stacktools" in rules, "BUILD has no //:stacktools py_library"
  lib = rules["stacktools"]
  assert lib.kind == "py_library"
  missing = sorted(set(modules) - set(lib.attrs.get("srcs", [])))
  assert not missing, (
      f"{missing} not in //:stacktools: add them to its srcs in BUILD "
      "(or glob them)")
  assert "." in lib.attrs.get("imports", []), (
      "//:stacktools needs imports = ['.'] for `import stacktools` to work "
      "from other workspaces")


def test_every_test_file_has_its_own_py_test(rules):
  test_files = _files(TEST_FILES)
  assert "tests/build/bazel_build_test.py" in test_files
  for test_file in test_files:
    targets = [name for name, r in rules.items()
               if r.kind == "py_test" and test_file in r.attrs.get("srcs", [])]
    assert len(targets) == 1, (
        f"{test_file} is in the srcs of {len(targets)} py_tests {targets}; "
        "BUILD should give each tests/<folder>/*_test.py exactly one")
    assert targets == [_target(test_file)], (
        f"{test_file}'s py_test is :{targets[0]}; it should be named after the "
        f"file, :{_target(test_file)}")
    attrs = rules[targets[0]].attrs
    assert attrs.get("main") == RUNNER, (
        f":{targets[0]} should run {test_file} through {RUNNER}")
    assert any(test_file in arg for arg in attrs.get("args", [])), (
        f":{targets[0]} does not pass {test_file} to the runner in args")
    assert attrs.get("size", "medium") in SIZES
    assert "stacktools" in [d.lstrip(":") for d in attrs.get("deps", [])]


def test_the_gpt_example_is_built(rules):
  example = _files("examples/gpt/*.py")
  assert "examples/gpt/train.py" in example
  missing = sorted(set(example) - _srcs(rules, "py_library", "py_binary"))
  assert not missing, f"{missing} not in any py_library or py_binary in BUILD"
  binaries = [r for r in rules.values() if r.kind == "py_binary"
              and r.attrs.get("main") == "examples/gpt/train.py"]
  assert binaries, "BUILD has no py_binary with main examples/gpt/train.py"


def test_every_file_named_in_build_exists(rules):
  if os.environ.get("TEST_SRCDIR"):
    pytest.skip("under Bazel the runfiles hold only declared files, and Bazel "
                "itself fails the build on a missing one")
  files = set(_tree_files())
  for name, r in rules.items():
    for attr in ("srcs", "data", "main"):
      value = r.attrs.get(attr, [])
      for label in [value] if isinstance(value, str) else value:
        if label.startswith((":", "//", "@")):
          continue
        assert label in files, f":{name} {attr} names {label}, which is missing"


def _docs_read_by(test_file):
  """The files under docs/ that ``test_file`` names as os.path.join(...,
  "docs", "a", "b.md") (each literal after "docs" a path component)."""
  with open(os.path.join(ROOT, test_file), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  found = set()
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "join"):
      continue
    parts = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None
             for a in node.args]
    if "docs" in parts:
      rest = parts[parts.index("docs"):]
      if None not in rest and len(rest) > 1:
        found.add("/".join(rest))
  return found


def test_every_docs_file_a_test_reads_is_its_data(rules):
  # Under Bazel a test sees only its declared files: a page it opens that
  # its target does not declare fails there (house_test and
  # over_layers_test once did), while pytest on the checkout passes.
  support = set(rules["test_support"].attrs.get("data", []))
  for test_file in _files(TEST_FILES):
    target = rules[_target(test_file)]
    declared = set(target.attrs.get("data", [])) | support
    missing = sorted(_docs_read_by(test_file) - declared)
    assert not missing, (
        f"{test_file} reads {missing}, which its py_test does not declare: add "
        f"them to its entry of _TEST_DATA in BUILD.")


_IMPORT_TEST_MODULE = re.compile(r"\bimport\s+(\w+_test)\b|\bfrom\s+(\w+_test)\s+import\b")


def _imported_test_files(test_file):
  """The tests/*/*_test.py files that `test_file` imports, directly or not."""
  by_module = {os.path.basename(f)[:-len(".py")]: f for f in _files(TEST_FILES)}
  found, todo = set(), [test_file]
  while todo:
    with open(os.path.join(ROOT, todo.pop()), encoding="utf-8") as f:
      text = f.read()
    for match in _IMPORT_TEST_MODULE.finditer(text):
      path = by_module.get(match.group(1) or match.group(2))
      if path is not None and path != test_file and path not in found:
        found.add(path)
        todo.append(path)
  return found


def test_no_test_module_imports_another(rules):
  # What tests share lives in helper modules (tests/helpers/*.py,
  # in //:test_support), so that each test's Bazel target needs only its own
  # file and no test depends on another test's internals. The search is
  # textual: it also finds an import in a subprocess's code string.
  for test_file in _files(TEST_FILES):
    imported = sorted(_imported_test_files(test_file))
    assert not imported, (
        f"{test_file} imports the test modules {imported}: move what it uses to "
        "a helper module under tests/ (e.g. tests/helpers/gpt_driver.py)")


_PACKAGE_TARGETS = {"stacktools": "stacktools", "examples": "gpt", "benchmarks": "benchmarks"}


def _imported_packages(path):
  """The top-level packages of this repository that ``path`` imports."""
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module.split(".")[0])
  return names & set(_PACKAGE_TARGETS)


def test_test_helpers_depend_on_what_they_import(rules):
  support = rules.get("test_support")
  assert support is not None, "BUILD has no //:test_support py_library"
  deps = {d.lstrip(":") for d in support.attrs.get("deps", [])}
  for helper in support.attrs.get("srcs", []):
    for package in _imported_packages(helper):
      assert _PACKAGE_TARGETS[package] in deps, (
          f"{helper} imports {package}, but //:test_support does not depend on "
          f":{_PACKAGE_TARGETS[package]}")


def test_per_test_settings_name_existing_tests(build):
  _, env = build
  test_files = set(_files(TEST_FILES))
  for table in ("_TEST_SIZE", "_TEST_DATA", "_CI_TESTS"):
    stale = sorted(set(env.get(table, {})) - test_files)
    assert not stale, f"BUILD's {table} names tests that do not exist: {stale}"
  for test_file, size in env.get("_TEST_SIZE", {}).items():
    assert size in SIZES, f"{test_file}: size {size!r} is not one of {SIZES}"


def test_ci_runs_a_few_tests_under_bazel(rules):
  # .ci/run builds every target and runs the tests tagged "ci"; the others
  # pytest has run already.
  tagged = sorted(name for name, r in rules.items()
                  if r.kind == "py_test" and "ci" in r.attrs.get("tags", []))
  assert "bazel_build_test" in tagged, tagged
  assert len(tagged) < len(_files(TEST_FILES)) // 2, tagged
  if os.environ.get("TEST_SRCDIR"):
    return  # .ci/run is not in a test's runfiles
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    script = f.read()
  assert "bazel --batch build //..." in script
  assert "--test_tag_filters=ci" in script


def test_glob_regex_follows_bazel_rules():
  assert _glob_regex("tests/*_test.py").match("tests/scan_test.py")
  assert not _glob_regex("tests/*_test.py").match("tests/sub/scan_test.py")
  assert _glob_regex(TEST_FILES).match("tests/library/scan_test.py")
  assert not _glob_regex(TEST_FILES).match("tests/scan_test.py")
  assert not _glob_regex(TEST_FILES).match("tests/library/sub/scan_test.py")
  assert _glob_regex("stacktools/**/*.py").match("stacktools/loops.py")
  assert _glob_regex("stacktools/**/*.py").match("stacktools/a/b/c.py")
  assert _glob_regex("tests/**").match("tests/data/x.txt")
  assert not _glob_regex("tests/**").match("tests")


def _load_runner():
  path = os.path.join(ROOT, "tools", "bazel", "pytest_runner.py")
  spec = importlib.util.spec_from_file_location("pytest_runner", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_runner_passes_bazel_settings_to_pytest():
  runner = _load_runner()
  assert runner.pytest_args("tests/library/a_test.py", [], {})[0] == \
      "tests/library/a_test.py"
  args = runner.pytest_args(
      "tests/library/a_test.py", ["-x"],
      {"XML_OUTPUT_FILE": "/o/test.xml", "TEST_TMPDIR": "/t",
       "TESTBRIDGE_TEST_ONLY": "nested"})
  assert "--junitxml=/o/test.xml" in args
  assert "--basetemp=" + os.path.join("/t", "pytest") in args
  assert args[args.index("-k") + 1] == "nested"
  assert args[-1] == "-x"
