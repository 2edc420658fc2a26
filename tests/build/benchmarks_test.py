"""Smoke tests for benchmarks/: every script runs in --quick mode, so none rots.

Each script's ``main(["--quick", "--results_dir", folder])`` runs (tiny
sizes, seconds) into a temporary results directory, never over the committed
``benchmarks/results``, and its JSON is checked for the keys the README and
the benchmark pages read and for positive numbers. The full runs are not
tests: their numbers are timings and memory of one machine, committed in
``benchmarks/results``. A quick run given no ``--results_dir`` writes into a
scratch folder, and leaves every tracked result as it was.

The quick runs happen one after the other in one process of their own,
started as soon as the tests are collected (tests/helpers/background.py), whose JAX
has one device as this one's has: ``pipeline.py``'s main() starts the script
again with 8, ``decode.py``'s a child under another XLA scheduler, as they
did here. ``init_time.py`` also runs as a user runs it, ``python -m
benchmarks.init_time --quick`` from the repository root, in a subprocess
that cannot import matplotlib: it must print one line, write no PNG, and
write into the scratch folder. ``nanogpt_cpu.py`` runs here, with stand-ins for the two
programs it compares.
"""

import ast
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import background

# The benchmarks are the team's instruments: their published runs use the
# oldest JAX on a CPU and the device's own (pinned) JAX, so .ci/run checks
# them on the oldest JAX only (pytest.ini).
pytestmark = pytest.mark.benchmark_scripts

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
  sys.path.insert(0, str(REPO_ROOT))

from benchmarks import accelerator_decode  # pylint: disable=wrong-import-position
from benchmarks import accelerator_gpt  # pylint: disable=wrong-import-position
from benchmarks import accelerator_offload  # pylint: disable=wrong-import-position
from benchmarks import accelerator_train  # pylint: disable=wrong-import-position
from benchmarks import compile_time  # pylint: disable=wrong-import-position
from benchmarks import decode  # pylint: disable=wrong-import-position
from benchmarks.common import accelerator  # pylint: disable=wrong-import-position
from benchmarks.common import device_profile  # pylint: disable=wrong-import-position
from benchmarks.common import device_runs  # pylint: disable=wrong-import-position
from benchmarks import depth_edits  # pylint: disable=wrong-import-position
from benchmarks.common import harness  # pylint: disable=wrong-import-position
from benchmarks import init_time  # pylint: disable=wrong-import-position
from benchmarks import layer_rules  # pylint: disable=wrong-import-position
from benchmarks import lora  # pylint: disable=wrong-import-position
from benchmarks import memory  # pylint: disable=wrong-import-position
from benchmarks import mixed_layers  # pylint: disable=wrong-import-position
from benchmarks import nanogpt_cpu  # pylint: disable=wrong-import-position
from benchmarks import pipeline  # pylint: disable=wrong-import-position
from benchmarks import remat_plan  # pylint: disable=wrong-import-position
from benchmarks import scan_gap  # pylint: disable=wrong-import-position
from benchmarks import stash_mlp  # pylint: disable=wrong-import-position
from benchmarks import step_time  # pylint: disable=wrong-import-position

COMMON_KEYS = {"benchmark", "question", "command", "quick", "config", "summary",
               "markdown", "environment", "seconds"}


def _positive_number(value):
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and value > 0)


def _quick(module):
  """The folder that ``module.main(["--quick", "--results_dir", folder])``
  wrote into, once main() returned the payload of ``module``'s benchmark
  (their runs start when the tests are collected: tests/helpers/background.py)."""
  name = module.__name__.rsplit(".", 1)[-1]
  done = background.benchmark_outcome(background.result("benchmarks_quick"), name)
  if "error" in done:
    pytest.fail(f"benchmarks/{name}.py's main() raised:\n{done['error']}")
  return done["benchmark"], done["folder"]


def _run(module):
  benchmark, folder = _quick(module)
  assert benchmark == module.NAME
  return _written(module, folder)


def _written(module, tmp_path):
  """The JSON a quick run wrote into ``tmp_path``, checked for the common keys,
  and its plot (where matplotlib is installed)."""
  path = tmp_path / f"{module.NAME}.json"
  assert path.exists(), f"{module.NAME} wrote no JSON in {tmp_path}"
  on_disk = json.loads(path.read_text())
  assert COMMON_KEYS <= set(on_disk), COMMON_KEYS - set(on_disk)
  assert on_disk["benchmark"] == module.NAME
  assert on_disk["quick"] is True
  assert on_disk["environment"]["jax"]
  assert on_disk["markdown"].startswith(("|", "**"))
  png = tmp_path / f"{module.NAME}.png"
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel,unused-import
    assert png.exists() and png.stat().st_size > 0
  except ImportError:
    assert not png.exists()
  return on_disk


