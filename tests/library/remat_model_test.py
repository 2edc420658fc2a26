"""Tests for the remat cost model, the few-compile planner and remembered plans.

References are independent of _cost_model.py and the planner (stacktools/planner/):

* the bytes a loop keeps per layer against what each added layer costs in
  compiled temp memory, and the offloaded ones against counting by hand;
* predicted temp memory and FLOPs against compiling every candidate and
  counting the compiled step's jaxpr;
* values and gradients of every plan against a Python loop over sliced
  weights;
* the planner's choice against the rule it states, with its timings replaced
  by fixed ones (so the rule, not the machine's noise, is tested);
* a remembered plan against planning afresh, in this process and another.
"""

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st
from stacktools.core import _jaxpr
from stacktools.planner import _cost_model
from stacktools.planner import _choose
from stacktools.planner import _compile
from stacktools.planner import _results
from stacktools.planner import _search
from stacktools.planner import _stack_info
from stacktools.planner import _trace

# The step planned in this process and in a second one (test_second_process).
STEP_SOURCE = """
import jax, jax.numpy as jnp
import stacktools as st

def layer(carry, w):
  h = st.checkpoint_name(jnp.tanh(carry @ w), "hidden")
  return carry + 0.5 * h

def make_step(num_layers=8, width=16, batch=512):
  ws = 0.3 * jax.random.normal(jax.random.PRNGKey(0), (num_layers, width, width))
  c = jnp.ones((batch, width))
  loss = lambda c, ws: jnp.sum(st.fold(layer, remat="auto")(c, ws) ** 2)
  return jax.grad(loss, (0, 1)), (c, ws)
"""
_namespace: dict = {}
exec(STEP_SOURCE, _namespace)  # pylint: disable=exec-used
layer, make_step = _namespace["layer"], _namespace["make_step"]

L, D, B = 8, 16, 512
CARRY = B * D * 4
# A few candidates of every kind, to keep compiles few.
SOME = ("none", "full", "nested", "save:hidden", "save_all", "none:4,full:4",
        "full:4,nested:4")


def _python_grads(c, ws):
  """``jax.grad`` of the Python loop, jitted (op by op, each operation would
  compile as a program of its own)."""
  def loss(c, ws):
    for i in range(ws.shape[0]):
      c = layer(c, ws[i])
    return jnp.sum(c ** 2)
  return jax.jit(jax.grad(loss, (0, 1)))(c, ws)


# ---------------------------------------------------------------------------
# The model.


@pytest.mark.parametrize("label", ["full", "none", "save:hidden", "save_all", "offload"])
def test_kept_bytes_per_layer_are_what_each_added_layer_costs(label):
  # Compiled at two depths: each added layer adds what the loop keeps of it.
  temp, costs = {}, {}
  for n in (8, 12):
    step, args = make_step(num_layers=n)
    traced = _trace.trace(step, *args)
    remat = _search.candidates(traced.stacks[0])[label]
    costs[n] = traced.models["loop_0"].layers[0].cost(remat)
    temp[n] = _compile.compile_plan(step, args, {"loop_0": remat}).temp_bytes
  assert costs[8] == costs[12]
  cost = costs[8]
  # On a CPU, host memory is the device's: offloaded bytes count too.
  assert (temp[12] - temp[8]) / 4 == cost.kept + cost.host
  assert cost.kept >= (0 if label == "offload" else CARRY)
  # One matmul forward, two backward (carry and weight), 2*B*D*D each.
  assert cost.flops >= 3 * 2 * B * D * D


def test_offloaded_bytes_counted_apart():
  step, args = make_step()
  traced = _trace.trace(step, *args)
  (model,) = traced.models.values()
  cost = model.layers[0].cost(st.REMAT_ALIASES["offload"])
  # The carry goes to host memory; the layer's weight slice is read from
  # the loop's inputs, where it is; nothing stays.
  assert (cost.kept, cost.host) == (0, CARRY)
  # Asked to, the weight slice goes to host memory too.
  cost = model.layers[0].cost(st.CheckpointPolicy(save_carries="offload",
                                                  save_inputs="offload"))
  assert (cost.kept, cost.host) == (0, CARRY + D * D * 4)


