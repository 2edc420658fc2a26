"""How close does one decode step of a scanned stack come to reading its bytes once?

The GPT example (``examples/gpt/model.py``, 12 layers, width 256, 8 heads,
float32) decodes one token at the last position of a KV cache of T
positions, batch 1 and 8, jitted with the cache donated. Side by side in one
process, rounds alternated (each round runs every contender in a rotated
order), the median over rounds:

* ``in_place``: ``model.decode``, the cache as ``st.per_layer(cache,
  in_place=True)`` in an ``st.Stacked``: each layer reads its row of the
  whole cache and writes its new key and value in place;
* ``sliced``: the same model with ``st.per_layer(cache)``: the cache sliced
  per layer (scan xs) and every layer's new row stacked again (scan ys);
* ``unrolled``: ``in_place`` on ``st.BlockSeq`` (a Python loop of layers);
* ``recompute``: no cache, the forward pass over all T positions for the
  last one's logits (what nanoGPT's ``generate`` does);
* ``floor``: one jitted pass that reads every parameter and every cache byte
  once (a sum): what a decode step cannot beat.

Also, from the compiled programs (never run): each cached contender's temp
memory with the cache donated, and how the peak (arguments + outputs -
aliased + temp) of ``in_place`` grows from batch 1 to batch 16, against the
cache's own growth.

Last, ``in_place`` and the floor again in a child process whose XLA:CPU
orders each program for memory rather than for concurrency
(:data:`MEMORY_SCHEDULER`, a process-wide flag): its temp memory and its time
over its own floor. XLA:CPU's default scheduler starts every weight's slice
of the layer at the top of the loop body, so that independent work can run
at once, and keeps their buffers apart; at batch 1 those copies, not the
cache, are most of the temp memory.

  python -m benchmarks.decode            # full run, 1.5 to 4 minutes on 2 cores
  python -m benchmarks.decode --quick    # seconds (the smoke test)

The default run measures T = 256 and 1024 to stay within a few minutes on 2
shared cores (the recompute of T = 4096 at batch 8 alone takes tens of
seconds a call there); ``--seq_lens=256,1024,2048,4096`` measures more.

Writes ``benchmarks/results/decode.json`` and ``decode.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import stacktools as st
from benchmarks.common import fast_compile
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import report
from examples.gpt import decoding
from examples.gpt import model as model_lib
from examples.gpt import model_config

NAME = "decode"
CACHED = ("in_place", "sliced", "unrolled")
CONTENDERS = CACHED + ("recompute", "floor")
QUICK = ["--num_layers", "2", "--d_model", "32", "--num_heads", "2", "--vocab_size", "16",
         "--seq_lens", "64", "--batches", "2", "--rounds", "2", "--calls", "2",
         "--memory_seq_len", "64", "--peak_batches", "1,4"]
#: XLA:CPU's memory-first scheduling: it reuses one buffer for the weight
#: slices of a layer instead of holding all of them at once. It is read from
#: ``XLA_FLAGS`` only (``compile(compiler_options=...)`` leaves it as it is).
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
#: What the child process run under :data:`MEMORY_SCHEDULER` measures.
MEMORY_ORDERED = ("in_place", "floor")
#: The T whose figures the summary and the README quote (the largest measured
#: when it is not among them).
QUOTED_T = 1024


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--num_layers", type=int, default=12)
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--num_heads", type=int, default=8)
  p.add_argument("--vocab_size", type=int, default=96)
  p.add_argument("--seq_lens", type=harness.int_list, default=[256, 1024],
                 help="cache lengths T")
  p.add_argument("--batches", type=harness.int_list, default=[1, 8])
  p.add_argument("--rounds", type=int, default=5, help="rounds, contenders alternated")
  p.add_argument("--calls", type=int, default=5,
                 help="timed calls per contender per round (recompute: 1)")
  p.add_argument("--memory_seq_len", type=int, default=1024,
                 help="T of the peak-memory comparison across batches")
  p.add_argument("--peak_batches", type=harness.int_list, default=[1, 16])
  p.add_argument("--memory_ordered_child", action="store_true",
                 help=argparse.SUPPRESS)   # the child of memory_ordered(): JSON on stdout
  return p


class Point:
  """The contenders at one (batch, T): compiled, with their inputs.

  The token goes at ``pos`` (default the last position). ``dtype`` is the
  parameters' and the cache's (a bfloat16 point stores both in bfloat16).
  With ``share_cache`` every cached contender and the floor use one cache
  (each call donates it and gets it back; every contender writes the same
  token at the same place, so it holds the same values), where a cache each
  would not fit in the device's memory.
  """

  def __init__(self, args, batch: int, seq_len: int, options,
               names: tuple[str, ...] = CONTENDERS, *, pos: Optional[int] = None,
               dtype: Any = jnp.float32, share_cache: bool = False):
    base = dict(vocab_size=args.vocab_size, seq_len=seq_len, num_layers=args.num_layers,
                num_heads=args.num_heads, d_model=args.d_model)
    cfg = model_config.GPTConfig(**base)
    forward = hk.without_apply_rng(hk.transform(
        lambda t: model_lib.forward(cfg, t)[0][:, -1]))
    self.tokens = jnp.zeros((batch, seq_len), jnp.int32)
    params = jax.jit(forward.init)(jax.random.PRNGKey(0), self.tokens[:, :8])
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    new_cache = lambda: decoding.init_cache(cfg, batch, dtype)  # noqa: E731
    self.cache_bytes = cache_bytes(jax.eval_shape(new_cache))
    self.cfg, self.batch = cfg, batch
    self.pos = seq_len - 1 if pos is None else pos
    self.share_cache = share_cache
    token = self.tokens[:, :1]

    def decoder(stack, in_place):
      c = model_config.GPTConfig(**base, stack=stack)
      return hk.without_apply_rng(hk.transform(
          lambda t, cache, p: decoding.decode(c, t, cache, p, in_place=in_place)))

    self.params = {"in_place": params, "sliced": params, "recompute": params,
                   "floor": params}
    if "unrolled" in names:   # a second copy of the layers' parameters
      self.params["unrolled"] = st.unstack_params(params, "h")
    models = {"in_place": decoder("scan", True), "sliced": decoder("scan", False),
              "unrolled": decoder("unrolled", True)}
    self.compiled, self.memory = {}, {}
    cache = jax.eval_shape(new_cache)
    for name, model in models.items():
      if name not in names:
        continue
      lowered = jax.jit(model.apply, donate_argnums=2).lower(
          self.params[name], token, cache, self.pos)
      self.compiled[name] = lowered.compile(compiler_options=options)
      self.memory[name] = memory_of(self.compiled[name])
    if "recompute" in names:
      self.compiled["recompute"] = jax.jit(forward.apply).lower(
          params, self.tokens).compile(compiler_options=options)
    self.compiled["floor"] = jax.jit(lambda p, c: sum(
        jnp.sum(a) for a in jax.tree.leaves((p, c)))).lower(params, cache).compile(
            compiler_options=options)
    if share_cache:
      self.caches = {"shared": new_cache()}
      self.floor_cache = None
    else:
      self.caches = {name: new_cache() for name in CACHED if name in names}
      self.floor_cache = new_cache()
    self.token = token

  def call(self, name: str) -> Any:
    """One call of ``name``; a cached contender keeps its (donated) cache."""
    if name in CACHED:
      slot = "shared" if self.share_cache else name
      logits, self.caches[slot] = self.compiled[name](
          self.params[name], self.token, self.caches[slot], self.pos)
      return logits
    if name == "recompute":
      return self.compiled[name](self.params[name], self.tokens)
    cache = self.caches["shared"] if self.share_cache else self.floor_cache
    return self.compiled[name](self.params[name], cache)


def cache_bytes(cache: Any) -> int:
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache))


def memory_of(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes),
          "peak_bytes": int(m.argument_size_in_bytes + m.output_size_in_bytes
                            - m.alias_size_in_bytes + m.temp_size_in_bytes),
          "alias_bytes": int(m.alias_size_in_bytes)}


def measure(point: Point, args,
            names: tuple[str, ...] = CONTENDERS) -> dict[str, float]:
  """ms per call of each of ``names``: the median over rounds."""
  for name in names:   # warm: the first call of each
    instruments.block(point.call(name))
  times = {name: [] for name in names}
  for r in range(args.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      calls = 1 if name == "recompute" else args.calls
      start = time.perf_counter()
      for _ in range(calls):
        out = point.call(name)
      instruments.block((out, point.caches))
      times[name].append((time.perf_counter() - start) / calls)
  row = {f"{name}_ms": 1e3 * instruments.median(times[name]) for name in names}
  if "sliced" in names and "in_place" in names:
    # The in-place and sliced forms give the same logits (same cache, same step).
    row["in_place_vs_sliced_max_abs_diff"] = float(np.max(np.abs(
        np.asarray(point.call("in_place")) - np.asarray(point.call("sliced")))))
  return row


def memory_ordered(argv: list[str]) -> list[dict[str, Any]]:
  """``in_place`` and the floor at every (batch, T) of this command line
  (``argv``), measured in a child process under :data:`MEMORY_SCHEDULER`:
  ms per call and temp bytes."""
  env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " "
                                     + MEMORY_SCHEDULER).strip()}
  done = harness.run_module("benchmarks.decode", [*argv, "--memory_ordered_child"], env,
                            capture_output=True, text=True)
  if done.returncode != 0:
    raise RuntimeError(f"the memory-ordered child process failed:\n{done.stderr}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def memory_ordered_child(args, options) -> None:
  """The child's side of :func:`memory_ordered`: one JSON line on stdout."""
  rows = []
  for seq_len in args.seq_lens:
    for batch in args.batches:
      point = Point(args, batch, seq_len, options, names=MEMORY_ORDERED)
      rows.append({"batch": batch, "seq_len": seq_len,
                   **measure(point, args, names=MEMORY_ORDERED),
                   "temp_bytes": point.memory["in_place"]["temp_bytes"]})
      del point
  print(json.dumps(rows))


