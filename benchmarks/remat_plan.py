"""Does remat="auto" choose well, and quickly? The planner's choice against every candidate.

For a gradient step of the benchmark GPT block stacked L times with
``remat="auto"``, at each depth:

1. Every candidate is compiled with its remat passed explicitly
   (``st.Stacked(..., remat=<candidate>)``): its temp memory, and the cost of
   one compile (the median candidate's).
2. ``st.remat_report(step, params, x)`` predicts every candidate from one
   trace (one compile, of ``full``, calibrates it): the cost model's error on
   temp bytes, against step 1, for every candidate.
3. For budgets 10%, 25%, 50% and 75% of the way from ``full``'s temp memory
   to ``none``'s, ``st.plan_remat(step, params, x, budget=..., cache_dir=...)``
   plans afresh (a new cache folder each time): its wall time against one
   compile, the compiles it spent; then once more with the same folder (the
   plan remembered: its wall time, the same plan). The step is compiled under
   the plan (``jax.jit(plan.wrap(step))``) and its temp memory checked
   against the budget.
4. Every candidate is re-timed side by side: ``--rounds`` rounds, each timing
   every candidate once, in an order that alternates direction every round.
   The chosen plan's step time is compared with every candidate that fits
   the same budget, as the median over rounds of the per-round ratio (on the
   wall clock, and in process CPU time); the largest of these ratios, against
   the fastest fitting candidate, must be at most 1.05.

  python -m benchmarks.remat_plan              # full run, ~10 min on 2 quiet cores
  python -m benchmarks.remat_plan --quick      # seconds (the smoke test)
  python -m benchmarks.remat_plan --depths 16 --rounds 5 --only none full nested

Writes ``benchmarks/results/remat_plan.json`` and ``remat_plan.png``; the
page's tables and figure are drawn by ``benchmarks/common/remat_plan_page.py``.
"""

from __future__ import annotations

import functools
import tempfile
import time
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import stacktools as st
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import models
from benchmarks.common import remat_plan_page

NAME = "remat_plan"
MiB = 2 ** 20
#: Budgets, as fractions of the way from full's temp memory to none's.
FRACTIONS = (0.10, 0.25, 0.50, 0.75)
#: The chosen plan's step time over the fastest fitting candidate's, at most.
TARGET = 1.05
#: Fresh plannings per budget, each followed by a compile of the step under
#: its plan (the fastest of each counts).
PLAN_ROUNDS = 2


def kind_of(label: str) -> str:
  """Which family a candidate label belongs to (for the plot and tables: a
  key of ``remat_plan_page.COLORS``)."""
  if label.startswith("save:"):
    return "named"
  if label.startswith("none:"):
    return "mix none/full"
  if ":" in label:
    return "mix full/nested"
  return "alias"


def gradient_step(cfg: models.ModelConfig, num_layers: int, remat: Any):
  """``(loss, init)`` and the un-jitted gradient step of a stack with ``remat``."""
  block = models.make_block(cfg)
  model = hk.without_apply_rng(hk.transform(lambda x: jnp.mean(jnp.square(
      st.Stacked(block, num_layers, remat=remat, name="h").fold(x)))))
  return model, jax.value_and_grad(model.apply)


def log_round(r: int, wall: dict[str, list[float]]) -> None:
  """One line per re-timing round: its fastest step, and the machine's load."""
  fastest = min(wall, key=lambda n: wall[n][-1])
  harness.log(f"  round {r}: fastest {fastest} {wall[fastest][-1] * 1e3:.0f} ms, "
              f"load {instruments.load_average()[:1]}")


def copy_name(label: str) -> str:
  """The name of ``label``'s step compiled under a plan, timed beside it."""
  return f"{label} [under the plan]"


def paired_max(chosen: np.ndarray, others: np.ndarray) -> np.ndarray:
  """``max_c median_r(chosen[r] / others[c, r])`` over the last axis of rounds,
  for a batch of resamples: ``chosen [..., R]``, ``others [..., C, R]``."""
  return np.max(np.median(chosen[..., None, :] / others, axis=-1), axis=-1)


