"""What train.py's --init_from flags ask for: checked together, and --depth_map
read as which of the checkpoint's blocks go where.

A run started from another run's checkpoint (``--init_from``) may have
another depth. ``--depth_map`` names a scheme (:data:`DEPTH_MAPS`, each one
of stacktools' ``st.depth`` helpers) or lists the blocks to take
(``take:0,1,new``); :func:`depth_indices` turns it into what
``st.take_layers`` takes, for the two depths. ``resume.py`` reads the
checkpoint and maps its blocks.
"""

from __future__ import annotations

from typing import Optional

from stacktools import depth
from examples.gpt import model_config

#: The --depth_map values that name a scheme (the others list blocks: take:...).
DEPTH_MAPS = ("repeat", "stack", "zero_new")

#: ``st.take_layers``' ``indices`` and ``zero``: which block goes where.
DepthMap = tuple[list[Optional[int]], tuple[str, ...]]


def check_init_flags(init_from: Optional[str], depth_map: Optional[str],
                     init_opt_state: str, resume: bool) -> None:
  """Checks the --init_from flags together, before anything is read.

  Raises:
    ValueError: one line naming the flags.
  """
  if init_from is None:
    given = (["depth_map"] if depth_map is not None else []) + (
        ["init_opt_state"] if init_opt_state != "fresh" else [])
    if given:
      raise ValueError(f"--{' and --'.join(given)} {'need' if len(given) > 1 else 'needs'} "
                       "--init_from=DIR, the run to start from.")
    return
  if resume:
    raise ValueError(
        "--init_from starts a new run from another run's checkpoint and --resume "
        "continues this --workdir's: pass one of them.")
  if depth_map is not None and depth_map not in DEPTH_MAPS:
    body = depth_map[len("take:"):] if depth_map.startswith("take:") else None
    if body is None or not all(p == "new" or p.isdigit() for p in body.split(",")):
      raise ValueError(
          f"--depth_map={depth_map!r} must be one of {', '.join(DEPTH_MAPS)} or take:I,J,... "
          "(block indices of --init_from's run, 'new' for a fresh block), e.g. take:0,1,2,5.")


def depth_indices(depth_map: Optional[str], old: int, new: int, period: int,
                  pattern: str = "") -> DepthMap:
  """``--depth_map`` as ``st.take_layers``' indices and ``zero=``, for a stack
  of ``old`` blocks becoming one of ``new``.

  Example::

    assert depth_indices("repeat", 2, 4, 1) == ([0, 0, 1, 1], ())

  Raises:
    ValueError: one line, when the map does not fit the depths.
  """
  if depth_map is None:
    if old != new:
      raise ValueError(f"its checkpoint has {old} blocks and --num_layers={new}: pass "
                       f"--depth_map ({', '.join(DEPTH_MAPS)} or take:I,J,...) to say "
                       f"which blocks go where, or --num_layers={old}.")
    return list(range(old)), ()
  if depth_map.startswith("take:"):
    indices = [None if p == "new" else int(p) for p in depth_map[len("take:"):].split(",")]
    if len(indices) != new:
      raise ValueError(f"--depth_map={depth_map} lists {len(indices)} blocks but "
                       f"--num_layers={new}; list one index per block.")
    outside = [i for i in indices if i is not None and i >= old]
    if outside:
      raise ValueError(f"--depth_map={depth_map} takes block {outside[0]}, but the "
                       f"checkpoint has {old} blocks (0 to {old - 1}): list blocks 0 "
                       f"to {old - 1}, and new for a fresh one.")
    for p, i in enumerate(indices):   # every position keeps its kind of --pattern
      if i is not None and pattern and pattern[i % period] != pattern[p % period]:
        raise ValueError(f"--depth_map={depth_map} puts block {i}, of kind "
                         f"{pattern[i % period]} in --pattern={pattern}, at position {p}, "
                         f"whose kind is {pattern[p % period]}: take a block of kind "
                         f"{pattern[p % period]} there, or new for a fresh one.")
    return indices, ()
  if new < old:
    raise ValueError(f"--depth_map={depth_map} grows the stack, but --num_layers={new} "
                     f"is less than its {old} blocks: to keep some, list them, e.g. "
                     f"--depth_map=take:{','.join(map(str, range(new)))}.")
  helper = {"repeat": depth.repeat, "stack": depth.tile, "zero_new": depth.insert_new}[depth_map]
  zero = model_config.RESIDUAL_OUTPUTS if depth_map == "zero_new" else ()
  return helper(old, new, period), zero
