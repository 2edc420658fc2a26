"""The public surface stays small, and the example and benchmarks keep to it.

``stacktools.__all__`` is what a user writes; the example (examples/) and the
benchmarks (benchmarks/) are written as a user writes, so they reach no
module of the package (``st.segments.describe_remat``) and no name outside
``__all__`` (``st.nested_split``). Checked on the source text: nothing here
runs them.
"""

import importlib
import os
import pkgutil
import re

import pytest

import stacktools

pytestmark = pytest.mark.jax_independent   # see pytest.ini

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_PUBLIC_NAMES = 20
USER_CODE = ("examples", "benchmarks")
#: Modules of helpers that user code may reach by name (``st.depth.repeat``,
#: ``from stacktools import depth``): each lists its helpers in ``__all__``.
#: They stay out of ``stacktools.__all__``, which holds what a user writes
#: most, as ``optax.contrib`` does beside ``optax``.
PUBLIC_MODULES = ("adapters", "depth")


def _sources(folder):
  """``(path relative to ROOT, text)`` of every .py file under ``folder``."""
  for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
    dirnames[:] = sorted(d for d in dirnames if d not in ("results", "__pycache__"))
    for name in sorted(filenames):
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        with open(path, encoding="utf-8") as f:
          yield os.path.relpath(path, ROOT), f.read()


def _line(text, match):
  return text.count("\n", 0, match.start()) + 1


def test_all_is_small_and_every_name_in_it_imports():
  names = stacktools.__all__
  assert len(names) <= MAX_PUBLIC_NAMES, (len(names), names)
  assert len(set(names)) == len(names), names
  for name in names:
    assert getattr(stacktools, name, None) is not None, name
    namespace = {}
    exec(f"from stacktools import {name}", namespace)  # pylint: disable=exec-used
    assert namespace[name] is getattr(stacktools, name), name


def _modules():
  """The names of the package's modules and subpackages (``remat``,
  ``policy``, ...), and of the subpackages' modules (``_segments``, ...)."""
  found = {m.name for m in pkgutil.iter_modules(stacktools.__path__)}
  for package in [m.name for m in pkgutil.iter_modules(stacktools.__path__) if m.ispkg]:
    path = importlib.import_module(f"stacktools.{package}").__path__
    found |= {m.name for m in pkgutil.iter_modules(path)}
  return sorted(found)


def test_the_module_list_is_what_it_should_be():
  modules = _modules()
  assert {"loops", "policy", "remat", "_segments"} <= set(modules), modules
  for info in pkgutil.walk_packages(stacktools.__path__, "stacktools."):
    importlib.import_module(info.name)


@pytest.mark.parametrize("folder", USER_CODE)
def test_no_module_of_the_package_is_reached_into(folder):
  # st.<module>. (st.segments.describe_remat, st._checks.x); module names
  # from the package itself, and any private name.
  modules = "|".join(re.escape(m) for m in _modules() if m not in PUBLIC_MODULES)
  pattern = re.compile(rf"\bst\.(?:{modules}|_\w+)\.")
  found = [f"{path}:{_line(text, m)}: {m.group(0)}"
           for path, text in _sources(folder) for m in pattern.finditer(text)]
  # A public module's helpers: only those in its __all__.
  for module in PUBLIC_MODULES:
    helpers = set(importlib.import_module(f"stacktools.{module}").__all__)
    found += [f"{path}:{_line(text, m)}: {m.group(0)}" for path, text in _sources(folder)
              for m in re.finditer(rf"(?:\bst\.|(?<![\w/.])){module}\.(\w+)\(", text)
              if m.group(1) not in helpers]
  assert not found, "\n".join(found)


@pytest.mark.parametrize("folder", USER_CODE)
def test_only_public_names_are_used(folder):
  public = set(stacktools.__all__) | set(PUBLIC_MODULES)
  found = []
  for path, text in _sources(folder):
    for m in re.finditer(r"\bst\.(\w+)", text):
      if m.group(1) not in public and not m.group(1).startswith("__"):
        found.append(f"{path}:{_line(text, m)}: {m.group(0)}")
    for m in re.finditer(r"^\s*from stacktools(\.\w+)* import ([^#\n]+)", text, re.M):
      names = {n.strip().split(" as ")[0] for n in m.group(2).strip("()\\ ").split(",")}
      if m.group(1) or not names <= public:
        found.append(f"{path}:{_line(text, m)}: {m.group(0).strip()}")
    for m in re.finditer(r"^\s*import stacktools\.\w+", text, re.M):
      found.append(f"{path}:{_line(text, m)}: {m.group(0).strip()}")
  assert not found, "\n".join(found)
