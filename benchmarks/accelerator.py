"""On an accelerator: the scanned stack against the unrolled one, decode and offload against their floors, and the example's train step.

One prepared run (at most 8 minutes on one TPU v5e chip) in four parts,
each measured side by side in this one process, its contenders alternated:

* ``gpt``: the example's GPT (``examples/gpt/model.py``) at the GPT-2-small
  shape (L=12, d=768, H=12, T=1024, vocabulary 256, batch 8, no biases): one
  ``value_and_grad`` of ``loss_fn`` (no optimizer) for every stack and policy
  of :data:`GPT_RUNS` (``st.BlockSeq`` and ``st.Stacked`` with no remat,
  ``save_all``, ``full`` and the example's default; ``hk.layer_stack``, the
  anchor), in float32 and in bfloat16 compute (float32 parameters, the model
  run in bfloat16: ``GPTConfig.dtype``, the example's mixed precision). Each: the median step, the compiled
  temp memory, the compile time; a program that does not fit is recorded as
  out of memory, with the bytes XLA says it needed.
* ``decode``: one token at T/2 of a KV cache (L=24, d=1024, H=16, T=4096,
  the cache donated), batch 8 and 1 in float32 and batch 8 in bfloat16, in
  place (``st.per_layer(cache, in_place=True)``), unrolled (``st.BlockSeq``)
  and sliced (scan xs/ys) against the floor, one jitted sum over the same
  bytes (``benchmarks/decode.py``'s ``Point`` and ``measure``).
* ``offload``: a residual MLP (width 2048, batch 8192, L=32, float32) and
  the GPT at d=2048 with ``remat="full"`` against ``"offload"``: gradients
  compared, device temp and host bytes from the compiled programs, and the
  host link's bandwidth both ways (measured inside a jitted program, as an
  offloading loop moves its carries: see :func:`host_link`), from which the
  time that moving the offloaded bytes out and back takes.
* ``train``: the example's whole train step (``step.make_train_step``,
  AdamW included) at the GPT-2-small shape in bfloat16, with the attention
  ``GPTConfig``'s default picks (the splash kernel on a TPU), at batches 4,
  8, 16 and 32 under each remat of :data:`TRAIN_REMATS`: tokens/s, model TFLOP/s
  and MFU against the device's peak (``metrics.PEAK_FLOPS``).

Sizes are scaled to the device: a batch is halved until its float32 program
(the unrolled GPT without remat, the decode cache, full's GPT at d=2048)
fits in 80% of ``memory_stats()["bytes_limit"]``. The GPT steps are compiled
first (traced one by one, then compiled ``--compile_threads`` at a time),
then timed in ``--rounds`` rounds that alternate their order (A B C, C B A,
...); a step's time is the median over rounds of the mean of ``--steps``
steps.

  python benchmarks/accelerator.py           # on the accelerator: the published run
  python benchmarks/accelerator.py --small   # every part at CPU sizes, under 2 minutes
  python benchmarks/accelerator.py --quick   # the smoke test (tinier still)

Writes ``benchmarks/results/accelerator_<device>.json`` (``<device>``: the
device's kind as a slug, ``tpu_v5_lite``, ``cpu``) after each part, so that a
run cut short still reports what it measured, and at the end its plot
``accelerator_<device>.png``; ``--small`` and ``--quick`` write into a
scratch folder (``benchmarks/harness.py``) unless ``--results_dir`` is given.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import json
import re
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Optional

if __package__ in (None, ""):
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# pylint: disable=wrong-import-position
import haiku as hk
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import stacktools as st
from benchmarks import decode
from benchmarks import fast_compile
from benchmarks import harness
from benchmarks import instruments
from examples.gpt import decoding
from examples.gpt import metrics
from examples.gpt import model as model_lib
from examples.gpt import model_config
from examples.gpt import step as step_lib
# pylint: enable=wrong-import-position

NAME = "accelerator"
PARTS = ("gpt", "decode", "offload", "train")
DTYPES = ("float32", "bfloat16")
#: The example's default remat: full, keeping the matmul outputs.
DEFAULT = st.CheckpointPolicy(save_block_internals=model_config.KEPT_MATMUL_OUTPUTS)
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
#: (label of the scanned run, label of the unrolled run) whose ratios are reported.
RATIOS = {"none": ("Stacked, none", "BlockSeq (unrolled), none"),
          "example default": ("Stacked, example default", "BlockSeq, example default")}
#: The train part's remat policies (label, remat), each at every batch.
TRAIN_REMATS = (("none", "none"), ("example default", DEFAULT), ("full", "full"),
                ("nested", "nested"))
#: Decode's contenders, each against the floor.
DECODED = ("in_place", "unrolled", "sliced")
#: The share of the device's memory a program's batch is fitted into.
FIT = 0.8
SIZES = {
    "accelerator": {
        "gpt": dict(layers=12, d_model=768, heads=12, seq_len=1024, batch=8),
        "decode": dict(layers=24, d_model=1024, heads=16, seq_len=4096,
                       points=((8, "float32"), (1, "float32"), (8, "bfloat16"))),
        "mlp": dict(width=2048, batch=8192, layers=32),
        "wide_gpt": dict(layers=8, d_model=2048, heads=16, seq_len=1024, batch=8),
        "link_bytes": 2**30,
        "train": dict(layers=12, d_model=768, heads=12, seq_len=1024, batches=(4, 8, 16, 32)),
    },
    "small": {
        "gpt": dict(layers=4, d_model=64, heads=2, seq_len=64, batch=4),
        "decode": dict(layers=4, d_model=64, heads=2, seq_len=256,
                       points=((4, "float32"), (1, "float32"), (4, "bfloat16"))),
        "mlp": dict(width=128, batch=256, layers=8),
        "wide_gpt": dict(layers=2, d_model=128, heads=4, seq_len=64, batch=4),
        "link_bytes": 2**24,
        "train": dict(layers=2, d_model=64, heads=2, seq_len=64, batches=(4,)),
    },
    "quick": {
        "gpt": dict(layers=2, d_model=32, heads=2, seq_len=16, batch=2),
        "decode": dict(layers=2, d_model=32, heads=2, seq_len=32,
                       points=((2, "float32"), (1, "float32"), (2, "bfloat16"))),
        "mlp": dict(width=32, batch=16, layers=4),
        "wide_gpt": dict(layers=2, d_model=64, heads=2, seq_len=16, batch=2),
        "link_bytes": 2**20,
        "train": dict(layers=2, d_model=32, heads=2, seq_len=16, batches=(2,)),
    },
}
VOCAB = 256
QUICK = ["--rounds", "2", "--steps", "1", "--calls", "1"]


# ---------------------------------------------------------------------------
# The device: its name, its memory, and what does not fit in it.


def device_slug(kind: Optional[str] = None) -> str:
  """The device's kind as a file-name slug: ``"TPU v5 lite"`` -> ``"tpu_v5_lite"``."""
  kind = jax.devices()[0].device_kind if kind is None else kind
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


