"""Bytes and budgets, as the planner takes and writes them.

A budget enters the planner as bytes or as a number with a unit
(``"48MiB"``); :func:`parse_budget` parses it once, where it enters, into a
:class:`Budget` that keeps the value as given (errors quote it) beside the
bytes it means. :func:`format_bytes` writes bytes as reports and errors do.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Union

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(budget: Union[int, str]) -> int:
  """``"48MiB"`` -> 50331648; an int is returned as it is.

  Example::

    assert parse_bytes("1.5GiB") == 1610612736

  Args:
    budget: bytes as an int, or a number with a unit (B, KB, MB, GB, KiB,
      MiB, GiB).

  Returns:
    The number of bytes.
  """
  if isinstance(budget, bool):
    raise TypeError(f"budget={budget!r} is not a size; pass bytes or e.g. '48MiB'.")
  if isinstance(budget, int):
    if budget <= 0:
      raise ValueError(f"budget={budget} must be a positive number of bytes.")
    return budget
  match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(budget))
  if not match or match.group(2).lower() not in _UNITS:
    raise ValueError(
        f"budget={budget!r} is not a size: pass bytes as an int, or a number "
        "with a unit, e.g. '48MiB', '1.5GB' (units: B, KB, MB, GB, KiB, MiB, GiB).")
  value = float(match.group(1)) * _UNITS[match.group(2).lower()]
  if value < 1:
    raise ValueError(f"budget={budget!r} must be at least one byte.")
  return int(value)


class Budget(NamedTuple):
  """A memory budget, parsed once where it enters the planner.

  ``given`` is the value as the caller wrote it (errors quote it), ``bytes``
  what it means.
  """
  given: Union[int, str]
  bytes: int


def parse_budget(budget: Union[int, str]) -> Budget:
  """``"48MiB"`` -> ``Budget("48MiB", 50331648)``; see :func:`parse_bytes`."""
  return Budget(budget, parse_bytes(budget))


def format_bytes(n: float) -> str:
  """Bytes as the report writes them: ``"48.00 MiB"``."""
  return f"{n / 2**20:.2f} MiB"
