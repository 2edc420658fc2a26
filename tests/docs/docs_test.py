"""The docs stay true: every example runs, every name and error is covered.

* Every ```python block of README.md and docs/ runs (a page's blocks in order,
  in one namespace; pages that build meshes in a subprocess with 8 virtual
  devices), and every ``Example::`` block of a docstring in stacktools/ runs
  (tests/helpers/doc_examples.py is the collector). The run ends with a line that
  counts them (tests/conftest.py prints it).
* A deliberately broken example, in a temporary copy of a page and of a
  module, fails the collector at its line.
* The README stays a front door; every public name has one API entry;
  every ``raise`` in stacktools/ is on the troubleshooting page; each
  benchmark page states the run its JSON records.
"""

import ast
import glob
import json
import os
import shutil

import pytest

import background
import doc_examples
import stacktools
from stacktools.remat import _nested_split

ROOT = doc_examples.ROOT
DOCS = os.path.join(ROOT, "docs")
MAX_FRAGMENTS = 3


def _pages():
  pages = [os.path.join(ROOT, "README.md")]
  pages += sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
  return pages


def _rel(path):
  return os.path.relpath(path, ROOT)


PAGES_WITH_CODE = [p for p in _pages() if doc_examples.markdown_blocks(p)]


@pytest.fixture(scope="module")
def on_devices():
  """The pages that build meshes and the docstring examples, run in one
  subprocess with 8 virtual devices: {item: blocks run, or the traceback}.

  The subprocess starts when the tests are collected (tests/helpers/background.py).
  """
  assert doc_examples.device_items() == [
      p for p in PAGES_WITH_CODE if doc_examples.page_devices(p)] + [doc_examples.DOCSTRINGS]
  job = background.result("docs_on_devices")
  return doc_examples.on_devices_results(job.returncode, job.stdout, job.stderr)


def _ran(on_devices, item):
  if isinstance(on_devices[item], str):
    pytest.fail(f"{item}:\n{on_devices[item]}")
  return on_devices[item]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_rel)
def test_the_examples_of_a_page_run(page, request):
  devices = doc_examples.page_devices(page)
  if devices:
    assert devices == doc_examples.DEVICES, devices
    ran = _ran(request.getfixturevalue("on_devices"), page)
  else:
    ran = doc_examples.run_page(page)
  blocks = doc_examples.markdown_blocks(page)
  assert ran == sum(not b.fragment for b in blocks), (ran, len(blocks))
  doc_examples.COUNTS["page blocks"] += ran


def test_the_docstring_examples_run(on_devices):
  ran = _ran(on_devices, doc_examples.DOCSTRINGS)
  found = sum(len(doc_examples.docstring_blocks(path))
              for path, _ in doc_examples.package_modules())
  assert ran == found and ran >= 30, (ran, found)
  doc_examples.COUNTS["docstring blocks"] += ran


@pytest.mark.jax_independent
def test_fragments_are_few_and_say_why():
  fragments = [b for p in _pages() for b in doc_examples.markdown_blocks(p) if b.fragment]
  assert len(fragments) <= MAX_FRAGMENTS, [(_rel(b.path), b.line) for b in fragments]
  assert all(len(b.fragment.split()) >= 3 for b in fragments), fragments