def result_name() -> str:
  """``accelerator_<device>``: the JSON's and the plot's name."""
  return f"{NAME}_{device_slug()}"


def bytes_limit() -> Optional[int]:
  """The device's memory in bytes, where JAX reports it (not on CPU)."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_NEEDED = (r"Used ([\d.]+)\s*([KMGT]?)i?B? of",            # XLA:TPU, compiling
           r"allocat\w* ([\d.]+)\s*([KMGT]?)i?B?\b",       # allocating at run time
           r"([\d]+)() bytes")


def out_of_memory(error: BaseException) -> Optional[dict[str, Any]]:
  """``{"bytes_needed", "message"}`` when ``error`` says the device's memory
  was exhausted (compiling or running), else ``None``."""
  text = str(error)
  if not re.search(r"RESOURCE_EXHAUSTED|out of memory|ran out of memory", text, re.I):
    return None
  needed = None
  for pattern in _NEEDED:
    m = re.search(pattern, text)
    if m:
      needed = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
      break
  line = next((l for l in text.splitlines() if l.strip()), text)
  return {"bytes_needed": needed, "message": line.strip()[:400]}


def failure(error: BaseException) -> dict[str, Any]:
  """What a configuration that raised records: out of memory, or the error."""
  oom = out_of_memory(error)
  if oom is not None:
    return {"out_of_memory": oom}
  traceback.print_exc()
  return {"error": f"{type(error).__name__}: {str(error).strip()[:400]}"}


def needed_bytes(compiled) -> int:
  """Device bytes a compiled program holds while it runs: its arguments,
  outputs (less the aliased ones) and temp."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)


def memory_of(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes),
          "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes),
          "host_temp_bytes": int(getattr(m, "host_temp_size_in_bytes", 0) or 0)}


def fit_batch(batch: int, build: Callable[[int], Any], limit: Optional[int],
              log: str) -> tuple[int, Optional[tuple[Any, float]], list[dict[str, Any]]]:
  """The largest of ``batch``, ``batch/2``, ... whose program fits in
  :data:`FIT` of ``limit``: ``(batch, (compiled, compile seconds) or None,
  the tries)``.

  ``build(batch)`` compiles the program; without a limit (CPU) nothing is
  compiled and ``batch`` is kept.
  """
  tries = []
  if limit is None:
    return batch, None, tries
  while True:
    try:
      start = time.perf_counter()
      compiled = build(batch)
      seconds = time.perf_counter() - start
      need = needed_bytes(compiled)
      tries.append({"batch": batch, "needed_bytes": need})
      if need <= FIT * limit or batch == 1:
        return batch, (compiled, seconds), tries
    except Exception as e:  # pylint: disable=broad-except
      if out_of_memory(e) is None or batch == 1:
        raise
      tries.append({"batch": batch, **failure(e)})
    harness.log(f"{log}: batch {batch} does not fit in {FIT:.0%} of "
                f"{limit / 2**30:.1f} GiB; halving")
    batch //= 2


# ---------------------------------------------------------------------------
# Steps: compiled, then timed in alternated rounds.


def hold_programs() -> bool:
  """Whether programs that have run are held side by side and timed in
  alternated rounds (on a CPU), or each is timed alone and dropped.

  On a TPU a program that has run keeps its device memory until it is
  dropped: with the unrolled GPT-2-small step held (8.3 GB of temp), the next
  program could not allocate 4.5 GB of the chip's 15.7 GB. There each
  program's rounds run back to back, and it is dropped before the next runs;
  the chip does not drift as a shared CPU does (the GPT steps' rounds agreed
  within 0.1%).
  """
  return jax.default_backend() == "cpu"


@dataclasses.dataclass
class Run:
  """One configuration: its record (what the JSON keeps) and its step."""

  record: dict[str, Any]
  compiled: Any = None
  args: tuple[Any, ...] = ()

  @property
  def ok(self) -> bool:
    return self.compiled is not None


#: One configuration to compile: its record, its function, the arguments,
#: and a program :func:`fit_batch` already compiled (with its seconds) or None.
Spec = tuple[dict[str, Any], Callable[..., Any], tuple[Any, ...], Optional[tuple[Any, float]]]


def compile_runs(specs: list[Spec], options, threads: int = 1) -> list[Run]:
  """Compiles each ``jax.jit(fn)`` for its arguments, warms it up and records
  its memory and compile seconds; a failure (out of memory, say) is recorded
  and the others go on.

  The functions are traced and lowered one after another (Haiku's and the
  stack's tracing state is Python's), then compiled ``threads`` at a time
  (XLA releases the GIL): a configuration's ``compile_s`` is its lowering
  plus its compile, the latter beside up to ``threads - 1`` others.
  """
  runs = [Run(record, args=args) for record, _, args, _ in specs]
  lowered = {}
  for i, (record, fn, args, fitted) in enumerate(specs):
    if fitted is not None:
      runs[i].compiled, record["compile_s"] = fitted
      continue
    try:
      start = time.perf_counter()
      lowered[i] = jax.jit(fn).lower(*args)
      record["compile_s"] = time.perf_counter() - start
    except Exception as e:  # pylint: disable=broad-except
      record.update(failure(e))

  def compile_one(i: int) -> tuple[Any, float]:
    start = time.perf_counter()
    compiled = lowered[i].compile(compiler_options=options)
    return compiled, time.perf_counter() - start

  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    done = {i: pool.submit(compile_one, i) for i in lowered}
    for i, future in done.items():
      try:
        runs[i].compiled, seconds = future.result()
        runs[i].record["compile_s"] += seconds
      except Exception as e:  # pylint: disable=broad-except
        runs[i].record.update(failure(e))
  lowered.clear()
  for run in runs:
    if run.ok:
      try:
        run.record.update(memory_of(run.compiled))
        if hold_programs():   # else warmed up where it is timed
          instruments.block(run.compiled(*run.args))   # the first call allocates
      except Exception as e:  # pylint: disable=broad-except
        run.record.update(failure(e))
        run.compiled = None
    harness.log(f"  {describe(run.record)}")
  return runs


