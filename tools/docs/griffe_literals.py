"""Griffe extension: the docstrings' reST literal blocks as fenced code.

The docstrings are Google style, read by Haiku's readers as reST: an example
is introduced by a line ending in ``::`` and indented below it. Markdown has
no such block, so before mkdocstrings renders a docstring each one becomes
a ```python fence (and the ``::`` a colon).
"""

import re
import textwrap

import griffe

BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)(?P<intro>\S[^\n]*?)::[ \t]*\n[ \t]*\n"
    r"(?P<body>(?:(?P=indent)[ \t]+\S[^\n]*\n|[ \t]*\n)+)",
    re.M)


def fence(text: str) -> str:
  """``text`` with each reST literal block written as a Markdown fence."""

  def one(m):
    indent = m.group("indent")
    body = textwrap.dedent(m.group("body")).strip("\n")
    code = "\n".join(indent + line if line else line for line in body.split("\n"))
    return (f"{indent}{m.group('intro')}:\n\n{indent}```python\n{code}\n"
            f"{indent}```\n\n")

  return BLOCK.sub(one, text if text.endswith("\n") else text + "\n")


class ReSTLiterals(griffe.Extension):

  def on_object(self, *, obj, **kwargs):
    if obj.docstring is not None:
      obj.docstring.value = fence(obj.docstring.value)