@pytest.fixture(scope="module")
def compiled_report():
  step, args = make_step()
  return st.remat_report(step, *args, only=SOME, compile_all=True), step, args


def test_predicted_temp_close_to_compiled(compiled_report):
  report, *_ = compiled_report
  assert report.compiles == len(SOME)
  for row in report.rows:
    (label,) = row.plan.values()
    one_loop = ":" not in label and label != "nested"
    # One-loop plans: what they keep per layer times the layers. Per-depth
    # and nested plans add copies of sliced inputs and their gradients,
    # which XLA does not always make: the model errs high there.
    low, high = (-0.02, 0.02) if one_loop else (-0.02, 0.25)
    assert low <= row.temp_error <= high, (label, row.temp_error)
  reference = next(r for r in report.rows if r.plan == {"loop_0": "full"})
  assert reference.temp_error == 0   # it calibrates the rest


def test_predicted_flops_match_the_compiled_steps_jaxpr(compiled_report):
  report, step, args = compiled_report
  for row in report.rows:
    (label,) = row.plan.values()
    remat = report.remats["loop_0"][label]
    counted = _jaxpr.flops(_results.under(_stack_info.Fixed({"loop_0": remat}), step),
                           *args)
    if ":" in label or label == "nested":
      # Seams add the gradients of slices; chunks recompute a little more.
      assert row.flops == pytest.approx(counted, rel=0.01), label
    else:
      assert row.flops == counted, label


def test_every_plan_computes_the_uncheckpointed_step():
  step, (c, ws) = make_step(num_layers=4, batch=8)
  want = _python_grads(c, ws)
  for label, remat in _search.candidates(_trace.discover(step, c, ws)[0]).items():
    got = jax.jit(_results.under(_stack_info.Fixed({"loop_0": remat}), step))(c, ws)
    # The reference (the Python loop) and the step are two programs: float32
    # sums fused in another order differ by a few parts in 1e5 (up to 4e-5
    # relative on jax 0.12, with the reference run op by op). A wrong plan is
    # off by far more than this.
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=label)


def test_mixed_precision_is_predicted_on_the_side_of_more_memory():
  # A bfloat16 GPT on a CPU was predicted low (none -14.8%, save_all -23.8%):
  # XLA's CPU backend keeps its bfloat16 residuals as float32.
  def mixed(carry, w):
    h = st.checkpoint_name(jnp.tanh(carry.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)),
                           "hidden")
    return carry + 0.5 * h.astype(jnp.float32)

  ws = 0.3 * jax.random.normal(jax.random.PRNGKey(0), (L, D, D))
  c = jnp.ones((B, D))
  step = jax.grad(lambda c, ws: jnp.sum(st.fold(mixed, remat="auto")(c, ws) ** 2), (0, 1))
  report = st.remat_report(step, c, ws, only=("full", "none", "save:hidden", "save_all"),
                           compile_all=True)
  for row in report.rows:
    # Within the planner's margin (counted at bfloat16's bytes on jaxlib
    # 0.10's CPU, which keeps them as float32: none -25%, save_all -46%;
    # counted at float32's on jaxlib 0.12's, which keeps bfloat16: +27%,
    # +73%); the plan returned is compiled to check either way.
    assert abs(row.temp_error) <= _results.MARGIN, (row.plan, row.temp_error, report)
  assert "error" in str(report).splitlines()[1]   # each compiled row says how far off


# ---------------------------------------------------------------------------
# The planner: few compiles, within budget, its rule.


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("measure", [False, True])
def test_plan_fits_in_few_compiles(compiled_report, fraction, measure):
  report, step, args = compiled_report
  temps = {r.plan["loop_0"]: r.temp_bytes for r in report.rows}
  budget = int(temps["full"] + fraction * (temps["none"] - temps["full"]))
  plan = st.plan_remat(step, *args, budget=budget, only=SOME, measure=measure,
                       repeats=2)
  assert plan.report.compiles <= _choose.MAX_COMPILES
  (label,) = plan.labels.values()
  assert temps[label] <= budget
  compiled = jax.jit(plan.wrap(step)).lower(*args).compile()
  assert compiled.memory_analysis().temp_size_in_bytes == temps[label]
  if not measure:   # the fewest FLOPs among the candidates that fit
    fits = [r for r in report.rows if r.temp_bytes <= budget]
    assert plan.report.chosen.flops == min(r.flops for r in fits)


