"""On an accelerator: how close does one decode step come to its floor, in place, unrolled and sliced?

One token at T/2 of a KV cache (L=24, d=1024, H=16, T=4096, the cache
donated), batch 8 and 1 in float32 and batch 8 in bfloat16, in place
(``st.per_layer(cache, in_place=True)``), unrolled (``st.BlockSeq``) and
sliced (scan xs/ys) against the floor, one jitted sum over the same bytes
(``benchmarks/decode.py``'s ``Point`` and ``measure``), side by side in this
one process, their calls alternated over ``--rounds`` rounds of ``--calls``
calls. A batch is halved until its cache and two copies of the parameters
fit in 80% of ``memory_stats()["bytes_limit"]``; if the three contenders do
not fit side by side, the sliced one (a second cache) runs on its own.

  python -m benchmarks.accelerator_decode           # on the accelerator
  python -m benchmarks.accelerator_decode --small   # CPU sizes
  python -m benchmarks.accelerator_decode --quick   # the smoke test (tinier still)

Writes ``benchmarks/results/accelerator_decode_<device>.json`` and ``.png``
(``benchmarks/common/accelerator.py``); ``--small`` and ``--quick`` write
into a scratch folder unless ``--results_dir`` is given.
"""

from __future__ import annotations

import gc
import types
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp

from benchmarks import decode
from benchmarks.common import accelerator
from benchmarks.common import device_runs
from benchmarks.common import harness
from examples.gpt import decoding
from examples.gpt import model as model_lib
from examples.gpt import model_config

NAME = "accelerator_decode"
#: Decode's contenders, each against the floor.
DECODED = ("in_place", "unrolled", "sliced")


def measure(part: dict[str, Any], sizes: dict[str, Any], args, options,
            limit: Optional[int], report: Callable[[], None]) -> None:
  """One token at T/2 at each (batch, dtype) of ``size["points"]``, into
  ``part``; ``report()`` after each."""
  size = sizes["decode"]
  point_args = types.SimpleNamespace(
      vocab_size=accelerator.VOCAB, num_layers=size["layers"], num_heads=size["heads"],
      d_model=size["d_model"], rounds=args.rounds, calls=args.calls)
  seq_len = size["seq_len"]
  part.update({"size": {k: v for k, v in size.items() if k != "points"}, "rows": []})
  for batch, dtype in size["points"]:
    fitted = decode_batch(point_args, batch, seq_len, dtype, limit)
    row = {"batch": fitted, "batch_asked": batch, "dtype": dtype, "seq_len": seq_len,
           "pos": seq_len // 2, "memory": {}, "out_of_memory": {}}
    harness.log(f"decode, batch {fitted}, {dtype}, T={seq_len}")
    # All three side by side; if that does not fit, the sliced form (a second
    # cache) on its own.
    measured_names: set[str] = set()
    for group in (DECODED, DECODED[:2], DECODED[2:]):
      if measured_names >= set(group):
        continue
      try:
        point = decode.Point(point_args, fitted, seq_len, options,
                             names=group + ("floor",), pos=seq_len // 2,
                             dtype=jnp.dtype(dtype), share_cache=True)
        measured = decode.measure(point, point_args, names=group + ("floor",))
        row["cache_bytes"] = point.cache_bytes
        row["param_bytes"] = decode.cache_bytes(point.params["floor"])
        row["memory"].update(point.memory)
        floor = measured.pop("floor_ms")
        if "floor_ms" in row:
          row["floor_ms_beside_sliced"] = floor
        else:
          row["floor_ms"] = floor
        row.update(measured)
        measured_names.update(group)
        for name in group:
          row["out_of_memory"].pop(name, None)
      except Exception as e:  # pylint: disable=broad-except
        problem = device_runs.failure(e)
        for name in group:
          row["out_of_memory"][name] = problem.get("out_of_memory") or problem
      point = None
      gc.collect()
    row["ratios_to_floor"] = {n: row[f"{n}_ms"] / row["floor_ms"] for n in DECODED
                              if f"{n}_ms" in row and "floor_ms" in row}
    part["rows"].append(row)
    harness.log("  " + ", ".join(f"{n} {row[f'{n}_ms']:.2f} ms" for n in ("floor",) + DECODED
                                 if f"{n}_ms" in row)
                + "".join(f"; {n} out of memory" for n in row["out_of_memory"]))
    report()


def decode_batch(point_args, batch: int, seq_len: int, dtype: str,
                 limit: Optional[int]) -> int:
  """``batch``, halved while one cache and two copies of the parameters (the
  scanned and the unrolled layout) would not fit in :data:`device_runs.FIT` of ``limit``."""
  cfg = model_config.GPTConfig(vocab_size=accelerator.VOCAB, seq_len=seq_len,
                               num_layers=point_args.num_layers, num_heads=point_args.num_heads,
                               d_model=point_args.d_model)
  forward = hk.transform(lambda t: model_lib.forward(cfg, t)[0])
  params = jax.eval_shape(forward.init, jax.random.PRNGKey(0),
                          jax.ShapeDtypeStruct((1, 8), jnp.int32))
  itemsize = jnp.dtype(dtype).itemsize
  param_bytes = decode.cache_bytes(params) // 4 * itemsize
  while limit is not None and batch > 1:
    cache = jax.eval_shape(lambda b=batch: decoding.init_cache(cfg, b, jnp.dtype(dtype)))
    if decode.cache_bytes(cache) + 2 * param_bytes <= device_runs.FIT * limit:
      break
    batch //= 2
  return batch



def summarise(payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Optional[bool]]]:
  """Each contender over the floor, and in place over unrolled; the goals."""
  goals: dict[str, Optional[bool]] = {}
  rows = payload["decode"].get("rows", [])
  out = {f"batch {r['batch']}, {r['dtype']}": {
      **{f"{n}_over_floor": r["ratios_to_floor"].get(n) for n in DECODED},
      "in_place_over_unrolled": device_runs.ratio(r.get("in_place_ms"), r.get("unrolled_ms"))}
         for r in rows}
  ratios = list(out.values())
  goals["decode: in place <= 1.2x the floor"] = (
      None if not ratios or any(v["in_place_over_floor"] is None for v in ratios)
      else all(v["in_place_over_floor"] <= 1.2 for v in ratios))
  goals["decode: in place <= unrolled"] = (
      None if not ratios or any(v["in_place_over_unrolled"] is None for v in ratios)
      else all(v["in_place_over_unrolled"] <= 1.0 for v in ratios))
  return out, goals