def compile_run(record: dict[str, Any], fn: Callable[..., Any], args: tuple[Any, ...],
                options, fitted: Optional[tuple[Any, float]] = None) -> Run:
  """:func:`compile_runs` of one configuration."""
  return compile_runs([(record, fn, args, fitted)], options)[0]


def describe(record: dict[str, Any]) -> str:
  label = f"{record['label']} [{record.get('dtype', 'float32')}]"
  if "out_of_memory" in record:
    return f"{label:44s} {oom_text(record)}"
  if "error" in record:
    return f"{label:44s} error: {record['error'][:120]}"
  return (f"{label:44s} temp {record['temp_bytes'] / 2**30:8.3f} GiB  "
          f"compile {record['compile_s']:5.1f} s")


def time_runs(runs: list[Run], rounds: int, steps: int) -> None:
  """Each run's ``step_s``: the median over rounds of its mean step, the
  rounds alternating the order (A B C, C B A, ...); where programs are not
  held (:func:`hold_programs`), each run's rounds back to back, after a
  warm-up, and the run dropped after them."""
  if not hold_programs():
    for run in runs:
      if run.ok:
        try:
          instruments.block(run.compiled(*run.args))   # the first call allocates
        except Exception as e:  # pylint: disable=broad-except
          run.record.update(failure(e))
          run.compiled = None
          harness.log(f"  {describe(run.record)}")
          continue
        _time_rounds([run], rounds, steps)
        run.compiled = None
        gc.collect()
    return
  _time_rounds(runs, rounds, steps)


def _time_rounds(runs: list[Run], rounds: int, steps: int) -> None:
  live = [r for r in runs if r.ok]
  times: dict[int, list[float]] = {id(r): [] for r in live}
  for i in range(rounds):
    for run in (live if i % 2 == 0 else live[::-1]):
      if not run.ok:
        continue
      start = time.perf_counter()
      try:
        out = None
        for _ in range(steps):
          out = run.compiled(*run.args)
        instruments.block(out)
      except Exception as e:  # pylint: disable=broad-except
        run.record.update(failure(e))
        run.compiled = out = None
        harness.log(f"  {describe(run.record)}")
        continue
      times[id(run)].append((time.perf_counter() - start) / steps)
  live = [r for r in live if r.ok]
  for run in live:
    run.record["step_s"] = instruments.median(times[id(run)])
    run.record["step_s_rounds"] = times[id(run)]


