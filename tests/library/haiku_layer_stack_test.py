"""Haiku's own layer_stack tests, run against st.layer_stack.

``st.layer_stack`` is a drop-in for ``hk.layer_stack``, so Haiku's test file
for it is the contract. That file ships in the installed dm-haiku wheel as
``haiku/_src/layer_stack_test.py``; this module loads it from there at test
time (nothing is copied into this repository), under a private module name
so that the installed module is left alone, and points the one name it
calls, ``layer_stack.layer_stack``, at ``st.layer_stack``. Every test method
of Haiku's ``LayerStackTest`` then runs unchanged, through pytest, except:

* the tests of transparency mode (``transparent=True`` with a
  ``LayerStackTransparencyMapping``), which ``st.layer_stack`` does not
  implement; they are listed by name in ``TRANSPARENT_TESTS``, and a check
  fails if that list and Haiku's file disagree;
* tests Haiku itself skips (``@unittest.skip``): they stay skipped.

Every test that runs must call ``st.layer_stack`` at least once, so a change
in how Haiku's file reaches ``layer_stack`` fails here instead of silently
testing Haiku's own implementation.
"""

import importlib.util
import inspect
import types
import unittest

import haiku as hk
import jax
import pytest

import stacktools as st

_HAIKU_TEST = "haiku._src.layer_stack_test"

# Haiku's tests of transparency mode, which st.layer_stack does not implement
# (it has no transparent= or transparency_map= argument).
TRANSPARENT_TESTS = (
    "test_transparent",
    "test_layer_stack_transparent_with_custom_pytrees",
)
# Haiku's file, run as a script, checks every test for tracer leaks. That makes
# its eager 20-layer reference loops slow (the whole file took four times the
# CPU time), so only these small tests, which between them reach every path of
# st.layer_stack (with and without per-layer inputs, state, reverse,
# pass_reverse_to_layer_fn, nested stacks), run with the check.
LEAK_CHECKED = (
    "test_layer_stack_with_state",
    "test_threading",
    "test_with_container_state",
    "test_reverse_with_pass_reverse_to_layer_fn",
)
_TRANSPARENT_REASON = ("transparency mode (transparent=True, transparency_map=) "
                       "is not implemented by st.layer_stack")


def _load_haiku_test_module():
  """Haiku's layer_stack_test.py from the installed wheel, as a fresh module."""
  spec = importlib.util.find_spec(_HAIKU_TEST)
  if spec is None or spec.origin is None:
    raise ImportError(
        f"{_HAIKU_TEST} is not in the installed dm-haiku "
        f"({hk.__version__}); these tests need the wheel's own test file.")
  spec = importlib.util.spec_from_file_location(
      "_stacktools_haiku_layer_stack_test", spec.origin)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_haiku_test = _load_haiku_test_module()

# Haiku's tests call ``layer_stack.layer_stack(...)``, with ``layer_stack`` the
# module ``haiku._src.layer_stack`` (``from haiku._src import layer_stack``).
_haiku_layer_stack_module = importlib.import_module("haiku._src.layer_stack")
if getattr(_haiku_test, "layer_stack", None) is not _haiku_layer_stack_module:
  raise ImportError(
      "Haiku's layer_stack_test.py no longer imports `layer_stack` as the "
      "module haiku._src.layer_stack; update how this file points it at "
      "st.layer_stack.")

_calls = []


def _counted_layer_stack(*args, **kwargs):
  _calls.append(args)
  return st.layer_stack(*args, **kwargs)


# Only ``layer_stack`` is there: any other name Haiku's tests take from the
# module (e.g. LayerStackTransparencyMapping, used only by the transparency
# tests) raises AttributeError instead of quietly using Haiku's code.
_haiku_test.layer_stack = types.SimpleNamespace(layer_stack=_counted_layer_stack)

_HaikuLayerStackTest = _haiku_test.LayerStackTest


def _test_names(cls):
  return sorted(unittest.TestLoader().getTestCaseNames(cls))


def _is_skipped(cls, name):
  return getattr(getattr(cls, name), "__unittest_skip__", False)


def _mark_transparent(cls):
  for name in TRANSPARENT_TESTS:
    setattr(cls, name, unittest.skip(_TRANSPARENT_REASON)(
        getattr(_HaikuLayerStackTest, name)))
  return cls


@_mark_transparent
class LayerStackTest(_HaikuLayerStackTest):
  """Haiku's LayerStackTest, with ``layer_stack.layer_stack = st.layer_stack``.

  As Haiku's file does when run as a script, matmuls run in float32 (Haiku's
  tolerances assume it on GPU/TPU too), and the tests in ``LEAK_CHECKED``
  also check for tracer leaks.
  """

  def setUp(self):
    super().setUp()
    self.enter_context(jax.default_matmul_precision("float32"))
    if self._testMethodName in LEAK_CHECKED:
      self.enter_context(jax.check_tracer_leaks(True))
    _calls.clear()

  def tearDown(self):
    calls = len(_calls)
    super().tearDown()
    self.assertGreater(
        calls, 0, f"{self._testMethodName} never called st.layer_stack: Haiku's "
        "test file must reach layer_stack another way now.")


# Keep pytest from collecting Haiku's class a second time under its own name.
del _HaikuLayerStackTest


def test_transparent_tests_listed_are_haikus_transparency_tests():
  """The skip list names exactly Haiku's tests that use transparency mode."""
  base = _haiku_test.LayerStackTest
  names = _test_names(base)
  assert set(TRANSPARENT_TESTS) <= set(names), (
      f"not in Haiku's LayerStackTest: {set(TRANSPARENT_TESTS) - set(names)}")
  uses_transparency = sorted(
      n for n in names
      if "transparen" in inspect.getsource(getattr(base, n)).lower())
  assert uses_transparency == sorted(TRANSPARENT_TESTS)


def test_every_other_haiku_test_runs():
  """Only the transparency tests and Haiku's own skips are skipped."""
  base = _haiku_test.LayerStackTest
  names = _test_names(base)
  assert _test_names(LayerStackTest) == names
  skipped = {n for n in names if _is_skipped(LayerStackTest, n)}
  haiku_skips = {n for n in names if _is_skipped(base, n)}
  assert skipped == set(TRANSPARENT_TESTS) | haiku_skips
  assert set(LEAK_CHECKED) <= set(names) - skipped
  # dm-haiku 0.0.17: 20 test methods, 17 run (one Haiku skips, two transparency).
  assert len(names) - len(skipped) >= 10, sorted(set(names) - skipped)


def test_layer_stack_is_pointed_at_stacktools():
  assert _haiku_test.layer_stack.layer_stack is _counted_layer_stack
  with pytest.raises(AttributeError):
    _haiku_test.layer_stack.LayerStackTransparencyMapping  # pylint: disable=pointless-statement
