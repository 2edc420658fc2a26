"""Which module absl files a binary's flags under, for its --helpshort and --helpfull.

The example's flags are defined in ``flags.py`` (train.py's) and
``sample_flags.py`` (sample.py's), not in the binaries themselves; absl
would list them under those modules, and a binary's --helpshort would show
none of them. Both pass :func:`help_owner` as the flags' ``module_name``.

Example::

  flags.DEFINE_integer("steps", 600, "Training steps.",
                       module_name=help_owner("train.py"))
"""

from __future__ import annotations

import os
import sys
from typing import Optional


def help_owner(binary: str) -> Optional[str]:
  """The module absl files these flags under: ``sys.argv[0]`` while ``binary``
  (a file beside this one) runs as the program, so that its --helpshort and
  --helpfull list them as its own, as when it defined them itself; else None
  (absl's default: the defining module)."""
  main = getattr(sys.modules.get("__main__"), "__file__", None)
  here = os.path.dirname(os.path.abspath(__file__))
  if main and os.path.abspath(main) == os.path.join(here, binary):
    return sys.argv[0]
  return None