def max_abs_diff(a: Any, b: Any) -> float:
  """The largest absolute difference between two pytrees' leaves."""
  return float(max(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


# ---------------------------------------------------------------------------
# Part 1: the GPT, every stack and policy, float32 and bfloat16 compute.


def gpt_config(size: dict[str, int], stack: str, remat: Any,
               dtype: str = "float32") -> model_config.GPTConfig:
  """The GPT of one configuration; ``dtype`` is its compute dtype (the
  example's mixed precision: float32 parameters either way)."""
  return model_config.GPTConfig(
      vocab_size=VOCAB, seq_len=size["seq_len"], num_layers=size["layers"],
      num_heads=size["heads"], d_model=size["d_model"], bias=False,
      stack="unrolled" if stack == "unrolled" else "scan",
      remat=False if stack == "hk_layer_stack" else remat, dtype=dtype)


def gpt_loss(size: dict[str, int], stack: str, remat: Any, dtype: str):
  """``(transformed, loss)``: the model's ``hk.transform`` and the float32
  ``loss(params, tokens)`` of one configuration."""
  cfg = gpt_config(size, stack, remat, dtype)
  if stack == "hk_layer_stack":
    def loss(tokens):
      with model_lib.precision(cfg):   # loss_fn enters it itself
        embed, head = model_lib.embed_and_head(cfg)
        x = embed(tokens[:, :-1])
        block = lambda x: model_lib.Block(cfg)(x)  # noqa: E731
        if remat is not None:
          block = hk.remat(block)
        x = hk.layer_stack(cfg.num_layers, name="h")(block)(x)
        logits = head(x).astype(jnp.float32)
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
      return jnp.mean(nll)
  else:
    loss = lambda tokens: model_lib.loss_fn(cfg, tokens)[0]  # noqa: E731
  transformed = hk.transform(loss)
  return transformed, lambda p, t: transformed.apply(p, None, t).astype(jnp.float32)


def gpt_tokens(size: dict[str, int], batch: int) -> jax.Array:
  return jax.random.randint(jax.random.PRNGKey(1), (batch, size["seq_len"] + 1), 0, VOCAB)


class GPTParams:
  """Float32 parameters, one set per layout (scanned, unrolled, hk.layer_stack),
  shared by every configuration of that layout."""

  def __init__(self, size: dict[str, int]):
    self.size, self.sets = size, {}

  def get(self, stack: str) -> Any:
    if stack not in self.sets:
      transformed, _ = gpt_loss(self.size, stack, "none", "float32")
      self.sets[stack] = jax.jit(transformed.init)(jax.random.PRNGKey(0),
                                                   gpt_tokens(self.size, 1))
    return self.sets[stack]


def gpt_part(part: dict[str, Any], size: dict[str, int], args, options,
             limit: Optional[int], report: Callable[[], None]) -> None:
  """Every configuration of :data:`GPT_RUNS` in each of :data:`DTYPES`, into
  ``part``; ``report()`` after each dtype."""
  params = GPTParams(size)
  label, stack, remat = GPT_RUNS[0]
  step = lambda dtype, stack, remat: jax.value_and_grad(  # noqa: E731
      gpt_loss(size, stack, remat, dtype)[1])
  batch, fitted, tries = fit_batch(
      size["batch"], lambda b: jax.jit(step("float32", stack, remat)).lower(
          params.get(stack), gpt_tokens(size, b)).compile(compiler_options=options),
      limit, "gpt")
  part.update({"size": {**size, "batch": batch}, "batch_fitting": tries,
               "bf16_compute": "GPTConfig.dtype (the example's jmp mixed precision)",
               "runs": []})
  tokens = gpt_tokens(size, batch)
  for dtype in DTYPES:
    harness.log(f"gpt, {dtype}, batch {batch}: compiling")
    specs = []
    for label, stack, remat in GPT_RUNS:
      record = {"label": label, "stack": stack, "remat": remat_label(remat),
                "dtype": dtype, "batch": batch}
      given = fitted if (dtype, label) == ("float32", GPT_RUNS[0][0]) else None
      specs.append((record, step(dtype, stack, remat), (params.get(stack), tokens), given))
    runs = compile_runs(specs, options, args.compile_threads)
    del specs
    harness.log(f"gpt, {dtype}: timing {sum(r.ok for r in runs)} steps, "
                f"{args.rounds} rounds of {args.steps}")
    time_runs(runs, args.rounds, args.steps)
    part["runs"] += [r.record for r in runs]
    for r in runs:
      if "step_s" in r.record:
        harness.log(f"  {r.record['label']:32s} [{dtype}] {1e3 * r.record['step_s']:8.1f} ms")
    del runs
    fitted = None
    gc.collect()
    report()


def remat_label(remat: Any) -> str:
  if remat is DEFAULT:
    return "example default (full, keeping the matmul outputs)"
  return "none" if remat is None else str(remat)


# ---------------------------------------------------------------------------
# Part 2: decode in place, unrolled and sliced against the floor.


def decode_part(part: dict[str, Any], size: dict[str, Any], args, options,
                limit: Optional[int], report: Callable[[], None]) -> None:
  """One token at T/2 at each (batch, dtype) of ``size["points"]``, into
  ``part``; ``report()`` after each."""
  point_args = types.SimpleNamespace(
      vocab_size=VOCAB, num_layers=size["layers"], num_heads=size["heads"],
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
        problem = failure(e)
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
  scanned and the unrolled layout) would not fit in :data:`FIT` of ``limit``."""
  cfg = model_config.GPTConfig(vocab_size=VOCAB, seq_len=seq_len,
                               num_layers=point_args.num_layers, num_heads=point_args.num_heads,
                               d_model=point_args.d_model)
  forward = hk.transform(lambda t: model_lib.forward(cfg, t)[0])
  params = jax.eval_shape(forward.init, jax.random.PRNGKey(0),
                          jax.ShapeDtypeStruct((1, 8), jnp.int32))
  itemsize = jnp.dtype(dtype).itemsize
  param_bytes = decode.cache_bytes(params) // 4 * itemsize
  while limit is not None and batch > 1:
    cache = jax.eval_shape(lambda b=batch: decoding.init_cache(cfg, b, jnp.dtype(dtype)))
    if decode.cache_bytes(cache) + 2 * param_bytes <= FIT * limit:
      break
    batch //= 2
  return batch


# ---------------------------------------------------------------------------
# Part 3: offload against full, and the host link.


def host_link(nbytes: int, reps: int) -> dict[str, Any]:
  """The host link's bandwidth both ways, as an offloading program sees it.

  Inside one jitted program, as offloading moves a loop's carries: ``rows``
  blocks written one by one to a ``pinned_host`` buffer and read back in
  reverse (out and back), and the same blocks read from a ``pinned_host``
  argument (back only). ``jax.device_put`` of a whole array to the host is
  not that link: it allocates and pins a fresh host buffer each call (0.9
  GB/s on a TPU v5e, where the program moves 14 GB/s).
  """
  device = jax.devices()[0]
  out: dict[str, Any] = {"bytes": nbytes, "reps": reps, "device_to_host_gb_s": None,
                         "host_to_device_gb_s": None}
  kinds = sorted(m.kind for m in device.addressable_memories())
  if jax.default_backend() == "cpu":
    out["why_not"] = ("CPU backend: the device's memory is the host's, there is no "
                      "link between them to measure")
    return out
  if "pinned_host" not in kinds:
    out["why_not"] = f"{device.device_kind} has no pinned_host memory (it has {kinds})"
    return out
  rows = 16
  block = jnp.ones((nbytes // rows // 4,), jnp.float32)
  host, on_device = jax.memory.Space.Host, jax.memory.Space.Device

  def read_back(total, row):   # the whole row comes to the device
    return total + jnp.sum(jax.device_put(row, on_device)), None

  def out_and_back():
    def write(_, i):
      return None, jax.device_put(block * i.astype(jnp.float32), host)
    _, hosted = lax.scan(write, None, jnp.arange(rows))
    return lax.scan(read_back, 0.0, hosted, reverse=True)[0]

  hosted = jax.device_put(jnp.ones((rows,) + block.shape, jnp.float32),
                          jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
  programs = {"out_and_back": (jax.jit(out_and_back), ()),
              "back": (jax.jit(lambda h: lax.scan(read_back, 0.0, h)[0]), (hosted,))}
  times: dict[str, list[float]] = {name: [] for name in programs}
  for name, (fn, args) in programs.items():
    jax.block_until_ready(fn(*args))        # compiled and warm
  for _ in range(reps):                     # alternated
    for name, (fn, args) in programs.items():
      times[name].append(instruments.timed(lambda: fn(*args))[0])  # pylint: disable=cell-var-from-loop
  back, both = (instruments.median(times[n]) for n in ("back", "out_and_back"))
  out.update({f"{name}_s": ts for name, ts in times.items()})
  out["host_to_device_gb_s"] = nbytes / back / 1e9
  out["device_to_host_gb_s"] = nbytes / max(both - back, 1e-9) / 1e9
  out["memory_kinds"] = kinds
  return out


def mlp_step(remat: str, size: dict[str, int]):
  """``(loss, (ws, x))`` of the residual MLP ``h + tanh(h @ w)``: a pure-JAX ``st.fold``."""
  width, layers = size["width"], size["layers"]
  ws = jax.random.normal(jax.random.PRNGKey(0), (layers, width, width)) / width ** 0.5
  x = jax.random.normal(jax.random.PRNGKey(1), (size["batch"], width))
  layer = lambda h, w: h + jnp.tanh(h @ w)  # noqa: E731
  loss = lambda ws, x: jnp.mean(st.fold(layer, remat=remat)(x, ws) ** 2)  # noqa: E731
  return jax.value_and_grad(loss), (ws, x)


def full_against_offload(model: str, steps: dict[str, tuple[Callable, tuple]], args,
                         options, fitted=None) -> dict[str, Any]:
  """``full`` and ``offload`` compiled, their gradients compared, timed alternated."""
  remats = ("full", "offload")
  runs = dict(zip(remats, compile_runs(
      [({"label": f"{model}, {remat}", "remat": remat}, *steps[remat],
        fitted if remat == "full" else None) for remat in remats],
      options, args.compile_threads)))
  out = {remat: run.record for remat, run in runs.items()}
  results = {}   # each one's (loss, gradients), on the host
  for remat, run in runs.items():
    if run.ok:
      try:
        results[remat] = jax.tree.map(np.asarray, run.compiled(*run.args))
      except Exception as e:  # pylint: disable=broad-except
        run.record.update(failure(e))
        run.compiled = None
    if not hold_programs():   # timed now, and dropped before the next runs
      time_runs([run], args.rounds, args.steps)
  if hold_programs():
    time_runs(list(runs.values()), args.rounds, args.steps)
  if len(results) == 2:
    (loss_f, grads_f), (loss_o, grads_o) = results["full"], results["offload"]
    out["loss_abs_diff"] = abs(float(loss_f) - float(loss_o))
    out["grads_max_abs_diff"] = max_abs_diff(grads_f, grads_o)
    out["grads_max_abs"] = float(max(np.max(np.abs(g)) for g in jax.tree.leaves(grads_f)))
    out["grads_max_abs_diff_highest"] = exact_grads_diff(steps, options)
  del results
  if all("step_s" in r for r in (out["full"], out["offload"])):
    out["offload_over_full_step"] = out["offload"]["step_s"] / out["full"]["step_s"]
  harness.log(f"  {model}: " + ", ".join(
      f"{remat} {1e3 * out[remat]['step_s']:.1f} ms" for remat in ("full", "offload")
      if "step_s" in out[remat]))
  return out


def exact_grads_diff(steps: dict[str, tuple[Callable, tuple]], options) -> Optional[float]:
  """``full``'s and ``offload``'s gradients compared with float32 matmuls.

  At the default precision a TPU computes a float32 matmul in bfloat16
  passes, and two programs that fuse differently round differently; at
  ``"highest"`` both multiply in float32, so a difference left is
  offload's own. (On a CPU the default is float32 already.)
  """
  grads = []
  for remat in ("full", "offload"):
    fn, fn_args = steps[remat]
    try:
      with jax.default_matmul_precision("highest"):
        compiled = jax.jit(fn).lower(*fn_args).compile(compiler_options=options)
      grads.append(jax.tree.map(np.asarray, compiled(*fn_args)[1]))
    except Exception as e:  # pylint: disable=broad-except
      harness.log(f"  gradients at the highest precision: {failure(e)}")
      return None
    del compiled
  return max_abs_diff(*grads)


def with_transfer(result: dict[str, Any], link: dict[str, Any]) -> dict[str, Any]:
  """Adds the time moving the offloaded bytes out and back takes at the
  measured bandwidths, and offload's step over the larger of it and full's."""
  host = result["offload"].get("host_temp_bytes")
  out, back = link["device_to_host_gb_s"], link["host_to_device_gb_s"]
  if not host or out is None or back is None:
    result["transfer_s"] = None
    result["why_no_transfer"] = ("no bytes offloaded to host memory" if not host
                                 else link.get("why_not", "bandwidth not measured"))
    return result
  result["transfer_s"] = host / (out * 1e9) + host / (back * 1e9)
  if "step_s" in result["offload"] and "step_s" in result["full"]:
    result["offload_over_max_full_transfer"] = result["offload"]["step_s"] / max(
        result["full"]["step_s"], result["transfer_s"])
  return result


def offload_part(part: dict[str, Any], sizes: dict[str, Any], args, options,
                 limit: Optional[int], report: Callable[[], None]) -> None:
  """The host link, then full against offload on the residual MLP and on the
  wide GPT, into ``part``; ``report()`` after each."""
  harness.log("offload: the host link")
  link = host_link(min(sizes["link_bytes"], int(0.1 * limit) if limit else sizes["link_bytes"]),
                   reps=5)
  if link["device_to_host_gb_s"] is not None:
    harness.log(f"  device->host {link['device_to_host_gb_s']:.1f} GB/s, "
                f"host->device {link['host_to_device_gb_s']:.1f} GB/s")
  else:
    harness.log(f"  not measured: {link['why_not']}")
  part["link"] = link
  harness.log("offload: residual MLP")
  mlp = sizes["mlp"]
  part["mlp"] = with_transfer(full_against_offload(
      "MLP", {r: mlp_step(r, mlp) for r in ("full", "offload")}, args, options), link)
  part["mlp"]["size"] = mlp
  gc.collect()
  report()

  wide = sizes["wide_gpt"]
  harness.log(f"offload: GPT at d={wide['d_model']}")
  params = GPTParams(wide)
  step = lambda remat: jax.value_and_grad(  # noqa: E731
      gpt_loss(wide, "scan", remat, "float32")[1])
  batch, fitted, tries = fit_batch(
      wide["batch"], lambda b: jax.jit(step("full")).lower(
          params.get("scan"), gpt_tokens(wide, b)).compile(compiler_options=options),
      limit, "wide gpt")
  tokens = gpt_tokens(wide, batch)
  part["wide_gpt"] = with_transfer(full_against_offload(
      f"GPT d={wide['d_model']}",
      {r: (step(r), (params.get("scan"), tokens)) for r in ("full", "offload")},
      args, options, fitted), link)
  part["wide_gpt"]["size"] = {**wide, "batch": batch}
  part["wide_gpt"]["batch_fitting"] = tries
  del params, fitted
  gc.collect()


# ---------------------------------------------------------------------------
# Part 4: the example's train step, tokens/s against batch for each remat.


def train_part(part: dict[str, Any], size: dict[str, Any], args, options,
               report: Callable[[], None]) -> None:
  """The example's whole train step (AdamW included) in bfloat16 at every
  batch of ``size["batches"]`` under each of :data:`TRAIN_REMATS`, into
  ``part``: tokens/s, model TFLOP/s and MFU (where the device's peak is
  known); ``report()`` after each batch."""
  import optax  # pylint: disable=g-import-not-at-top
  peak = metrics.peak_flops(jax.devices()[0].device_kind)
  part.update({"size": size, "peak_flops": peak, "runs": []})
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
  # One set of parameters and optimizer state serves every run (none is
  # donated here): the remat and the batch do not change their shapes.
  params = GPTParams(size).get("scan")
  opt_state = optimizer.init(params)
  for batch in size["batches"]:
    tokens = gpt_tokens(size, batch)
    specs = []
    for label, remat in TRAIN_REMATS:
      cfg = gpt_config(size, "scan", remat, "bfloat16")
      flops = metrics.model_flops_per_token(
          cfg, sum(a.size for a in jax.tree.leaves(params)))
      record = {"label": label, "remat": remat_label(remat), "dtype": "bfloat16",
                "batch": batch, "attention": "splash" if cfg.uses_splash(size["seq_len"])
                else "xla", "flops_per_token": flops}
      specs.append((record, step_lib.make_train_step(step_lib.transform(cfg), optimizer),
                    (params, opt_state, tokens), None))
    harness.log(f"train, batch {batch}: compiling {len(specs)}")
    runs = compile_runs(specs, options, args.compile_threads)
    del specs
    time_runs(runs, args.rounds, args.steps)
    for run in runs:
      r = run.record
      if "step_s" in r:
        r["tokens_s"] = batch * size["seq_len"] / r["step_s"]
        r["model_tflop_s"] = r["tokens_s"] * r["flops_per_token"] / 1e12
        r["mfu"] = None if peak is None else r["model_tflop_s"] * 1e12 / peak
        harness.log(f"  {r['label']:16s} batch {batch:3d} {r['tokens_s'] / 1e3:8.1f}k tokens/s"
                    + ("" if peak is None else f"  MFU {100 * r['mfu']:.1f}%"))
      part["runs"].append(r)
    del runs
    gc.collect()
    report()


# ---------------------------------------------------------------------------
# The summary, the page's tables and the plot.


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
  return None if a is None or b is None else a / b


def summarise(payload: dict[str, Any]) -> dict[str, Any]:
  """The ratios the issue's goals are stated in (``None``: not measured)."""
  out: dict[str, Any] = {}
  goals: dict[str, Optional[bool]] = {}
  if payload.get("gpt"):
    by = {(r["label"], r["dtype"]): r for r in payload["gpt"].get("runs", [])}
    gpt = {}
    for dtype in DTYPES:
      for key, (scanned, unrolled) in RATIOS.items():
        s, u = by.get((scanned, dtype), {}), by.get((unrolled, dtype), {})
        gpt[f"{dtype}, {key}"] = {
            "stacked_over_blockseq_step": _ratio(s.get("step_s"), u.get("step_s")),
            "stacked_over_blockseq_temp": _ratio(s.get("temp_bytes"), u.get("temp_bytes"))}
      none = gpt[f"{dtype}, none"]
      goals[f"gpt {dtype}: Stacked none <= 1.05x BlockSeq (step and temp)"] = (
          None if None in none.values() else max(none.values()) <= 1.05)
    default = gpt["float32, example default"]["stacked_over_blockseq_step"]
    goals["gpt float32: example default scanned <= 1.0x unrolled (step)"] = (
        None if default is None else default <= 1.0)
    out["gpt"] = gpt
  if payload.get("decode"):
    rows = payload["decode"].get("rows", [])
    out["decode"] = {f"batch {r['batch']}, {r['dtype']}": {
        **{f"{n}_over_floor": r["ratios_to_floor"].get(n) for n in DECODED},
        "in_place_over_unrolled": _ratio(r.get("in_place_ms"), r.get("unrolled_ms"))}
                     for r in rows}
    ratios = [v for v in out["decode"].values()]
    goals["decode: in place <= 1.2x the floor"] = (
        None if not ratios or any(v["in_place_over_floor"] is None for v in ratios)
        else all(v["in_place_over_floor"] <= 1.2 for v in ratios))
    goals["decode: in place <= unrolled"] = (
        None if not ratios or any(v["in_place_over_unrolled"] is None for v in ratios)
        else all(v["in_place_over_unrolled"] <= 1.0 for v in ratios))
  if payload.get("offload"):
    part = payload["offload"]
    out["offload"] = {
        "mlp_offload_over_full_step": part.get("mlp", {}).get("offload_over_full_step"),
        "mlp_offload_over_max_full_transfer":
            part.get("mlp", {}).get("offload_over_max_full_transfer"),
        "wide_gpt_offload_over_full_step":
            part.get("wide_gpt", {}).get("offload_over_full_step"),
        "device_to_host_gb_s": part.get("link", {}).get("device_to_host_gb_s"),
        "host_to_device_gb_s": part.get("link", {}).get("host_to_device_gb_s")}
    compared = [part[k] for k in ("mlp", "wide_gpt") if k in part]
    r = out["offload"]["mlp_offload_over_max_full_transfer"]
    goals["offload MLP: <= 1.15x max(full, transfer)"] = None if r is None else r <= 1.15
    r = out["offload"]["wide_gpt_offload_over_full_step"]
    goals["offload GPT d=2048: <= 1.2x full"] = None if r is None else r <= 1.2
    # Compared with float32 matmuls where measured (exact_grads_diff).
    diffs = [m.get("grads_max_abs_diff_highest", m.get("grads_max_abs_diff"))
             for m in compared]
    goals["offload: gradients equal full's (within 1e-5 of their largest)"] = (
        None if not compared or any(d is None for d in diffs)
        else all(d <= 1e-5 * max(1.0, m["grads_max_abs"]) for d, m in zip(diffs, compared)))
  out["goals"] = goals
  return out


def _gib(n: Optional[float]) -> str:
  return "" if n is None else f"{n / 2**30:.2f}"


def oom_text(record: dict[str, Any]) -> str:
  needed = record["out_of_memory"].get("bytes_needed")
  return ("out of memory" + (f" ({needed / 2**30:.1f} GiB needed)" if needed else ""))


def _cells(record: Optional[dict[str, Any]]) -> list[str]:
  """step ms | temp GiB | compile s of one run (one cell saying why if it failed)."""
  if record is None:
    return ["", "", ""]
  if "out_of_memory" in record:
    return [oom_text(record), "", ""]
  if "error" in record:
    return ["error", "", ""]
  return [f"{1e3 * record['step_s']:.1f}" if "step_s" in record else "",
          _gib(record.get("temp_bytes")), f"{record['compile_s']:.1f}"]


def run_table(payload: dict[str, Any]) -> list[str]:
  """The row every benchmark page starts with: when, on what, how long."""
  env = payload["environment"]
  devices = f"{jax.device_count()} x {env['device']}" if env["backend"] != "cpu" else (
      f"{env['cpu_count']} CPU cores")
  return ["| run | machine | versions | took |", "|---|---|---|---|",
          f"| {env['date_utc'].replace('T', ' ')[:16]} UTC | {devices}; "
          f"{env['backend']} backend, {env['platform'].split('-')[0]} | "
          f"Python {env['python']}, jax {env['jax']}, dm-haiku {env['dm_haiku']} | "
          f"{payload.get('seconds', 0):.0f} s |"]


def markdown(payload: dict[str, Any]) -> str:
  lines = run_table(payload) + ["", "```bash", payload["command"], "```", ""]
  others = [(name, payload[name]["run"]) for name in PARTS
            if payload.get(name, {}).get("run", {}).get("command", payload["command"])
            != payload["command"]]
  if others:   # a run of some --parts keeps the others from an earlier run
    lines += [f"`{name}` kept from the run of {run['date_utc'].replace('T', ' ')[:16]} UTC: "
              f"`{run['command']}`." for name, run in others] + [""]
  summary = payload.get("summary") or summarise(payload)
  if payload.get("gpt", {}).get("runs"):
    gpt = payload["gpt"]
    size = gpt["size"]
    by = {(r["label"], r["dtype"]): r for r in gpt["runs"]}
    lines += [f"**GPT, one `value_and_grad` step** (L={size['layers']}, d={size['d_model']}, "
              f"H={size['heads']}, T={size['seq_len']}, vocabulary {VOCAB}, batch "
              f"{size['batch']}; bf16: {gpt['bf16_compute']}; median of "
              f"{payload['config']['rounds']} alternated rounds; compile s: tracing, then "
              f"XLA, {payload['config'].get('compile_threads', 1)} programs at once):", "",
              "| stack, remat | f32 step ms | f32 temp GiB | f32 compile s | "
              "bf16 step ms | bf16 temp GiB | bf16 compile s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for label, _, _ in GPT_RUNS:
      lines.append(f"| {label} | " + " | ".join(
          _cells(by.get((label, "float32"))) + _cells(by.get((label, "bfloat16")))) + " |")
    ratios = [f"{key}: step {_x(r['stacked_over_blockseq_step'])}, temp "
              f"{_x(r['stacked_over_blockseq_temp'])}" for key, r in summary["gpt"].items()]
    lines += ["", "Stacked over BlockSeq: " + "; ".join(ratios) + ".", ""]
  if payload.get("decode", {}).get("rows"):
    rows = payload["decode"]["rows"]
    size = payload["decode"]["size"]
    lines += [f"**Decode, ms per token** (L={size['layers']}, d={size['d_model']}, "
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
          cells.append("error" if "error" in failed else oom_text({"out_of_memory": failed}))
        elif f"{name}_ms" not in r:
          cells.append("")
        elif name == "floor":
          cells.append(f"{r['floor_ms']:.2f}")
        else:
          cells.append(f"{r[f'{name}_ms']:.2f} ({_x(r['ratios_to_floor'].get(name))})")
      lines.append(f"| {text} | " + " | ".join(cells) + " |")
    lines.append("")
  if payload.get("offload", {}).get("link"):
    part = payload["offload"]
    link = part["link"]
    lines += ["**Offload against full** (float32; temp: device, host: the offloaded "
              "bytes; transfer: those bytes out and back at the measured bandwidths):", "",
              "| model | full ms | offload ms | offload / full | full temp GiB | "
              "offload temp GiB | host GiB | transfer ms | offload / max(full, transfer) | "
              "gradients' max abs diff | the same, float32 matmuls |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in ("mlp", "wide_gpt"):
      if key not in part:
        continue
      m, size = part[key], part[key]["size"]
      model = (f"residual MLP (width {size['width']}, batch {size['batch']}, L={size['layers']})"
               if key == "mlp" else f"GPT (L={size['layers']}, d={size['d_model']}, "
               f"T={size['seq_len']}, batch {size['batch']})")
      f, o = m["full"], m["offload"]
      lines.append(" | ".join([
          f"| {model}", _cells(f)[0], _cells(o)[0], _x(m.get("offload_over_full_step")),
          _gib(f.get("temp_bytes")), _gib(o.get("temp_bytes")), _gib(o.get("host_temp_bytes")),
          "" if m.get("transfer_s") is None else f"{1e3 * m['transfer_s']:.1f}",
          _x(m.get("offload_over_max_full_transfer")),
          "" if m.get("grads_max_abs_diff") is None else f"{m['grads_max_abs_diff']:.1e}",
          "" if m.get("grads_max_abs_diff_highest") is None
          else f"{m['grads_max_abs_diff_highest']:.1e}"]) + " |")
    if link["device_to_host_gb_s"] is not None:
      lines += ["", f"Host link (inside a jitted program: {link['bytes'] / 2**30:.2f} GiB "
                f"in 16 blocks to `pinned_host` and back, median of {link['reps']}): device to host "
                f"{link['device_to_host_gb_s']:.1f} GB/s, host to device "
                f"{link['host_to_device_gb_s']:.1f} GB/s."]
    else:
      lines += ["", f"Host link not measured: {link['why_not']}."]
    lines.append("")
  if payload.get("train", {}).get("runs"):
    part = payload["train"]
    size = part["size"]
    attention = sorted({r["attention"] for r in part["runs"]})
    lines += [f"**The example's train step** (AdamW included; L={size['layers']}, "
              f"d={size['d_model']}, T={size['seq_len']}, bfloat16 compute, "
              f"{' and '.join(attention)} attention): tokens/s by batch and remat", "",
              "| remat | " + " | ".join(f"batch {b}" for b in size["batches"]) + " |",
              "|---|" + "---:|" * len(size["batches"])]
    by = {(r["label"], r["batch"]): r for r in part["runs"]}
    for label, _ in TRAIN_REMATS:
      cells = []
      for b in size["batches"]:
        r = by.get((label, b), {})
        if "tokens_s" in r:
          cells.append(f"{r['tokens_s'] / 1e3:.1f}k" + (
              "" if r.get("mfu") is None else f" ({100 * r['mfu']:.1f}% MFU, "
              f"{_gib(r['temp_bytes'])} GiB)"))
        else:
          cells.append(oom_text(r) if "out_of_memory" in r else "")
      lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
  for name_of_part in PARTS:
    failed = payload.get(name_of_part, {}).get("failed")
    if failed:
      lines += [f"**{name_of_part}** stopped: "
                + (oom_text(failed) if "out_of_memory" in failed else failed["error"]) + ".", ""]
  goals = summary["goals"]
  if goals:
    lines.append("Goals: " + ", ".join(
        f"{k}: {'not measured' if v is None else 'met' if v else 'missed'}"
        for k, v in goals.items()) + ".")
  if payload.get("name"):
    lines += ["", f"![{payload['name']}](../../benchmarks/results/{payload['name']}.png)"]
  return "\n".join(lines).rstrip()


def _x(ratio: Optional[float]) -> str:
  return "" if ratio is None else f"{ratio:.2f}x"


def draw(payload: dict[str, Any]):
  def fig_fn(plt):
    fig, axes = plt.subplots(1, 4, figsize=(21, 5))
    ax = axes[0]
    for dtype, marker in zip(DTYPES, ("o", "s")):
      for r in payload.get("gpt", {}).get("runs", []):
        if r["dtype"] == dtype and "step_s" in r:
          ax.scatter(r["temp_bytes"] / 2**30, 1e3 * r["step_s"], marker=marker,
                     color="C0" if dtype == "float32" else "C1")
          ax.annotate(r["label"], (r["temp_bytes"] / 2**30, 1e3 * r["step_s"]), fontsize=6,
                      xytext=(4, 2), textcoords="offset points")
      ax.scatter([], [], marker=marker, color="C0" if dtype == "float32" else "C1",
                 label=dtype if dtype == "float32" else "bfloat16 compute")
    if payload.get("gpt", {}).get("runs"):
      ax.set_xscale("log")
    ax.set_xlabel("compiled temp memory (GiB, log)")
    ax.set_ylabel("step (ms)")
    ax.set_title("GPT: step time against memory")
    ax.legend(fontsize=8)
    ax = axes[1]
    rows = payload.get("decode", {}).get("rows", [])
    for i, name in enumerate(DECODED):
      ax.bar([j + 0.25 * (i - 1) for j in range(len(rows))],
             [r["ratios_to_floor"].get(name, 0) for r in rows], width=0.25, label=name)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="floor")
    ax.set_xticks(range(len(rows)), [f"batch {r['batch']}\n{r['dtype']}" for r in rows])
    if rows:   # a run of other parts has none to scale
      ax.set_yscale("log")
    ax.set_ylabel("decode step over the floor (log)")
    ax.set_title("Decode: one token at T/2")
    ax.legend(fontsize=8)
    ax = axes[2]
    part = payload.get("offload", {})
    models = [k for k in ("mlp", "wide_gpt") if k in part]
    for i, (what, key) in enumerate((("full", "full"), ("offload", "offload"),
                                     ("transfer", None))):
      values = []
      for k in models:
        if key is None:
          values.append(1e3 * (part[k].get("transfer_s") or 0))
        else:
          values.append(1e3 * part[k][key].get("step_s", 0))
      ax.bar([j + 0.25 * (i - 1) for j in range(len(models))], values, width=0.25, label=what)
    ax.set_xticks(range(len(models)), ["residual MLP" if k == "mlp" else "GPT, wide"
                                       for k in models])
    ax.set_ylabel("ms")
    ax.set_title("Offload against full, and the transfer time")
    if models:
      ax.legend(fontsize=8)
    else:   # a run cut short before this part, or run without it
      ax.set_axis_off()
      ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center",
              transform=ax.transAxes)
    ax = axes[3]
    runs = payload.get("train", {}).get("runs", [])
    for label, _ in TRAIN_REMATS:
      points = sorted((r["batch"], r["tokens_s"] / 1e3) for r in runs
                      if r["label"] == label and "tokens_s" in r)
      if points:
        ax.plot(*zip(*points), marker="o", label=label)
    if runs:
      ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("tokens/s (thousands)")
    ax.set_title("The example's train step (bfloat16)")
    if runs:
      ax.legend(fontsize=8)
    fig.suptitle(f"{payload['environment']['device']}, jax {payload['environment']['jax']}")
    return fig
  return fig_fn


# ---------------------------------------------------------------------------
# The command line.


def earlier_parts(args, name: str) -> dict[str, Any]:
  """The parts an earlier run on this device wrote to this run's JSON, for a
  run of only some ``--parts``: the JSON keeps them (each part's ``run`` says
  when and how it was measured)."""
  path = Path(args.results_dir) / f"{name}.json"
  if set(args.parts) == set(PARTS) or not path.exists():
    return {}
  earlier = json.loads(path.read_text(encoding="utf-8"))
  return {p: earlier[p] for p in PARTS if earlier.get(p, {}).get("run")}


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--small", action="store_true",
                 help="CPU sizes (GPT L=4, d=64, T=64): every part, under 2 minutes")
  p.add_argument("--parts", type=harness.str_list(PARTS), default=list(PARTS),
                 help="which parts to run, comma-separated")
  p.add_argument("--rounds", type=int, default=5, help="timing rounds, order alternated")
  p.add_argument("--steps", type=int, default=4, help="steps per round")
  p.add_argument("--calls", type=int, default=5, help="decode calls per round")
  p.add_argument("--compile_threads", type=int, default=None,
                 help="programs compiled at once (default: 4 on an accelerator, 1 on a CPU)")
  return p


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  if args.compile_threads is None:
    args.compile_threads = 1 if jax.default_backend() == "cpu" else 4
  preset = "quick" if args.quick else "small" if args.small else "accelerator"
  sizes = SIZES[preset]
  # --quick compiles with XLA's cheap settings: it checks that the script runs.
  options = (fast_compile.CODEGEN if (args.quick or args.small) and jax.default_backend() == "cpu"
             else None)
  limit = bytes_limit()
  name = result_name()
  start = time.perf_counter()
  payload: dict[str, Any] = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(), "quick": args.quick, "preset": preset,
      "name": name,
      "config": {"sizes": sizes, "parts": args.parts, "rounds": args.rounds,
                 "steps": args.steps, "calls": args.calls, "bytes_limit": limit,
                 "compile_threads": args.compile_threads,
                 "fit": FIT},
      "environment": harness.environment(),
  }

  def report() -> None:
    payload["seconds"] = time.perf_counter() - start
    payload["summary"] = summarise(payload)
    payload["markdown"] = markdown(payload)
    harness.write_json(args.results_dir, name, payload)

  harness.log(f"{payload['environment']['device']} ({jax.default_backend()}), memory "
              f"{'not reported' if limit is None else f'{limit / 2**30:.1f} GiB'}; "
              f"preset {preset}; parts {', '.join(args.parts)}")
  parts = {"gpt": lambda part: gpt_part(part, sizes["gpt"], args, options, limit, report),
           "decode": lambda part: decode_part(part, sizes["decode"], args, options, limit,
                                              report),
           "offload": lambda part: offload_part(part, sizes, args, options, limit, report),
           "train": lambda part: train_part(part, sizes["train"], args, options, report)}
  earlier = earlier_parts(args, name)
  for name_of_part in PARTS:
    if name_of_part not in args.parts:
      if name_of_part in earlier:
        payload[name_of_part] = earlier[name_of_part]
        harness.log(f"== {name_of_part}: kept from the run of "
                    f"{earlier[name_of_part]['run']['date_utc']}")
      continue
    began = time.perf_counter()
    harness.log(f"== {name_of_part} ({began - start:.0f} s in)")
    payload[name_of_part] = {"run": {"date_utc": payload["environment"]["date_utc"],
                                     "command": payload["command"]}}
    try:
      parts[name_of_part](payload[name_of_part])
    except Exception as e:  # pylint: disable=broad-except
      payload[name_of_part]["failed"] = failure(e)   # the other parts still run
    payload[name_of_part]["run"]["seconds"] = time.perf_counter() - began
    report()
  payload["seconds"] = time.perf_counter() - start
  payload["summary"] = summarise(payload)
  return harness.publish(args, name, payload, markdown, draw)


if __name__ == "__main__":
  main()
