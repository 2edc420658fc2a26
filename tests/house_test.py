"""The package's layout rules, read from its source: small rooms, one direction.

Checked against the source of ``stacktools/`` itself (not a picture of it):

* no module over :data:`MAX_LINES` lines, and the example's training binary
  (``examples/gpt/train.py``: flags, the loop, logging and checkpoints) not
  over :data:`MAX_BINARY_LINES`;
* no function over :data:`MAX_FUNCTION_LINES` lines without a docstring;
* no circle among the modules' imports;
* no module imports the package (its ``__init__``) rather than a module;
* no module uses another module's private (``_name``) attributes;
* the picture of the house on docs/development/internals.md is the one the
  imports draw today (``python tests/house_test.py`` prints it).
"""

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "stacktools")
MAX_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_BINARY_LINES = 700


def _modules():
  return sorted(f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py"))


def _tree(module):
  with open(os.path.join(PACKAGE, f"{module}.py"), encoding="utf-8") as f:
    source = f.read()
  return source, ast.parse(source)


def _imports(module):
  """``{alias: module}`` of the package's modules that ``module`` imports, and
  the names it imports from the package itself (not a module)."""
  _, tree = _tree(module)
  modules, from_package = {}, []
  known = set(_modules())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == "stacktools":
      for alias in node.names:
        if alias.name in known:
          modules[alias.asname or alias.name] = alias.name
        else:
          from_package.append(alias.name)
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stacktools."):
      modules[f"<from {node.module}>"] = node.module.split(".", 1)[1]
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name == "stacktools":
          from_package.append("stacktools")
  return modules, from_package


@pytest.mark.parametrize("module", _modules())
def test_a_module_is_a_small_room(module):
  source, _ = _tree(module)
  assert len(source.splitlines()) <= MAX_LINES, (
      f"stacktools/{module}.py has {len(source.splitlines())} lines, over {MAX_LINES}: "
      "split it along a seam of its own.")


def test_the_training_binary_stays_a_client_of_the_library():
  with open(os.path.join(ROOT, "examples", "gpt", "train.py"), encoding="utf-8") as f:
    lines = len(f.read().splitlines())
  assert lines <= MAX_BINARY_LINES, (
      f"examples/gpt/train.py has {lines} lines, over {MAX_BINARY_LINES}: move what "
      "is not flags, the loop, logging or checkpoints into a module of the example "
      "(or a rule into the library).")


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


def test_imports_run_one_way():
  graph = {m: set(_imports(m)[0].values()) - {m} for m in _modules() if m != "__init__"}
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


@pytest.mark.parametrize("module", [m for m in _modules() if m != "__init__"])
def test_no_module_imports_the_package(module):
  _, from_package = _imports(module)
  assert not from_package, (
      f"stacktools/{module}.py imports {from_package} from the package's __init__; "
      "import the module that defines it.")


@pytest.mark.parametrize("module", [m for m in _modules() if m != "__init__"])
def test_no_module_reaches_into_another_modules_private_names(module):
  modules, _ = _imports(module)
  _, tree = _tree(module)
  reaches = sorted({f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")})
  assert not reaches, (f"stacktools/{module}.py uses private names of other modules: "
                       f"{reaches}; give what is shared a public name in its module.")


def test_the_rules_can_fail(tmp_path, monkeypatch):
  # A package with a circle, an oversized module and a private reach is refused.
  bad = tmp_path / "stacktools"
  bad.mkdir()
  (bad / "a.py").write_text("from stacktools import b\nx = b._hidden\n" + "y = 1\n" * 400)
  (bad / "b.py").write_text("from stacktools import a\n_hidden = 1\n")
  monkeypatch.setattr(__import__(__name__), "PACKAGE", str(bad))
  with pytest.raises(AssertionError, match="over 400"):
    test_a_module_is_a_small_room("a")
  with pytest.raises(AssertionError, match="an import circle: a -> b -> a"):
    test_imports_run_one_way()
  with pytest.raises(AssertionError, match=r"b\._hidden"):
    test_no_module_reaches_into_another_modules_private_names("a")


def floors():
  """``{module: floor}``: a module that imports none of the package's is on
  floor 1, any other one floor above the highest it imports."""
  graph = {m: set(_imports(m)[0].values()) - {m} for m in _modules()}
  floor = {}

  def of(module):
    if module not in floor:
      floor[module] = 1 + max((of(d) for d in graph[module]), default=0)
    return floor[module]

  for module in graph:
    of(module)
  return floor, graph


def picture():
  """The house in text: each floor's modules, each with what it imports."""
  floor, graph = floors()
  lines = []
  for level in sorted(set(floor.values()), reverse=True):
    for module in sorted(m for m in floor if floor[m] == level):
      imports = ", ".join(sorted(graph[module], key=lambda d: (-floor[d], d)))
      lines.append(f"{level:>2}  {module:<18}{'-> ' + imports if imports else ''}".rstrip())
  return "\n".join(lines)


def test_the_internals_page_shows_the_house_as_it_is():
  with open(os.path.join(ROOT, "docs", "development", "internals.md"), encoding="utf-8") as f:
    page = f.read()
  assert picture() in page, (
      "docs/development/internals.md's picture of the house is not the one the "
      "imports draw: paste the output of `python tests/house_test.py` in its place.\n"
      + picture())


if __name__ == "__main__":
  sys.stdout.write(picture() + "\n")
