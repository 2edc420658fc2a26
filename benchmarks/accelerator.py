"""On an accelerator: how fast and how big is a training step, per stack and policy?

One prepared run (at most a few minutes on one GPU) of the example's GPT at
the GPT-2-small shape (L=12, d=768, H=12, T=1024, batch 16, vocabulary 256,
float32): one compiled ``value_and_grad`` step for each stack and policy

* ``st.BlockSeq`` (unrolled) and ``st.Stacked`` (scanned) with no remat,
  ``st.Stacked`` with ``save_all`` (every value of every layer kept: what no
  remat kept before a loop step learned to recompute elementwise values);
* ``hk.layer_stack`` with no remat and over ``hk.remat``: the anchor;
* ``full``, and the example's default (``full`` keeping the matmul outputs),
  scanned and unrolled;

each with its compiled temp memory, its compile time and its median step
time; and a residual MLP (width 2048, batch 8192, L=32) with ``full`` against
``offload``, whose device and host memory are read from the compiled program.
All steps are compiled first, then timed in ``--rounds`` rounds that
alternate their order (A B C, C B A, ...); a step's time is the median over
rounds of the mean of ``--steps`` steps.

  python benchmarks/gpu.py                 # on a GPU: a few minutes
  python benchmarks/gpu.py --small         # on a CPU: tiny sizes, well under 2 minutes
  python benchmarks/gpu.py --quick         # the smoke test (tinier still)

Writes ``benchmarks/results/gpu.json`` (``gpu_small.json`` with ``--small``)
and the plot of step time against compiled temp memory, one point per
configuration.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

if __package__ in (None, ""):
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import haiku as hk  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position

import stacktools as st  # pylint: disable=wrong-import-position
from benchmarks import harness  # pylint: disable=wrong-import-position
from benchmarks import instruments  # pylint: disable=wrong-import-position
from examples.gpt import model as model_lib  # pylint: disable=wrong-import-position

NAME = "gpu"
#: The example's default remat: full, keeping the matmul outputs.
DEFAULT = st.CheckpointPolicy(save_block_internals=model_lib.KEPT_MATMUL_OUTPUTS)
#: (label, stack, remat) of the GPT configurations, in the table's order.
GPT_RUNS = (
    ("BlockSeq (unrolled), none", "unrolled", "none"),
    ("Stacked, none", "scan", "none"),
    ("Stacked, save_all", "scan", "save_all"),
    ("hk.layer_stack, no remat", "hk_layer_stack", None),
    ("hk.layer_stack + hk.remat", "hk_layer_stack", "full"),
    ("Stacked, full", "scan", "full"),
    ("Stacked, example default", "scan", DEFAULT),
    ("BlockSeq, example default", "unrolled", DEFAULT),
)
SIZES = {   # L, d, H, T, batch; MLP width, batch, L
    "gpu": dict(layers=12, d_model=768, heads=12, seq_len=1024, batch=16,
                mlp_width=2048, mlp_batch=8192, mlp_layers=32),
    "small": dict(layers=4, d_model=64, heads=2, seq_len=64, batch=4,
                  mlp_width=128, mlp_batch=256, mlp_layers=8),
    "quick": dict(layers=2, d_model=32, heads=2, seq_len=16, batch=2,
                  mlp_width=32, mlp_batch=16, mlp_layers=4),
}


def gpt_step(label: str, stack: str, remat: Any, size: dict[str, int]):
  """``(step, params, tokens)`` of one GPT configuration."""
  cfg = model_lib.GPTConfig(
      vocab_size=256, seq_len=size["seq_len"], num_layers=size["layers"],
      num_heads=size["heads"], d_model=size["d_model"], bias=False,
      stack="unrolled" if stack == "unrolled" else "scan",
      remat=False if stack == "hk_layer_stack" else remat)
  if stack == "hk_layer_stack":
    def loss(tokens):
      embed, head = model_lib._ends(cfg)  # pylint: disable=protected-access
      x = embed(tokens[:, :-1])
      block = lambda x: model_lib.Block(cfg)(x)  # noqa: E731
      if remat is not None:
        block = hk.remat(block)
      x = hk.layer_stack(cfg.num_layers, name="h")(block)(x)
      logits = head(x)
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
      return jnp.mean(nll)
  else:
    loss = lambda tokens: model_lib.loss_fn(cfg, tokens)[0]  # noqa: E731
  transformed = hk.transform(loss)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (size["batch"], cfg.seq_len + 1),
                              0, cfg.vocab_size)
  params = transformed.init(jax.random.PRNGKey(0), tokens)
  step = jax.jit(jax.value_and_grad(lambda p, t: transformed.apply(p, None, t)))
  del label
  return step, params, tokens


def mlp_step(remat: str, size: dict[str, int]):
  """``(step, params, x)`` of the residual MLP: a pure-JAX ``st.fold``."""
  width, layers = size["mlp_width"], size["mlp_layers"]
  ws = jax.random.normal(jax.random.PRNGKey(0), (layers, width, width)) / width ** 0.5
  x = jax.random.normal(jax.random.PRNGKey(1), (size["mlp_batch"], width))
  layer = lambda h, w: h + jnp.tanh(h @ w)  # noqa: E731
  loss = lambda ws, x: jnp.mean(st.fold(layer, remat=remat)(x, ws) ** 2)  # noqa: E731
  return jax.jit(jax.value_and_grad(loss)), ws, x


def compile_all(size: dict[str, int], with_offload: bool) -> list[dict[str, Any]]:
  """Every configuration compiled, with its memory and compile seconds."""
  runs = []
  plans: list[tuple[str, str, Callable[[], tuple[Any, Any, Any]]]] = [
      (label, "gpt", lambda l=label, s=stack, r=remat: gpt_step(l, s, r, size))
      for label, stack, remat in GPT_RUNS]
  plans.append(("MLP, full", "mlp", lambda: mlp_step("full", size)))
  if with_offload:
    plans.append(("MLP, offload", "mlp", lambda: mlp_step("offload", size)))
  for label, model, build in plans:
    step, params, batch = build()
    start = time.perf_counter()
    compiled = step.lower(params, batch).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    instruments.block(compiled(params, batch))   # warm-up
    runs.append({"label": label, "model": model, "compiled": compiled,
                 "args": (params, batch), "compile_s": seconds,
                 "temp_bytes": int(memory.temp_size_in_bytes),
                 "host_temp_bytes": int(getattr(memory, "host_temp_size_in_bytes", 0) or 0)})
    harness.log(f"{label:32s} temp {runs[-1]['temp_bytes'] / 2**30:8.3f} GiB  "
                f"compile {seconds:5.1f} s")
  return runs


def time_all(runs: list[dict[str, Any]], rounds: int, steps: int) -> None:
  """Median over rounds of each run's mean step, rounds alternating order."""
  times: dict[str, list[float]] = {r["label"]: [] for r in runs}
  for i in range(rounds):
    for run in (runs if i % 2 == 0 else runs[::-1]):
      compiled, args = run["compiled"], run["args"]
      start = time.perf_counter()
      out = None
      for _ in range(steps):
        out = compiled(*args)
      instruments.block(out)
      times[run["label"]].append((time.perf_counter() - start) / steps)
  for run in runs:
    run["step_s"] = instruments.median(times[run["label"]])
    run["step_s_rounds"] = times[run["label"]]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
  by = {r["label"]: r for r in runs}
  unrolled, scanned = by["BlockSeq (unrolled), none"], by["Stacked, none"]
  out = {"scan_over_unrolled_step": scanned["step_s"] / unrolled["step_s"],
         "scan_over_unrolled_temp": scanned["temp_bytes"] / unrolled["temp_bytes"],
         "save_all_over_unrolled_step": by["Stacked, save_all"]["step_s"] / unrolled["step_s"]}
  if "MLP, offload" in by:
    out["offload_over_full_step"] = by["MLP, offload"]["step_s"] / by["MLP, full"]["step_s"]
  return out


