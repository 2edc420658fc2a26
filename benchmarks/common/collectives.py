"""The collectives of a compiled program, counted in its HLO text.

:func:`count` reads ``compiled.as_text()`` and counts each collective op
(:data:`NAMES`) once where it appears in the program (not per loop trip),
split by what it moves: an op whose arrays end in the carry's trailing
shape moves activations, any other parameters or their gradients. Knows
nothing of what compiled the program.
"""

from __future__ import annotations

import math
import re

NAMES = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")

_COLLECTIVE_RE = re.compile(
    r"^\s*\S+ = (?P<shape>.*?) (?P<op>" + "|".join(NAMES) + r")(?:-start)?\(", re.M)
_ARRAY_RE = re.compile(r"\b([a-z]+)(\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1}


def count(hlo: str, carry_tail: tuple[int, ...]) -> dict[str, dict[str, int]]:
  """Counts each collective in compiled HLO text, split by what it moves.

  An op whose arrays end in the carry's ``carry_tail`` (``(seq_len,
  width)``, say) moves activations (microbatches between stages, the
  outputs' final sum); any other moves parameters or their gradients (the
  caller checks that no parameter's shape ends like the carry, so the split
  is unambiguous). Each op is counted once where it appears in the program,
  not per loop trip; ``*_bytes`` adds up the bytes of what each op returns
  (per device).
  """
  counts = {op: {"activations": 0, "parameters": 0, "activations_bytes": 0,
                 "parameters_bytes": 0} for op in NAMES}
  for match in _COLLECTIVE_RE.finditer(hlo):
    arrays = [(kind, bits, tuple(int(d) for d in dims.split(",") if d))
              for kind, bits, dims in _ARRAY_RE.findall(match.group("shape"))]
    moves_carry = all(d[-len(carry_tail):] == carry_tail for _, _, d in arrays if d)
    size = sum(math.prod(d) * (int(bits) // 8 if bits else _BYTES.get(kind, 4))
               for kind, bits, d in arrays)
    what = "activations" if moves_carry else "parameters"
    counts[match.group("op")][what] += 1
    counts[match.group("op")][f"{what}_bytes"] += size
  return counts
