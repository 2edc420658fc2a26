"""Remembered remat plans: one JSON file per step, budget and machine.

A plan depends on the step (its jaxpr, traced with every stack ``"full"``),
its arguments' shapes, dtypes and shardings, the budget and the planner's
options, the backend and devices, and the versions of JAX, jaxlib and
stacktools. :func:`key` hashes all of them; :class:`PlanCache` keeps one file
per key, ``remat_plan-<hash>.json``, holding the key itself (a file whose key
differs is not used), the chosen labels and the report.

A file that cannot be read back is ignored with a warning and rewritten.
Files are written to a temporary file in the same folder, then renamed over
the target (``os.replace``), so a reader sees the old file or the new one,
never half of one; the temporary name, ``.<target>.<8 hex>.tmp``, is the one
the GPT example's start-up clears after a killed write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import jax

from stacktools.core import _version

#: The environment variable naming the default cache folder.
ENV = "STACKTOOLS_PLAN_CACHE"
#: Bumped when the file's layout changes; older files are then replanned.
FORMAT = 1


def _jaxlib_version() -> str:
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return "unknown"


def _arg_signature(args: Sequence[Any]) -> list[list[Any]]:
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
    aval = jax.typeof(leaf)
    sharding = getattr(leaf, "sharding", None)
    out.append([jax.tree_util.keystr(path), list(aval.shape), str(aval.dtype),
                None if sharding is None else str(sharding)])
  return out


def key(text: str, args: Sequence[Any], options: Mapping[str, Any]) -> dict[str, Any]:
  """What a plan depends on, as a JSON-able dict.

  Args:
    text: the step's jaxpr, as text.
    args: the step's arguments (arrays or ``jax.ShapeDtypeStruct``).
    options: the budget and planner options.

  Returns:
    The key; :func:`digest` names its file.
  """
  # Printed functions carry their addresses, which differ between processes.
  text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
  device = jax.devices()[0]
  return {
      "jaxpr_sha256": hashlib.sha256(text.encode()).hexdigest(),
      "args": _arg_signature(args),
      "options": dict(options),
      "backend": {"platform": device.platform, "device_kind": device.device_kind,
                  "devices": jax.device_count(), "processes": jax.process_count()},
      "versions": {"jax": jax.__version__, "jaxlib": _jaxlib_version(),
                   "stacktools": _version.__version__},
  }


def digest(plan_key: Mapping[str, Any]) -> str:
  return hashlib.sha256(json.dumps(plan_key, sort_keys=True).encode()).hexdigest()


class PlanCache:
  """A folder of remembered plans.

  Example::

    import tempfile
    cache = PlanCache.at(tempfile.mkdtemp())   # or None: no folder, no cache
    assert cache.load({"step": "abc"}) is None   # a miss; store(key, entry) fills it
  """

  def __init__(self, folder: str):
    self.folder = folder

  @classmethod
  def at(cls, folder: Optional[str]) -> Optional["PlanCache"]:
    """The cache in ``folder``, else in ``$STACKTOOLS_PLAN_CACHE``, else None."""
    folder = folder if folder is not None else os.environ.get(ENV) or None
    return None if folder is None else cls(os.fspath(folder))

  def path(self, plan_key: Mapping[str, Any]) -> str:
    return os.path.join(self.folder, f"remat_plan-{digest(plan_key)[:24]}.json")

  def load(self, plan_key: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The entry stored under ``plan_key``, or None (missing or unreadable)."""
    path = self.path(plan_key)
    if not os.path.exists(path):
      return None
    try:
      with open(path, encoding="utf-8") as f:
        entry = json.load(f)
      if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        raise ValueError(f"not a plan file of format {FORMAT}")
      if entry.get("key") != json.loads(json.dumps(plan_key)):
        raise ValueError("its key is not this step's")
      for field in ("labels", "report"):
        if not isinstance(entry.get(field), dict):
          raise ValueError(f"it has no {field!r}")
    except (OSError, ValueError) as e:
      self.warn(path, e)
      return None
    return entry

  @staticmethod
  def warn(path: str, problem: Any) -> None:
    warnings.warn(f"st.plan_remat: ignoring the remembered plan {path} ({problem}); "
                  "planning afresh and rewriting it.", stacklevel=4)

  def store(self, plan_key: Mapping[str, Any], entry: Mapping[str, Any]) -> Optional[str]:
    """Writes ``entry`` under ``plan_key`` atomically; its path, or None
    (with a warning) where the folder cannot be written."""
    path = self.path(plan_key)
    text = json.dumps({"format": FORMAT, "key": plan_key, **entry}, indent=1,
                      default=str)
    tmp = os.path.join(self.folder, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    try:
      os.makedirs(self.folder, exist_ok=True)
      with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    except OSError as e:
      warnings.warn(f"st.plan_remat: could not remember the plan in {path} ({e}); "
                    "the next run plans again.", stacklevel=3)
      if os.path.exists(tmp):
        os.remove(tmp)
      return None
    return path
