"""Mixed-layer stacks (pattern=): right, flat to compile, lean in memory and KV cache?

Four questions about ``st.Stacked(..., pattern=...)``, each answered from the
compiled program:

1. Values and gradients (float32, rtol 1e-5) equal the ``BlockSeq`` twin and
   a Python loop over sliced parameters, for the patterns ``LG`` and
   ``LLLLLG`` at 6, 13 and 26 layers, for every remat alias (and a per_depth
   mix), forward and reverse; and every ``--remat`` of the GPT example gives
   the same loss and gradients with ``--pattern=LLLG`` as ``none``.
2. Trace + compile time of a gradient step of the 5:1 pattern does not grow
   with depth: target, 48 layers at most 1.2x 12 layers (the fastest of
   ``--repeats``, CPU seconds and wall seconds); ``BlockSeq`` with the same
   pattern, and a stack of one block, for contrast.
3. Compiled temp memory with ``remat="full"`` grows by one carry per layer,
   as a stack of one block's does (least-squares slope over the depths).
4. The GPT example's KV cache with ``--pattern=LLLG --window=32`` against
   all-global layers, at the same sequence lengths.

The blocks of questions 2 and 3 are the GPT example's blocks
(``examples/gpt/model.py``: pre-LayerNorm attention + MLP), small; a local
block attends over the last ``--window`` positions, a global one over all.
Question 1 uses two residual MLPs with different hidden widths
(``--verify_block``; 72 cases of three programs each compile quickly) and
the GPT example itself. The stacks compared, their blocks and the loop they
are checked against are in ``benchmarks/common/pattern_stacks.py``.

  python -m benchmarks.mixed_layers            # full run, ~10 min on 2 cores
  python -m benchmarks.mixed_layers --quick    # seconds (the smoke test)

Writes ``benchmarks/results/mixed_layers.json`` and ``mixed_layers.png``.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from typing import Any, Optional

import haiku as hk
import jax

import stacktools as st
from benchmarks.common import fast_compile
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import models
from benchmarks.common import pattern_stacks
from benchmarks.common import report
from examples.gpt import decoding
from examples.gpt import model as gpt
from examples.gpt import model_config

NAME = "mixed_layers"
ALIASES = tuple(st.CheckpointPolicy.ALIASES)
RTOL = 1e-5


# ---------------------------------------------------------------------------
# 1. Values and gradients.


def verify_case(args, pattern, n, remat, reverse) -> dict[str, Any]:
  """One case of question 1: the stack and its BlockSeq twin against the loop."""
  stacked = pattern_stacks.transformed(args, "pattern", pattern, n, remat, reverse)
  seq = pattern_stacks.transformed(args, "blockseq", pattern, n, remat, reverse)
  x = pattern_stacks.example_input(args)
  params = models.normal_params(stacked, x)
  grad_step = pattern_stacks.grad_step

  def all_three(params, x):
    ref = grad_step(lambda p, x: pattern_stacks.reference(args, p, x, pattern, n, reverse))(
        params, x)
    out = grad_step(stacked.apply)(params, x)
    (value, (g_seq, gx)) = grad_step(seq.apply)(
        st.unstack_params(params, "h", pattern=pattern), x)
    return ref, out, (value, (st.stack_params(g_seq, "h", pattern=pattern), gx))

  ref, out, out_seq = jax.jit(all_three).lower(params, x).compile(
      fast_compile.CODEGEN)(params, x)
  return {"pattern": pattern, "num_layers": n, "remat": harness_remat(remat),
          "reverse": reverse, "vs_loop": instruments.max_error_over_rtol(out, ref, RTOL),
          "blockseq_vs_loop": instruments.max_error_over_rtol(out_seq, ref, RTOL)}


def harness_remat(remat) -> str:
  """An alias as it is, a policy as ``str(policy)``, a per_depth value as
  ``per_depth(none:3,nested:3)``."""
  if isinstance(remat, (str, st.CheckpointPolicy)):
    return str(remat)
  return f"per_depth({remat})"


def verify_gpt(args) -> list[dict[str, Any]]:
  """Every alias of the GPT example with --pattern=LLLG equals remat none."""
  rows, base = [], None
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 17), 0, 32)
  for remat in ["none"] + [a for a in args.gpt_aliases if a != "none"]:
    cfg = model_config.GPTConfig(vocab_size=32, seq_len=16, num_layers=6, num_heads=2, d_model=16,
                                 pattern="LLLG", window=4, remat=remat)
    model = hk.without_apply_rng(hk.transform(lambda t, cfg=cfg: gpt.loss_fn(cfg, t)[0]))
    params = models.normal_params(model, tokens)
    out = jax.jit(jax.value_and_grad(model.apply)).lower(params, tokens).compile(
        fast_compile.CODEGEN)(params, tokens)
    base = out if base is None else base
    rows.append({"remat": remat, "vs_none": instruments.max_error_over_rtol(out, base, RTOL)})
    harness.log(f"gpt --pattern=LLLG --remat={remat}: max error {rows[-1]['vs_none']:.2g} x rtol")
  return rows


# ---------------------------------------------------------------------------
# 2. and 3. Compile time and memory against depth.


def compile_seconds(args, impl: str, n: int) -> dict[str, float]:
  """Seconds to trace and compile a fresh step, and the size of the program
  (lines of StableHLO, instructions after XLA's optimisation): sizes do not
  depend on the machine's load."""
  (w0, c0) = instruments.clocks()
  low = pattern_stacks.lowered(args, impl, n, "full")
  (w1, c1) = instruments.clocks()
  compiled = low.compile(fast_compile.CODEGEN if args.quick else None)
  (w2, c2) = instruments.clocks()
  return {"trace_s": w1 - w0, "total_s": w2 - w0, "cpu_total_s": c2 - c0,
          "stablehlo_lines": len(low.as_text().splitlines()),
          "hlo_instructions": len(re.findall(r"^\s+\S+ = ", compiled.as_text(), re.M))}


def measure_compile(args) -> list[dict[str, Any]]:
  if not args.quick:   # the smoke test only checks that the script runs
    compile_seconds(args, "pattern", args.depths[0])   # warm-up, untimed
  runs: dict[tuple[str, int], list[dict[str, float]]] = {}
  for repeat in range(args.repeats):
    plan = [(impl, n) for n in args.depths for impl in pattern_stacks.CONTENDERS
            if impl != "blockseq" or (n in args.blockseq_depths
                                      and repeat < args.blockseq_repeats)]
    for impl, n in (plan if repeat % 2 == 0 else plan[::-1]):
      runs.setdefault((impl, n), []).append(compile_seconds(args, impl, n))
      t = runs[(impl, n)][-1]
      harness.log(f"compile {impl:9s} L={n:<3d} repeat {repeat}: {t['total_s']:.2f}s wall, "
                  f"{t['cpu_total_s']:.2f}s cpu")
  return [{"impl": impl, "num_layers": n, **instruments.fastest(v)}
          for (impl, n), v in sorted(runs.items())]


def measure_memory(args) -> list[dict[str, Any]]:
  rows = []
  for impl in ("pattern", "one_block"):
    for remat in args.memory_remats:
      for n in args.depths:
        temp = instruments.temp_bytes(pattern_stacks.lowered(args, impl, n, remat),
                                      fast_compile.CODEGEN)
        rows.append({"impl": impl, "remat": remat, "num_layers": n, "temp_bytes": temp})
        harness.log(f"memory {impl:9s} remat={remat:4s} L={n:<3d}: {temp / 2**20:.2f} MiB")
  return rows


# ---------------------------------------------------------------------------
# 4. KV-cache bytes of the GPT example.


def kv_bytes(cfg: model_config.GPTConfig) -> int:
  shapes = jax.eval_shape(lambda: decoding.init_cache(cfg, 1))
  return sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes))


