"""Finds and runs the Python examples of the docs, the README and the docstrings.

A small collector of our own rather than Sybil or pytest-markdown-docs: it
reads both kinds of example this project writes (fenced ```python blocks in
Markdown, and the ``Example::`` literal blocks of Google-style docstrings),
runs the blocks of one page in order in one namespace, and needs nothing
beyond the standard library, so it runs under plain pytest and under Bazel
alike.

* Markdown: every fence whose info string starts with ``python`` runs. A
  fence right after a line ``<!-- fragment: why -->`` is shown, not run (a
  few lines that need a cluster, say); a page with a line
  ``<!-- doc-test: devices=N -->`` runs in a subprocess of its own with N
  virtual CPU devices (for meshes and pipelines).
* Docstrings: every literal block introduced by a line ``Example::`` (or
  ``Example, something::``) runs in a copy of its module's globals, as doctest
  runs a docstring, with ``jax``, ``jnp``, ``np``, ``hk``, ``optax`` and
  ``st`` imported.

A failing block raises with its file and line, so tracebacks point into the
page or the module.
"""

import ast
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<ticks>```+)(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)(?P=ticks)[ \t]*$",
    re.M | re.S)
FRAGMENT = re.compile(r"<!--\s*fragment:\s*(?P<why>[^>]*?)\s*-->\s*$")
DEVICES_MARK = re.compile(r"<!--\s*doc-test:\s*devices=(?P<n>\d+)\s*-->")
EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example[^\n:]*::[ \t]*$", re.M)
DEVICES = 8                    # for the examples that build meshes
DOCSTRINGS = "--docstrings"    # run_on_devices' item for the docstring examples
# How many blocks the test run ran, by kind; tests/conftest.py prints them.
COUNTS = {"page blocks": 0, "docstring blocks": 0}
PREAMBLE = ("import jax\nimport jax.numpy as jnp\nimport numpy as np\n"
            "import haiku as hk\nimport optax\nimport stacktools as st\n")


@dataclasses.dataclass
class Block:
  path: str        # the file it is in
  line: int        # the line of its first code line, 1-based
  code: str
  fragment: str = ""  # why it is not run; empty: it runs


def markdown_blocks(path):
  """The ```python blocks of a Markdown file, in order."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  blocks = []
  for m in FENCE.finditer(text):
    if not m.group("info").strip().startswith("python"):
      continue
    line = text.count("\n", 0, m.start("body")) + 1
    before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
    why = FRAGMENT.search(before)
    code = textwrap.dedent(m.group("body"))
    blocks.append(Block(path, line, code, why.group("why") if why else ""))
  return blocks


def page_devices(path):
  """The virtual device count a page asks for (0: the test process's)."""
  with open(path, encoding="utf-8") as f:
    m = DEVICES_MARK.search(f.read())
  return int(m.group("n")) if m else 0


