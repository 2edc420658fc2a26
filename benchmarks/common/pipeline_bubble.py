"""Question 1 of ``pipeline``: the bubble, counted in the schedule's table.

For each schedule, P, M and R, the idle stage-ticks over all stage-ticks of
``st.Pipeline(microbatches=M, schedule=..., repeats=R).table(P)``, against
(P-1)/(M+P-1) for ``gpipe`` and ``1f1b``, (P-1)/(R*M+P-1) for ``circular``
and ``interleaved``, and (P-1)/(3M+P-1) for ``zb`` (a tick per forward,
input-gradient or weight-gradient op), compared as fractions: exactly.
Nothing compiles. Here: the rows (:func:`rows`), their table for the page
(:func:`table`) and their panel of the figure (:func:`panel`).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import stacktools as st
from benchmarks.common import report

SCHEDULES = ("gpipe", "1f1b", "circular", "interleaved", "zb")
#: The schedules that run R chunks per stage (``repeats``).
CHUNKED = ("circular", "interleaved")


def rows(stages: list[int], microbatches: list[int],
         repeats: list[int]) -> list[dict[str, Any]]:
  """One row per (schedule, P, M, R): the counted bubble and the formula's.

  The count is exact: idle stage-ticks over all stage-ticks of the table, as
  a fraction, against the formula as a fraction.
  """
  out = []
  for schedule in SCHEDULES:
    for p in stages:
      chunks = ([r for r in repeats if r > 1] if schedule == "interleaved"
                else repeats if schedule == "circular" else [1])
      for r in chunks:
        for m in microbatches:
          if schedule != "gpipe" and m < p or schedule == "interleaved" and m % p:
            # circular: a microbatch must be back at stage 0 before its next
            # repeat; the others: their steady state runs one forward and
            # one backward on every stage; interleaved: microbatches enter
            # in groups of P.
            continue
          timeline = st.Pipeline(microbatches=m, schedule=schedule, repeats=r).table(p)
          idle, total = int((~timeline.busy).sum()), int(timeline.busy.size)
          # Busy ticks per stage: zb's 3M (F, B, W); the others' R*M, halved
          # with their ticks (each of their ops, F or B, is one tick).
          work = 3 * m if schedule == "zb" else r * m
          counted, formula = Fraction(idle, total), Fraction(p - 1, work + p - 1)
          out.append({"schedule": schedule, "P": p, "M": m, "R": r,
                      "ticks": int(timeline.busy.shape[0]), "idle_stage_ticks": idle,
                      "stage_ticks": total, "bubble": timeline.bubble,
                      "formula": float(formula), "counted": str(counted),
                      "exact": counted == formula,
                      "float_diff": abs(timeline.bubble - float(formula))})
  return out


def _label(schedule: str, repeats: int) -> str:
  return f"{schedule} R={repeats}" if schedule in CHUNKED else schedule


def table(bubble: dict[str, Any]) -> list[str]:
  """The page's lines for the bubble: a heading, and a table of schedule and
  P against M."""
  ms = sorted({r["M"] for r in bubble["rows"]})
  by = {(r["schedule"], r["R"], r["P"], r["M"]): r for r in bubble["rows"]}
  kinds = sorted({(r["schedule"], r["R"], r["P"]) for r in bubble["rows"]},
                 key=lambda k: (SCHEDULES.index(k[0]), k[1], k[2]))
  cells = [[_label(s, r), p] + [f"{by[(s, r, p, m)]['bubble']:.3f}" if (s, r, p, m) in by
                                else "–" for m in ms] for s, r, p in kinds]
  return (["**Bubble, counted in `st.Pipeline(...).table(P)`** (equal to the formula, as "
           f"fractions of stage-ticks, in {bubble['exact']} of {len(bubble['rows'])} "
           "cells)", ""]
          + report.table(["schedule", "P"] + [f"M={m}" for m in ms], cells) + [""])


def panel(ax: Any, bubble_rows: list[dict[str, Any]]) -> None:
  """The bubble against M, a line per P and schedule, the formula's as black x."""
  stages = sorted({r["P"] for r in bubble_rows})
  kinds = sorted({(r["schedule"], r["R"]) for r in bubble_rows},
                 key=lambda k: (SCHEDULES.index(k[0]), k[1]))
  styles = dict(zip(kinds, [("-", "o"), ("--", "s"), (":", "^"), ("-.", "v"), ("-", "D"),
                            ("--", "P"), (":", "*"), ("-.", "X"), ("-", "h")]))
  for i, p in enumerate(stages):
    for key in kinds:
      pts = sorted((r["M"], r["bubble"], r["formula"]) for r in bubble_rows
                   if r["P"] == p and (r["schedule"], r["R"]) == key)
      if not pts:
        continue
      m, counted, formula = zip(*pts)
      ls, marker = styles[key]
      ax.plot(m, counted, ls, marker=marker, color=f"C{i}",
              label=f"P={p} " + _label(*key), ms=5)
      ax.plot(m, formula, "x", color="black", ms=4)
  report.log2_axis(ax, [r["M"] for r in bubble_rows], "microbatches M")
  ax.set_ylabel("bubble: idle stage-ticks / all")
  ax.set_title("Bubble counted in st.Pipeline(...).table(P)\n"
               "(black x: (P-1)/(R·M+P-1); zb: (P-1)/(3M+P-1))")
  ax.legend(fontsize=6, ncol=2)