def measure_kv(args) -> list[dict[str, Any]]:
  rows = []
  for seq_len in args.kv_seq_lens:
    common = dict(vocab_size=128, seq_len=seq_len, num_layers=args.kv_layers,
                  num_heads=4, d_model=128)
    local = kv_bytes(model_config.GPTConfig(pattern="LLLG", window=min(args.kv_window, seq_len),
                                            **common))
    full = kv_bytes(model_config.GPTConfig(**common))
    rows.append({"seq_len": seq_len, "pattern_LLLG_bytes": local, "all_global_bytes": full,
                 "ratio": local / full})
  return rows


# ---------------------------------------------------------------------------
# Summary, table, plot.


def summarise(payload: dict[str, Any], args) -> dict[str, Any]:
  checks = payload["verification"]
  worst = max(max(r["vs_loop"], r["blockseq_vs_loop"]) for r in checks)
  gpt_worst = max((r["vs_none"] for r in payload["gpt_remat"]), default=0.0)
  out: dict[str, Any] = {
      "values_and_gradients": {
          "cases": len(checks), "worst_error_over_rtol": worst, "met": worst <= 1.0,
          "what": f"Stacked and BlockSeq vs a Python loop over sliced params, rtol {RTOL}"},
      "gpt_every_remat": {"aliases": [r["remat"] for r in payload["gpt_remat"]],
                          "worst_error_over_rtol": gpt_worst, "met": gpt_worst <= 1.0}}
  rows = payload["compile"]
  lo, hi = min(args.depths), max(args.depths)
  for clock, key in (("cpu", "cpu_total_s"), ("wall", "total_s")):
    t = {(r["impl"], r["num_layers"]): r[key] for r in rows}
    ratio = t[("pattern", hi)] / t[("pattern", lo)]
    out[f"compile_{clock}"] = {
        "what": f"pattern={pattern_stacks.P51} at L={hi} over L={lo} (trace + compile)",
        "ratio": ratio, "target": args.flat_target, "met": ratio <= args.flat_target,
        "hlo_instructions": {r["num_layers"]: r["hlo_instructions"] for r in rows
                             if r["impl"] == "pattern"},
        "one_block_ratio": t[("one_block", hi)] / t[("one_block", lo)],
        "blockseq": {n: t[("blockseq", n)] for n in args.blockseq_depths}}
  mem = payload["memory"]
  carry = 4 * args.batch * args.seq_len * args.width
  slopes = {}
  for impl in ("pattern", "one_block"):
    for remat in args.memory_remats:
      pts = [(r["num_layers"], r["temp_bytes"]) for r in mem
             if r["impl"] == impl and r["remat"] == remat]
      slopes[f"{impl}/{remat}"] = instruments.fit_line(*zip(*pts))[1]
  out["memory_full"] = {
      "carry_bytes": carry,
      "pattern_bytes_per_layer": slopes["pattern/full"],
      "one_block_bytes_per_layer": slopes["one_block/full"],
      "pattern_carries_per_layer": slopes["pattern/full"] / carry,
      "one_block_carries_per_layer": slopes["one_block/full"] / carry,
      "none_bytes_per_layer": {"pattern": slopes.get("pattern/none"),
                               "one_block": slopes.get("one_block/none")}}
  out["kv_cache"] = payload["kv_cache"][-1]
  return out


