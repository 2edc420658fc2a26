"""How much memory does one gradient step need, per remat policy and depth?

Measures the compiled temp memory (``memory_analysis().temp_size_in_bytes`` of
the lowered and compiled program; deterministic, never run) of one gradient
step of an L-layer MLP stack and of a small GPT-like transformer stack, for
every policy (none, full, nested, offload, save_all, and save_named: keep one
tagged internal), beside what the Haliax "Scan and Fold" guide's table
predicts:

  none   ~ N*C + N*I        full ~ N*C + I        nested ~ 2*sqrt(N)*C + I

with C and I measured: C is the slope (bytes per layer) of ``full``, I the
slope of ``none`` minus the slope of ``full`` (the activations one layer keeps
beyond its carry), both least-squares fits over the measured depths. The
analytic carry size (4 bytes * the carry's elements) is stated beside C.

And the reference workload of nested's memory floor (``residual``: ``x +
fc2(tanh(fc1 x))``, width 256, batch 1024) at 61 and 64 layers, full and
nested against ``hk.layer_stack`` over an ``hk.remat``-ed block.

The same for what a user writes by hand: a Python loop (``st.BlockSeq``),
``hk.layer_stack`` over an ``hk.remat``-ed block, and
``jax.lax.scan(jax.checkpoint(...))``.

  python -m benchmarks.memory                  # full run, ~5 min on 2 cores
  python -m benchmarks.memory --quick          # seconds (the smoke test)
  python -m benchmarks.memory --depths 4,16,64 --models gpt --gpt_width 256

Writes ``benchmarks/results/memory.json`` and ``memory.png``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

from benchmarks.common import contenders
from benchmarks.common import fast_compile
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import models
from benchmarks.common import report

NAME = "memory"
MiB = 2 ** 20
GUIDE_POLICIES = ("none", "full", "nested")


def configs(args) -> dict[str, models.ModelConfig]:
  """The model configurations ``args`` asks for."""
  out = {}
  if "mlp" in args.models:
    out["mlp"] = models.ModelConfig("mlp", width=args.mlp_width, batch=args.mlp_batch)
  if "residual" in args.models:
    out["residual"] = models.ModelConfig("residual", width=args.residual_width,
                                         batch=args.residual_batch)
  if "gpt" in args.models:
    out["gpt"] = models.ModelConfig("gpt", width=args.gpt_width, batch=args.gpt_batch,
                                    seq_len=args.gpt_seq_len, heads=args.gpt_heads)
  return out


def plan(args, model: str) -> list[tuple[str, str, int]]:
  """Every (impl, policy, depth) to measure for ``model``."""
  runs = []
  if model == "residual":   # the nested floor against the Haiku user's own
    for depth in args.residual_depths:
      runs += [("stacked", policy, depth) for policy in ("full", "nested")]
      runs += [("hk_layer_stack", "full", depth)]
    return runs
  for depth in args.depths:
    for policy in args.policies:
      runs.append(("stacked", policy, depth))
  for impl in ("hk_layer_stack", "lax_scan"):
    for depth in args.alt_depths:
      for policy in args.alt_policies:
        if contenders.supports(impl, policy, depth):
          runs.append((impl, policy, depth))
  for depth in args.blockseq_depths:
    for policy in args.blockseq_policies:
      runs.append(("blockseq", policy, depth))
  return runs


def guide_prediction(rows: list[dict[str, Any]], model: str,
                     cfg: models.ModelConfig) -> Optional[dict[str, Any]]:
  """C and I from the Stacked none/full slopes, and the guide's predictions."""
  def series(policy):
    points = sorted((r["num_layers"], r["temp_bytes"]) for r in rows
                    if r["model"] == model and r["impl"] == "stacked"
                    and r["policy"] == policy)
    return [p[0] for p in points], [p[1] for p in points]

  depths_none, none = series("none")
  depths_full, full = series("full")
  if len(depths_none) < 2 or len(depths_full) < 2:
    return None
  _, slope_none = instruments.fit_line(depths_none, none)
  _, slope_full = instruments.fit_line(depths_full, full)
  c_bytes = slope_full
  i_bytes = slope_none - slope_full
  formulas = {
      "none": lambda n: n * c_bytes + n * i_bytes,
      "full": lambda n: n * c_bytes + i_bytes,
      "nested": lambda n: 2 * math.sqrt(n) * c_bytes + i_bytes,
  }
  predicted = []
  for policy, formula in formulas.items():
    for depth, measured in zip(*series(policy)):
      guess = formula(depth)
      predicted.append({"policy": policy, "num_layers": depth,
                        "predicted_bytes": int(round(guess)),
                        "measured_bytes": measured,
                        "measured_over_predicted": measured / guess if guess > 0 else None})
  return {
      "C_bytes_measured": c_bytes,
      "C_bytes_analytic": cfg.carry_bytes,
      "P_bytes_per_layer": cfg.param_bytes_per_layer,
      "I_bytes_measured": i_bytes,
      "I_over_C": i_bytes / cfg.carry_bytes,
      "slope_none_bytes_per_layer": slope_none,
      "slope_full_bytes_per_layer": slope_full,
      "how": ("C = least-squares slope of Stacked full's temp bytes against L; "
              "I = slope of none minus slope of full; predicted none = N*C + N*I, "
              "full = N*C + I, nested = 2*sqrt(N)*C + I (no constant term)."),
      "predicted": predicted,
  }