def test_memory_quick():
  result = _run(memory)
  rows = result["measurements"]
  assert {(r["impl"], r["policy"]) for r in rows} >= {
      ("stacked", "none"), ("stacked", "full"), ("hk_layer_stack", "full"),
      ("lax_scan", "full"), ("blockseq", "full")}
  for row in rows:
    assert set(row) == {"model", "impl", "policy", "num_layers", "temp_bytes"}
    assert _positive_number(row["temp_bytes"]), row
  for model, guide in result["guide"].items():
    assert _positive_number(guide["C_bytes_analytic"]), model
    for key in ("C_bytes_measured", "I_bytes_measured"):
      assert isinstance(guide[key], float), (model, key)
    assert {p["policy"] for p in guide["predicted"]} == {"none", "full"}
    assert all(_positive_number(p["measured_bytes"]) for p in guide["predicted"])
  # Without remat the step keeps every layer's activations; with it, less.
  by = {(r["impl"], r["policy"], r["num_layers"]): r["temp_bytes"] for r in rows}
  deepest = max(result["config"]["depths"])
  assert by[("stacked", "none", deepest)] > by[("stacked", "full", deepest)]
  assert result["summary"]["gpt"]["order_low_to_high"][-1] == "none"


def test_mixed_layers_quick():
  """benchmarks/mixed_layers.py reports what the README reads."""
  benchmark, folder = _quick(mixed_layers)   # run with --no_plot
  assert benchmark == mixed_layers.NAME
  result = json.loads((folder / "mixed_layers.json").read_text())
  summary = result["summary"]
  assert summary["values_and_gradients"]["met"] is True
  assert summary["values_and_gradients"]["cases"] == 1
  assert summary["compile_cpu"]["ratio"] > 0 and isinstance(summary["compile_cpu"]["met"], bool)
  # 6 and 12 layers: one and two whole periods (fewer than 6 would leave the
  # pattern's global kind without a layer); the full run: 12, 24, 48.
  assert summary["memory_full"]["one_block_carries_per_layer"] == pytest.approx(1.0)
  kv = summary["kv_cache"]
  assert kv["pattern_LLLG_bytes"] < kv["all_global_bytes"]


def test_compile_time_quick():
  result = _run(compile_time)
  rows = result["measurements"]
  assert {r["impl"] for r in rows} == {"stacked", "hk_layer_stack", "blockseq"}
  for row in rows:
    for key in ("trace_s", "compile_s", "total_s", "cpu_total_s"):
      assert _positive_number(row[key]), row
  for clock in ("wall", "cpu"):
    assert _positive_number(result["summary"][clock]["target"]["ratio"])
    assert isinstance(result["summary"][clock]["target"]["met"], bool)


def test_step_time_quick():
  result = _run(step_time)
  assert set(result["seconds_per_step"]) == {
      "stacked/none", "lax_scan/none", "stacked/full", "lax_scan/full"}
  for name, seconds in result["seconds_per_step"].items():
    assert len(seconds) == result["config"]["rounds"], name
    assert all(_positive_number(s) for s in seconds), name
    assert all(_positive_number(s) for s in result["cpu_seconds_per_step"][name]), name
  for clock, key in (("wall", "ratios"), ("cpu", "cpu_ratios")):
    ratios = result[key]
    for policy in ("none", "full"):
      entry = ratios["stacked_over"]["lax_scan"][policy]
      assert _positive_number(entry["median"]) and entry["target"] == 1.03
    assert _positive_number(ratios["over_none"]["full"]["median"])
    assert ratios["over_none"]["full"]["guide_flops_ratio"] == pytest.approx(4 / 3)
    assert isinstance(result["summary"][clock]["targets_missed"], list)
    assert set(result["summary"][clock]["stacked_over_lax_scan"]) == {"none", "full"}


def test_layer_rules_quick():
  result = _run(layer_rules)
  for name in layer_rules.OPTIMIZERS:
    run = result["optimizers"][name]
    assert run["valid_loss"][-1][0] == result["config"]["steps"], name
    assert _positive_number(run["final_valid_loss"]), name
  drop = result["layer_drop"]
  for name in layer_rules.DROPS:
    assert len(drop["seconds_per_step"][name]) == result["config"]["rounds"], name
    assert _positive_number(drop["median_s"][name]), name
  assert _positive_number(result["summary"]["drop_step_time_ratio"])
  assert result["summary"]["best"] in layer_rules.OPTIMIZERS


def test_lora_quick():
  result = _run(lora)
  summary = result["summary"]
  for key, value in summary.items():   # a quick run's fine-tunes may gain nothing
    assert key.startswith("quality") or _positive_number(value), key
  # The 8 stacked adapters add their own bytes and nothing else; the base is
  # in memory once, and the optimizer state is the adapters' alone.
  assert abs(summary["params_over_base_plus_adapters"] - 1) < 0.01
  assert summary["optimizer_state_lora_over_full_gpt2_small"] < 0.02
  temp = result["steps"]["temp_bytes"]
  assert temp["lora"] < temp["full"] * 2 and temp["frozen_base"] < temp["full"]


