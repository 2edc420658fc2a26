"""How fast is a gradient step with each remat policy, against writing it by hand?

Steady-state seconds per gradient step of an L-layer stack, for every policy,
of ``st.Stacked`` against

* the hand-written ``jax.lax.scan(jax.checkpoint(body, policy=...,
  prevent_cse=False))`` with the equivalent jax policy (target: Stacked at
  most 1.03x its time), and
* ``hk.layer_stack`` over an ``hk.remat(policy=...)``-ed block, as a Haiku
  user writes it (target: at most 1.0x),

and the recompute cost of ``full`` and ``nested`` against ``none`` (the
Haliax guide predicts 4/3 and 5/3 of the FLOPs of ``none``).

All contenders are compiled and warmed up first, then timed in one process in
``--rounds`` rounds; each round times every contender for ``--steps`` steps
(``block_until_ready`` on the last), in an order that alternates direction
every round (A B C, C B A, ...) so that a slow drift in the machine's load
cancels. A ratio is the median over rounds of the two contenders' times in
the same round: only ratios, never absolute times, are meant to carry over to
another machine. Each step is timed twice: wall clock (what a user waits)
and this process's CPU time (``time.process_time``, all XLA threads), which a
busy shared machine disturbs far less: stacked/none and lax_scan/none compile
to the same program, and their CPU-time ratio is the noise floor.

  python -m benchmarks.step_time               # full run, ~4 min on 2 cores
  python -m benchmarks.step_time --quick       # seconds (the smoke test)
  python -m benchmarks.step_time --model mlp --num_layers 36 --rounds 15

Writes ``benchmarks/results/step_time.json`` and ``step_time.png``.
"""

from __future__ import annotations

import collections
import re
import time
from typing import Any, Optional

import jax
import numpy as np

from benchmarks.common import contenders
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import models

NAME = "step_time"
IMPLS = ("stacked", "lax_scan", "hk_layer_stack")
BASELINES = {"lax_scan": 1.03, "hk_layer_stack": 1.0}
GUIDE_RECOMPUTE = {"full": 4 / 3, "nested": 5 / 3}


def prepare(contender: contenders.Contender, x: jax.Array):
  """Makes the contender's parameters, compiles its step and runs it once."""
  params = contender.synthetic_params(x)
  step = contender.grad_step()
  t0 = time.perf_counter()
  compiled = step.lower(params, x).compile()
  compile_s = time.perf_counter() - t0
  instruments.block(compiled(params, x))
  return compiled, params, compile_s


def op_counts(compiled) -> dict[str, int]:
  """How many of each HLO op the compiled program has (names and metadata aside)."""
  ops = re.findall(r"= [^=]*? ([a-z][a-z0-9\-]*)\(", compiled.as_text())
  return dict(collections.Counter(ops))


def time_steps(compiled, params, x, steps: int) -> tuple[float, float]:
  """Wall-clock and process-CPU seconds per step over ``steps`` steps."""
  t0, c0 = time.perf_counter(), time.process_time()
  out = None
  for _ in range(steps):
    out = compiled(params, x)
  instruments.block(out)
  return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def ratio_stats(a: list[float], b: list[float]) -> dict[str, Any]:
  """Median, quartiles and a bootstrap 95% interval of the per-round ``a / b``."""
  r = np.asarray(a) / np.asarray(b)
  resampled = np.random.default_rng(0).choice(r, size=(2000, len(r)), replace=True)
  lo, hi = np.percentile(np.median(resampled, axis=1), [2.5, 97.5])
  return {"median": float(np.median(r)), "p25": float(np.percentile(r, 25)),
          "p75": float(np.percentile(r, 75)), "ci95": [float(lo), float(hi)],
          "min": float(r.min()), "max": float(r.max()), "rounds": int(len(r))}


def verdict(median: float, target: float, noise: float) -> str:
  """``met``; ``missed``; or missed by less than ``noise``, the largest distance
  from 1 measured between two programs with the same HLO ops."""
  if median <= target:
    return "met"
  if median <= target + noise:
    return "missed by less than the noise floor"
  return "missed"


def hlo_diff(a: dict[str, int], b: dict[str, int]) -> dict[str, list[int]]:
  """The ops whose counts differ between two programs: ``{op: [in a, in b]}``."""
  return {op: [a.get(op, 0), b.get(op, 0)] for op in sorted(set(a) | set(b))
          if a.get(op, 0) != b.get(op, 0)}


