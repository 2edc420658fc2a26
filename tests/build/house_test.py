"""The package's layout rules, read from its source: small rooms, one direction.

Checked against the source of ``stacktools/`` itself (not a picture of it):

* every module lives in a subpackage (a *room*); the package's top level
  holds only *faces*: ``__init__.py`` and the public modules kept at their
  first paths (``depth``, ``loops``, ``policy``), and each subpackage has a
  face too. A face only re-exports (imports, ``__all__``, its docstring) and
  says in its docstring what it holds; a subpackage's face also says which
  other subpackages its rooms may import (``May import:``);
* no module over :data:`MAX_LINES` lines, in ``examples/`` and ``benchmarks/``
  too, and no benchmark edits ``sys.path`` (they run as ``python -m
  benchmarks.<name>``);
* no function over :data:`MAX_FUNCTION_LINES` lines without a docstring;
* no circle among the modules' imports, and none among the subpackages';
  a room imports from another subpackage only what that face allows;
* no room imports a face (a package's ``__init__``) rather than a module;
* no module uses another module's private (``_name``) attributes;
* the rooms stand on at most :data:`MAX_FLOORS` floors;
* the picture of the house on docs/development/internals.md is the one the
  imports draw today (``python tests/build/house_test.py`` prints it).

And against the files of ``tests/``: each test file sits in the folder of
what it tests (:data:`TEST_FOLDERS`), under a name of its own, the helpers
in ``tests/helpers/``, and nothing at the top but ``conftest.py``.

And against the source of ``examples/``: the training binary is ``main`` plus
``train(config, workdir)``; only the flags modules (:data:`FLAG_MODULES`)
define or read a flag (``flags.DEFINE_*``, ``flags.FLAGS``, a flag holder's
``.value``), every other function takes the values it needs.
"""

import ast
import os
import re
import sys

import pytest

pytestmark = pytest.mark.jax_independent   # see pytest.ini: source text only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "stacktools")
MAX_LINES = 400
MAX_FUNCTION_LINES = 80
EXAMPLES = os.path.join(ROOT, "examples")
#: The example's modules that define and read flags, one per binary; every
#: other module takes a frozen config (examples/gpt/run_config.py).
FLAG_MODULES = ("gpt/flags.py", "gpt/sample_flags.py")
#: Issue 53's aim. The two chains that reach it: the planner's entry points
#: over choose (or compile, or the trace), the cost model and the engine's
#: segments; layer_stack and Stacked over run_stacked, the engine's loops
#: and segments. Never raise it.
MAX_FLOORS = 8
FACE = "__init__"


def _modules():
  """Every module of the package by its path under ``stacktools/`` without
  ``.py``: ``__init__``, ``depth``, ``remat/__init__``, ``remat/_loops``."""
  found = []
  for dirpath, dirnames, filenames in os.walk(PACKAGE):
    dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
    folder = os.path.relpath(dirpath, PACKAGE)
    found += [f[:-3] if folder == "." else f"{folder}/{f[:-3]}"
              for f in filenames if f.endswith(".py")]
  return sorted(found)


def _subpackages():
  return sorted({m.split("/")[0] for m in _modules() if "/" in m})


def _is_face(module):
  """Faces: every ``__init__`` and every module at the package's top level."""
  return "/" not in module or module.endswith("/" + FACE)


def _rooms():
  return [m for m in _modules() if not _is_face(m)]


def _tree(module):
  with open(os.path.join(PACKAGE, f"{module}.py"), encoding="utf-8") as f:
    source = f.read()
  return source, ast.parse(source)


def _resolve(dotted):
  """The module ``stacktools.a.b`` names: ``a/b``, or ``a/__init__`` for a
  package; None where it is no module of the package."""
  path = "/".join(dotted.split(".")[1:])
  known = set(_modules())
  if not path:
    return FACE
  if path in known:
    return path
  if f"{path}/{FACE}" in known:
    return f"{path}/{FACE}"
  return None


def _imports(module):
  """``{alias: module}`` of the package's modules that ``module`` imports, and
  the faces it imports names from (rather than a module)."""
  _, tree = _tree(module)
  modules, from_faces = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "stacktools":
      for alias in node.names:
        target = _resolve(f"{node.module}.{alias.name}")
        if target is not None and not target.endswith(FACE):
          modules[alias.asname or alias.name] = target
        else:
          source = _resolve(node.module)
          if source is not None and source.endswith(FACE):
            from_faces.append(f"{alias.name} from {source}")
          elif source is not None:
            modules[f"<from {node.module}>"] = source
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "stacktools":
          from_faces.append(alias.name)
  return modules, from_faces