def test_depth_edits_quick():
  result = _run(depth_edits)
  arms = result["arms"]
  for name in depth_edits.ARMS:
    assert arms[name]["curve"][-1][0] == arms[name]["steps"], name
    assert _positive_number(arms[name]["final_valid_loss"]), name
    assert [r["layer"] for r in result["pruning"][name]["rows"]] == [0, 1, 2, 3]
  # Equal compute, within one step of the 4-layer model.
  assert abs(arms["progressive"]["curve"][-1][1] - arms["scratch"]["curve"][-1][1]) <= 1
  grow = arms["progressive"]["events"]
  assert grow["grow_step"] == result["config"]["grow_at"]
  assert grow["valid_loss_after"] == pytest.approx(grow["valid_loss_before"], rel=1e-6)
  assert 0 < result["summary"]["flops_ratio_2_over_4"] < 1
  assert _positive_number(result["summary"]["seconds_ratio"])


def test_remat_plan_quick():
  result = _run(remat_plan)
  (depth,) = result["depths"]
  labels = {c["label"] for c in depth["candidates"]}
  assert labels == {"none", "full", "none:1,full:1"}
  for cand in depth["candidates"]:
    for key in ("temp_bytes", "predicted_temp_bytes", "flops", "compile_s", "median_s"):
      assert _positive_number(cand[key]), (cand["label"], key)
    assert cand["temp_error"] == pytest.approx(
        cand["predicted_temp_bytes"] / cand["temp_bytes"] - 1)
    assert len(cand["wall_s"]) == len(cand["cpu_s"]) == result["config"]["rounds"]
  # The prediction is calibrated on full's compile.
  assert next(c for c in depth["candidates"] if c["label"] == "full")["temp_error"] == 0
  temp = {c["label"]: c["temp_bytes"] for c in depth["candidates"]}
  # A mix pays a seam's copy of the per-layer inputs, which can put it above
  # both of its policies now that none recomputes elementwise values.
  assert temp["full"] < temp["none:1,full:1"] and temp["full"] < temp["none"], temp
  budgets = depth["budgets"]
  assert [b["fraction"] for b in budgets] == result["config"]["fractions"]
  assert [b["budget_bytes"] for b in budgets] == sorted(b["budget_bytes"] for b in budgets)
  for b in budgets:
    assert temp["full"] <= b["budget_bytes"] < temp["none"]
    assert b["chosen"] in b["fitting"] and b["chosen_by_flops"] in b["fitting"]
    assert set(b["fitting"]) == {n for n, t in temp.items() if t <= b["budget_bytes"]}
    # Compiled under the plan: the chosen candidate's memory, within the budget.
    assert b["within_budget"] and b["chosen_temp_bytes"] == temp[b["chosen"]]
    # Paired by round against every fitting candidate, the chosen one included.
    assert b["ratio"] >= 1.0 and b["ratio_cpu"] >= 1.0
    assert b["fastest_fitting"] in b["fitting"] and b["rank_by_median"] >= 1
    assert isinstance(b["met"], bool) and isinstance(b["met_cpu"], bool)
    assert b["ratio_ci95"][0] <= b["ratio"] <= b["ratio_ci95"][1]
    assert _positive_number(b["copy_ratio"]) and b["verdict"] in (
        "met", "missed, within noise", "missed")
    # Planned in a few compiles, then remembered.
    assert 1 <= b["compiles"] <= 3 and _positive_number(b["planning_seconds"])
    assert b["reused"] and b["reused_same_plan"] and b["reuse_seconds"] < b["planning_seconds"]
  # The chosen step, compiled explicitly and under the plan, timed side by side.
  assert set(depth["identical_programs"]) == {b["chosen"] for b in budgets}
  assert all(_positive_number(c["ratio"]) for c in depth["identical_programs"].values())
  planning = depth["planning"]
  for key in ("predict_seconds", "compile_all_seconds", "one_compile_seconds"):
    assert _positive_number(planning[key]), key
  assert planning["candidates"] == 3
  assert result["summary"]["all_within_budget"] is True
  assert result["summary"]["report_temp_mismatches"] == {}


