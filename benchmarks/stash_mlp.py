"""Does a loop whose kept values are written and read in place by its matmuls train a residual MLP stack at the pace of a Python loop?

The question behind the scanned stack's gap on a TPU (``scan_gap.py``): the
loop writes each kept value into row ``i`` of a stacked ``[L, ...]`` buffer
and reads it back in the backward pass, and XLA does both as copies of
their own. Here the same residual MLP stack (``x + gelu(x @ W1[i]) @ W2[i]``,
bfloat16, the GPT-2-medium MLP's sizes) runs five ways, side by side:

* ``loop``: a Python loop (XLA sees every layer: the target);
* ``scan``: ``jax.lax.scan``, JAX's own backward pass;
* ``stacked``: ``st.fold`` without remat (the engine's rule of what to keep);
* ``owned_xla``: a hand-written backward pass (``jax.custom_vjp`` over the
  whole loop) that keeps ``x`` and ``h = x @ W1[i]`` in two stacked buffers,
  written and read with XLA's dynamic slices;
* ``owned_pallas``: the same loop with every matmul a kernel of
  ``stash_kernels.py``: ``h`` written by its matmul straight into its row of
  the stack, read by the next matmul (``gelu`` as its prologue) and by the
  backward pass's matmuls from there, the weights read at their row, and the
  weight gradients written into their rows.

For each: the median step of ``value_and_grad`` over alternated rounds, the
compiled temp memory, and the largest difference of its gradients from the
loop's, relative to the largest gradient.

  python -m benchmarks.stash_mlp           # on a TPU: the published run
  python -m benchmarks.stash_mlp --quick   # the smoke test (CPU, interpret mode)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import stacktools as st
from benchmarks.common import device_runs
from benchmarks.common import harness
from benchmarks.common import stash_kernels

NAME = "stash_mlp"
VARIANTS = ("loop", "scan", "stacked", "owned_xla", "owned_pallas")
SIZES = {"accelerator": dict(layers=24, width=1024, hidden=4096, rows=8192),
         "quick": dict(layers=3, width=32, hidden=64, rows=32),
         # The float32 check's, the smallest that Mosaic's (8, 128) tiles take.
         "check": dict(layers=3, width=128, hidden=256, rows=256)}
CHECK_BLOCKS = (128, 128, 128)
QUICK = ["--rounds", "2", "--steps", "1"]
_C = 0.7978845608028654   # sqrt(2 / pi), of gelu's tanh form


def gelu(h: jax.Array) -> jax.Array:
  return 0.5 * h * (1.0 + jnp.tanh(_C * (h + 0.044715 * h ** 3)))


def gelu_grad(h: jax.Array) -> jax.Array:
  t = jnp.tanh(_C * (h + 0.044715 * h ** 3))
  return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * h * h)


def layer(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
  h = jnp.dot(x, w1, preferred_element_type=jnp.float32)
  y = jnp.dot(gelu(h).astype(x.dtype), w2, preferred_element_type=jnp.float32)
  return (x.astype(jnp.float32) + y).astype(x.dtype)


def loop(params, x):
  for i in range(params[0].shape[0]):
    x = layer(x, params[0][i], params[1][i])
  return x


def scan(params, x):
  return lax.scan(lambda x, w: (layer(x, *w), None), x, params)[0]


def stacked(params, x):
  return st.fold(lambda x, w: layer(x, *w), remat="none")(x, params)


def _owned(ops: dict[str, Callable[..., jax.Array]]):
  """The stack with its backward pass written by hand over ``ops``' matmuls
  (each takes the layer index and reads or writes stacked operands there)."""

  @jax.custom_vjp
  def run(params, x):
    return forward(params, x)[0]

  def forward(params, x):
    w1, w2 = params
    layers = w1.shape[0]
    xs = jnp.zeros((layers, *x.shape), x.dtype)
    hs = jnp.zeros((layers, x.shape[0], w1.shape[2]), x.dtype)

    def body(i, carry):
      x, xs, hs = carry
      xs = lax.dynamic_update_index_in_dim(xs, x, i, 0)
      hs = ops["h"](x, w1, i, hs)
      return ops["out"](hs, w2, i, x), xs, hs

    x, xs, hs = lax.fori_loop(0, layers, body, (x, xs, hs))
    return x, (w1, w2, xs, hs)

  def backward(res, g):
    w1, w2, xs, hs = res

    def body(j, carry):
      i = w1.shape[0] - 1 - j
      g, d1, d2 = carry
      d2 = ops["dw2"](hs, g, i, d2)
      gh = ops["gh"](g, w2, i, hs)
      d1 = ops["dw1"](xs, gh, i, d1)
      return ops["gx"](gh, w1, i, g), d1, d2

    g, d1, d2 = lax.fori_loop(0, w1.shape[0], body, (g, jnp.zeros_like(w1), jnp.zeros_like(w2)))
    return (d1, d2), g

  run.defvjp(forward, backward)
  return run


def _f32(a: jax.Array) -> jax.Array:
  return a.astype(jnp.float32)


def _row(a: jax.Array, i: jax.Array) -> jax.Array:
  return lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def _put(stack: jax.Array, value: jax.Array, i: jax.Array) -> jax.Array:
  return lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), i, 0)


def _dot(a, b, dims=((1,), (0,))):
  return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


#: The owned loop's matmuls with XLA's slices.
XLA_OPS = {
    "h": lambda x, w1, i, hs: _put(hs, _dot(x, _row(w1, i)), i),
    "out": lambda hs, w2, i, x: (_f32(x) + _dot(gelu(_f32(_row(hs, i))).astype(x.dtype),
                                                _row(w2, i))).astype(x.dtype),
    "dw2": lambda hs, g, i, d2: _put(d2, _dot(gelu(_f32(_row(hs, i))).astype(g.dtype), g,
                                              ((0,), (0,))), i),
    "gh": lambda g, w2, i, hs: (_dot(g, _row(w2, i), ((1,), (1,)))
                                * gelu_grad(_f32(_row(hs, i)))).astype(g.dtype),
    "dw1": lambda xs, gh, i, d1: _put(d1, _dot(_row(xs, i), gh, ((0,), (0,))), i),
    "gx": lambda gh, w1, i, g: (_f32(g) + _dot(gh, _row(w1, i), ((1,), (1,)))).astype(g.dtype),
}


def pallas_ops(blocks: tuple[int, int, int]) -> dict[str, Callable[..., jax.Array]]:
  """The owned loop's matmuls as in-place kernels (``stash_kernels.matmul``)."""
  mm = lambda *a, **k: stash_kernels.matmul(*a, blocks=blocks, **k)  # noqa: E731
  return {
      "h": lambda x, w1, i, hs: mm(x, w1, i, b_stacked=True, into=hs),
      "out": lambda hs, w2, i, x: mm(hs, w2, i, a_stacked=True, b_stacked=True,
                                     prologue=gelu, epilogue=jnp.add, extras=(x,)),
      "dw2": lambda hs, g, i, d2: mm(hs, g, i, a_stacked=True, transpose_a=True,
                                     prologue=gelu, into=d2),
      "gh": lambda g, w2, i, hs: mm(g, w2, i, b_stacked=True, transpose_b=True,
                                    epilogue=lambda acc, h: acc * gelu_grad(h),
                                    extras=(hs,), extras_stacked=(True,)),
      "dw1": lambda xs, gh, i, d1: mm(xs, gh, i, a_stacked=True, transpose_a=True, into=d1),
      "gx": lambda gh, w1, i, g: mm(gh, w1, i, b_stacked=True, transpose_b=True,
                                    epilogue=jnp.add, extras=(g,)),
  }


