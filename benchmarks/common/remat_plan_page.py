"""What the ``remat_plan`` page shows: its tables and its figure.

Built from the results' JSON alone (the payload ``benchmarks/remat_plan.py``
writes): per depth, a table of the planner's choice under each budget and a
table of every candidate, predicted and compiled (:func:`markdown`); and a
figure of every candidate's step time and predicted temp memory against its
compiled temp memory, the chosen ones ringed (:func:`draw`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.common import report

MiB = 2 ** 20
#: Each family of candidates, in the legend's order, and its colour.
COLORS = {"alias": "tab:blue", "named": "tab:green", "mix none/full": "tab:red",
          "mix full/nested": "tab:purple"}


def markdown(payload: dict[str, Any]) -> str:
  """The page's tables: per depth, the planner's choice under each budget and
  every candidate; then what their columns mean."""
  target = payload["config"]["target"]
  lines = []
  for depth in payload["depths"]:
    n, p = depth["num_layers"], depth["planning"]
    by = {c["label"]: c for c in depth["candidates"]}
    lines.append(f"**L={n}**: full {depth['temp_full_bytes'] / MiB:.1f} MiB, none "
                 f"{depth['temp_none_bytes'] / MiB:.1f} MiB; {len(by)} candidates; one "
                 f"compile {p['one_compile_seconds']:.2f} s (the median candidate's)")
    lines.append("")
    lines.append("| budget | planning s (x one compile; x the compile beside it) "
                 "| compiles | chosen plan (every round) | temp MiB "
                 "| step ms | fastest fitting (ms) | ratio: wall | cpu "
                 "| same program under the plan: wall | cpu | remembered: s, same plan |")
    lines.append("|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---|")
    for b in depth["budgets"]:
      ratio, ratio_cpu = (_ratio_cell(b["ratio"], b["ratio_ci95"], target),
                          _ratio_cell(b["ratio_cpu"], b["ratio_cpu_ci95"], target))
      planning = (f"{b['planning_seconds']:.1f} ({b['planning_over_one_compile']:.2f}x; "
                  f"{b['planning_over_compile_beside']:.2f}x)")
      if b["planning_over_one_compile"] > 3:
        planning = f"**{planning}**"
      chosen = b["chosen"] if b["same_plan_every_round"] else (
          ", ".join(r["label"] for r in b["rounds"]))
      lines.append(
          f"| {b['fraction']:.0%}: {b['budget_bytes'] / MiB:.1f} MiB | {planning} "
          f"| {b['compiles']} | {chosen} "
          f"| {b['chosen_temp_bytes'] / MiB:.1f} | {b['chosen_s'] * 1e3:.0f} "
          f"| {b['fastest_fitting']} ({b['fastest_fitting_s'] * 1e3:.0f}) | {ratio} "
          f"| {ratio_cpu} | {b['copy_ratio']:.3f} | {b['copy_ratio_cpu']:.3f} "
          f"| {b['reuse_seconds']:.2f}, {'yes' if b['reused_same_plan'] else 'NO'} |")
    lines.append("")
    lines.append("| candidate | predicted temp MiB | compiled temp MiB | error | saved MiB "
                 "| GFLOPs | step ms | compile s |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in sorted(depth["candidates"], key=lambda c: c["temp_bytes"]):
      lines.append(
          f"| {c['label']} | {c['predicted_temp_bytes'] / MiB:.2f} "
          f"| {c['temp_bytes'] / MiB:.2f} | {100 * c['temp_error']:+.1f}% "
          f"| {c['saved_bytes'] / MiB:.2f} | {c['flops'] / 1e9:.2f} "
          f"| {c['median_s'] * 1e3:.0f} | {c['compile_s']:.2f} |")
    lines.append("")
    pairs = ", ".join(f"{n}: wall {c['ratio']:.3f}, cpu {c['ratio_cpu']:.3f}"
                      for n, c in depth["identical_programs"].items())
    lines.append(f"Noise: the chosen step, compiled explicitly over compiled under the plan "
                 f"(the same program), median of the per-round ratios: {pairs}.")
    lines.append("")
  lines.append(f"Ratio: the median over {payload['config']['rounds']} rounds of the chosen "
               "plan's step time over the fastest fitting candidate's in the same round "
               "(fastest: the one this ratio is largest against; on the CPU clock it can "
               "be another), [its bootstrap 95% interval]; **bold**: above "
               f"{target} (or planning above 3x one compile). *Same program under the "
               "plan*: the same statistic for the chosen plan's step compiled under the "
               "plan (an identical program, timed beside it): what noise alone gives. "
               "*Planning*: the faster of two fresh st.plan_remat calls, over one "
               "compile (the median candidate's) and over the faster of the two "
               "compiles of the step under the plan right after each; *every round*: "
               "the plans the two calls chose, where they differ. *Remembered*: "
               "st.plan_remat called again with the same cache folder.")
  return "\n".join(lines)


def _ratio_cell(ratio: float, ci95: list[float], target: float) -> str:
  text = f"{ratio:.3f} [{ci95[0]:.3f}, {ci95[1]:.3f}]"
  return text if ratio <= target else f"**{text}**"


def draw(payload: dict[str, Any]):
  """The figure: a column per depth, every candidate's step time (top) and
  predicted temp memory (bottom) against its compiled temp memory."""
  depths = payload["depths"]

  def fig_fn(plt):
    fig, axes = plt.subplots(2, len(depths), figsize=(7.5 * len(depths), 11.5),
                             squeeze=False)
    handles = {}
    for col, depth in enumerate(depths):
      cands = depth["candidates"]
      mem = {c["label"]: c["temp_bytes"] / MiB for c in cands}
      for row, (key, ylabel, choose) in enumerate((
          ("wall_s", "step time: median over the interleaved rounds, bars p25-p75 (ms)",
           "chosen"),
          ("predicted", "temp memory predicted from one trace (MiB); gray: equal",
           "chosen"))):
        ax = axes[row][col]
        if key == "wall_s":
          value = {c["label"]: 1e3 * c["median_s"] for c in cands}
          spread = {c["label"]: 1e3 * np.percentile(c["wall_s"], [25, 75]) for c in cands}
        else:
          value = {c["label"]: c["predicted_temp_bytes"] / MiB for c in cands}
          spread = None
        for kind in COLORS:
          names = [c["label"] for c in cands if c["kind"] == kind]
          if not names:
            continue
          xs, ys = [mem[n] for n in names], [value[n] for n in names]
          if spread:
            err = np.array([[value[n] - spread[n][0], spread[n][1] - value[n]]
                            for n in names]).T
            ax.errorbar(xs, ys, yerr=err, fmt="none", ecolor=COLORS[kind], alpha=0.4,
                        zorder=2)
          handles[kind] = ax.scatter(xs, ys, color=COLORS[kind], s=30, zorder=3)
        for n in mem:
          ax.annotate(n, (mem[n], value[n]), fontsize=6, xytext=(4, -8),
                      textcoords="offset points", alpha=0.8)
        if key == "wall_s":
          front = report.frontier(list(zip(mem.values(), value.values())))
          (handles["frontier: the best with at most this memory"],) = ax.plot(
              *zip(*front), "-", color="gray", alpha=0.5, zorder=1)
        else:
          span = [min(mem.values()), max(mem.values())]
          ax.plot(span, span, "-", color="gray", alpha=0.5, zorder=1)
          ax.set_yscale("log")
        rings: dict[str, list[str]] = {}
        for i, b in enumerate(depth["budgets"]):
          color = f"C{i + 4}"
          handles[f"budget at {b['fraction']:.0%} of the way from full to none"] = (
              ax.axvline(b["budget_bytes"] / MiB, color=color, linestyle="--",
                         linewidth=1))
          ax.scatter([mem[b[choose]]], [value[b[choose]]], s=150 + 110 * i,
                     facecolors="none", edgecolors=color, linewidths=1.5, zorder=4)
          rings.setdefault(b[choose], []).append(f"{b['fraction']:.0%}")
        for n, fractions in rings.items():
          ax.annotate("chosen at " + ", ".join(fractions), (mem[n], value[n]),
                      fontsize=7, fontweight="bold", xytext=(8, 8),
                      textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("compiled temp memory of one gradient step (MiB)")
        ax.set_ylabel(ylabel, fontsize=8)
        what = ("rings: chosen by st.plan_remat" if row == 0
                else "the cost model against the compiler")
        ax.set_title(f"{payload['config']['model_config']['kind']} "
                     f"L={depth['num_layers']}: every candidate; {what}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    # Below the bottom-left panel: tight_layout makes room for an axes' legend.
    axes[-1][0].legend(list(handles.values()), list(handles), loc="upper left",
                       bbox_to_anchor=(0.0, -0.13), ncol=3, fontsize=8, frameon=False)
    return fig

  return fig_fn
