"""Device time per op of a compiled program, from a ``jax.profiler`` trace.

A benchmark that asks *where* a step's time goes (not only how long it takes)
runs the compiled program a few times under ``jax.profiler.trace`` and reads
the trace's "XLA Ops" lines (one event per executed HLO instruction on the
device). Each op is named by its instruction's kind (its name without the
numeric suffix: ``fusion``, ``copy``, ``bitcast_dynamic-update-slice_fusion``)
and its output shape, both read from the compiled HLO text, so two programs'
ops can be grouped and subtracted (:func:`difference`). A fusion whose
computation holds a ``dot`` or ``convolution`` counts as a matmul.

On a CPU the trace has no "XLA Ops" line: the tables are empty there, which a
``--quick`` run accepts (it checks the plumbing, not the figures).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from typing import Any, Callable

import jax

#: An HLO instruction: ``%name = shape{layout} opcode(...)``, the shape one
#: array or a tuple; ``calls=`` names a fusion's computation.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(?[a-z0-9]+\[[^=]*?\]|\([^=]*?\))"
                          r"(?:\{[^}]*\})?\s+([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")
_MATMUL_OPS = ("dot", "convolution")
_CONTROL_FLOW = ("while", "conditional", "call")
_NAME = re.compile(r"^%?([^\s=]*)")


def hlo_ops(hlo_text: str) -> dict[str, dict[str, Any]]:
  """``{instruction name: {"kind", "shape", "matmul"}}`` of a compiled
  program's HLO text (``compiled.as_text()``)."""
  computations: dict[str, list[tuple[str, str, str, str]]] = collections.defaultdict(list)
  current = ""
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      calls = _CALLS.search(line)
      computations[current].append((m.group(1), _LAYOUT.sub("", m.group(2)), m.group(3),
                                    calls.group(1) if calls else ""))
      continue
    c = _COMPUTATION.match(line)
    if c:
      current = c.group(1)
  opcodes = {name: {op for _, _, op, _ in instrs} for name, instrs in computations.items()}

  def has_matmul(computation: str, seen: frozenset = frozenset()) -> bool:
    if computation in seen or computation not in computations:
      return False
    return (bool(opcodes[computation] & set(_MATMUL_OPS))
            or any(has_matmul(called, seen | {computation})
                   for _, _, _, called in computations[computation] if called))

  ops = {}
  for instrs in computations.values():
    for name, shape, opcode, called in instrs:
      ops[name] = {"kind": re.sub(r"\.\d+$", "", name), "shape": shape.replace(" ", ""),
                   "opcode": opcode,
                   "matmul": opcode in _MATMUL_OPS or (opcode == "fusion" and has_matmul(called))}
  return ops


def _device_op_events(trace_dir: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
  """The complete events on the "XLA Ops" lines of the trace in ``trace_dir``,
  and how many complete events each (process, thread) line of it holds."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*trace.json.gz"), recursive=True))
  if not paths:
    return [], {}
  with gzip.open(paths[0], "rt", encoding="utf-8") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
      names[(e["name"], e.get("pid"), e.get("tid") if e["name"] == "thread_name" else None)] = (
          str(e.get("args", {}).get("name", "")))
  line_of = lambda e: (names.get(("process_name", e.get("pid"), None), str(e.get("pid"))),  # noqa: E731
                       names.get(("thread_name", e.get("pid"), e.get("tid")), str(e.get("tid"))))
  complete = [e for e in events if e.get("ph") == "X"]
  lines = collections.Counter("|".join(line_of(e)) for e in complete)
  return [e for e in complete if line_of(e)[1] == "XLA Ops"], dict(lines.most_common(12))


def profile(compiled: Any, args: tuple[Any, ...], steps: int = 3) -> dict[str, Any]:
  """Device milliseconds per step of ``compiled(*args)``, by op.

  Returns ``{"device_ms", "by_kind_ms", "by_op_ms", "steps", "trace_lines"}``:
  the total, then grouped by kind of op (``matmul`` for any op holding a
  dot), then by kind and output shape (``"copy -> bf16[8,1024,16,64]"``),
  and the trace's busiest lines (what a trace without "XLA Ops" had). A
  loop's or call's own event spans its body's ops and is left out.
  """
  ops = hlo_ops(compiled.as_text())
  jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        out = compiled(*args)
      jax.block_until_ready(out)
    events, lines = _device_op_events(trace_dir)
  by_kind: dict[str, float] = collections.defaultdict(float)
  by_op: dict[str, float] = collections.defaultdict(float)
  for event in events:
    # The line's names are the instruction's, or its whole text ("%fusion.3 = ...").
    name = _NAME.match(event.get("name", "")).group(1)
    op = ops.get(name, {"kind": re.sub(r"\.\d+$", "", name), "shape": "?", "matmul": False,
                        "opcode": re.sub(r"\.\d+$", "", name)})
    if op["opcode"] in _CONTROL_FLOW:   # its time is its body's ops', counted already
      continue
    ms = float(event.get("dur", 0.0)) / 1e3 / steps
    by_kind["matmul" if op["matmul"] else op["kind"]] += ms
    by_op[f"{op['kind']} -> {op['shape']}"] += ms
  return {"steps": steps, "device_ms": sum(by_kind.values()),
          "by_kind_ms": _rounded_desc(by_kind), "by_op_ms": _rounded_desc(by_op),
          "trace_lines": lines}


def difference(a: dict[str, float], b: dict[str, float], top: int = 30,
               key: Callable[[str], str] = lambda op: op) -> list[dict[str, Any]]:
  """``a`` minus ``b`` per entry (after ``key``), the ``top`` largest
  differences by size: ``[{"op", "a", "b", "diff"}]``."""
  grouped = [collections.defaultdict(float), collections.defaultdict(float)]
  for table, out in zip((a, b), grouped):
    for op, ms in table.items():
      out[key(op)] += ms
  rows = [{"op": op, "a": round(grouped[0][op], 3), "b": round(grouped[1][op], 3),
           "diff": round(grouped[0][op] - grouped[1][op], 3)}
          for op in set(grouped[0]) | set(grouped[1])]
  return sorted(rows, key=lambda r: -abs(r["diff"]))[:top]


def without_layers_axis(num_layers: int) -> Callable[[str], str]:
  """A :func:`difference` key that drops a leading ``num_layers`` axis from an
  op's shape, so a stacked buffer's write groups with the unrolled value."""
  return lambda op: re.sub(rf"\[{num_layers},", "[", op)


def _rounded_desc(table: dict[str, float]) -> dict[str, float]:
  return {k: round(v, 3) for k, v in sorted(table.items(), key=lambda kv: -kv[1])}