def markdown(payload: dict[str, Any]) -> str:
  env = payload.get("environment", {})
  lines = [f"**{payload['preset']}**: {payload['shape']} "
           f"({env.get('device', jax.devices()[0].device_kind)}, jax {jax.__version__})", "",
           "| configuration | step ms | compiled temp GiB | host temp GiB | compile s |",
           "|---|---:|---:|---:|---:|"]
  for r in payload["runs"]:
    lines.append(f"| {r['label']} | {1e3 * r['step_s']:.1f} | {r['temp_bytes'] / 2**30:.3f} | "
                 f"{r['host_temp_bytes'] / 2**30:.3f} | {r['compile_s']:.1f} |")
  s = payload["summary"]
  lines += ["", f"Scanned over unrolled, no remat: step {s['scan_over_unrolled_step']:.2f}x, "
            f"temp {s['scan_over_unrolled_temp']:.2f}x; save_all (what no remat kept "
            f"before) {s['save_all_over_unrolled_step']:.2f}x the unrolled step."]
  if "offload_over_full_step" in s:
    lines.append(f"MLP offload over full: {s['offload_over_full_step']:.2f}x the step.")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  def fig_fn(plt):
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for r in payload["runs"]:
      if r["model"] != "gpt":
        continue
      ax.scatter(r["temp_bytes"] / 2**30, 1e3 * r["step_s"])
      ax.annotate(r["label"], (r["temp_bytes"] / 2**30, 1e3 * r["step_s"]), fontsize=7,
                  xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("compiled temp memory (GiB, log)")
    ax.set_ylabel("step (ms)")
    ax.set_title(f"GPT {payload['shape']}: step time against memory\n"
                 f"({payload['environment']['device']})")
    return fig
  return fig_fn


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--small", action="store_true",
                 help="CPU sizes (L=4, d=64, T=64): the script, tested here")
  p.add_argument("--rounds", type=int, default=5, help="timing rounds")
  p.add_argument("--steps", type=int, default=4, help="steps per round")
  return p


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, ["--rounds", "2", "--steps", "1"], argv)
  preset = "quick" if args.quick else "small" if args.small else "gpu"
  size = SIZES[preset]
  with_offload = jax.default_backend() != "cpu"   # host offload needs pinned host memory
  start = time.perf_counter()
  runs = compile_all(size, with_offload)
  time_all(runs, args.rounds, args.steps)
  payload = {
      "question": "Step time, compiled memory and compile time of each stack and policy "
                  "on one accelerator, the scanned stack against the unrolled one.",
      "command": harness.command_line(), "quick": args.quick, "preset": preset,
      "config": {"size": size, "rounds": args.rounds, "steps": args.steps,
                 "offload": with_offload},
      "shape": (f"L={size['layers']}, d={size['d_model']}, H={size['heads']}, "
                f"T={size['seq_len']}, batch {size['batch']}, f32"),
      "runs": [{k: v for k, v in r.items() if k not in ("compiled", "args")} for r in runs],
  }
  payload["summary"] = summarise(runs)
  payload["seconds"] = time.perf_counter() - start
  name = f"{NAME}_small" if preset == "small" else NAME
  return harness.publish(args, name, payload, markdown, draw)


if __name__ == "__main__":
  main()