def controls(times: dict[str, list[float]], ops: dict[str, dict[str, int]]) -> dict[str, Any]:
  """Ratios between contenders that compiled to the same HLO ops (same policy).

  Whatever separates them from 1 is the machine, not the code: noise, and
  the systematic effects of where each program's buffers landed.
  """
  out = {}
  names = list(times)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      if a.split("/")[1] == b.split("/")[1] and ops[a] == ops[b]:
        out[f"{a} / {b}"] = ratio_stats(times[a], times[b])
  return out


def analyse(times: dict[str, list[float]], policies: list[str],
            ops: dict[str, dict[str, int]]) -> dict[str, Any]:
  """Stacked over each baseline, per policy, each policy over ``none``, and the
  identical-program controls that set the noise floor."""
  same = controls(times, ops)
  noise = max((abs(e["median"] - 1) for e in same.values()), default=0.0)
  vs: dict[str, Any] = {}
  for baseline, target in BASELINES.items():
    entry = {}
    for policy in policies:
      a, b = times.get(f"stacked/{policy}"), times.get(f"{baseline}/{policy}")
      if a and b:
        stats = ratio_stats(a, b)
        entry[policy] = {**stats, "target": target, "met": stats["median"] <= target,
                         "verdict": verdict(stats["median"], target, noise),
                         "same_hlo_ops": ops[f"stacked/{policy}"] == ops[f"{baseline}/{policy}"]}
    vs[baseline] = entry
  recompute = {}
  none = times.get("stacked/none")
  for policy in policies:
    if policy != "none" and none and times.get(f"stacked/{policy}"):
      recompute[policy] = {**ratio_stats(times[f"stacked/{policy}"], none),
                           "guide_flops_ratio": GUIDE_RECOMPUTE.get(policy)}
  if times.get("stacked/nested") and times.get("stacked/full"):
    recompute["nested_over_full"] = {
        **ratio_stats(times["stacked/nested"], times["stacked/full"]),
        "guide_flops_ratio": GUIDE_RECOMPUTE["nested"] / GUIDE_RECOMPUTE["full"]}
  return {"stacked_over": vs, "over_none": recompute, "identical_programs": same,
          "noise_floor": noise}


def _cell(entry: Optional[dict[str, Any]]) -> str:
  if not entry:
    return "n/a"
  lo, hi = entry["ci95"]
  text = f"{entry['median']:.3f} [{lo:.3f}, {hi:.3f}]"
  if "met" in entry and not entry["met"]:
    text = f"**{text}**"
  return text