def test_pipeline_quick():
  # main() runs the script again in a new process: this one's JAX has 1 device.
  result = _run(pipeline)
  assert result["config"]["devices"] == pipeline.NUM_DEVICES
  bubble = result["bubble"]["rows"]
  assert bubble and all(r["exact"] for r in bubble)
  for r in bubble:   # zb's ticks: one per forward, input- or weight-gradient op
    work = 3 * r["M"] if r["schedule"] == "zb" else r["R"] * r["M"]
    assert r["bubble"] == pytest.approx((r["P"] - 1) / (work + r["P"] - 1))
  # Every mesh holds 1/(P*fsdp) of the stack; only Adam's step count stays whole.
  for row in result["resident"]["rows"]:
    assert row["exact_on_split_leaves"], row["mesh"]
    assert row["param_ratio"] == 1 / row["expected_divisor"], row["mesh"]
    whole = {leaf["leaf"] for leaves in row["leaves_not_split"].values() for leaf in leaves}
    assert whole == {"[0].count"}, (row["mesh"], whole)
  rows = {r["schedule"]: r for r in result["compiled"]["rows"]}
  assert set(rows) == {"gpipe", "circular"}
  for row in rows.values():
    assert row["matches_plain"], row
    assert _positive_number(row["temp_bytes"]) and _positive_number(row["plain_temp_bytes"])
    # Microbatches go from stage to stage in both schedules.
    assert row["collectives"]["collective-permute"]["activations"] > 0
  # Only the circular step regroups its parameters.
  assert not any(c["parameters"] for c in rows["gpipe"]["collectives"].values())
  assert rows["circular"]["collectives"]["all-to-all"]["parameters"] > 0
  assert result["summary"]["all_match_plain"] and result["summary"]["bubble_all_exact"]
  assert {r["schedule"] for r in bubble} == {"gpipe", "1f1b", "circular", "interleaved", "zb"}
  # The GPT example against M: 1f1b's temp memory stays, GPipe's grows (the
  # suite's check of 1f1b's memory: were all M microbatches' stage inputs
  # kept, as GPipe keeps them, 1f1b's would grow as GPipe's does).
  example = result["against_m"]
  assert {(r["schedule"], r["microbatches"]) for r in example["rows"]} == {
      (s, m) for s in ("gpipe", "1f1b") for m in (4, 8)}
  assert all(r["matches_plain"] and len(r["wall_seconds"]) == 1 for r in example["rows"])
  assert example["temp_growth"]["1f1b"] <= 1.25 < example["temp_growth"]["gpipe"]


# Stand-ins for the two programs nanogpt_cpu.py runs, which print (nanoGPT)
# and write (ours) in their real formats: each step takes 10 ms in ours and
# 20 ms in nanoGPT, whose iterations with an evaluation take 500 ms.
FAKE_NANOGPT = """
import os, pickle, sys
import numpy as np
args = dict(a[2:].split("=", 1) for a in sys.argv[2:])
assert os.path.isfile(sys.argv[1]) and os.path.isfile("configurator.py")
data = os.path.join("data", args["dataset"])
meta = pickle.load(open(os.path.join(data, "meta.pkl"), "rb"))
ids = np.fromfile(os.path.join(data, "train.bin"), dtype=np.uint16)
assert 0 < ids.max() < meta["vocab_size"] == len(meta["itos"])
every = int(args["eval_interval"])
for it in range(int(args["max_iters"]) + 1):
  if it % every == 0:
    print(f"step {it}: train loss 2.0000, val loss {3 - it / 100:.4f}")
  print(f"iter {it}: loss 2.0000, time {500 if it % every == 0 else 20:.2f}ms, mfu 0.00%")
"""
FAKE_TRAIN = """
import json, os, sys
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
os.makedirs(flags["workdir"])
with open(os.path.join(flags["workdir"], "metrics.jsonl"), "w") as f:
  for step in range(1, int(flags["steps"]) + 1):
    record = {"step": step}
    if step % int(flags["log_every"]) == 0:
      record.update(train_loss=2.0, step_time_s=0.010, tokens_per_s=1.0)
    if step % int(flags["eval_every"]) == 0:
      record["valid_loss"] = 2 - step / 100
    if len(record) > 1:
      f.write(json.dumps(record) + "\\n")
"""