def _depends(module):
  """What ``module`` imports of the package: modules, and the faces."""
  modules, from_faces = _imports(module)
  faces = {_resolve(".".join(["stacktools"] + f.split(" from ")[-1].split("/")[:-1]))
           for f in from_faces if " from " in f}
  return (set(modules.values()) | faces) - {module}


def _subpackage(module):
  return module.split("/")[0] if "/" in module else None


def _may_import(package):
  """The subpackages ``package``'s face says its rooms may import."""
  _, tree = _tree(f"{package}/{FACE}")
  doc = ast.get_docstring(tree) or ""
  found = re.search(r"May import:(.*?)(?:\n\n|\Z)", doc, re.S)
  assert found, f"stacktools/{package}/__init__.py: the docstring has no 'May import:'"
  return set(re.findall(r"``stacktools\.(\w+)``", found.group(1)))


@pytest.mark.parametrize("module", _modules())
def test_a_module_is_a_small_room(module):
  source, _ = _tree(module)
  assert len(source.splitlines()) <= MAX_LINES, (
      f"stacktools/{module}.py has {len(source.splitlines())} lines, over {MAX_LINES}: "
      "split it along a seam of its own.")


def _example_files():
  """Every Python file under ``examples/``, by its path there (``gpt/train.py``)."""
  found = []
  for dirpath, dirnames, filenames in os.walk(EXAMPLES):
    dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
    found += [os.path.relpath(os.path.join(dirpath, f), EXAMPLES)
              for f in filenames if f.endswith(".py")]
  return sorted(found)


def _example_source(path):
  with open(os.path.join(EXAMPLES, path), encoding="utf-8") as f:
    return f.read()


@pytest.mark.parametrize("path", _example_files())
def test_an_example_module_is_a_small_room(path):
  lines = len(_example_source(path).splitlines())
  assert lines <= MAX_LINES, (
      f"examples/{path} has {lines} lines, over {MAX_LINES}: split it along a "
      "seam of its own (one concept a module).")


BENCHMARKS = os.path.join(ROOT, "benchmarks")


def _benchmark_files():
  """Every Python file under ``benchmarks/``, by its path there."""
  found = []
  for dirpath, dirnames, filenames in os.walk(BENCHMARKS):
    dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "results"))
    found += [os.path.relpath(os.path.join(dirpath, f), BENCHMARKS)
              for f in filenames if f.endswith(".py")]
  return sorted(found)


@pytest.mark.parametrize("path", _benchmark_files())
def test_a_benchmark_module_is_a_small_room(path):
  with open(os.path.join(BENCHMARKS, path), encoding="utf-8") as f:
    source = f.read()
  assert not re.search(r"sys\.path\.(insert|append|extend)\(|sys\.path\s*[+]?=", source), (
      f"benchmarks/{path} edits sys.path: run it as python -m benchmarks.<name> "
      "from the repository root instead.")
  lines = len(source.splitlines())
  assert lines <= MAX_LINES, (
      f"benchmarks/{path} has {lines} lines, over {MAX_LINES}: split it into "
      "scripts of one question each, what they share in benchmarks/common/.")