def summarise(rows: list[dict[str, Any]], model_names: list[str]) -> dict[str, Any]:
  """Per model, at the deepest Stacked depth: the bytes of each policy, in order."""
  out = {}
  for model in model_names:
    stacked = [r for r in rows if r["model"] == model and r["impl"] == "stacked"]
    deepest = max(r["num_layers"] for r in stacked)
    at = {r["policy"]: r["temp_bytes"] for r in stacked if r["num_layers"] == deepest}
    entry = {"num_layers": deepest, "temp_bytes": at,
             "order_low_to_high": sorted(at, key=at.get)}
    if "none" in at and "full" in at and at["full"]:
      entry["none_over_full"] = at["none"] / at["full"]
    if "nested" in at and "full" in at and at["full"]:
      entry["nested_over_full"] = at["nested"] / at["full"]
    # Hand-written alternatives over Stacked, same policy and depth.
    same = {}
    for r in rows:
      if r["model"] != model or r["impl"] == "stacked":
        continue
      ref = [s["temp_bytes"] for s in stacked
             if s["policy"] == r["policy"] and s["num_layers"] == r["num_layers"]]
      if ref and ref[0]:
        same.setdefault(r["impl"], {})[f"{r['policy']}@{r['num_layers']}"] = (
            r["temp_bytes"] / ref[0])
    entry["alternative_over_stacked"] = same
    # The floor nested reaches, against what a Haiku user writes by hand.
    by_hand = {r["num_layers"]: r["temp_bytes"] for r in rows
               if r["model"] == model and r["impl"] == "hk_layer_stack"
               and r["policy"] == "full"}
    entry["nested_over_hk_layer_stack_full"] = {
        str(s["num_layers"]): s["temp_bytes"] / by_hand[s["num_layers"]]
        for s in stacked if s["policy"] == "nested" and s["num_layers"] in by_hand}
    out[model] = entry
  return out


def markdown(payload: dict[str, Any]) -> str:
  """Tables of the measurements, in MiB, for the README."""
  rows = payload["measurements"]
  lines = []
  for model in payload["config"]["models"]:
    stacked = [r for r in rows if r["model"] == model and r["impl"] == "stacked"]
    depths = sorted({r["num_layers"] for r in stacked})
    policies = [p for p in contenders.POLICIES if any(r["policy"] == p for r in stacked)]
    lines.append(f"**{model}**: st.Stacked, compiled temp MiB of one gradient step")
    lines.append("")
    lines.append("| policy | " + " | ".join(f"L={d}" for d in depths) + " |")
    lines.append("|---|" + "---:|" * len(depths))
    table = {(r["policy"], r["num_layers"]): r["temp_bytes"] for r in stacked}
    for policy in policies:
      cells = [f"{table[(policy, d)] / MiB:.1f}" if (policy, d) in table else ""
               for d in depths]
      lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    guide = payload["guide"].get(model)
    if guide:
      pred = {(p["policy"], p["num_layers"]): p["predicted_bytes"] for p in guide["predicted"]}
      for policy in GUIDE_POLICIES:
        cells = [f"{pred[(policy, d)] / MiB:.1f}" if (policy, d) in pred else ""
                 for d in depths]
        lines.append(f"| *guide: {policy}* | " + " | ".join(cells) + " |")
    lines.append("")
    floor = payload["summary"][model]["nested_over_hk_layer_stack_full"]
    if floor:
      lines.append(f"**{model}**: st.Stacked nested / hk.layer_stack + hk.remat: " + ", ".join(
          f"{ratio:.3f}x at L={depth}" for depth, ratio in floor.items()))
      lines.append("")
    others = [r for r in rows if r["model"] == model and r["impl"] != "stacked"]
    if others:
      cols = sorted({(r["impl"], r["num_layers"]) for r in others},
                    key=lambda c: (contenders.IMPLS.index(c[0]), c[1]))
      depths_alt = sorted({r["num_layers"] for r in others})
      lines.append(f"**{model}**: the same step written by hand, temp MiB "
                   "(st.Stacked in brackets)")
      lines.append("")
      head = []
      for impl in contenders.IMPLS[1:]:
        for d in depths_alt:
          if (impl, d) in cols:
            head.append((impl, d))
      lines.append("| policy | " + " | ".join(
          f"{contenders.IMPL_LABELS[i].split(' (')[0]} L={d}" for i, d in head) + " |")
      lines.append("|---|" + "---:|" * len(head))
      alt = {(r["impl"], r["policy"], r["num_layers"]): r["temp_bytes"] for r in others}
      for policy in contenders.POLICIES:
        if not any(k[1] == policy for k in alt):
          continue
        cells = []
        for impl, d in head:
          value = alt.get((impl, policy, d))
          ref = table.get((policy, d))
          if value is None:
            cells.append("n/a")
          elif ref is None:
            cells.append(f"{value / MiB:.1f}")
          else:
            cells.append(f"{value / MiB:.1f} ({ref / MiB:.1f})")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
      lines.append("")
  return "\n".join(lines)


