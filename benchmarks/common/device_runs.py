"""Programs on one device, side by side: what fits, compiled, then timed.

What the accelerator scripts (``accelerator_gpt``, ``accelerator_decode``,
``accelerator_offload``, ``accelerator_train``, ``scan_gap``, ``stash_mlp``)
share to measure on a device whose memory is small and not shared:

* the device: its name as a slug (:func:`device_slug`), its memory
  (:func:`bytes_limit`), what a program needs (:func:`needed_bytes`), the
  largest batch whose program fits (:func:`fit_batch`);
* what does not fit: an error read as out of memory, with the bytes XLA says
  it needed (:func:`out_of_memory`, :func:`failure`), recorded while the
  other configurations go on;
* configurations compiled a few at a time (:func:`compile_runs`), then timed
  in alternated rounds (:func:`time_runs`);
* the cells of the pages' tables (:func:`cells`, :func:`gib`, :func:`x`,
  :func:`oom_text`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import re
import time
import traceback
from typing import Any, Callable, Optional

import jax
import numpy as np

from benchmarks.common import harness
from benchmarks.common import instruments

#: The share of the device's memory a program's batch is fitted into.
FIT = 0.8


# ---------------------------------------------------------------------------
# The device: its name, its memory, and what does not fit in it.


def device_slug(kind: Optional[str] = None) -> str:
  """The device's kind as a file-name slug: ``"TPU v5 lite"`` -> ``"tpu_v5_lite"``."""
  kind = jax.devices()[0].device_kind if kind is None else kind
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


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
  """A compiled program's temp, argument, output and host temp bytes."""
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
  """One log line: a configuration's memory and compile time, or why it failed."""
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
# The cells of the pages' tables.


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
  """``a / b``, or ``None`` where either was not measured."""
  return None if a is None or b is None else a / b


def gib(n: Optional[float]) -> str:
  """Bytes as GiB with two decimals ("" for none)."""
  return "" if n is None else f"{n / 2**30:.2f}"


def oom_text(record: dict[str, Any]) -> str:
  """"out of memory (N GiB needed)" for a record that ran out."""
  needed = record["out_of_memory"].get("bytes_needed")
  return ("out of memory" + (f" ({needed / 2**30:.1f} GiB needed)" if needed else ""))


def cells(record: Optional[dict[str, Any]]) -> list[str]:
  """step ms | temp GiB | compile s of one run (one cell saying why if it failed)."""
  if record is None:
    return ["", "", ""]
  if "out_of_memory" in record:
    return [oom_text(record), "", ""]
  if "error" in record:
    return ["error", "", ""]
  return [f"{1e3 * record['step_s']:.1f}" if "step_s" in record else "",
          gib(record.get("temp_bytes")), f"{record['compile_s']:.1f}"]


def x(value: Optional[float]) -> str:
  """A ratio as "1.23x" ("" for none)."""
  return "" if value is None else f"{value:.2f}x"