def markdown(payload: dict[str, Any]) -> str:
  s = payload["summary"]
  v, c, m = s["values_and_gradients"], s["compile_cpu"], s["memory_full"]
  kv = s["kv_cache"]
  lines = [
      "| question | result |", "|---|---|",
      f"| values and gradients = BlockSeq = loop ({v['cases']} cases) | worst "
      f"{v['worst_error_over_rtol']:.2g} x rtol: {'met' if v['met'] else 'NOT met'} |",
      f"| GPT --pattern=LLLG, every --remat = none | worst "
      f"{s['gpt_every_remat']['worst_error_over_rtol']:.2g} x rtol |",
      f"| compile, {c['what']} (CPU s) | {c['ratio']:.2f}x (target <= {c['target']}): "
      f"{'met' if c['met'] else 'NOT met'}; one block {c['one_block_ratio']:.2f}x |",
      f"| compile, same (wall s) | {s['compile_wall']['ratio']:.2f}x |",
      f"| compiled program of pattern={pattern_stacks.P51}, by depth | "
      + ", ".join(f"L={n}: {k} HLO instructions" for n, k in c["hlo_instructions"].items())
      + " |",
      f"| temp memory per layer, remat=full | {m['pattern_carries_per_layer']:.3f} carries "
      f"(one block: {m['one_block_carries_per_layer']:.3f}) |",
      f"| KV cache at seq_len {kv['seq_len']}, LLLG window 32 vs all global | "
      f"{kv['pattern_LLLG_bytes'] / 2**20:.2f} MiB vs {kv['all_global_bytes'] / 2**20:.2f} "
      f"MiB ({kv['ratio']:.3f}x) |"]
  rows = payload["compile"]
  depths = sorted({r["num_layers"] for r in rows})
  lines += ["", "| trace + compile, CPU s | " + " | ".join(f"L={d}" for d in depths) + " |",
            "|---|" + "---:|" * len(depths)]
  for impl, label in pattern_stacks.CONTENDERS.items():
    t = {r["num_layers"]: r["cpu_total_s"] for r in rows if r["impl"] == impl}
    lines.append(f"| {label} | " + " | ".join(f"{t[d]:.2f}" if d in t else "" for d in depths)
                 + " |")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  def fig_fn(plt):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ax = axes[0]
    for impl, label in pattern_stacks.CONTENDERS.items():
      pts = sorted((r["num_layers"], r["cpu_total_s"]) for r in payload["compile"]
                   if r["impl"] == impl)
      ax.plot(*zip(*pts), marker="o", label=label)
    report.depth_axis(ax, [r["num_layers"] for r in payload["compile"]])
    ax.set_ylabel("trace + compile of a gradient step (CPU s)")
    ax.set_title("Compile time vs depth (remat=full)")
    report.finish(ax, log_y=True)
    ax = axes[1]
    for impl in ("pattern", "one_block"):
      for remat, style in (("full", "-"), ("none", "--")):
        if remat not in payload["config"]["memory_remats"]:
          continue
        pts = sorted((r["num_layers"], r["temp_bytes"] / 2**20) for r in payload["memory"]
                     if r["impl"] == impl and r["remat"] == remat)
        ax.plot(*zip(*pts), linestyle=style, marker="o",
                label=f"{pattern_stacks.CONTENDERS[impl]}, remat={remat}")
    report.depth_axis(ax, [r["num_layers"] for r in payload["memory"]])
    ax.set_ylabel("compiled temp memory (MiB)")
    ax.set_title("Memory of a gradient step vs depth")
    report.finish(ax)
    ax = axes[2]
    kv = payload["kv_cache"]
    lens = [r["seq_len"] for r in kv]
    ax.plot(lens, [r["all_global_bytes"] / 2**20 for r in kv], marker="o", label="all global")
    ax.plot(lens, [r["pattern_LLLG_bytes"] / 2**20 for r in kv], marker="o",
            label="--pattern=LLLG --window=32")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("KV cache, batch 1 (MiB)")
    ax.set_title(f"GPT example KV cache ({payload['config']['kv_layers']} layers, d=128)")
    report.finish(ax, log_y=True)
    return fig
  return fig_fn


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--depths", type=harness.int_list, default=[12, 24, 48],
                 help="depths of the compile-time and memory measurements")
  p.add_argument("--blockseq_depths", type=harness.int_list, default=[12, 24, 48])
  p.add_argument("--verify_depths", type=harness.int_list, default=[6, 13, 26])
  p.add_argument("--verify_patterns", default="LG,LLLLLG")
  p.add_argument("--verify_aliases", type=harness.str_list(ALIASES), default=list(ALIASES))
  p.add_argument("--verify_directions", type=harness.str_list(("forward", "reverse")),
                 default=["forward", "reverse"])
  p.add_argument("--gpt_aliases", type=harness.str_list(ALIASES), default=list(ALIASES))
  p.add_argument("--skip_gpt", action="store_true",
                 help="skip the GPT example's check of every --remat")
  p.add_argument("--memory_remats", type=harness.str_list(("full", "none")),
                 default=["full", "none"])
  p.add_argument("--block", choices=("attention", "mlp"), default="attention",
                 help="attention: GPT blocks, local ones windowed; mlp: residual MLPs")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--blockseq_repeats", type=int, default=1,
                 help="repeats of the (slow to compile) BlockSeq contender")
  p.add_argument("--flat_target", type=float, default=1.2)
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=64)
  p.add_argument("--window", type=int, default=16)
  p.add_argument("--verify_width", type=int, default=16)
  p.add_argument("--verify_block", choices=("attention", "mlp"), default="mlp",
                 help="the blocks of question 1 (the GPT check has attention)")
  p.add_argument("--kv_layers", type=int, default=8)
  p.add_argument("--kv_window", type=int, default=32)
  p.add_argument("--kv_seq_lens", type=harness.int_list, default=[128, 512, 2048, 8192])
  return p