def test_report_with_a_budget_shows_the_planners_choice(compiled_report):
  report, step, args = compiled_report
  budget = next(r.temp_bytes for r in report.rows if r.plan == {"loop_0": "none"})
  planned = st.remat_report(step, *args, budget=budget, only=SOME)
  assert planned.chosen is not None and planned.chosen.memory <= budget
  assert 1 <= planned.compiles <= _choose.MAX_COMPILES
  text = str(planned)
  assert "<- chosen" in text and f"chosen: {planned.decision}" in text
  # What was compiled shows the compiler's figure beside the prediction.
  for row in planned.rows:
    want = next(r for r in report.rows if r.plan == row.plan)
    assert row.predicted_temp_bytes == want.predicted_temp_bytes
    assert row.temp_bytes in (None, want.temp_bytes)


def _fixed_timings(monkeypatch, seconds):
  """Every timed run of plan ``label`` takes ``seconds[label]``."""
  def time_runs(executables, args, repeats, donate_argnums=()):
    del args, donate_argnums
    return [[seconds[labels[id(e)]]] * repeats for e in executables]

  labels = {}
  compile_plan = _compile.compile_plan

  def remembering(step_fn, args, choice, **kw):
    compiled = compile_plan(step_fn, args, choice, **kw)
    (remat,) = choice.values()
    labels[id(compiled.executable)] = next(
        label for label, r in _search.candidates(
            _stack_info.StackInfo("loop_0", L, ("hidden",))).items() if r == remat)
    return compiled

  monkeypatch.setattr(_compile, "time_runs", time_runs)
  monkeypatch.setattr(_compile, "compile_plan", remembering)


@pytest.mark.parametrize("challenger_seconds,chosen", [
    (1.01, "none"),   # within the noise: the fewer FLOPs
    (0.80, "none"),   # faster
    (1.20, "full"),   # slower: the reference
])
def test_timed_choice_follows_its_rule(monkeypatch, challenger_seconds, chosen):
  step, args = make_step()
  _fixed_timings(monkeypatch, {"full": 1.0, "none": challenger_seconds})
  plan = st.plan_remat(step, *args, budget="64MiB", only=("full", "nested", "none"))
  assert plan.labels == {"loop_0": chosen}
  timed = {r.plan["loop_0"] for r in plan.report.rows if r.step_time_s is not None}
  assert timed == {"full", "none"}   # the reference and the fewest FLOPs


def _label_of(remat):
  return next(label for label, r in _search.candidates(
      _stack_info.StackInfo("loop_0", L, ("hidden",))).items() if r == remat)


def test_a_refused_edge_check_leaves_a_compile_for_a_plan_that_fits(monkeypatch):
  # GPT-2-medium at batch 16 on a TPU v5e: the two plans with the fewest FLOPs
  # were predicted at the budget's edge and both refused by XLA; with its
  # compiles spent, the planner fell back to "full" although a plan with
  # fewer FLOPs was predicted well within the budget. Here "none" and
  # "save_all" are put at the edge and refused, "none:4,full:4" fits.
  step, args = make_step()
  predict = _cost_model.predict

  def save_all_like_none(models, choice, **kw):
    if _label_of(choice["loop_0"]) == "save_all":
      return predict(models, {"loop_0": st.REMAT_ALIASES["none"]}, **kw)
    return predict(models, choice, **kw)

  monkeypatch.setattr(_cost_model, "predict", save_all_like_none)
  _fixed_timings(monkeypatch, {"full": 1.0, "none:4,full:4": 0.9})
  remembering = _compile.compile_plan

  def refusing(step_fn, args, choice, **kw):
    if _label_of(choice["loop_0"]) in ("none", "save_all"):
      raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.")
    return remembering(step_fn, args, choice, **kw)

  monkeypatch.setattr(_compile, "compile_plan", refusing)
  full = st.remat_report(step, *args, only=("full", "none")).rows
  budget = next(r.predicted_temp_bytes for r in full if r.plan["loop_0"] == "none")
  plan = st.plan_remat(step, *args, budget=budget, only=SOME)
  by = {r.plan["loop_0"]: r for r in plan.report.rows}
  assert by["none"].out_of_memory          # the one check of the edge
  assert by["save_all"].temp_bytes is None and not by["save_all"].out_of_memory
  assert plan.labels == {"loop_0": "none:4,full:4"}, plan.report.decision
  assert plan.report.compiles == _choose.MAX_COMPILES