COLORS = {"none": "tab:red", "full": "tab:blue", "nested": "tab:green",
          "offload": "tab:purple", "save_all": "tab:orange", "save_named": "tab:brown"}
STYLES = {"stacked": ("-", "o"), "blockseq": ("-.", "s"),
          "hk_layer_stack": ("--", "x"), "lax_scan": (":", "+")}


def draw(payload: dict[str, Any]):
  """The figure: per model, Stacked vs the guide, and Stacked vs the alternatives."""
  rows = payload["measurements"]
  model_names = list(payload["config"]["models"])

  def fig_fn(plt):
    fig, axes = plt.subplots(len(model_names), 2, figsize=(13, 4.8 * len(model_names)),
                             squeeze=False)
    for row, model in enumerate(model_names):
      ax_guide, ax_alt = axes[row]
      for policy in contenders.POLICIES:
        pts = sorted((r["num_layers"], r["temp_bytes"] / MiB) for r in rows
                     if r["model"] == model and r["impl"] == "stacked"
                     and r["policy"] == policy)
        if pts:
          ax_guide.plot(*zip(*pts), "-o", color=COLORS[policy], label=f"{policy} (measured)")
      guide = payload["guide"].get(model)
      if guide:
        for policy in GUIDE_POLICIES:
          pts = sorted((p["num_layers"], p["predicted_bytes"] / MiB)
                       for p in guide["predicted"] if p["policy"] == policy)
          ax_guide.plot(*zip(*pts), "--", color=COLORS[policy], alpha=0.7,
                        label=f"{policy} (guide's table)")
      ax_guide.set_title(f"{model}: st.Stacked, every policy, vs the guide's table\n"
                         f"C = {guide['C_bytes_measured'] / MiB:.2f} MiB, "
                         f"I = {guide['I_bytes_measured'] / MiB:.2f} MiB (measured)"
                         if guide else f"{model}: st.Stacked, every policy")
      for impl in contenders.IMPLS:
        for policy in ("none", "full", "nested", "save_named"):
          pts = sorted((r["num_layers"], r["temp_bytes"] / MiB) for r in rows
                       if r["model"] == model and r["impl"] == impl
                       and r["policy"] == policy)
          if pts:
            style, marker = STYLES[impl]
            ax_alt.plot(*zip(*pts), linestyle=style, marker=marker, color=COLORS[policy],
                        label=f"{contenders.IMPL_LABELS[impl]}: {policy}")
      ax_alt.set_title(f"{model}: the same policies written by hand")
      for ax in (ax_guide, ax_alt):
        ax.set_yscale("log")
        report.depth_axis(ax, [r["num_layers"] for r in rows if r["model"] == model])
        ax.set_ylabel("compiled temp memory of one gradient step (MiB)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    return fig

  return fig_fn


def compiler_options(args, cfgs) -> tuple[Optional[dict[str, Any]], dict[str, Any]]:
  """``fast_compile.CODEGEN``, once checked to give the default's temp bytes."""
  if args.exact_compile:
    return None, {"checked": False, "reason": "--exact_compile: XLA's defaults"}
  if args.quick:
    return dict(fast_compile.CODEGEN), {"checked": False, "reason": "--quick"}
  model, cfg = next(iter(cfgs.items()))
  policy = "nested" if "nested" in args.policies else args.policies[0]
  contender = contenders.build("stacked", policy, cfg, max(args.depths), save_name=args.save_name)
  x = models.example_input(cfg)
  fast = instruments.temp_bytes(contender.lowered_step(x), fast_compile.CODEGEN)
  default = instruments.temp_bytes(contender.lowered_step(x))
  check = {"checked": True, "on": f"{model} stacked/{policy} L={max(args.depths)}",
           "default_bytes": default, "fast_bytes": fast, "equal": fast == default}
  if fast != default:
    harness.log(f"fast_compile.CODEGEN changed the temp bytes ({fast} != {default}): "
                "using defaults")
    return None, check
  return dict(fast_compile.CODEGEN), check


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--models", type=harness.str_list(("mlp", "gpt", "residual")),
                 default=["mlp", "gpt", "residual"])
  p.add_argument("--depths", type=harness.int_list, default=[4, 8, 16, 32, 64, 128],
                 help="depths for st.Stacked, every policy")
  p.add_argument("--alt_depths", type=harness.int_list, default=[16, 64],
                 help="depths for hk.layer_stack and lax.scan, every policy")
  p.add_argument("--blockseq_depths", type=harness.int_list, default=[2, 4, 8],
                 help="depths for st.BlockSeq (unrolled: its compile time grows)")
  p.add_argument("--policies", type=harness.str_list(contenders.POLICIES),
                 default=list(contenders.POLICIES))
  p.add_argument("--alt_policies", type=harness.str_list(contenders.POLICIES),
                 default=list(contenders.POLICIES))
  p.add_argument("--blockseq_policies", type=harness.str_list(contenders.POLICIES),
                 default=["none", "full", "save_named"])
  p.add_argument("--save_name", default="mlp_hidden",
                 help="the internal that save_named keeps (mlp_hidden or, gpt only, attn_out)")
  p.add_argument("--exact_compile", action="store_true",
                 help="compile with XLA's default options (slower; same bytes)")
  p.add_argument("--mlp_width", type=int, default=128)
  p.add_argument("--mlp_batch", type=int, default=1024)
  p.add_argument("--residual_width", type=int, default=256)
  p.add_argument("--residual_batch", type=int, default=1024)
  p.add_argument("--residual_depths", type=harness.int_list, default=[61, 64],
                 help="depths of the residual model (full, nested, hk.layer_stack)")
  p.add_argument("--gpt_width", type=int, default=128)
  p.add_argument("--gpt_batch", type=int, default=8)
  p.add_argument("--gpt_seq_len", type=int, default=128)
  p.add_argument("--gpt_heads", type=int, default=4)
  return p


