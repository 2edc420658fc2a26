"""The built docs site renders in a browser: headless Chromium opens it.

The home page (the README) and one guide are loaded from site/ (built by
``mkdocs build --strict``, as .ci/run does) in Debian's ``chromium``, which
dumps the DOM after the page's scripts ran and takes a screenshot of each
(saved to build/docs-screenshots/, or $STACKTOOLS_ARTIFACTS). The test checks
the title, the navigation and a highlighted Python block.

Without Chromium or a built site the test skips and says which is missing;
CI sets STACKTOOLS_DOCS_BROWSER=required, which turns that skip into a
failure, since .ci/run installs both.
"""

import html
import os
import re
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.jax_independent   # see pytest.ini

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITE = os.path.join(ROOT, "site")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--window-size=1280,1600", "--virtual-time-budget=3000")


def _chromium():
  path = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
  missing = []
  if path is None:
    missing.append("chromium is not installed (apt-get install chromium)")
  if not os.path.exists(os.path.join(SITE, "index.html")):
    missing.append("the site is not built (pip install -e '.[docs]' && mkdocs build --strict)")
  if missing:
    if os.environ.get("STACKTOOLS_DOCS_BROWSER") == "required":
      pytest.fail("; ".join(missing))
    pytest.skip("; ".join(missing))
  return path


def _open(chromium, page, tmp_path, shot):
  """The DOM of ``site/<page>`` after its scripts ran; a screenshot to ``shot``."""
  url = "file://" + os.path.join(SITE, page)
  for mode in ([f"--screenshot={shot}"], ["--dump-dom"]):
    profile = tmp_path / f"profile-{len(os.listdir(tmp_path))}"   # a fresh one each run
    out = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *mode, url],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout


@pytest.mark.parametrize("page, title, code", [
    ("index.html", "stacktools", "st.Stacked(Block, num_layers=24"),
    ("guides/stacks.html", "Stacks and blocks - stacktools", "st.BlockSeq(Block, 6"),
])
def test_a_page_renders_its_title_navigation_and_code(page, title, code, tmp_path):
  chromium = _chromium()
  artifacts = os.environ.get("STACKTOOLS_ARTIFACTS", os.path.join(ROOT, "build", "docs-screenshots"))
  os.makedirs(artifacts, exist_ok=True)
  shot = os.path.join(artifacts, page.replace("/", "_").replace(".html", ".png"))
  if os.path.exists(shot):
    os.remove(shot)
  dom = _open(chromium, page, tmp_path, shot)

  assert re.search(rf"<title>{re.escape(title)}</title>", dom), dom[:500]
  # Material's navigation: the sections and a link to every guide group.
  nav = dom[dom.index('<nav class="md-nav md-nav--primary"'):]
  for label in ("Guides", "API reference", "Benchmarks", "Getting started", "Troubleshooting"):
    assert label in nav, label
  # A highlighted code block (Pygments' spans: "kn" for import) holding the
  # page's Python.
  blocks = re.findall(r'<div class="highlight"><pre[^>]*>(.*?)</code>', dom, re.S)
  assert any('<span class="kn">import</span>' in b for b in blocks), len(blocks)
  # The theme's scripts ran: they gave each block its copy button.
  assert all('data-md-type="copy"' in b for b in blocks), blocks[0][:300]
  text = html.unescape("".join(re.sub(r"<[^>]+>", "", b) for b in blocks))
  assert code in text, text[:300]
  # The screenshot is a picture of the page, not an empty window.
  with open(shot, "rb") as f:
    png = f.read()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, len(png)
