"""How does the compile time of a gradient step grow with depth?

Measures trace (``jax.jit(step).lower``) and compile (``.compile()``) seconds
of one gradient step of an L-layer stack, for ``st.Stacked`` (one scan),
``hk.layer_stack`` (one scan) and ``st.BlockSeq`` (a Python loop: the program
grows with L). Target: the Stacked curve is flat, its L=64 total at most 1.5x
its L=4 total, while the unrolled one grows.

Each (contender, depth) is traced and compiled ``--repeats`` times from a
fresh ``jax.jit`` (nothing cached); each repeat sweeps every depth and
contender, in alternating directions, so that a drift in the machine's load
reaches all of them alike, and the fastest repeat is kept: on a shared
machine the minimum is the least noisy estimate of the work. One untimed
compile warms JAX up first.

  python -m benchmarks.compile_time            # full run, ~4 min on 2 cores
  python -m benchmarks.compile_time --quick    # seconds (the smoke test)
  python -m benchmarks.compile_time --model gpt --remat none --depths 4,16,64

Writes ``benchmarks/results/compile_time.json`` and ``compile_time.png``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from benchmarks.common import contenders
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import models
from benchmarks.common import report

NAME = "compile_time"
IMPLS = ("stacked", "hk_layer_stack", "blockseq")


def measure(contender: contenders.Contender, x) -> dict[str, float]:
  """Wall and CPU seconds to trace/lower and to compile a fresh jitted step."""
  params = contender.abstract_params(x)
  step = contender.grad_step()
  (w0, c0) = instruments.clocks()
  lowered = step.lower(params, x)
  (w1, c1) = instruments.clocks()
  lowered.compile()
  (w2, c2) = instruments.clocks()
  return {"trace_s": w1 - w0, "compile_s": w2 - w1, "total_s": w2 - w0,
          "cpu_trace_s": c1 - c0, "cpu_compile_s": c2 - c1, "cpu_total_s": c2 - c0}


def summarise(rows: list[dict[str, Any]], flat_at: int, flat_target: float) -> dict[str, Any]:
  """Deepest over shallowest per contender, and the flatness target, per clock."""
  out: dict[str, Any] = {}
  for clock, key in (("wall", "total_s"), ("cpu", "cpu_total_s")):
    entry: dict[str, Any] = {}
    for impl in IMPLS:
      points = {r["num_layers"]: r[key] for r in rows if r["impl"] == impl}
      if not points:
        continue
      lo, hi = min(points), max(points)
      entry[impl] = {"shallowest": lo, "deepest": hi,
                     "deepest_over_shallowest": points[hi] / points[lo]}
    stacked = {r["num_layers"]: r[key] for r in rows if r["impl"] == "stacked"}
    if stacked and flat_at in stacked:
      ratio = stacked[flat_at] / stacked[min(stacked)]
      entry["target"] = {"what": f"st.Stacked at L={flat_at} <= {flat_target}x at "
                                 f"L={min(stacked)} (trace + compile)",
                         "ratio": ratio, "met": ratio <= flat_target}
    out[clock] = entry
  return out


def markdown(payload: dict[str, Any]) -> str:
  rows = payload["measurements"]
  depths = sorted({r["num_layers"] for r in rows})
  lines = ["| contender | " + " | ".join(f"L={d}" for d in depths) + " |",
           "|---|" + "---:|" * len(depths)]
  for impl in IMPLS:
    table = {r["num_layers"]: r for r in rows if r["impl"] == impl}
    if table:
      cells = [f"{table[d]['total_s']:.2f} ({table[d]['trace_s']:.2f} + "
               f"{table[d]['compile_s']:.2f})" if d in table else "" for d in depths]
      lines.append(f"| {contenders.IMPL_LABELS[impl]}: wall | " + " | ".join(cells) + " |")
      cells = [f"{table[d]['cpu_total_s']:.2f}" if d in table else "" for d in depths]
      lines.append(f"| {contenders.IMPL_LABELS[impl]}: CPU | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  rows = payload["measurements"]
  cfg = payload["config"]

  def fig_fn(plt):
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {"stacked": ("-", "o"), "hk_layer_stack": ("--", "x"), "blockseq": ("-.", "s")}
    for impl in IMPLS:
      pts = sorted((r["num_layers"], r["total_s"], r["trace_s"]) for r in rows
                   if r["impl"] == impl)
      if not pts:
        continue
      depths, totals, traces = zip(*pts)
      style, marker = styles[impl]
      line, = ax.plot(depths, totals, linestyle=style, marker=marker,
                      label=f"{contenders.IMPL_LABELS[impl]}: trace + compile, wall")
      ax.plot(depths, traces, linestyle=style, color=line.get_color(), alpha=0.35,
              label=f"{contenders.IMPL_LABELS[impl]}: trace only, wall")
      cpu = [r["cpu_total_s"] for r in sorted((r for r in rows if r["impl"] == impl),
                                               key=lambda r: r["num_layers"])]
      ax.plot(depths, cpu, linestyle="none", marker=marker, markerfacecolor="none",
              markersize=10, color=line.get_color(),
              label=f"{contenders.IMPL_LABELS[impl]}: trace + compile, CPU time")
    ax.set_yscale("log")
    report.depth_axis(ax, [r["num_layers"] for r in rows])
    ax.set_ylabel("seconds to trace + compile one gradient step (s)")
    ax.set_ylim(bottom=0.03)
    ax.set_title(f"Compile time vs depth ({cfg['model']}, remat={cfg['remat']}, "
                 f"fastest of {cfg['repeats']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig

  return fig_fn


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
  p.add_argument("--remat", choices=contenders.POLICIES, default="full",
                 help="the policy every contender uses")
  p.add_argument("--depths", type=harness.int_list, default=[4, 8, 16, 32, 64],
                 help="depths for the scanned contenders")
  p.add_argument("--blockseq_depths", type=harness.int_list, default=[4, 8, 16, 32],
                 help="depths for st.BlockSeq (unrolled, so slow to compile)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--flat_at", type=int, default=64,
                 help="the depth whose Stacked time is held to --flat_target x the shallowest")
  p.add_argument("--flat_target", type=float, default=1.5)
  p.add_argument("--width", type=int, default=128)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--seq_len", type=int, default=64, help="gpt only")
  p.add_argument("--heads", type=int, default=4, help="gpt only")
  return p


QUICK = ["--depths", "2,4", "--blockseq_depths", "2", "--repeats", "1", "--flat_at", "4",
         "--width", "16", "--batch", "4"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  cfg = models.model_config(args)
  x = models.example_input(cfg)
  start = time.perf_counter()
  if not args.quick:  # The smoke test only checks that the script runs.
    measure(contenders.build("stacked", args.remat, cfg, 2), x)  # warm-up, untimed
  depths = sorted(set(args.depths) | set(args.blockseq_depths))
  repeats: dict[tuple[str, int], list[dict[str, float]]] = {}
  # Repeats outermost, directions alternating, so that a drift in the
  # machine's load over the run reaches every depth and contender alike.
  for repeat in range(args.repeats):
    for depth in (depths if repeat % 2 == 0 else depths[::-1]):
      impls = [i for i in IMPLS if depth in (args.blockseq_depths if i == "blockseq"
                                              else args.depths)]
      impls = [i for i in impls if contenders.supports(i, args.remat, depth)]
      for impl in (impls if repeat % 2 == 0 else impls[::-1]):
        times = measure(contenders.build(impl, args.remat, cfg, depth), x)
        harness.log(f"{impl:15s} L={depth:<4d} repeat {repeat}: trace {times['trace_s']:.2f}s"
                    f" compile {times['compile_s']:.2f}s (cpu {times['cpu_total_s']:.2f}s)")
        repeats.setdefault((impl, depth), []).append(times)
  best = {k: instruments.fastest(v) for k, v in repeats.items()}
  rows = [{"impl": impl, "num_layers": depth, **times}
          for (impl, depth), times in sorted(best.items(), key=lambda kv: (
              IMPLS.index(kv[0][0]), kv[0][1]))]
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {"model": args.model, "model_config": cfg.describe(), "remat": args.remat,
                 "depths": args.depths, "blockseq_depths": args.blockseq_depths,
                 "repeats": args.repeats,
                 "statistic": "each quantity's minimum over the repeats",
                 "clocks": "wall: time.perf_counter; cpu: time.process_time (all threads)",
                 "step": "jax.jit(jax.value_and_grad(mean(stack(x)**2))).lower(...).compile()",
                 "compiler_options": "XLA defaults"},
      "measurements": rows,
      "summary": summarise(rows, args.flat_at, args.flat_target),
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