def test_a_plan_a_compile_shows_over_the_budget_is_never_returned(monkeypatch,
                                                                   compiled_report):
  # A mixed-precision GPT on a CPU: "none" was predicted surely within the
  # budget (15% under its compiled bytes), returned without a compile, and
  # compiled over it. Here "none" is predicted to keep what "full" keeps.
  report, step, args = compiled_report
  temps = {r.plan["loop_0"]: r.temp_bytes for r in report.rows}
  predict = _cost_model.predict

  def none_like_full(models, choice, **kw):
    if _label_of(choice["loop_0"]) == "none":   # its FLOPs, full's bytes
      full = predict(models, {"loop_0": st.REMAT_ALIASES["full"]}, **kw)
      return dataclasses.replace(predict(models, choice, **kw), saved_bytes=full.saved_bytes,
                                 temp_bytes=full.temp_bytes)
    return predict(models, choice, **kw)

  monkeypatch.setattr(_cost_model, "predict", none_like_full)
  budget = (temps["full"] + temps["none"]) // 2
  plan = st.plan_remat(step, *args, budget=budget, only=("full", "none", "save:hidden"),
                       measure=False)
  by = {r.plan["loop_0"]: r for r in plan.report.rows}
  assert by["none"].temp_bytes == temps["none"] > budget   # compiled to check
  (label,) = plan.labels.values()
  assert label != "none" and temps[label] <= budget, plan.report
  assert plan.report.chosen.temp_bytes == temps[label]   # checked by its compile too


def test_time_runs_passes_over_a_program_the_device_cannot_load():
  calls = []

  def ok(x):
    calls.append("ok")
    return x

  def refused(x):
    raise RuntimeError("RESOURCE_EXHAUSTED: Error loading program 'jit_train_step': "
                       "Attempting to reserve 10.65G at the bottom of memory.")

  x = jnp.ones(3)
  runs = _compile.time_runs([ok, refused, ok], [x], 3, donate_argnums=(0,))
  assert [len(r) for r in runs] == [3, 0, 3] and calls == ["ok"] * 6
  with pytest.raises(RuntimeError, match="INTERNAL"):
    _compile.time_runs([lambda x: (_ for _ in ()).throw(RuntimeError("INTERNAL"))],
                             [x], 1)


def test_a_challenger_that_cannot_be_timed_is_chosen_by_its_flops(monkeypatch):
  # Timing a donating step runs it on copies of the donated arguments: on a
  # full chip a plan within the budget may not load beside them.
  step, args = make_step()
  _fixed_timings(monkeypatch, {"full": 1.0, "none": 2.0})
  fixed = _compile.time_runs

  def none_refused(executables, args, repeats, donate_argnums=()):
    runs = fixed(executables, args, repeats, donate_argnums)
    return [[] if r == [2.0] * repeats else r for r in runs]

  monkeypatch.setattr(_compile, "time_runs", none_refused)
  plan = st.plan_remat(step, *args, budget="64MiB", only=("full", "none"))
  assert plan.labels == {"loop_0": "none"}
  assert plan.report.decision == ("not timed: the device could not run none beside "
                                  "copies of the donated arguments; none has the "
                                  "fewer FLOPs")
  assert plan.report.chosen.step_time_s is None


def test_a_budget_that_leaves_no_room_for_the_arguments_is_refused(monkeypatch):
  step, args = make_step()
  held = sum(a.nbytes for a in args)
  monkeypatch.setattr(_choose, "device_bytes", lambda: held + 2**20 - 1)
  with pytest.raises(ValueError, match=(
      r"budget='1MiB' \(1.00 MiB\) of temp memory does not fit beside the step's "
      rf"arguments: they hold .* of the device's .*, which leaves .* for the step\. "
      r"Pass a budget of at most that")):
    st.plan_remat(step, *args, budget="1MiB", measure=False)
  monkeypatch.setattr(_choose, "device_bytes", lambda: held + 2**20)
  assert st.plan_remat(step, *args, budget="1MiB", measure=False).labels


