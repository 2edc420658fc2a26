"""What a benchmark shows: its Markdown tables and its plots' common axes.

Every script prints its results as Markdown tables (the page quotes them)
and draws one figure; the pieces they share live here:

* :func:`row` and :func:`table`: a Markdown row, and a table (its header,
  the rule that aligns its columns, its rows);
* :func:`log2_axis`: a log2 x axis ticked at the measured values, and
  :func:`depth_axis`, that axis labelled "layers L";
* :func:`frontier`: the best value reachable within each cost, as a step line;
* :func:`finish`: the grid, the legend and a log y axis, as most panels have
  them.

Nothing here imports JAX or knows what is measured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional


def row(*cells: Any) -> str:
  """``| a | b | c |``: one Markdown table row."""
  return "|" + "".join(f" {c} |" if str(c) else " |" for c in cells)


def rule(align: str) -> str:
  """The line under a header: ``align`` has one letter per column, ``l``
  (left, ``---``) or ``r`` (right, ``---:``)."""
  return "|" + "".join("---|" if a == "l" else "---:|" for a in align)


def table(header: Sequence[Any], rows: Iterable[Sequence[Any]] = (),
          align: Optional[str] = None) -> list[str]:
  """A Markdown table's lines: ``header``, its rule (``align``, default: the
  first column left and the others right) and ``rows``."""
  if align is None:
    align = "l" + "r" * (len(header) - 1)
  assert len(align) == len(header), (align, header)
  return [row(*header), rule(align)] + [row(*cells) for cells in rows]


def log2_axis(ax: Any, values: Iterable[int], label: str) -> None:
  """A log2 x axis labelled ``label``, ticked at the measured ``values``."""
  values = sorted(set(values))
  ax.set_xscale("log", base=2)
  ax.set_xticks(values, [str(v) for v in values])
  ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
  ax.set_xlabel(label)


def depth_axis(ax: Any, depths: Iterable[int]) -> None:
  """A log2 x axis labelled "layers L", ticked at the measured depths."""
  log2_axis(ax, depths, "layers L")


def frontier(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
  """The lowest y reachable with at most x: the corners of a step line
  through ``(x, y)`` points (a cost and what it buys, lower is better)."""
  out, best = [], float("inf")
  for x, y in sorted(points):
    if y < best:
      if out:
        out.append((x, best))
      out.append((x, y))
      best = y
  return out


def finish(ax: Any, *, log_y: bool = False, legend: Optional[int] = 8,
           grid: str = "both", **legend_kwargs: Any) -> None:
  """A panel's last touches: a log y axis (``log_y``), a light grid
  (``grid``: ``"both"`` (major and minor ticks), ``"major"``, ``"y"``, or
  ``""`` for none) and a legend in
  ``legend``-point type (``None``: none)."""
  if log_y:
    ax.set_yscale("log")
  if grid in ("both", "major"):
    ax.grid(True, which=grid, alpha=0.3)
  elif grid:
    ax.grid(True, axis=grid, alpha=0.3)
  if legend is not None:
    ax.legend(fontsize=legend, **legend_kwargs)