@pytest.mark.jax_independent
def test_nanogpt_cpu_side_by_side_with_stand_ins(tmp_path, monkeypatch):
  nanogpt = tmp_path / "nanoGPT"
  (nanogpt / "config").mkdir(parents=True)
  (nanogpt / "train.py").write_text(FAKE_NANOGPT)
  for name in ("model.py", "configurator.py", "config/train_shakespeare_char.py"):
    (nanogpt / name).write_text("")
  torch = tmp_path / "torch_stand_in"
  torch.mkdir()
  (torch / "torch.py").write_text("__version__ = '0.0'\ndef get_num_threads():\n  return 2\n")
  python = tmp_path / "python"
  python.write_text(f'#!/bin/sh\nPYTHONPATH="{torch}" exec "{sys.executable}" "$@"\n')
  python.chmod(0o755)
  train = tmp_path / "train.py"
  train.write_text(FAKE_TRAIN)
  monkeypatch.setattr(nanogpt_cpu, "TRAIN", train)
  corpus = tmp_path / "text.txt"
  corpus.write_text("the cat sat on the mat. " * 400)
  result = nanogpt_cpu.main(["--quick", "--results_dir", str(tmp_path / "results"),
                             "--nanogpt_dir", str(nanogpt), "--nanogpt_python", str(python),
                             "--data_path", str(corpus), "--rounds", "2", "--no_plot"])
  on_disk = json.loads((tmp_path / "results" / f"{nanogpt_cpu.NAME}.json").read_text())
  assert COMMON_KEYS <= set(on_disk)
  assert [r["round"] for r in result["runs"]["nanogpt"]] == [0, 1]
  summary = result["summary"]
  # Evaluations are left out of nanoGPT's step times, and the first window.
  assert summary["nanogpt"]["median_step_s"] == pytest.approx(0.020)
  assert summary["ours"]["median_step_s"] == pytest.approx(0.010)
  assert summary["ours_over_nanogpt"]["tokens_per_s"] == pytest.approx(2.0)
  assert summary["ours_over_nanogpt"]["per_round"] == pytest.approx([2.0, 2.0])
  steps = result["config"]["ours_flags"]["steps"]
  assert summary["ours"]["final_valid_loss"] == pytest.approx(2 - steps / 100)
  assert summary["nanogpt"]["final_valid_loss"] == pytest.approx(3 - steps / 100)
  assert summary["ours_over_nanogpt"]["valid_loss_no_worse"] is True
  assert "**2.00x**" in result["markdown"]


def test_scan_gap_quick():
  benchmark, folder = _quick(scan_gap)
  name = f"scan_gap_{device_runs.device_slug()}"
  result = json.loads((folder / f"{name}.json").read_text())
  assert COMMON_KEYS <= set(result) and result["benchmark"] == benchmark == name
  # Every stack, remat and unroll at each batch, measured.
  runs = {(r["label"], r["batch"]): r for r in result["gpt"]["runs"]}
  batch = scan_gap.SIZES["quick"]["batches"][0]
  assert set(runs) == {(label, batch) for label, *_ in scan_gap.RUNS}
  for run in runs.values():
    for key in ("step_s", "temp_bytes", "compile_s"):
      assert _positive_number(run[key]), (key, run)
  assert runs[("Stacked, none, unroll=2", batch)]["unroll"] == 2
  # Each profiled pair compared (a CPU's trace has no device line: empty tables).
  assert set(result["gpt"]["profiles"]) == {f"{a} vs {b}" for a, b in scan_gap.PROFILED}
  for pair in result["gpt"]["profiles"].values():
    assert "scanned_minus_unrolled_ms" in pair and len(pair) == 4
  # The init of both stacks, phase by phase; the unrolled one has a leaf per layer.
  init = {r["stack"]: r for r in result["init"]["runs"]}
  assert set(init) == {"scan", "unrolled"}
  for record in init.values():
    assert _positive_number(record["total_s"]), record
  assert init["unrolled"]["leaves"] > init["scan"]["leaves"]
  for ratios in (v for k, v in result["summary"].items() if "/ unrolled" in k):
    assert all(_positive_number(v) for v in ratios.values()), ratios


def test_device_profile_reads_the_compiled_hlo():
  """Each instruction's kind, output shape and whether it holds a matmul,
  from the compiled text; the tables of two programs subtracted."""
  def f(w, x):
    return jnp.tanh(x @ w).sum()
  compiled = jax.jit(jax.grad(f)).lower(jnp.ones((4, 16, 32)), jnp.ones((8, 16))).compile()
  ops = device_profile.hlo_ops(compiled.as_text())
  matmuls = [op for op in ops.values() if op["matmul"]]
  assert matmuls and all(op["shape"].startswith("f32[") for op in matmuls)
  assert not any(op["matmul"] for op in ops.values() if op["opcode"] in ("constant", "parameter"))
  rows = device_profile.difference({"copy -> f32[24,8]": 3.0, "fusion -> f32[8]": 1.0},
                                   {"copy -> f32[8]": 1.0, "fusion -> f32[8]": 1.5},
                                   key=device_profile.without_layers_axis(24))
  assert rows == [{"op": "copy -> f32[8]", "a": 3.0, "b": 1.0, "diff": 2.0},
                  {"op": "fusion -> f32[8]", "a": 1.0, "b": 1.5, "diff": -0.5}]


def test_stash_mlp_quick():
  benchmark, folder = _quick(stash_mlp)
  result = json.loads((folder / "stash_mlp.json").read_text())
  assert COMMON_KEYS <= set(result) and result["benchmark"] == benchmark == "stash_mlp"
  # In float32 every variant's gradients are the loop's: the hand-written
  # backward passes, and the in-place kernels (in interpret mode here).
  assert set(result["float32_check"]) == set(stash_mlp.VARIANTS[1:])
  for variant, error in result["float32_check"].items():
    assert error <= 1e-5, (variant, error)
  runs = {r["label"]: r for r in result["runs"]}
  assert list(runs) == list(stash_mlp.VARIANTS)
  for run in runs.values():
    assert _positive_number(run["step_s"]) and run["grads_error"] <= 5e-2, run