def test_donated_arguments_leave_their_room_to_the_budget(monkeypatch):
  # A donated argument's buffer becomes an output, and XLA leaves it out of
  # its own check of the program against the device's memory: only what the
  # step keeps (here the carry, not the donated weights) is counted.
  step, (c, ws) = make_step()
  monkeypatch.setattr(_choose, "device_bytes", lambda: c.nbytes + 2**20 - 1)
  with pytest.raises(ValueError, match=(
      r"does not fit beside the step's arguments it does not donate: they hold "
      rf"{c.nbytes / 2**20:.2f} MiB of the device's")):
    st.plan_remat(step, c, ws, budget="1MiB", measure=False, donate_argnums=(1,))
  monkeypatch.setattr(_choose, "device_bytes", lambda: c.nbytes + 2**20)
  assert st.plan_remat(step, c, ws, budget="1MiB", measure=False,
                       donate_argnums=(1,)).labels
  with pytest.raises(ValueError, match="beside the step's arguments: they hold"):
    st.plan_remat(step, c, ws, budget="1MiB", measure=False)


def test_ties_go_to_fewer_flops_then_less_memory():
  row = lambda label, flops, temp, seconds: _results.ReportRow(
      plan={"s": label}, predicted_temp_bytes=temp, saved_bytes=0, flops=flops,
      temp_bytes=temp, step_time_s=seconds)
  rows = (row("a", 10, 100, 1.000), row("b", 8, 300, 1.010), row("c", 8, 200, 1.015),
          row("d", 5, 100, 1.500), row("e", 1, 900, 0.900))
  report = _results.RematReport(stacks=(), rows=rows, compile_seconds=0.0,
                                      remats={"s": {r.plan["s"]: r.plan["s"] for r in rows}})
  # e is over budget; a, b and c tie within the noise; b and c have the
  # fewest FLOPs, and c the less memory.
  assert report.plan(budget=500).labels == {"s": "c"}
  assert report.plan(budget=500, by_time=False).labels == {"s": "d"}


def test_same_inputs_same_plan():
  step, args = make_step()
  plans = [st.plan_remat(step, *args, budget="64MiB", measure=False).labels
           for _ in range(2)]
  assert plans[0] == plans[1]


# ---------------------------------------------------------------------------
# Remembered plans.