def peak_growth(args, options) -> dict[str, Any]:
  """Peak bytes of the in-place step at each of --peak_batches (compiled only)."""
  out = {}
  for batch in args.peak_batches:
    cfg = model_config.GPTConfig(vocab_size=args.vocab_size, seq_len=args.memory_seq_len,
                                 num_layers=args.num_layers, num_heads=args.num_heads,
                                 d_model=args.d_model)
    model = hk.without_apply_rng(hk.transform(
        lambda t, c, p, cfg=cfg: decoding.decode(cfg, t, c, p)))
    forward = hk.without_apply_rng(hk.transform(
        lambda t, cfg=cfg: model_lib.forward(cfg, t)))
    params = jax.eval_shape(forward.init, jax.random.PRNGKey(0),
                            jnp.zeros((1, 8), jnp.int32))
    cache = jax.eval_shape(lambda cfg=cfg, batch=batch: decoding.init_cache(cfg, batch))
    compiled = jax.jit(model.apply, donate_argnums=2).lower(
        params, jax.ShapeDtypeStruct((batch, 1), jnp.int32), cache, 0).compile(
            compiler_options=options)
    out[str(batch)] = {**memory_of(compiled), "cache_bytes": cache_bytes(cache)}
  first, last = (out[str(b)] for b in (args.peak_batches[0], args.peak_batches[-1]))
  growth = (last["peak_bytes"] - first["peak_bytes"]) / (
      last["cache_bytes"] - first["cache_bytes"])
  return {"seq_len": args.memory_seq_len, "by_batch": out,
          "peak_growth_over_cache_growth": growth, "goal": 1.2, "met": growth <= 1.2}