QUICK = ["--models", "gpt", "--depths", "1,2", "--policies", "none,full",
         "--alt_depths", "2", "--alt_policies", "full", "--blockseq_depths", "1",
         "--blockseq_policies", "full", "--gpt_width", "16", "--gpt_batch", "2",
         "--gpt_seq_len", "8", "--gpt_heads", "2"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  cfgs = configs(args)
  start = time.perf_counter()
  options, options_check = compiler_options(args, cfgs)
  rows = []
  for model, cfg in cfgs.items():
    x = models.example_input(cfg)
    for impl, policy, depth in plan(args, model):
      contender = contenders.build(impl, policy, cfg, depth, save_name=args.save_name)
      t0 = time.perf_counter()
      value = instruments.temp_bytes(contender.lowered_step(x), options)
      rows.append({"model": model, "impl": impl, "policy": policy, "num_layers": depth,
                   "temp_bytes": value})
      harness.log(f"{model:4s} {impl:15s} {policy:11s} L={depth:<4d} "
                  f"{value / MiB:9.2f} MiB  ({time.perf_counter() - t0:.1f}s)")
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {
          "models": {m: c.describe() for m, c in cfgs.items()},
          "depths": args.depths, "alt_depths": args.alt_depths,
          "blockseq_depths": args.blockseq_depths, "policies": args.policies,
          "blockseq_policies": args.blockseq_policies, "save_name": args.save_name,
          "step": "jax.jit(jax.value_and_grad(mean(stack(x)**2))), lowered and compiled",
          "metric": "compiled.memory_analysis().temp_size_in_bytes",
          "compiler_options": options,
          "compiler_options_check": options_check,
      },
      "measurements": rows,
      "guide": {m: guide_prediction(rows, m, c) for m, c in cfgs.items()},
      "summary": summarise(rows, list(cfgs)),
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