def tables(payload: dict[str, Any]) -> list[str]:
  """ms per token of each contender at each point, over the floor."""
  if not payload["decode"].get("rows"):
    return []
  rows = payload["decode"]["rows"]
  size = payload["decode"]["size"]
  lines = [f"**Decode, ms per token** (L={size['layers']}, d={size['d_model']}, "
           f"H={size['heads']}, T={size['seq_len']}, one token at T/2, the cache "
           "donated; in brackets: over the floor):", "",
           "| | " + " | ".join(f"batch {r['batch']}, {r['dtype']}" for r in rows) + " |",
           "|---|" + "---:|" * len(rows)]
  names = {"floor": "floor (one sum over the same bytes)",
           "in_place": "in place (`st.per_layer(cache, in_place=True)`)",
           "unrolled": "unrolled (`BlockSeq`)", "sliced": "sliced (xs/ys)"}
  for name, text in names.items():
    cells = []
    for r in rows:
      if name in r["out_of_memory"]:
        failed = r["out_of_memory"][name]
        cells.append("error" if "error" in failed
                     else device_runs.oom_text({"out_of_memory": failed}))
      elif f"{name}_ms" not in r:
        cells.append("")
      elif name == "floor":
        cells.append(f"{r['floor_ms']:.2f}")
      else:
        cells.append(f"{r[f'{name}_ms']:.2f} ({device_runs.x(r['ratios_to_floor'].get(name))})")
    lines.append(f"| {text} | " + " | ".join(cells) + " |")
  return lines + [""]


def draw(ax: Any, payload: dict[str, Any]) -> None:
  """Each contender over the floor at each point (log)."""
  rows = payload.get("decode", {}).get("rows", [])
  for i, name in enumerate(DECODED):
    ax.bar([j + 0.25 * (i - 1) for j in range(len(rows))],
           [r["ratios_to_floor"].get(name, 0) for r in rows], width=0.25, label=name)
  ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="floor")
  ax.set_xticks(range(len(rows)), [f"batch {r['batch']}\n{r['dtype']}" for r in rows])
  if rows:   # a run that failed has none to scale
    ax.set_yscale("log")
  ax.set_ylabel("decode step over the floor (log)")
  ax.set_title("Decode: one token at T/2")
  ax.legend(fontsize=8)


def flags(parser: Any) -> None:
  parser.add_argument("--calls", type=int, default=5, help="decode calls per round")


PART = accelerator.Part("decode", __doc__, ("decode",), measure, summarise, tables, draw,
                        flags=flags, quick=("--calls", "1"), config=("calls",))


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  return accelerator.main(PART, argv)


if __name__ == "__main__":
  main()