def judge(budget: int, chosen: str, temp: dict[str, int], wall, cpu,
          copy: str) -> dict[str, Any]:
  """The chosen plan against the fastest candidate that fits ``budget``.

  Paired by round: against each fitting candidate, the median over rounds of
  ``chosen / candidate`` in the same round (a slow drift in the machine's
  load cancels); the fastest fitting candidate is the one this ratio is
  largest against (the chosen plan itself fits, so the ratio is >= 1). The
  same statistic for ``copy``, the same program compiled under the plan,
  shows what noise alone does to it.
  """
  fitting = [n for n in temp if temp[n] <= budget]
  out: dict[str, Any] = {"fitting": fitting}
  rng = np.random.default_rng(0)
  for times, suffix in ((wall, ""), (cpu, "_cpu")):
    paired = {n: instruments.paired_ratio(times[chosen], times[n]) for n in fitting}
    fastest = max(paired, key=paired.get)
    med = {n: instruments.median(times[n]) for n in fitting}
    rounds = len(times[chosen])
    picks = rng.integers(0, rounds, size=(2000, rounds))
    others = np.asarray([times[n] for n in fitting])
    boot = paired_max(np.asarray(times[chosen])[picks], others[:, picks].transpose(1, 0, 2))
    copy_ratio = float(paired_max(np.asarray(times[copy]), others))
    out.update({f"fastest_fitting{suffix}": fastest, f"ratio{suffix}": paired[fastest],
                f"ratio{suffix}_ci95": [float(v) for v in np.percentile(boot, [2.5, 97.5])],
                f"copy_ratio{suffix}": copy_ratio,
                f"fastest_fitting{suffix}_s": med[fastest], f"chosen{suffix}_s": med[chosen],
                f"fastest_by_median{suffix}": min(fitting, key=med.get),
                f"ratio_of_medians{suffix}": med[chosen] / min(med.values()),
                f"rank_by_median{suffix}": sorted(fitting, key=med.get).index(chosen) + 1})
    out[f"met{suffix}"] = paired[fastest] <= TARGET
    out[f"verdict{suffix}"] = ("met" if paired[fastest] <= TARGET else
                               "missed, within noise" if copy_ratio > TARGET or
                               out[f"ratio{suffix}_ci95"][0] <= TARGET else "missed")
  return out


def plan_afresh(step, params, x, budget: int, only) -> dict[str, Any]:
  """``st.plan_remat`` in a new cache folder, then again in the same one."""
  with tempfile.TemporaryDirectory() as folder:
    start = time.perf_counter()
    plan = st.plan_remat(step, params, x, budget=budget, only=only, cache_dir=folder)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    again = st.plan_remat(step, params, x, budget=budget, only=only, cache_dir=folder)
    reuse_seconds = time.perf_counter() - start
  report = plan.report
  return {"plan": plan, "seconds": seconds, "compiles": report.compiles,
          "compiled": [r.plan_text() for r in report.rows if r.compiled],
          "timed": {r.plan_text(): r.step_time_s for r in report.rows
                    if r.step_time_s is not None},
          "decision": report.decision, "reuse_seconds": reuse_seconds,
          "reused": again.reused, "reused_same_plan": again.labels == plan.labels}