def markdown(payload: dict[str, Any]) -> str:
  wall, cpu = payload["ratios"], payload["cpu_ratios"]
  med = payload["median_seconds"]
  lines = ["| policy | Stacked ms/step | temp MiB | / lax.scan + jax.checkpoint: wall | cpu "
           "| / hk.layer_stack + hk.remat: wall | cpu | / Stacked none: wall | cpu |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for policy in payload["config"]["policies"]:
    ms = med.get(f"stacked/{policy}")
    if ms is None:
      continue
    temp = payload["temp_bytes"].get(f"stacked/{policy}")
    cells = [f"{ms * 1e3:.1f}", f"{temp / 2**20:.1f}" if temp is not None else ""]
    for baseline in BASELINES:
      cells += [_cell(r["stacked_over"][baseline].get(policy)) for r in (wall, cpu)]
    if policy == "none":
      cells += ["1", "1"]
    else:
      cells += [_cell(r["over_none"].get(policy)) for r in (wall, cpu)]
    lines.append(f"| {policy} | " + " | ".join(cells) + " |")
  nof = wall["over_none"].get("nested_over_full")
  if nof:
    lines.append("")
    lines.append(f"nested / full: wall {_cell(nof)}, cpu "
                 f"{_cell(cpu['over_none']['nested_over_full'])} (the guide: 5/4 of the "
                 "FLOPs; 'about 20% slower in practice').")
  lines.append("")
  lines.append("Median over rounds of the per-round ratio [bootstrap 95% interval of the "
               "median]; **bold**: the median misses its target (<= 1.03 vs lax.scan, "
               "<= 1.0 vs hk.layer_stack). The guide's FLOPs ratio over none: full 1.33, "
               "nested 1.67.")
  lines.append("")
  for clock, res in (("wall", wall), ("cpu", cpu)):
    pairs = ", ".join(f"{k} {e['median']:.3f}" for k, e in res["identical_programs"].items())
    lines.append(f"Noise floor ({clock}): pairs that compile to the same HLO ops measure "
                 f"{pairs or 'n/a'}; the largest distance from 1 is "
                 f"{res['noise_floor']:.3f}.")
    lines.append("")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  wall, cpu = payload["ratios"], payload["cpu_ratios"]
  policies = payload["config"]["policies"]
  cfg = payload["config"]

  def errs(entries):
    return np.array([[e["median"] - e["ci95"][0], e["ci95"][1] - e["median"]] if e
                     else [0, 0] for e in entries]).T.reshape(2, len(entries))

  def fig_fn(plt):
    fig, (ax_vs, ax_rc) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.38
    pos = np.arange(len(policies))
    tops = [1.0]
    for k, (baseline, target) in enumerate(BASELINES.items()):
      entries = [wall["stacked_over"][baseline].get(p) for p in policies]
      med = [e["median"] if e else np.nan for e in entries]
      cpu_med = [e["median"] if e else np.nan
                 for e in (cpu["stacked_over"][baseline].get(p) for p in policies)]
      tops += [e["ci95"][1] for e in entries if e] + [m for m in cpu_med if m == m]
      x = pos + (k - 0.5) * width
      ax_vs.bar(x, med, width, yerr=errs(entries), capsize=3, color=f"C{k}",
                label=f"wall time: st.Stacked / {contenders.IMPL_LABELS[baseline]}")
      ax_vs.plot(x, cpu_med, "D", color="black", markersize=5,
                 label="CPU time, same ratio" if k == 0 else None)
      ax_vs.axhline(target, color=f"C{k}", linestyle="--", linewidth=1,
                    label=f"target <= {target:g}x vs {contenders.IMPL_LABELS[baseline]}")
    ax_vs.set_xticks(pos, policies)
    ax_vs.set_xlabel("remat policy")
    ax_vs.set_ylabel("step-time ratio, Stacked / hand-written (x)")
    ax_vs.set_ylim(0.8, max(tops) + 0.1)
    ax_vs.set_title("st.Stacked vs the same policy written by hand\n"
                    "(bars: median over rounds, whiskers: its bootstrap 95% interval)")
    ax_vs.grid(True, axis="y", alpha=0.3)
    ax_vs.legend(fontsize=7, loc="upper left")
    others = [p for p in policies if p in wall["over_none"] and p != "nested_over_full"]
    pos = np.arange(len(others))
    entries = [wall["over_none"][p] for p in others]
    ax_rc.bar(pos - 0.2, [e["median"] for e in entries], 0.4, yerr=errs(entries),
              capsize=3, label="measured wall time / none")
    ax_rc.plot(pos - 0.2, [cpu["over_none"][p]["median"] for p in others], "D",
               color="black", markersize=5, label="measured CPU time / none")
    ax_rc.bar(pos + 0.2, [GUIDE_RECOMPUTE.get(p, np.nan) for p in others], 0.4,
              color="lightgray", edgecolor="gray",
              label="the guide's FLOPs ratio (full 4/3, nested 5/3)")
    ax_rc.axhline(1.0, color="black", linewidth=0.8)
    ax_rc.set_xticks(pos, others)
    ax_rc.set_xlabel("remat policy")
    ax_rc.set_ylabel("st.Stacked step time relative to remat=none (x)")
    ax_rc.set_title(f"Recompute cost ({cfg['model']}, L={cfg['num_layers']})")
    ax_rc.grid(True, axis="y", alpha=0.3)
    ax_rc.legend(fontsize=7)
    return fig

  return fig_fn


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--model", choices=("mlp", "gpt"), default="gpt")
  p.add_argument("--num_layers", type=int, default=16)
  p.add_argument("--policies", type=harness.str_list(contenders.POLICIES),
                 default=list(contenders.POLICIES))
  p.add_argument("--impls", type=harness.str_list(IMPLS), default=list(IMPLS),
                 help="st.Stacked and the hand-written contenders it is timed against")
  p.add_argument("--save_name", default="mlp_hidden")
  p.add_argument("--warmup_rounds", type=int, default=1,
                 help="untimed rounds before the timed ones")
  p.add_argument("--rounds", type=int, default=51)
  p.add_argument("--steps", type=int, default=1, help="steps per contender per round")
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=64, help="gpt only")
  p.add_argument("--heads", type=int, default=4, help="gpt only")
  return p