def _accelerator_quick(module):
  """The JSON of one accelerator script's quick run (--small's is the same
  code at larger sizes), checked as every part's; and its sizes."""
  benchmark, folder = _quick(module)
  name = module.PART.result_name()
  assert name == f"{module.NAME}_{device_runs.device_slug()}"
  result = json.loads((folder / f"{name}.json").read_text())
  assert COMMON_KEYS <= set(result) and result["benchmark"] == benchmark == name
  assert result["preset"] == "quick" and result["quick"] is True
  assert result["config"]["rounds"] == 2
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel,unused-import
    assert (folder / f"{name}.png").stat().st_size > 0
  except ImportError:
    pass
  # The page's section: the run, the command, the run's table and the
  # part's, and the plot.
  markdown = result["markdown"]
  assert markdown.startswith("| run | machine | versions | took |")
  assert f"```bash\n{result['command']}\n```" in markdown
  assert markdown.count("|---|") >= 2 and f"results/{name}.png)" in markdown
  assert "failed" not in result[module.PART.name], result[module.PART.name]
  return result, accelerator.SIZES["quick"]


def test_accelerator_gpt_quick():
  result, _ = _accelerator_quick(accelerator_gpt)
  # Every stack and policy, float32 and bfloat16 compute, measured.
  runs = {(r["label"], r["dtype"]): r for r in result["gpt"]["runs"]}
  assert set(runs) == {(label, dtype) for label, _, _ in accelerator_gpt.GPT_RUNS
                       for dtype in accelerator_gpt.DTYPES}
  for run in runs.values():
    for key in ("step_s", "temp_bytes", "compile_s"):
      assert _positive_number(run[key]), (key, run)
    assert len(run["step_s_rounds"]) == result["config"]["rounds"] == 2
  for key, ratios in result["summary"]["gpt"].items():
    assert all(_positive_number(v) for v in ratios.values()), (key, ratios)
  # What the scanned stack without remat keeps is below what save_all keeps.
  for dtype in accelerator_gpt.DTYPES:
    assert (runs[("Stacked, none", dtype)]["temp_bytes"]
            < runs[("Stacked, save_all", dtype)]["temp_bytes"])
  assert "**GPT, one `value_and_grad` step**" in result["markdown"]


def test_accelerator_decode_quick():
  result, sizes = _accelerator_quick(accelerator_decode)
  # Each contender and the floor at each point; in place and sliced decode
  # the same logits.
  rows = result["decode"]["rows"]
  assert [(r["batch"], r["dtype"]) for r in rows] == list(sizes["decode"]["points"])
  assert rows[0]["dtype"] == "float32" and rows[-1]["dtype"] == "bfloat16"
  assert rows[0]["batch"] == rows[-1]["batch"]
  for row in rows:
    assert not row["out_of_memory"], row
    for contender in ("floor",) + accelerator_decode.DECODED:
      assert _positive_number(row[f"{contender}_ms"]), (contender, row)
    assert row["pos"] == row["seq_len"] // 2
    tolerance = 1e-5 if row["dtype"] == "float32" else 1e-2
    assert row["in_place_vs_sliced_max_abs_diff"] <= tolerance, row
    assert row["memory"]["in_place"]["alias_bytes"] >= row["cache_bytes"]   # donated
  assert rows[-1]["cache_bytes"] == rows[0]["cache_bytes"] // 2   # bfloat16
  assert "decode: in place <= 1.2x the floor" in result["summary"]["goals"]
  assert "**Decode, ms per token**" in result["markdown"]


def test_accelerator_offload_quick():
  result, _ = _accelerator_quick(accelerator_offload)
  # Full's gradients, and no link to measure on a CPU.
  part = result["offload"]
  for key in ("mlp", "wide_gpt"):
    for remat in ("full", "offload"):
      assert _positive_number(part[key][remat]["step_s"]), (key, remat)
      assert _positive_number(part[key][remat]["temp_bytes"]), (key, remat)
    assert part[key]["grads_max_abs_diff"] <= 1e-5, part[key]
    assert _positive_number(part[key]["offload_over_full_step"])
  link = part["link"]
  assert link["device_to_host_gb_s"] is None and link["host_to_device_gb_s"] is None
  assert "CPU" in link["why_not"]
  assert "offload MLP: <= 1.15x max(full, transfer)" in result["summary"]["goals"]
  assert "**Offload against full**" in result["markdown"]


