"""MkDocs hooks: the README as the home page, the benchmark results uncopied.

* The README is the front door on GitHub and the site's home page, written
  once: ``docs/index.md`` is a placeholder that becomes README.md, with its
  links into ``docs/`` made relative to the site.
* The benchmark plots and JSON live once in git, in benchmarks/results/. The
  pages link them by their path in the repository
  (``../../benchmarks/results/x.png``, which GitHub shows as is); each file is
  added to the site as ``benchmarks/results/x.png`` and the links rewritten to
  it, so ``mkdocs build --strict`` checks every one.
* The docstrings are Google style with a few reST marks (``Example::``,
  ``:func:`fold```); the API pages show them without the marks.
"""

import os
import posixpath
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = "benchmarks/results"
LINK = re.compile(r"\]\((?P<target>(?:\.\./)+benchmarks/results/[\w.-]+)\)")
README_LINK = re.compile(r"\]\(docs/")
ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|obj):(?=<code>)")
LITERAL_INTRO = re.compile(r"(?<=\w)::(?=\s*</p>)")


def on_files(files, config):
  for name in sorted(os.listdir(os.path.join(ROOT, RESULTS))):
    if name.endswith((".png", ".json")):
      files.append(File(f"{RESULTS}/{name}", ROOT, config["site_dir"],
                        config["use_directory_urls"]))
  return files


def on_page_markdown(markdown, page, config, files):
  if page.file.src_uri == "index.md":
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
      return README_LINK.sub("](", f.read())
  page_dir = posixpath.dirname(page.file.src_uri)

  def site_link(m):
    # Where the link points in the repository, from docs/<page's folder>.
    in_repo = posixpath.normpath(posixpath.join("docs", page_dir, m.group("target")))
    if not in_repo.startswith(RESULTS + "/"):
      return m.group(0)
    return "](" + posixpath.relpath(in_repo, page_dir or ".") + ")"

  return LINK.sub(site_link, markdown)


def on_page_content(html, page, config, files):
  if not page.file.src_uri.startswith("api/"):
    return html
  return LITERAL_INTRO.sub(":", ROLE.sub("", html))