def run_depth(args, cfg: models.ModelConfig, num_layers: int) -> dict[str, Any]:
  """Compile all, predict, plan under every budget, re-time, check: one depth."""
  harness.log(f"L={num_layers}: load {instruments.load_average()}")
  x = models.example_input(cfg)
  auto_model, auto_step = gradient_step(cfg, num_layers, "auto")
  params = models.fan_in_params(auto_model, x)

  start = time.perf_counter()
  predicted = st.remat_report(auto_step, params, x, only=args.only)
  predict_s = time.perf_counter() - start
  (key,) = [s.key for s in predicted.stacks]
  rows = {r.plan[key]: r for r in predicted.rows}

  # Every candidate with its remat passed explicitly: the temp bytes the
  # predictions are checked against, one compile's cost, the executables.
  compiled, compile_s, temp = {}, {}, {}
  for label, remat in predicted.remats[key].items():
    step = jax.jit(gradient_step(cfg, num_layers, remat)[1])
    t0 = time.perf_counter()
    compiled[label] = step.lower(params, x).compile()
    compile_s[label] = time.perf_counter() - t0
    temp[label] = int(compiled[label].memory_analysis().temp_size_in_bytes)
    instruments.block(compiled[label](params, x))
  one = instruments.median(compile_s.values())   # a typical single compile
  harness.log(f"L={num_layers}: {len(rows)} candidates predicted in {predict_s:.1f} s "
              f"(one compile: {one:.2f} s)\n{predicted}")

  budgets, plan_compiles, copies = [], {}, {}
  low, high = temp["full"], temp["none"]
  for fraction in args.fractions:
    budget = int(low + fraction * (high - low))
    runs = []
    for _ in range(PLAN_ROUNDS):
      planned = plan_afresh(auto_step, params, x, budget, args.only)
      plan = planned.pop("plan")
      # The step as a user compiles it under the plan, right after planning:
      # one compile, timed beside the planning. plan.wrap gives a fresh
      # function: `with plan: jax.jit(auto_step)` would reuse the trace that
      # jit cached for auto_step under the first plan.
      t0 = time.perf_counter()
      under_plan = jax.jit(plan.wrap(auto_step)).lower(params, x).compile()
      planned["compile_under_plan_seconds"] = time.perf_counter() - t0
      planned["label"] = plan.labels[key]
      planned["temp_under_plan"] = int(under_plan.memory_analysis().temp_size_in_bytes)
      runs.append((planned, under_plan))
    (planned, under_plan), label = runs[0], runs[0][0]["label"]
    if label not in plan_compiles:
      plan_compiles[label] = (planned["temp_under_plan"],
                              planned["compile_under_plan_seconds"])
      instruments.block(under_plan(params, x))
      copies[copy_name(label)] = under_plan
    seconds = min(r["seconds"] for r, _ in runs)
    beside = min(r["compile_under_plan_seconds"] for r, _ in runs)
    fits = [n for n in temp if temp[n] <= budget]
    by_flops = min(fits, key=lambda n: (rows[n].flops, temp[n]))
    budgets.append({"fraction": fraction, "budget_bytes": budget, "chosen": label,
                    "chosen_kind": kind_of(label),
                    "chosen_temp_bytes": planned["temp_under_plan"],
                    "within_budget": all(r["temp_under_plan"] <= budget for r, _ in runs),
                    "planning_seconds": seconds,
                    "planning_over_one_compile": seconds / one,
                    "compile_beside_seconds": beside,
                    "planning_over_compile_beside": seconds / beside,
                    "same_plan_every_round": len({r["label"] for r, _ in runs}) == 1,
                    "rounds": [r for r, _ in runs],
                    **{k: v for k, v in planned.items() if k != "seconds"},
                    "chosen_by_flops": by_flops,
                    "chosen_by_flops_temp_bytes": temp[by_flops]})
    harness.log(f"L={num_layers} budget {fraction:.0%} ({budget / MiB:.1f} MiB): "
                f"{label} ({planned['temp_under_plan'] / MiB:.1f} MiB), planned in "
                f"{seconds:.1f} s = {seconds / one:.2f}x one compile, "
                f"{seconds / beside:.2f}x the compile beside it; "
                f"{planned['compiles']} compiles; reused in "
                f"{planned['reuse_seconds']:.2f} s; "
                f"{[r['label'] for r, _ in runs]}; {planned['decision']}")

  harness.log(f"L={num_layers}: re-timing {len(compiled)} candidates and "
              f"{len(copies)} compiled under a plan, {args.rounds} rounds")
  wall, cpu = instruments.alternating_rounds(
      {n: functools.partial(step, params, x) for n, step in {**compiled, **copies}.items()},
      args.rounds, args.warmup_rounds, after_round=log_round)
  for entry in budgets:
    entry.update(judge(entry["budget_bytes"], entry["chosen"], temp, wall, cpu,
                       copy_name(entry["chosen"])))
  # Identical programs: the chosen candidate compiled explicitly and under the plan.
  controls = {n: {"ratio": instruments.paired_ratio(wall[n], wall[copy_name(n)]),
                  "ratio_cpu": instruments.paired_ratio(cpu[n], cpu[copy_name(n)]),
                  "median_s": instruments.median(wall[copy_name(n)])}
              for n in plan_compiles}

  candidates = []
  for label, row in rows.items():
    candidates.append({
        "label": label, "kind": kind_of(label), "temp_bytes": temp[label],
        "predicted_temp_bytes": row.predicted_temp_bytes,
        "temp_error": row.predicted_temp_bytes / temp[label] - 1,
        "saved_bytes": row.saved_bytes, "flops": row.flops,
        "compile_s": compile_s[label],
        "median_s": instruments.median(wall[label]),
        "median_cpu_s": instruments.median(cpu[label]),
        "wall_s": wall[label], "cpu_s": cpu[label]})
  return {
      "num_layers": num_layers, "stack": key, "candidates": candidates,
      "budgets": budgets, "temp_full_bytes": low, "temp_none_bytes": high,
      "report_temp_mismatches": {n: [temp[n], rows[n].temp_bytes] for n in rows
                                 if rows[n].compiled and rows[n].temp_bytes != temp[n]},
      "identical_programs": controls,
      "noise_floor": max(abs(c["ratio"] - 1) for c in controls.values()),
      "noise_floor_cpu": max(abs(c["ratio_cpu"] - 1) for c in controls.values()),
      "planning": {
          "candidates": len(rows),
          "predict_seconds": predict_s,
          "compile_all_seconds": sum(compile_s.values()),
          "one_compile_seconds": one,
          "plan_compile_seconds": {n: c[1] for n, c in plan_compiles.items()},
          "compile_all_over_one_compile": sum(compile_s.values()) / one,
          "max_planning_over_one_compile": max(b["planning_over_one_compile"]
                                               for b in budgets),
          "max_temp_error": max(abs(c["temp_error"]) for c in candidates),
      },
      "load": instruments.load_average(),
  }