def test_accelerator_train_quick():
  result, _ = _accelerator_quick(accelerator_train)
  # Every remat at each batch, tokens/s from its step, no MFU where the
  # device's peak is unknown (a CPU).
  part = result["train"]
  size = part["size"]
  assert part["peak_flops"] is None
  assert {(r["label"], r["batch"]) for r in part["runs"]} == {
      (label, b) for label, _ in accelerator_train.TRAIN_REMATS for b in size["batches"]}
  for run in part["runs"]:
    assert run["tokens_s"] == pytest.approx(run["batch"] * size["seq_len"] / run["step_s"])
    assert run["mfu"] is None and run["attention"] == "xla"
    assert run["flops_per_token"] > 12 * size["layers"] * size["d_model"] * size["seq_len"]
  assert "**The example's train step**" in result["markdown"]


def test_accelerator_records_what_does_not_fit():
  # XLA:TPU's compile-time message, and a run-time allocation's.
  oom = device_runs.out_of_memory(RuntimeError(
      "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
      "space hbm. Used 16.80G of 15.75G hbm. Exceeded hbm capacity by 1.05G."))
  assert oom["bytes_needed"] == int(16.80 * 2**30)
  oom = device_runs.out_of_memory(RuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 6442450944 bytes."))
  assert oom["bytes_needed"] == 6442450944
  assert device_runs.out_of_memory(ValueError("shapes do not match")) is None
  assert device_runs.device_slug("TPU v5 lite") == "tpu_v5_lite"
  assert device_runs.device_slug("NVIDIA H200") == "nvidia_h200"

  # A configuration whose compile runs out of memory is recorded, and the
  # others are still timed.
  def too_big(x):
    raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. "
                       "Used 2.00G of 1.00G hbm.")
  x = jax.numpy.ones(3)
  runs = [device_runs.compile_run({"label": "too big"}, too_big, (x,), None),
          device_runs.compile_run({"label": "fits"}, lambda x: x * 2, (x,), None)]
  device_runs.time_runs(runs, rounds=2, steps=1)
  assert runs[0].record["out_of_memory"]["bytes_needed"] == 2 * 2**30
  assert "step_s" not in runs[0].record and _positive_number(runs[1].record["step_s"])
  assert device_runs.cells(runs[0].record)[0] == "out of memory (2.0 GiB needed)"

  # A batch is halved until its program fits in 80% of the device's memory.
  class Program:
    def __init__(self, batch):
      self.batch = batch

    def memory_analysis(self):
      return type("Stats", (), dict(argument_size_in_bytes=0, output_size_in_bytes=0,
                                    alias_size_in_bytes=0,
                                    temp_size_in_bytes=self.batch * 100))()
  batch, (program, _), tries = device_runs.fit_batch(16, Program, 1000, "test")
  assert batch == program.batch == 8 and [t["batch"] for t in tries] == [16, 8]
  assert device_runs.fit_batch(16, Program, None, "test") == (16, None, [])


def _results_snapshot():
  """``git status`` of benchmarks/results, the folder's listing, and each
  tracked result's hash and modification time."""
  def git(*argv):
    return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout
  results = REPO_ROOT / "benchmarks" / "results"
  files = {}
  for path in filter(None, git("ls-files", "-z", "--", "benchmarks/results").split("\0")):
    full = REPO_ROOT / path
    files[path] = (full.stat().st_mtime_ns, hashlib.sha256(full.read_bytes()).hexdigest())
  return git("status", "--porcelain", "--", "benchmarks/results"), sorted(os.listdir(results)), files


def _in_a_git_work_tree():
  return shutil.which("git") is not None and subprocess.run(
      ["git", "rev-parse", "--is-inside-work-tree"], cwd=REPO_ROOT, capture_output=True,
      check=False).returncode == 0


@pytest.mark.jax_independent
def test_every_script_writes_through_the_harness():
  # The harness chooses the folder (a scratch one for a preset) and writes;
  # an accelerator script hands its part to common/accelerator.py's main(),
  # which does.
  hands_over = (REPO_ROOT / "benchmarks" / "common" / "accelerator.py").read_text()
  assert "harness.parse_args(" in hands_over and "harness.publish(" in hands_over
  for script in sorted((REPO_ROOT / "benchmarks").glob("*.py")):
    text = script.read_text()
    if "def main(" not in text:
      continue
    assert ("harness.parse_args(" in text and "harness.publish(" in text) or (
        "accelerator.main(PART, argv)" in text), script.name
    for writer in (".savefig(", "json.dump(", "write_json(", "save_plot("):
      assert writer not in text.replace("harness.write_json(", ""), (script.name, writer)