@pytest.mark.jax_independent
def test_the_collector_finds_fences_fragments_and_docstring_examples(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("Text.\n\n```python\nx = 1\n```\n\n<!-- fragment: needs a real cluster -->\n"
                  "```python\ncluster()\n```\n\n```bash\nls\n```\n\n  ```python\n  y = x + 1\n  ```\n")
  blocks = doc_examples.markdown_blocks(str(page))
  assert [(b.line, b.code, b.fragment) for b in blocks] == [
      (4, "x = 1\n", ""), (9, "cluster()\n", "needs a real cluster"), (17, "y = x + 1\n", "")]
  namespace = {}
  assert doc_examples.run_blocks(blocks, namespace) == 2 and namespace["y"] == 2
  module = tmp_path / "module.py"
  module.write_text('def f():\n  """Doc.\n\n  Example::\n\n    a = 1\n\n    b = a + 1\n\n'
                    '  Args:\n    none.\n  """\n')
  (block,) = doc_examples.docstring_blocks(str(module))
  assert (block.line, block.code) == (6, "a = 1\n\nb = a + 1\n")


def test_a_broken_example_in_a_copy_of_a_page_fails(tmp_path):
  copy = tmp_path / "README.md"
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  good = '.shape == (24, 128, 512)'
  assert text.count(good) == 1
  copy.write_text(text.replace(good, '.shape == (23, 128, 512)'))
  line = text[:text.index(good)].count("\n") + 1
  with pytest.raises(AssertionError, match=f"README.md:{line}"):
    doc_examples.run_page(str(copy))


def test_a_broken_docstring_example_in_a_copy_of_a_module_fails(tmp_path):
  copy = tmp_path / "_nested_split.py"
  shutil.copy(os.path.join(ROOT, "stacktools", "remat", "_nested_split.py"), copy)
  text = copy.read_text()
  good = "assert split_nested(61, True) == (8, 7, 5)"
  assert text.count(good) == 1
  copy.write_text(text.replace(good, "assert split_nested(61, True) == (8, 7, 6)"))
  with pytest.raises(AssertionError, match="_nested_split.py:"):
    doc_examples.run_docstrings(str(copy), vars(_nested_split))


@pytest.mark.jax_independent
def test_the_readme_is_a_short_front_door():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  assert len(lines) <= 300, len(lines)
  assert lines[2] == "```bash", lines[:4]
  assert lines[3].startswith("pip install -e '.[examples]' && python examples/gpt/train.py")
  assert lines[4].startswith("pip install -e '.[test]' && python -m pytest -q tests")


@pytest.mark.jax_independent
def test_every_public_name_has_one_api_entry():
  entries = {}
  for path in glob.glob(os.path.join(DOCS, "api", "*.md")):
    with open(path, encoding="utf-8") as f:
      for line in f:
        if line.startswith("::: stacktools."):
          name = line.split("::: stacktools.", 1)[1].strip()
          entries.setdefault(name, []).append(_rel(path))
  # And each helper of a public module that holds its own (st.adapters.lora).
  public = set(stacktools.__all__) | {f"adapters.{n}" for n in stacktools.adapters.__all__}
  for name in public:
    assert len(entries.get(name, [])) == 1, (name, entries.get(name))
  assert set(entries) == public, set(entries) ^ public


def _literal_parts(node):
  """The literal text of an error message: its strings and f-string parts."""
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return [node.value]
  if isinstance(node, ast.JoinedStr):
    return [v.value for v in node.values if isinstance(v, ast.Constant)]
  if isinstance(node, ast.BinOp):
    return _literal_parts(node.left) + _literal_parts(node.right)
  return []


@pytest.mark.jax_independent
def test_every_error_the_library_raises_is_on_the_troubleshooting_page():
  with open(os.path.join(DOCS, "guides", "troubleshooting.md"), encoding="utf-8") as f:
    page = f.read()
  missing = []
  for path, _ in doc_examples.package_modules():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
        # The message's longest literal run, as the page shows it.
        parts = [" ".join(p.split()) for p in _literal_parts(node.exc.args[0])]
        longest = max(parts, key=len, default="")
        if len(longest) > 12 and longest.strip() not in page:
          missing.append(f"{_rel(path)}:{node.lineno}: {longest.strip()[:80]}")
  assert not missing, "\n".join(missing)


def _page_of(name):
  """docs/benchmarks/<name>.md; for a result named after its device too
  (``accelerator_tpu_v5_lite``), the page of the longest prefix that has one
  (``accelerator.md``)."""
  parts = name.split("_")
  for end in range(len(parts), 0, -1):
    path = os.path.join(DOCS, "benchmarks", "_".join(parts[:end]) + ".md")
    if os.path.exists(path):
      return path
  return os.path.join(DOCS, "benchmarks", f"{name}.md")


@pytest.mark.jax_independent
@pytest.mark.parametrize("name", sorted(
    os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json"))))
def test_each_benchmark_page_states_its_run(name):
  with open(os.path.join(ROOT, "benchmarks", "results", f"{name}.json"), encoding="utf-8") as f:
    result = json.load(f)
  with open(_page_of(name), encoding="utf-8") as f:
    page = f.read()
  date = result["environment"]["date_utc"].replace("T", " ")[:16]
  assert f"| {date} UTC |" in page, date
  assert f"```bash\n{result['command']}\n```" in page, result["command"]
  assert f"../../benchmarks/results/{name}.png" in page