def docstring_blocks(path):
  """The ``Example::`` blocks of every docstring in a Python source file."""
  with open(path, encoding="utf-8") as f:
    source = f.read()
  tree = ast.parse(source)
  blocks = []
  nodes = [tree] + [n for n in ast.walk(tree) if isinstance(
      n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
  for node in nodes:
    body = getattr(node, "body", [])
    if not (body and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
      continue
    # The docstring's lines as written in the file (raw, unindented by
    # Python's cleandoc), so line numbers point at the source.
    first = body[0].value.lineno
    raw = source.splitlines()[first - 1:body[0].value.end_lineno]
    for i, text in enumerate(raw):
      m = EXAMPLE.match(text)
      if not m:
        continue
      indent = len(m.group("indent"))
      j = i + 1
      while j < len(raw) and (not raw[j].strip() or
                              len(raw[j]) - len(raw[j].lstrip()) > indent):
        j += 1
      lines = raw[i + 1:j]
      k = 0
      while k < len(lines) and not lines[k].strip():
        k += 1
      code = textwrap.dedent("\n".join(lines[k:])).strip("\n") + "\n"
      blocks.append(Block(path, first + i + 1 + k, code))
  return blocks


def run_blocks(blocks, namespace):
  """Runs blocks in order in one namespace; returns how many ran.

  A block is compiled under its file's name with its own line numbers, so a
  traceback shows the page or module and the line that failed.
  """
  ran = 0
  for block in blocks:
    if block.fragment:
      continue
    code = "\n" * (block.line - 1) + block.code
    try:
      exec(compile(code, block.path, "exec"), namespace)  # pylint: disable=exec-used
    except Exception as e:
      # The line that failed, where the traceback passes through the block.
      lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
               if f.filename == block.path]
      raise AssertionError(
          f"the example at {os.path.relpath(block.path, ROOT)}:"
          f"{lines[-1] if lines else block.line} failed: {type(e).__name__}: {e}") from e
    ran += 1
  return ran


def run_page(path):
  """Runs a Markdown page's blocks; returns how many ran.

  A page that asks for devices runs in a subprocess (see run_on_devices).
  """
  if page_devices(path):
    return _result(path, run_on_devices([path])[path])
  return run_blocks(markdown_blocks(path), {"__name__": "__doc_example__"})


def run_docstrings(path, module_globals):
  """Runs a module's docstring examples, each in a copy of its globals.

  As Haiku's own docstring tests do, each example runs inside a Haiku
  transform (its init), so it may build modules where a model would.
  """
  import haiku as hk  # pylint: disable=g-import-not-at-top
  blocks = docstring_blocks(path)
  for block in blocks:
    namespace = dict(module_globals)
    exec(PREAMBLE, namespace)  # pylint: disable=exec-used
    hk.testing.transform_and_run(lambda: run_blocks([block], namespace),
                                 run_apply=False)()
  return len(blocks)


def package_modules():
  """``(path, module name)`` of every module of the package."""
  found = []
  for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "stacktools")):
    dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
    package = os.path.relpath(dirpath, ROOT).replace(os.sep, ".")
    found += [(os.path.join(dirpath, name),
               package if name == "__init__.py" else f"{package}.{name[:-3]}")
              for name in sorted(filenames) if name.endswith(".py")]
  return found


def device_items():
  """What docs_test runs on DEVICES devices: the README's and docs/' pages
  that ask for devices, and DOCSTRINGS."""
  pages = [os.path.join(ROOT, "README.md")] + sorted(
      glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
  return [p for p in pages if markdown_blocks(p) and page_devices(p)] + [DOCSTRINGS]


def on_devices_command(items):
  """``(argv, env)`` of the subprocess that runs ``items`` on DEVICES devices."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={DEVICES}")
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
  return [sys.executable, os.path.abspath(__file__), *items], env


def on_devices_results(returncode, stdout, stderr):
  """What the subprocess of :func:`on_devices_command` printed, read back:
  ``{item: the number of blocks run, or the error's traceback as text}``."""
  if returncode:
    raise AssertionError(f"the examples on {DEVICES} devices:\n{stderr[-4000:]}")
  return json.loads(stdout.strip().splitlines()[-1])


def run_on_devices(items):
  """Runs pages and the docstring examples in one subprocess with DEVICES
  virtual CPU devices (their examples build meshes), so JAX starts once.

  Args:
    items: Markdown pages, and DOCSTRINGS for every docstring example of the
      package.

  Returns:
    ``{item: the number of blocks run, or the error's traceback as text}``.
  """
  argv, env = on_devices_command(items)
  out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
  return on_devices_results(out.returncode, out.stdout, out.stderr)


def _result(item, result):
  if isinstance(result, str):
    raise AssertionError(f"{item} on {DEVICES} devices:\n{result}")
  return result


def _run_item(item):
  if item != DOCSTRINGS:
    return run_blocks(markdown_blocks(item), {"__name__": "__doc_example__"})
  import importlib  # pylint: disable=g-import-not-at-top
  return sum(run_docstrings(path, vars(importlib.import_module(name)))
             for path, name in package_modules())


if __name__ == "__main__":
  # What run_on_devices starts: python tests/helpers/doc_examples.py ITEM...; prints
  # {item: count or traceback} as JSON on its last line.
  sys.path.insert(0, ROOT)
  results = {}
  for arg in sys.argv[1:]:
    try:
      results[arg] = _run_item(arg)
    except Exception:  # pylint: disable=broad-except
      results[arg] = traceback.format_exc()[-4000:]
  print(json.dumps(results))