def _flag_reads(source):
  """Where ``source`` defines or reads an absl flag: ``flags.DEFINE_*``
  calls, ``FLAGS`` (``flags.FLAGS``, ``FLAGS.x``) and ``.value`` of a flag
  holder (a name in capitals, as ``_STEPS = flags.DEFINE_integer(...)``)."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute) and node.attr.startswith("DEFINE"):
      found.append(f"line {node.lineno}: {node.attr}")
    elif isinstance(node, ast.Attribute) and node.attr == "FLAGS":
      found.append(f"line {node.lineno}: FLAGS")
    elif isinstance(node, ast.Name) and node.id == "FLAGS":
      found.append(f"line {node.lineno}: FLAGS")
    elif isinstance(node, ast.Attribute) and node.attr == "value":
      holder = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(
          node.value, "id", "")
      if holder.lstrip("_").isupper():
        found.append(f"line {node.lineno}: {holder}.value")
  return found


@pytest.mark.parametrize("path", [p for p in _example_files() if p not in FLAG_MODULES])
def test_only_the_flags_modules_read_flags(path):
  reads = _flag_reads(_example_source(path))
  assert not reads, (
      f"examples/{path} defines or reads flags ({', '.join(reads)}); only "
      f"{', '.join(FLAG_MODULES)} do: give the value a field of the run's config "
      "(examples/gpt/run_config.py) and take it from there.")


def test_the_training_binary_stays_a_client_of_the_library():
  # train.py is main plus train(config, workdir): callable from Python, no
  # flag read there (its flags are flags.py's, the start-up start_up.py's).
  tree = ast.parse(_example_source(os.path.join("gpt", "train.py")))
  functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
  assert {"main", "train"} <= set(functions), sorted(functions)
  assert [a.arg for a in functions["train"].args.args] == ["config", "workdir"]
  imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and node.module == "absl" for alias in node.names}
  assert "flags" not in imported, "train.py imports absl.flags: define flags in flags.py."


def test_the_example_rules_can_fail(tmp_path, monkeypatch):
  # An oversized module, a flag read outside the flags modules and a binary
  # whose train takes no config are refused.
  (tmp_path / "gpt").mkdir()
  (tmp_path / "gpt" / "big.py").write_text("y = 1\n" * 401)
  (tmp_path / "gpt" / "loop.py").write_text(
      "from absl import flags\n_STEPS = flags.DEFINE_integer('steps', 1, '')\n"
      "def f():\n  return _STEPS.value + flags.FLAGS.seed\n")
  (tmp_path / "gpt" / "train.py").write_text("def main(argv):\n  pass\n\n"
                                             "def train(workdir):\n  pass\n")
  monkeypatch.setattr(__import__(__name__), "EXAMPLES", str(tmp_path))
  with pytest.raises(AssertionError, match="over 400"):
    test_an_example_module_is_a_small_room(os.path.join("gpt", "big.py"))
  with pytest.raises(AssertionError, match=r"DEFINE_integer, line 4: _STEPS\.value, line 4: FLAGS"):
    test_only_the_flags_modules_read_flags(os.path.join("gpt", "loop.py"))
  with pytest.raises(AssertionError):
    test_the_training_binary_stays_a_client_of_the_library()

TESTS = os.path.join(ROOT, "tests")
#: The folders of tests/, each holding the test files of what it names
#: (``<topic>_test.py``; the GPT example's ``gpt_<topic>_test.py``).
TEST_FOLDERS = {
    "library": "the library's tests (stacktools/)",
    "example": "the GPT example's tests (examples/)",
    "docs": "the docs' tests: their examples run, the site built",
    "build": "the repository's rules: BUILD, the house, the public names, the benchmarks",
}
#: What the tests share (imported by bare name: tests/conftest.py puts this
#: folder on sys.path), and nothing else.
TEST_HELPERS = "helpers"
#: The only file at the top of tests/.
TEST_TOP = ("conftest.py",)


def _test_layout_problems():
  """What in tests/ breaks the layout: a file at the top but conftest.py, a
  folder not in :data:`TEST_FOLDERS` (or :data:`TEST_HELPERS`), a module in a
  test folder not named ``*_test.py`` or one in the helpers named so, a GPT
  test outside ``example/``, and two test files of one name (pytest imports
  each by its bare name, and Bazel names its target after it)."""
  problems, seen = [], {}
  for name in sorted(os.listdir(TESTS)):
    path = os.path.join(TESTS, name)
    if name in ("__pycache__",) or name.startswith("."):
      continue
    if not os.path.isdir(path):
      if name not in TEST_TOP:
        problems.append(f"tests/{name}: move it into one of tests/{'/, tests/'.join(TEST_FOLDERS)}/"
                        f" (or tests/{TEST_HELPERS}/ if it is no test)")
      continue
    if name != TEST_HELPERS and name not in TEST_FOLDERS:
      problems.append(f"tests/{name}/: not a folder of the layout ({', '.join(TEST_FOLDERS)}, "
                      f"{TEST_HELPERS}); add it to house_test.TEST_FOLDERS with what it holds")
      continue
    for file in sorted(os.listdir(path)):
      if not file.endswith(".py"):
        continue
      where = f"tests/{name}/{file}"
      if name == TEST_HELPERS and file.endswith("_test.py"):
        problems.append(f"{where}: a test file among the helpers; file it by what it tests")
      elif name != TEST_HELPERS and not file.endswith("_test.py"):
        problems.append(f"{where}: not a test file; helpers live in tests/{TEST_HELPERS}/")
      elif name != TEST_HELPERS and file.startswith("gpt_") and name != "example":
        problems.append(f"{where}: the GPT example's tests live in tests/example/")
      elif file.endswith("_test.py") and file in seen:
        problems.append(f"{where}: named as {seen[file]}; a test file's name is unique")
      seen.setdefault(file, where)
  return problems


def test_tests_are_filed_by_what_they_test():
  problems = _test_layout_problems()
  assert not problems, "tests/ out of its layout:\n" + "\n".join(problems)


def test_the_test_layout_rule_can_fail(tmp_path, monkeypatch):
  # A test at the top, an unknown folder, a helper among the tests, a test
  # among the helpers, a GPT test in library/ and a name used twice are refused.
  for path in ("conftest.py", "stray_test.py", "misc/a_test.py", "library/tools.py",
               "helpers/b_test.py", "library/gpt_x_test.py", "library/c_test.py",
               "docs/c_test.py", "example/gpt_y_test.py", "helpers/driver.py"):
    (tmp_path / path).parent.mkdir(exist_ok=True)
    (tmp_path / path).write_text("")
  monkeypatch.setattr(__import__(__name__), "TESTS", str(tmp_path))
  problems = _test_layout_problems()
  assert [p.split(":")[0] for p in problems] == [
      "tests/helpers/b_test.py", "tests/library/c_test.py", "tests/library/gpt_x_test.py",
      "tests/library/tools.py", "tests/misc/", "tests/stray_test.py"], problems
  with pytest.raises(AssertionError, match="tests/stray_test.py: move it into one of"):
    test_tests_are_filed_by_what_they_test()


@pytest.mark.parametrize("module", _modules())
def test_a_long_function_says_what_it_does(module):
  _, tree = _tree(module)
  long = [f"{node.name} (line {node.lineno}, {node.end_lineno - node.lineno + 1} lines)"
          for node in ast.walk(tree)
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
          and ast.get_docstring(node) is None]
  assert not long, f"stacktools/{module}.py: functions over {MAX_FUNCTION_LINES} lines " \
                   f"without a docstring: {long}"


@pytest.mark.parametrize("face", [m for m in _modules() if _is_face(m)])
def test_a_face_only_re_exports_and_says_what_it_holds(face):
  _, tree = _tree(face)
  assert ast.get_docstring(tree), f"stacktools/{face}.py: a face says what it holds"
  other = [f"line {node.lineno}" for node in tree.body[1:]
           if not isinstance(node, (ast.Import, ast.ImportFrom))
           and not (isinstance(node, ast.Assign) and
                    [getattr(t, "id", None) for t in node.targets] == ["__all__"])]
  assert not other, (f"stacktools/{face}.py is a face: it only re-exports, but has "
                     f"more at {other}; move that into a module of a subpackage.")


def test_each_subpackage_has_a_face():
  missing = [p for p in _subpackages() if f"{p}/{FACE}" not in _modules()]
  assert not missing, f"subpackages without an __init__.py: {missing}"


def test_imports_run_one_way():
  graph = {m: _depends(m) for m in _modules()}
  state = {}

  def visit(module, path):
    state[module] = "open"
    for dep in sorted(graph.get(module, ())):
      if state.get(dep) == "open":
        cycle = path[path.index(dep):] + [dep]
        raise AssertionError("an import circle: " + " -> ".join(cycle))
      if dep not in state:
        visit(dep, path + [dep])
    state[module] = "done"

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])


def test_subpackages_import_only_what_their_faces_allow():
  allowed = {p: _may_import(p) for p in _subpackages()}
  wrong = []
  for room in _rooms():
    for dep in _depends(room):
      package = _subpackage(dep)
      if package is None or (package != _subpackage(room)
                             and package not in allowed[_subpackage(room)]):
        wrong.append(f"stacktools/{room}.py imports {dep}")
  assert not wrong, ("a room imports what its face's 'May import:' leaves out, or a "
                     "top-level face:\n" + "\n".join(wrong))
  # The allowed imports run one way too: no subpackage may import upwards.
  order, state = [], {}

  def visit(package, path):
    state[package] = "open"
    for dep in sorted(allowed[package]):
      assert dep in allowed, f"stacktools/{package}: 'May import:' names no subpackage {dep}"
      assert state.get(dep) != "open", "a circle of subpackages: " + " -> ".join(path + [dep])
      if dep not in state:
        visit(dep, path + [dep])
    state[package] = "done"
    order.append(package)

  for package in sorted(allowed):
    if package not in state:
      visit(package, [package])


@pytest.mark.parametrize("module", _rooms())
def test_no_module_imports_the_package(module):
  _, from_faces = _imports(module)
  assert not from_faces, (
      f"stacktools/{module}.py imports {from_faces} from a package's face "
      "(its __init__); import the module that defines it.")


@pytest.mark.parametrize("module", [m for m in _modules() if m != FACE])
def test_no_module_reaches_into_another_modules_private_names(module):
  modules, _ = _imports(module)
  _, tree = _tree(module)
  reaches = sorted({f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")})
  assert not reaches, (f"stacktools/{module}.py uses private names of other modules: "
                       f"{reaches}; give what is shared a public name in its module.")


def test_the_rooms_stand_on_few_floors():
  floor, _ = floors()
  top = max(floor.values())
  assert top <= MAX_FLOORS, (
      f"the rooms stand on {top} floors, over {MAX_FLOORS}:\n{picture()}")


def test_the_rules_can_fail(tmp_path, monkeypatch):
  # A package with a circle, an oversized module, a private reach, a face
  # that holds code and a room that imports upwards is refused.
  bad = tmp_path / "stacktools"
  (bad / "low").mkdir(parents=True)
  (bad / "high").mkdir()
  (bad / "__init__.py").write_text('"""Face."""\nx = 1\n')
  (bad / "low" / "__init__.py").write_text('"""Low.\n\nMay import: nothing.\n"""\n')
  (bad / "high" / "__init__.py").write_text(
      '"""High.\n\nMay import: ``stacktools.low``.\n"""\n')
  (bad / "low" / "a.py").write_text(
      "from stacktools.low import b\nfrom stacktools.high import c\nx = b._hidden\n"
      + "y = 1\n" * 400)
  (bad / "low" / "b.py").write_text("from stacktools.low import a\n_hidden = 1\n")
  (bad / "high" / "c.py").write_text("z = 1\n")
  monkeypatch.setattr(__import__(__name__), "PACKAGE", str(bad))
  with pytest.raises(AssertionError, match="over 400"):
    test_a_module_is_a_small_room("low/a")
  with pytest.raises(AssertionError, match="an import circle: low/a -> low/b -> low/a"):
    test_imports_run_one_way()
  with pytest.raises(AssertionError, match=r"b\._hidden"):
    test_no_module_reaches_into_another_modules_private_names("low/a")
  with pytest.raises(AssertionError, match="more at"):
    test_a_face_only_re_exports_and_says_what_it_holds(FACE)
  with pytest.raises(AssertionError, match="low/a.py imports high/c"):
    test_subpackages_import_only_what_their_faces_allow()
  (bad / "low" / "b.py").write_text("_hidden = 1\n")   # no circle: two floors
  monkeypatch.setattr(__import__(__name__), "MAX_FLOORS", 1)
  with pytest.raises(AssertionError, match="over 1"):
    test_the_rooms_stand_on_few_floors()


def floors():
  """``{room: floor}``: a room that imports none of the package's rooms is on
  floor 1, any other one floor above the highest it imports. Faces only
  re-export and are no rooms, so they stand on no floor."""
  rooms = set(_rooms())
  graph = {m: _depends(m) & rooms for m in rooms}
  floor = {}

  def of(module):
    if module not in floor:
      floor[module] = 1 + max((of(d) for d in graph[module]), default=0)
    return floor[module]

  for module in graph:
    of(module)
  return floor, graph


def picture():
  """The house in text: each floor's rooms, each with what it imports."""
  floor, graph = floors()
  lines = []
  for level in sorted(set(floor.values()), reverse=True):
    for module in sorted(m for m in floor if floor[m] == level):
      imports = ", ".join(sorted(graph[module], key=lambda d: (-floor[d], d)))
      lines.append(f"{level:>2}  {module:<25}{'-> ' + imports if imports else ''}".rstrip())
  return "\n".join(lines)


def test_the_internals_page_shows_the_house_as_it_is():
  with open(os.path.join(ROOT, "docs", "development", "internals.md"), encoding="utf-8") as f:
    page = f.read()
  assert picture() in page, (
      "docs/development/internals.md's picture of the house is not the one the "
      "imports draw: paste the output of `python tests/build/house_test.py` in its place.\n"
      + picture())


if __name__ == "__main__":
  sys.stdout.write(picture() + "\n")