QUICK = ["--block", "mlp", "--depths", "6,12", "--blockseq_depths", "6", "--verify_depths", "4",
         "--verify_patterns", "LLG", "--verify_aliases", "nested", "--verify_directions",
         "reverse", "--skip_gpt", "--memory_remats", "full", "--repeats", "1",
         "--width", "8", "--heads", "2", "--batch", "2", "--seq_len", "8", "--window", "3",
         "--verify_width", "8", "--kv_seq_lens", "64,128"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  start = time.perf_counter()
  small = argparse.Namespace(**{**vars(args), "width": args.verify_width,
                                 "block": args.verify_block})
  checks = []
  for pattern in args.verify_patterns.split(","):
    for n in args.verify_depths:
      remats = list(args.verify_aliases)
      if not args.quick:
        remats.append(st.per_depth((n // 2, "none"), (n - n // 2, "nested")))
      for remat in remats:
        for reverse in [d == "reverse" for d in args.verify_directions]:
          checks.append(verify_case(small, pattern, n, remat, reverse))
          r = checks[-1]
          harness.log(f"verify {pattern} L={n} remat={r['remat']} "
                      f"{'reverse' if reverse else 'forward'}: {r['vs_loop']:.2g}, "
                      f"BlockSeq {r['blockseq_vs_loop']:.2g} x rtol")
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {k: v for k, v in vars(args).items() if k not in ("results_dir",)},
      "verification": checks,
      "gpt_remat": [] if args.skip_gpt else verify_gpt(args),
      "compile": measure_compile(args),
      "memory": measure_memory(args),
      "kv_cache": measure_kv(args),
  }
  payload["config"]["statistic"] = "compile: each quantity's minimum over the repeats"
  payload["summary"] = summarise(payload, args)
  payload["seconds"] = time.perf_counter() - start
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