def _no_compiles(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("compiled although the plan is remembered")
  monkeypatch.setattr(_compile, "compile_plan", refuse)


def _plan_files(folder):
  return sorted(f for f in os.listdir(folder) if f.startswith("remat_plan-"))


def test_remembered_plan_is_reused(tmp_path, monkeypatch):
  step, args = make_step()
  first = st.plan_remat(step, *args, budget="64MiB", measure=False, cache_dir=tmp_path)
  assert not first.reused and first.cache_path
  assert _plan_files(tmp_path) == [os.path.basename(first.cache_path)]
  _no_compiles(monkeypatch)
  again = st.plan_remat(step, *args, budget="64MiB", measure=False, cache_dir=tmp_path)
  assert again.reused and again.cache_path == first.cache_path
  assert again.labels == first.labels
  assert again.report.chosen.plan == first.report.chosen.plan
  assert str(again.report) == str(first.report)
  with again:
    got = jax.jit(step)(*args)
  np.testing.assert_allclose(got[1], _python_grads(*args)[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change", ["budget", "width", "depth", "only"])
def test_changed_step_or_budget_plans_afresh(tmp_path, change):
  step, args = make_step()
  st.plan_remat(step, *args, budget="64MiB", measure=False, cache_dir=tmp_path)
  options = dict(budget="64MiB", measure=False, cache_dir=tmp_path)
  if change == "budget":
    options["budget"] = "65MiB"
  elif change == "only":
    options["only"] = ["full", "nested"]
  else:
    step, args = make_step(**{"width" if change == "width" else "num_layers": 12})
  plan = st.plan_remat(step, *args, **options)
  assert not plan.reused
  assert len(_plan_files(tmp_path)) == 2


def test_corrupt_file_is_ignored_and_rewritten(tmp_path, monkeypatch):
  step, args = make_step()
  first = st.plan_remat(step, *args, budget="64MiB", measure=False, cache_dir=tmp_path)
  for garbage in ('{"format": 1, "key": ', json.dumps({"format": 1, "labels": {}})):
    with open(first.cache_path, "w", encoding="utf-8") as f:
      f.write(garbage)
    with pytest.warns(UserWarning, match="ignoring the remembered plan .* planning afresh"):
      plan = st.plan_remat(step, *args, budget="64MiB", measure=False,
                           cache_dir=tmp_path)
    assert not plan.reused and plan.labels == first.labels
    with open(first.cache_path, encoding="utf-8") as f:
      assert json.load(f)["labels"] == first.labels   # rewritten whole
  assert _plan_files(tmp_path) == [os.path.basename(first.cache_path)]  # no temp left
  _no_compiles(monkeypatch)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert st.plan_remat(step, *args, budget="64MiB", measure=False,
                         cache_dir=tmp_path).reused


def test_cache_folder_from_the_environment(tmp_path, monkeypatch):
  step, args = make_step()
  monkeypatch.setenv("STACKTOOLS_PLAN_CACHE", str(tmp_path))
  first = st.plan_remat(step, *args, budget="64MiB", measure=False)
  assert os.path.dirname(first.cache_path) == str(tmp_path)
  assert st.plan_remat(step, *args, budget="64MiB", measure=False).reused
  monkeypatch.delenv("STACKTOOLS_PLAN_CACHE")
  assert st.plan_remat(step, *args, budget="64MiB", measure=False).cache_path is None


def test_second_process_reuses_the_plan(tmp_path):
  step, args = make_step()
  first = st.plan_remat(step, *args, budget="64MiB", measure=False, cache_dir=tmp_path)
  code = STEP_SOURCE + f"""
step, args = make_step()
plan = st.plan_remat(step, *args, budget="64MiB", measure=False, cache_dir={str(tmp_path)!r})
print("REUSED", plan.reused, dict(plan.labels))
"""
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True,
                       text=True, check=True, env={**os.environ, "PYTHONPATH": repo},
                       timeout=300).stdout
  assert f"REUSED True {dict(first.labels)}" in out, out


def test_integer_outputs_and_inputs_are_costed():
  # A step with an integer output and an integer per-layer input: no
  # cotangent flows through them; they cost what they keep.
  def step(carry, x):
    w, k = x
    h = layer(carry, w)
    return h * (k + 1).astype(h.dtype), jnp.argmax(h, axis=-1)

  ws = 0.3 * jax.random.normal(jax.random.PRNGKey(0), (4, D, D))
  ks = jnp.arange(4)
  c = jnp.ones((8, D))

  def loss(c, remat):
    carry, ys = st.scan(step, remat=remat)(c, (ws, ks))
    return jnp.sum(carry ** 2) + jnp.sum(ys)

  grad = jax.grad(lambda c: loss(c, "auto"))
  plan = st.plan_remat(grad, c, budget="64MiB", measure=False)
  with plan:
    got = jax.jit(grad)(c)
  np.testing.assert_allclose(got, jax.jit(jax.grad(lambda c: loss(c, "none")))(c), rtol=1e-5)
  full = next(r for r in plan.report.rows if r.plan == {"loop_0": "full"})
  assert full.temp_error == 0 and full.saved_bytes >= 4 * 8 * D * 4


def test_every_process_takes_process_zeros_plan(monkeypatch):
  # Each process plans itself, and a close race may go either way; but all
  # must trace one program. Process 0's choice (here another candidate than
  # this process's) is what every process gets.
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  step, args = make_step()
  mine = st.plan_remat(step, *args, budget="64MiB", measure=False, only=SOME)
  rows = [dict(r.plan) for r in mine.report.rows]
  theirs = next(i for i, labels in enumerate(rows) if labels != mine.labels)
  sent = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all",
                      lambda x: sent.append(int(x)) or np.int32(theirs))
  plan = st.plan_remat(step, *args, budget="64MiB", measure=False, only=SOME)
  assert sent == [rows.index(mine.labels)]          # this process's choice, sent
  assert plan.labels == rows[theirs]                # process 0's, taken
  assert plan.choice == {"loop_0": plan.report.remats["loop_0"][rows[theirs]["loop_0"]]}