def variant(name: str, blocks: tuple[int, int, int]) -> Callable[..., Any]:
  fn = {"loop": loop, "scan": scan, "stacked": stacked, "owned_xla": _owned(XLA_OPS),
        "owned_pallas": _owned(pallas_ops(blocks))}[name]
  return jax.value_and_grad(lambda params, x: jnp.mean(_f32(fn(params, x)) ** 2),
                            argnums=(0, 1))


def inputs(size: dict[str, int], dtype: Any) -> tuple[Any, jax.Array]:
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  shape1 = (size["layers"], size["width"], size["hidden"])
  shape2 = (size["layers"], size["hidden"], size["width"])
  w1 = jax.random.normal(k1, shape1, dtype) * size["width"] ** -0.5
  w2 = jax.random.normal(k2, shape2, dtype) * size["hidden"] ** -0.5 / size["layers"] ** 0.5
  return (w1, w2), jax.random.normal(k3, (size["rows"], size["width"]), dtype)


def grads_error(got: Any, want: Any) -> float:
  """The largest difference of ``got``'s gradients from ``want``'s, relative
  to the largest of ``want``'s, over every gradient."""
  return max(float(np.max(np.abs(_np(a) - _np(b))) / max(np.max(np.abs(_np(b))), 1e-30))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _np(a):
  return np.asarray(a, np.float32)


def markdown(payload: dict[str, Any]) -> str:
  lines = ["| variant | step ms | / loop | temp GiB | grads vs loop (relative) |",
           "|---|---:|---:|---:|---:|"]
  rows = {r["label"]: r for r in payload.get("runs", [])}
  base = rows.get("loop", {}).get("step_s")
  for r in payload.get("runs", []):
    if "step_s" not in r:
      lines.append(f"| {r['label']} | {r.get('error', device_runs.oom_text(r))[:80]} | | | |")
      continue
    ratio = f"{r['step_s'] / base:.2f}x" if base else ""
    lines.append(f"| {r['label']} | {1e3 * r['step_s']:.2f} | {ratio} | "
                 f"{r['temp_bytes'] / 2**30:.3f} | {r.get('grads_error', float('nan')):.1e} |")
  checks = payload.get("float32_check")
  if checks:
    lines += ["", "Float32 at the check's sizes, gradients against the loop's: " + ", ".join(
        f"{k} {v:.1e}" for k, v in checks.items())]
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  runs = [r for r in payload.get("runs", []) if "step_s" in r]

  def plot(pyplot):
    fig, ax = pyplot.subplots(figsize=(7, 3))
    ax.barh(range(len(runs)), [1e3 * r["step_s"] for r in runs])
    ax.set_yticks(range(len(runs)), [r["label"] for r in runs])
    ax.invert_yaxis()
    ax.set_xlabel("value_and_grad step, ms")
    ax.set_title(f"Residual MLP stack, {payload['environment']['device']}")
    return fig
  return plot


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--rounds", type=int, default=5, help="timing rounds, order alternated")
  p.add_argument("--steps", type=int, default=5, help="steps per round")
  p.add_argument("--blocks", type=harness.int_list, default=list(stash_kernels.BLOCKS),
                 help="the kernels' blocks: rows, columns, contraction")
  return p


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  size = SIZES["quick" if args.quick else "accelerator"]
  blocks = tuple(args.blocks) if not args.quick else (16, 16, 16)
  start = time.perf_counter()
  payload: dict[str, Any] = {"question": __doc__.strip().splitlines()[0],
                             "command": harness.command_line(), "quick": args.quick,
                             "config": {"size": size, "blocks": blocks, "rounds": args.rounds,
                                        "steps": args.steps},
                             "environment": harness.environment()}
  # Float32 at small sizes first: every variant's gradients equal the loop's.
  params, x = inputs(SIZES["check"], jnp.float32)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(variant("loop", CHECK_BLOCKS))(params, x)
    payload["float32_check"] = {
        name: grads_error(jax.jit(variant(name, CHECK_BLOCKS))(params, x), want)
        for name in VARIANTS[1:]}
  harness.log(f"float32 check: {payload['float32_check']}")
  params, x = inputs(size, jnp.bfloat16)
  specs = [({"label": name}, variant(name, blocks), (params, x), None) for name in VARIANTS]
  runs = device_runs.compile_runs(specs, None, 1)
  want = None
  for run in runs:   # the gradients of each against the loop's, then its timing
    if run.ok:
      out = run.compiled(*run.args)
      if want is None:
        want = jax.tree.map(_np, out)
      run.record["grads_error"] = grads_error(out, want)
      del out
  device_runs.time_runs(runs, args.rounds, args.steps)
  payload["runs"] = [r.record for r in runs]
  payload["seconds"] = time.perf_counter() - start
  payload["summary"] = {r["label"]: r["step_s"] for r in payload["runs"] if "step_s" in r}
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