QUICK = ["--model", "mlp", "--num_layers", "4", "--policies", "none,full",
         "--impls", "stacked,lax_scan", "--rounds", "3", "--steps", "1", "--width", "16",
         "--batch", "8"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  cfg = models.model_config(args)
  x = models.example_input(cfg)
  start = time.perf_counter()
  ready = {}
  compile_s = {}
  for policy in args.policies:
    for impl in args.impls:
      if contenders.supports(impl, policy, args.num_layers):
        c = contenders.build(impl, policy, cfg, args.num_layers, save_name=args.save_name)
        compiled, params, compile_s[c.name] = prepare(c, x)
        ready[c.name] = (compiled, params)
        harness.log(f"compiled {c.name} ({compile_s[c.name]:.1f}s)")
  names = list(ready)
  ops = {n: op_counts(compiled) for n, (compiled, _) in ready.items()}
  times: dict[str, list[float]] = {n: [] for n in names}
  cpu_times: dict[str, list[float]] = {n: [] for n in names}
  for r in range(-args.warmup_rounds, args.rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      compiled, params = ready[name]
      wall, cpu = time_steps(compiled, params, x, args.steps)
      if r >= 0:
        times[name].append(wall)
        cpu_times[name].append(cpu)
    if r >= 0:
      harness.log(f"round {r}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.1f}ms"
                                               for n in names))
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {"model": args.model, "model_config": cfg.describe(),
                 "num_layers": args.num_layers, "policies": args.policies,
                 "impls": args.impls, "save_name": args.save_name, "rounds": args.rounds,
                 "warmup_rounds": args.warmup_rounds, "steps": args.steps,
                 "step": "jax.jit(jax.value_and_grad(mean(stack(x)**2)))(params, x)",
                 "order": "all contenders each round, direction alternating every round",
                 "hand_written": {
                     "lax_scan": "jax.lax.scan(jax.checkpoint(body, policy=<jax policy>, "
                                 "prevent_cse=False)); nested: a scan of checkpointed scans",
                     "hk_layer_stack": "hk.layer_stack(L)(hk.remat(block, policy=<jax "
                                       "policy>)) with hk.remat's default prevent_cse=True; "
                                       "nested: hk.layer_stack of hk.remat(hk.layer_stack)"}},
      "seconds_per_step": times,
      "cpu_seconds_per_step": cpu_times,
      "median_seconds": {n: instruments.median(t) for n, t in times.items()},
      "compile_seconds": compile_s,
      "temp_bytes": {n: int(c.memory_analysis().temp_size_in_bytes)
                     for n, (c, _) in ready.items()},
      "ratios": analyse(times, args.policies, ops),
      "cpu_ratios": analyse(cpu_times, args.policies, ops),
      "hlo_ops_stacked_vs_lax_scan": {
          p: hlo_diff(ops[f"stacked/{p}"], ops[f"lax_scan/{p}"]) for p in args.policies
          if f"stacked/{p}" in ops and f"lax_scan/{p}" in ops},
      "seconds": time.perf_counter() - start,
  }
  payload["summary"] = {}
  for clock, key in (("wall", "ratios"), ("cpu", "cpu_ratios")):
    res = payload[key]
    payload["summary"][clock] = {
        "stacked_over_lax_scan": {p: e["median"] for p, e in
                                  res["stacked_over"]["lax_scan"].items()},
        "stacked_over_hk_layer_stack": {p: e["median"] for p, e in
                                        res["stacked_over"]["hk_layer_stack"].items()},
        "over_none": {p: e["median"] for p, e in res["over_none"].items()},
        "targets_missed": [f"{p} vs {b}: {e['median']:.3f} > {e['target']} "
                           f"({e['verdict']})"
                           for b, d in res["stacked_over"].items()
                           for p, e in d.items() if not e["met"]],
        "noise_floor": res["noise_floor"],
        "identical_programs": {k: e["median"] for k, e in res["identical_programs"].items()},
    }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