def summarise(depths: list[dict[str, Any]]) -> dict[str, Any]:
  entries = [(d["num_layers"], b) for d in depths for b in d["budgets"]]
  return {
      "all_within_budget": all(b["within_budget"] for _, b in entries),
      "all_met": all(b["met"] for _, b in entries),
      "all_met_cpu": all(b["met_cpu"] for _, b in entries),
      "target": TARGET,
      "worst_ratio": max(b["ratio"] for _, b in entries),
      "worst_ratio_cpu": max(b["ratio_cpu"] for _, b in entries),
      "max_planning_over_one_compile": max(b["planning_over_one_compile"]
                                           for _, b in entries),
      "max_planning_over_compile_beside": max(b["planning_over_compile_beside"]
                                              for _, b in entries),
      "all_same_plan_every_round": all(b["same_plan_every_round"] for _, b in entries),
      "max_compiles": max(b["compiles"] for _, b in entries),
      "max_reuse_seconds": max(b["reuse_seconds"] for _, b in entries),
      "all_reused_same_plan": all(b["reused"] and b["reused_same_plan"]
                                  for _, b in entries),
      "max_temp_error": max(d["planning"]["max_temp_error"] for d in depths),
      "misses": [f"L={n} {b['fraction']:.0%}: {b['chosen']} {b['ratio']:.3f}x "
                 f"{b['fastest_fitting']} ({b['verdict']})" for n, b in entries
                 if not b["met"]],
      "misses_cpu": [f"L={n} {b['fraction']:.0%}: {b['chosen']} {b['ratio_cpu']:.3f}x "
                     f"{b['fastest_fitting_cpu']} ({b['verdict_cpu']})" for n, b in entries
                     if not b["met_cpu"]],
      "noise_floor": {str(d["num_layers"]): [d["noise_floor"], d["noise_floor_cpu"]]
                      for d in depths},
      "over_budget": [f"L={n} {b['fraction']:.0%}: {b['chosen']}" for n, b in entries
                      if not b["within_budget"]],
      "chosen": {str(d["num_layers"]): {f"{b['fraction']:.0%}": b["chosen"]
                                        for b in d["budgets"]} for d in depths},
      "report_temp_mismatches": {str(d["num_layers"]): d["report_temp_mismatches"]
                                 for d in depths if d["report_temp_mismatches"]},
  }


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--depths", type=harness.int_list, default=[32, 64])
  p.add_argument("--fractions", type=lambda s: [float(v) for v in s.split(",")],
                 default=list(FRACTIONS),
                 help="budgets, as fractions of the way from full's temp bytes to none's")
  p.add_argument("--only", nargs="+", default=None,
                 help="candidate labels to report (default: every candidate); must "
                      "include none and full, which set the budgets")
  p.add_argument("--rounds", type=int, default=31, help="interleaved re-timing rounds")
  p.add_argument("--warmup_rounds", type=int, default=1)
  p.add_argument("--model", choices=("gpt", "mlp"), default="gpt",
                 help="the benchmark block (mlp: for --quick, it compiles faster)")
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  return p


#: Two budgets: the tightest (only full fits) and the loosest (the planner
#: tries more than one plan); the others plan the same way at other sizes.
QUICK = ["--model", "mlp", "--depths", "2", "--only", "none", "full", "none:1,full:1",
         "--fractions", "0.1,0.75", "--rounds", "3", "--warmup_rounds", "0", "--width", "16",
         "--batch", "8"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  if args.only is not None and not {"none", "full"} <= set(args.only):
    raise SystemExit("--only must include none and full: they set the budgets.")
  cfg = models.model_config(args)
  start = time.perf_counter()
  load_before = instruments.load_average()
  depths = [run_depth(args, cfg, n) for n in args.depths]
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {
          "model_config": cfg.describe(), "depths": args.depths,
          "fractions": args.fractions, "only": args.only,
          "rounds": args.rounds, "warmup_rounds": args.warmup_rounds, "target": TARGET,
          "step": f"jax.value_and_grad(mean(st.Stacked({args.model}, L, "
                  "remat='auto').fold(x)**2))",
          "budget": "temp(full) + fraction * (temp(none) - temp(full)), in bytes",
          "choice": "st.plan_remat(step, params, x, budget=..., cache_dir=<new folder>)",
          "ratio": "max over fitting candidates c of the median over rounds of "
                   "chosen / c in the same round; every candidate timed once per "
                   "round, direction alternating",
      },
      "depths": depths,
      "summary": summarise(depths),
      "load_before": load_before,
      "load_after": instruments.load_average(),
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, remat_plan_page.markdown,
                         remat_plan_page.draw)


if __name__ == "__main__":
  main()