def summarise(rows: list[dict[str, Any]], peak: dict[str, Any],
              ordered: list[dict[str, Any]]) -> dict[str, Any]:
  seq_lens = sorted({r["seq_len"] for r in rows})
  t = QUOTED_T if QUOTED_T in seq_lens else seq_lens[-1]
  summary = {"seq_len": t, "by_batch": {}}
  for r in rows:
    if r["seq_len"] != t:
      continue
    in_place = r["in_place_ms"]
    mine = next(o for o in ordered
                if (o["batch"], o["seq_len"]) == (r["batch"], r["seq_len"]))
    summary["by_batch"][str(r["batch"])] = {
        "in_place_over_floor": in_place / r["floor_ms"],
        "sliced_over_in_place": r["sliced_ms"] / in_place,
        "in_place_over_unrolled": in_place / r["unrolled_ms"],
        "recompute_over_in_place": r["recompute_ms"] / in_place,
        "in_place_temp_over_cache": r["memory"]["in_place"]["temp_bytes"] / r["cache_bytes"],
        "sliced_temp_over_cache": r["memory"]["sliced"]["temp_bytes"] / r["cache_bytes"],
        "memory_ordered_in_place_over_floor": mine["in_place_ms"] / mine["floor_ms"],
        "memory_ordered_temp_over_cache": mine["temp_bytes"] / r["cache_bytes"],
    }
  by = summary["by_batch"]
  summary["goals"] = {
      "in_place_within_2x_floor": all(b["in_place_over_floor"] <= 2 for b in by.values()),
      "8x_faster_than_sliced_at_largest_batch": (
          by[max(by, key=int)]["sliced_over_in_place"] >= 8),
      "scanned_within_1.15x_of_unrolled": all(
          b["in_place_over_unrolled"] <= 1.15 for b in by.values()),
      "temp_at_most_0.15x_cache": all(b["in_place_temp_over_cache"] <= 0.15
                                      for b in by.values()),
      "temp_at_most_0.15x_cache_memory_ordered": all(
          b["memory_ordered_temp_over_cache"] <= 0.15 for b in by.values()),
      "peak_growth_at_most_1.2x_cache_growth": peak["met"],
  }
  return summary


