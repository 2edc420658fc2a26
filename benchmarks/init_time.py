"""How long does initialising a deep stack take: vmapped init vs scanned init?

``st.Stacked`` initialises all L layers with one ``jax.vmap`` of the block's
init, every layer from its own key; ``hk.layer_stack`` initialises them in a
``jax.lax.scan``, one layer per iteration (it also runs each layer forward to
make the next layer's input, which XLA removes as dead code when, as here, no
parameter depends on the input's values). This script measures, for each
depth, the seconds of ``jax.jit(model.init)``: trace (``.lower``), compile,
and run (until the parameters are ready), for ``--repeats`` repeats; each
repeat sweeps every depth and both contenders in alternating directions, and
each one's fastest total is kept (least noisy on a shared machine). One
untimed init warms JAX up first.

  python -m benchmarks.init_time               # full run, ~2 min on 2 cores
  python -m benchmarks.init_time --quick       # seconds (the smoke test)
  python -m benchmarks.init_time --depths 16,256 --width 256 --seq_len 256

Writes ``benchmarks/results/init_time.json`` and ``init_time.png``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import jax

from benchmarks.common import contenders
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import models
from benchmarks.common import report

NAME = "init_time"
IMPLS = ("stacked", "hk_layer_stack")
PHASES = ("trace_s", "compile_s", "run_s")


def measure(contender: contenders.Contender, x: jax.Array) -> dict[str, float]:
  """Seconds to trace, compile and run a fresh ``jax.jit(init)``."""
  key = jax.random.PRNGKey(0)
  w0, c0 = instruments.clocks()
  lowered = jax.jit(contender.init).lower(key, x)
  w1, c1 = instruments.clocks()
  compiled = lowered.compile()
  w2, c2 = instruments.clocks()
  instruments.block(compiled(key, x))
  w3, c3 = instruments.clocks()
  return {"trace_s": w1 - w0, "compile_s": w2 - w1, "run_s": w3 - w2, "total_s": w3 - w0,
          "cpu_trace_s": c1 - c0, "cpu_compile_s": c2 - c1, "cpu_run_s": c3 - c2,
          "cpu_total_s": c3 - c0}


def markdown(payload: dict[str, Any]) -> str:
  rows = payload["measurements"]
  depths = sorted({r["num_layers"] for r in rows})
  table = {(r["impl"], r["num_layers"]): r for r in rows}
  summary = payload["summary"]
  lines = ["| L | st.Stacked: total (trace + compile + run) s | "
           "hk.layer_stack: total (trace + compile + run) s | hk / Stacked: wall | CPU |",
           "|---:|---:|---:|---:|---:|"]
  for d in depths:
    cells = []
    for impl in IMPLS:
      r = table.get((impl, d))
      cells.append(f"{r['total_s']:.2f} ({r['trace_s']:.2f} + {r['compile_s']:.2f} + "
                   f"{r['run_s']:.2f})" if r else "")
    cells.append(f"{summary['hk_over_stacked'][str(d)]:.2f}")
    cells.append(f"{summary['hk_over_stacked_cpu'][str(d)]:.2f}")
    lines.append(f"| {d} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  rows = payload["measurements"]
  cfg = payload["config"]

  def fig_fn(plt):
    fig, (ax_total, ax_run) = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = {"stacked": ("-", "o", "C0"), "hk_layer_stack": ("--", "x", "C1")}
    labels = {"stacked": "st.Stacked (vmapped init)",
              "hk_layer_stack": "hk.layer_stack (scanned init)"}
    for impl in IMPLS:
      pts = sorted((r["num_layers"], r["total_s"], r["cpu_total_s"], r["run_s"],
                    r["trace_s"] + r["compile_s"]) for r in rows if r["impl"] == impl)
      if not pts:
        continue
      depths, total, cpu, run, tc = zip(*pts)
      style, marker, color = styles[impl]
      ax_total.plot(depths, total, linestyle=style, marker=marker, color=color,
                    label=f"{labels[impl]}: wall")
      ax_total.plot(depths, cpu, linestyle=style, marker=marker, color=color, alpha=0.4,
                    label=f"{labels[impl]}: CPU time")
      ax_run.plot(depths, tc, linestyle=style, marker=marker, color=color, alpha=0.4,
                  label=f"{labels[impl]}: trace + compile")
      ax_run.plot(depths, run, linestyle=style, marker=marker, color=color,
                  label=f"{labels[impl]}: run")
    ax_total.set_title(f"init = trace + compile + run ({cfg['model']}, fastest of "
                       f"{cfg['repeats']})")
    ax_total.set_ylim(bottom=0)
    ax_total.set_ylabel("seconds to initialise (s)")
    ax_run.set_title("the same, split into its phases (wall)")
    ax_run.set_yscale("log")
    ax_run.set_ylabel("seconds (s)")
    for ax in (ax_total, ax_run):
      report.depth_axis(ax, [r["num_layers"] for r in rows])
      ax.grid(True, which="both", alpha=0.3)
      ax.legend(fontsize=8)
    return fig

  return fig_fn


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--model", choices=("mlp", "gpt"), default="gpt")
  p.add_argument("--depths", type=harness.int_list, default=[4, 16, 64, 256, 1024])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=128, help="gpt only")
  p.add_argument("--heads", type=int, default=4, help="gpt only")
  return p


QUICK = ["--depths", "2", "--repeats", "1", "--width", "16", "--batch", "2",
         "--seq_len", "8", "--heads", "2"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  cfg = models.model_config(args)
  x = models.example_input(cfg)
  start = time.perf_counter()
  if not args.quick:  # The smoke test only checks that the script runs.
    measure(contenders.build("stacked", "none", cfg, 2), x)  # warm-up, untimed
  repeats: dict[tuple[str, int], list[dict[str, float]]] = {}
  # Repeats outermost, directions alternating, so that a drift in the
  # machine's load over the run reaches every depth and contender alike.
  for repeat in range(args.repeats):
    for depth in (args.depths if repeat % 2 == 0 else args.depths[::-1]):
      for impl in (IMPLS if repeat % 2 == 0 else IMPLS[::-1]):
        times = measure(contenders.build(impl, "none", cfg, depth), x)
        harness.log(f"{impl:15s} L={depth:<4d} repeat {repeat}: " +
                    " ".join(f"{k[:-2]} {times[k]:.2f}s" for k in PHASES) +
                    f" (cpu {times['cpu_total_s']:.2f}s)")
        repeats.setdefault((impl, depth), []).append(times)
  best = {k: instruments.fastest(v) for k, v in repeats.items()}
  rows = [{"impl": impl, "num_layers": depth, **best[(impl, depth)]}
          for impl in IMPLS for depth in args.depths]
  def ratio(key):
    return {str(d): best[("hk_layer_stack", d)][key] / best[("stacked", d)][key]
            for d in args.depths}
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {"model": args.model, "model_config": cfg.describe(), "depths": args.depths,
                 "repeats": args.repeats,
                 "statistic": "each quantity's minimum over the repeats",
                 "clocks": "wall: time.perf_counter; cpu: time.process_time (all threads)",
                 "init": "jax.jit(hk.transform(f).init).lower(key, x).compile()(key, x)"},
      "measurements": rows,
      "summary": {"hk_over_stacked": ratio("total_s"),
                  "hk_over_stacked_cpu": ratio("cpu_total_s"),
                  "hk_over_stacked_compile_only": ratio("compile_s"),
                  "hk_over_stacked_run_only": ratio("run_s"),
                  "deepest": max(args.depths)},
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