def test_init_time_as_a_script_without_matplotlib_leaves_the_published_results_alone(
    tmp_path):
  """``python -m benchmarks.init_time --quick``, as a user runs it from the
  repository root, where
  matplotlib cannot be imported: one line says so, no PNG; and with no
  --results_dir it writes into the scratch folder, leaving every published
  result as it was (git status, the folder's listing, each file's hash and
  modification time)."""
  # A stand-in matplotlib that fails to import, ahead of any installed one.
  shadow = tmp_path / "shadow" / "matplotlib"
  shadow.mkdir(parents=True)
  (shadow / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
  temp = tmp_path / "tmp"   # the scratch folder is <tmp>/stacktools-benchmarks/quick
  temp.mkdir()
  env = dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"), TMPDIR=str(temp))
  git = _in_a_git_work_tree()
  before = _results_snapshot() if git else None
  done = subprocess.run(
      [sys.executable, "-m", "benchmarks.init_time", "--quick"],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  if git:   # without git there is no status to compare
    assert _results_snapshot() == before
  assert harness.NO_MATPLOTLIB in done.stdout.splitlines(), done.stdout[-2000:]
  results = temp / "stacktools-benchmarks" / "quick"
  assert not (results / f"{init_time.NAME}.png").exists()
  result = json.loads((results / f"{init_time.NAME}.json").read_text())
  assert COMMON_KEYS <= set(result) and result["quick"]
  assert {r["impl"] for r in result["measurements"]} == {"stacked", "hk_layer_stack"}
  for row in result["measurements"]:
    for key in ("trace_s", "compile_s", "run_s", "total_s", "cpu_total_s"):
      assert _positive_number(row[key]), row
  assert all(_positive_number(v) for v in result["summary"]["hk_over_stacked"].values())


@pytest.mark.jax_independent
def test_flags_reject_bad_lists():
  with pytest.raises(SystemExit):
    memory.build_parser().parse_args(["--policies", "full,bogus"])
  with pytest.raises(SystemExit):
    compile_time.build_parser().parse_args(["--depths", "4,0"])


def _benchmark_imports(path):
  """The modules of ``benchmarks`` that ``benchmarks/<path>`` imports, named
  as under ``benchmarks/`` (``common.models``, ``decode``)."""
  tree = ast.parse((REPO_ROOT / "benchmarks" / path).read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "benchmarks":
      package = node.module.split(".")[1:]
      names.update(".".join(package + [alias.name]) for alias in node.names)
    elif isinstance(node, ast.Import):
      names.update(a.name.split(".", 1)[1] for a in node.names
                   if a.name.startswith("benchmarks."))
  return names


@pytest.mark.jax_independent
def test_shared_modules_import_one_way():
  # The shared modules import no script, and the measuring and publishing
  # ones know nothing of what they measure.
  common = sorted((REPO_ROOT / "benchmarks" / "common").glob("*.py"))
  assert len(common) > 5
  for path in common:
    imported = _benchmark_imports(f"common/{path.name}")
    assert all(name.startswith("common.") for name in imported), (path.name, imported)
  for name in ("harness", "fast_compile", "instruments", "models", "report",
               "virtual_devices", "meshes", "collectives"):
    assert _benchmark_imports(f"common/{name}.py") == set(), name
  assert _benchmark_imports("common/contenders.py") == {"common.models"}


def test_decode_quick():
  result = _run(decode)
  rows = result["measurements"]
  config = result["config"]
  assert {(r["batch"], r["seq_len"]) for r in rows} == {
      (b, t) for b in config["batches"] for t in config["seq_lens"]}
  for row in rows:
    for name in decode.CONTENDERS:
      assert _positive_number(row[f"{name}_ms"]), (name, row)
    # The in-place and sliced forms decode the same logits.
    assert row["in_place_vs_sliced_max_abs_diff"] < 1e-5, row
    for name in decode.CACHED:
      memory = row["memory"][name]
      assert memory["alias_bytes"] >= row["cache_bytes"], (name, row)   # donated
    # The sliced form stacks a second cache; the in-place one does not.
    assert (row["memory"]["sliced"]["temp_bytes"] - row["memory"]["in_place"]["temp_bytes"]
            >= 0.9 * row["cache_bytes"]), row
  summary = result["summary"]
  assert summary["seq_len"] == max(config["seq_lens"])
  assert set(summary["by_batch"]) == {str(b) for b in config["batches"]}
  assert set(summary["goals"]) == {
      "in_place_within_2x_floor", "8x_faster_than_sliced_at_largest_batch",
      "scanned_within_1.15x_of_unrolled", "temp_at_most_0.15x_cache",
      "temp_at_most_0.15x_cache_memory_ordered", "peak_growth_at_most_1.2x_cache_growth"}
  # The child process ran under XLA:CPU's memory-first scheduler: the same
  # in-place step holds less at once.
  for ordered in result["memory_ordered"]:
    row = next(r for r in rows if (r["batch"], r["seq_len"])
               == (ordered["batch"], ordered["seq_len"]))
    assert _positive_number(ordered["in_place_ms"]) and _positive_number(ordered["floor_ms"])
    assert ordered["temp_bytes"] < row["memory"]["in_place"]["temp_bytes"], (ordered, row)
  assert _positive_number(result["peak"]["peak_growth_over_cache_growth"])