def markdown(payload: dict[str, Any]) -> str:
  cfg = payload["config"]
  lines = [f"**One decode step, ms** (median of {cfg['rounds']} alternated rounds; "
           f"L={cfg['num_layers']}, d={cfg['d_model']}, H={cfg['num_heads']}, float32, "
           "cache donated; temp: compiled temp memory over the cache's bytes; "
           f"memory-ordered: `XLA_FLAGS={MEMORY_SCHEDULER}`, in a child process, "
           "over its own floor):", ""] + report.table(
               ["batch", "T", "floor", "in_place", "sliced (today)", "unrolled", "recompute",
                "in_place temp", "sliced temp", "memory-ordered in_place", "its temp"],
               align="l" * 11)
  for r in payload["measurements"]:
    f = r["floor_ms"]
    cells = [f"{r[f'{n}_ms']:.1f} ({r[f'{n}_ms'] / f:.1f}x)"
             for n in ("in_place", "sliced", "unrolled", "recompute")]
    temps = [f"{r['memory'][n]['temp_bytes'] / r['cache_bytes']:.2f}x"
             for n in ("in_place", "sliced")]
    mine = next(o for o in payload["memory_ordered"]
                if (o["batch"], o["seq_len"]) == (r["batch"], r["seq_len"]))
    ordered = [f"{mine['in_place_ms']:.1f} ({mine['in_place_ms'] / mine['floor_ms']:.1f}x)",
               f"{mine['temp_bytes'] / r['cache_bytes']:.2f}x"]
    lines.append(report.row(r["batch"], r["seq_len"], f"{f:.1f}", *cells, *temps, *ordered))
  peak = payload["peak"]
  b0, b1 = (str(b) for b in cfg["peak_batches"])
  lines += ["", f"Peak memory of the in-place step at T={peak['seq_len']}: batch {b0} "
            f"{peak['by_batch'][b0]['peak_bytes'] / 2**20:.1f} MiB, batch {b1} "
            f"{peak['by_batch'][b1]['peak_bytes'] / 2**20:.1f} MiB: it grows "
            f"{peak['peak_growth_over_cache_growth']:.2f}x the cache's growth."]
  goals = payload["summary"]["goals"]
  lines += ["", "Goals: " + ", ".join(f"{k}: {'met' if v else 'missed'}"
                                      for k, v in goals.items()) + "."]
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  rows = payload["measurements"]
  batches = sorted({r["batch"] for r in rows})

  def fig_fn(plt):
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
      mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["seq_len"])
      ts = [r["seq_len"] for r in mine]
      for name, style in (("in_place", "o-"), ("sliced", "s-"), ("unrolled", "^-"),
                          ("recompute", "x-")):
        ax.plot(ts, [r[f"{name}_ms"] for r in mine], style, label=name)
      ax.plot(ts, [r["floor_ms"] for r in mine], "k--", label="floor (bytes read once)")
      ax.set_xscale("log", base=2)
      ax.set_xticks(ts, [str(t) for t in ts])
      ax.set(xlabel="cache length T", ylabel="ms per token", title=f"batch {batch}")
      report.finish(ax, log_y=True, grid="")
    return fig

  return fig_fn


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  start = time.perf_counter()
  # --quick compiles with XLA's cheap settings: a smoke test checks that the
  # script runs, not how fast the code is.
  options = fast_compile.CODEGEN if args.quick else None
  if args.memory_ordered_child:
    memory_ordered_child(args, options)
    return {}
  ordered = memory_ordered(list(argv if argv is not None else sys.argv[1:]))
  harness.log("memory-ordered child: " + ", ".join(
      f"B={o['batch']} T={o['seq_len']} in_place {o['in_place_ms']:.2f} ms, "
      f"temp {o['temp_bytes'] / 2**20:.1f} MiB" for o in ordered))
  rows = []
  for seq_len in args.seq_lens:
    for batch in args.batches:
      point = Point(args, batch, seq_len, options)
      row = {"batch": batch, "seq_len": seq_len, "cache_bytes": point.cache_bytes,
             **measure(point, args), "memory": point.memory}
      rows.append(row)
      harness.log(f"B={batch} T={seq_len}: " + ", ".join(
          f"{n} {row[f'{n}_ms']:.2f} ms" for n in CONTENDERS)
                  + f"; in_place temp {point.memory['in_place']['temp_bytes'] / 2**20:.1f} MiB")
      del point
  peak = peak_growth(args, options)
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(), "quick": args.quick,
      "config": {"num_layers": args.num_layers, "d_model": args.d_model,
                 "num_heads": args.num_heads, "vocab_size": args.vocab_size,
                 "seq_lens": args.seq_lens, "batches": args.batches, "rounds": args.rounds,
                 "calls": args.calls, "peak_batches": args.peak_batches},
      "measurements": rows,
      "peak": peak,
      "memory_ordered": ordered,
      "memory_scheduler_flag": MEMORY_SCHEDULER,
      "summary": summarise(rows, peak, ordered),
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
