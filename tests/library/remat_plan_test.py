"""Tests for per-depth policies, the remat report and the planner (remat="auto").

References are independent of _segments.py and the planner (stacktools/planner/):

* values and gradients of ``per_depth`` stacks against the same stack with one
  policy, against ``jax.grad`` of a Python loop over sliced weights, and
  against the BlockSeq twin;
* each report row's compiled temp memory against compiling the step with
  that candidate passed explicitly as ``remat=``, and its predicted FLOPs
  against counting the compiled step's jaxpr;
* FLOPs of a scan against the same loop unrolled in Python.

The cost model's predictions, the few-compile planner and the plan cache are
tested in remat_model_test.py.
"""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st
from stacktools.core import _jaxpr
from stacktools.planner import _budget
from stacktools.planner import _compile
from stacktools.planner import _results
from stacktools.planner import _search
from stacktools.planner import _stack_info
from stacktools.planner import _trace
from stacktools.remat import _segments

L, D, B = 6, 8, 4
RTOL = 1e-5


def _step(carry, w):
  h = st.checkpoint_name(jnp.tanh(carry @ w), "hidden")
  return carry + 0.5 * h


def _weights(n=L, d=D, seed=0):
  return 0.3 * jax.random.normal(jax.random.PRNGKey(seed), (n, d, d))


def _python_loop(carry, ws, reverse=False):
  for i in (reversed(range(ws.shape[0])) if reverse else range(ws.shape[0])):
    carry = _step(carry, ws[i])
  return carry


def _value_and_grad(fold):
  return jax.jit(jax.value_and_grad(lambda c, ws: jnp.sum(fold(c, ws) ** 2), (0, 1)))


# ---------------------------------------------------------------------------
# per_depth in the pure-JAX loops.


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("remat", [
    st.per_depth((2, "none"), (4, "full")),
    st.per_depth((1, "full"), (3, "nested"), (2, "offload")),
    st.per_depth((4, st.CheckpointPolicy(save_block_internals=["hidden"])), (2, "save_all")),
])
def test_per_depth_fold_matches_python_loop(remat, reverse):
  c, ws = jnp.ones((B, D)), _weights()
  value, grads = _value_and_grad(st.fold(_step, remat=remat, reverse=reverse))(c, ws)
  ref_value, ref_grads = _value_and_grad(
      lambda c, ws: _python_loop(c, ws, reverse))(c, ws)
  np.testing.assert_allclose(value, ref_value, rtol=RTOL)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)


def test_per_depth_scan_ys_in_layer_order():
  ws = _weights()
  step = lambda c, w: (_step(c, w), jnp.sum(c))
  for reverse in (False, True):
    _, ys = jax.jit(st.scan(step, remat=st.per_depth((2, "none"), (4, "full")),
                            reverse=reverse))(jnp.ones((B, D)), ws)
    _, ref = jax.jit(st.scan(step, reverse=reverse))(jnp.ones((B, D)), ws)
    np.testing.assert_allclose(ys, ref, rtol=RTOL)


def test_per_depth_counts_must_add_up():
  with pytest.raises(ValueError, match=r"per_depth\(none:2,full:3\) covers 5 "
                     r"layers, but the stack has 6\. Make the segment counts add up to 6"):
    st.fold(_step, remat=st.per_depth((2, "none"), (3, "full")))(jnp.ones((B, D)), _weights())


@pytest.mark.parametrize("segments,error,match", [
    ((), ValueError, r"at least one \(num_layers, remat\) segment"),
    (((0, "full"),), ValueError, r"segment 0 has num_layers=0"),
    (((2, "auto"),), ValueError, r"segment 0 has remat='auto'"),
    (((2, "nest"),), ValueError, r"remat='nest' is not a checkpoint policy"),
    ((("full", 2),), ValueError, r"segment 0 has num_layers='full'"),
    ((3,), TypeError, r"segment 0 is 3; each segment is a pair"),
])
def test_per_depth_bad_segments(segments, error, match):
  with pytest.raises(error, match=match):
    st.per_depth(*segments)


def test_per_depth_nested_outer_checked_per_segment():
  remat = st.per_depth((2, st.CheckpointPolicy(nested=3)), (4, "full"))
  with pytest.raises(ValueError, match=r"nested=3\) asks for 3 outer chunks, but "
                     r"the loop has only 2 steps"):
    st.fold(_step, remat=remat)(jnp.ones((B, D)), _weights())


def test_per_depth_parses_a_spec_string():
  assert st.per_depth("none:2, full:4") == st.per_depth((2, "none"), (4, "full"))
  assert str(st.per_depth("nested:3,offload:1")) == "nested:3,offload:1"
  for bad in ("none", "none:two", "none:2;full:4", "bogus:2"):
    with pytest.raises(ValueError):
      st.per_depth(bad)


def test_per_depth_memory_between_its_policies_give_or_take_a_seam():
  # A carry-heavy stack (wide batch, small weights), where policies differ.
  n, d, b = 8, 16, 1024
  ws = _weights(n, d)
  c = jnp.ones((b, d))

  def temp(remat):
    fn = jax.value_and_grad(lambda c: jnp.sum(st.fold(_step, remat=remat)(c, ws)))
    return jax.jit(fn).lower(c).compile().memory_analysis().temp_size_in_bytes

  none, full = temp("none"), temp("full")
  mixed = temp(st.per_depth((4, "none"), (4, "full")))
  # A seam slices the per-layer inputs: one copy of them, which can put a
  # mix above both of its policies (jax 0.12: 721,240 bytes against 721,048
  # and 656,600); the planner measures it, and its report marks it. Buffer
  # alignment adds a little more (jax 0.12.1: 729,440 against 721,056 and a
  # seam of 8,192).
  seam = ws.size * ws.dtype.itemsize
  alignment = 1024
  assert min(full, none) < mixed <= max(full, none) + seam + alignment, (
      full, mixed, none, seam)


# ---------------------------------------------------------------------------
# per_depth in the Haiku stacks.


class _IndexedBlock(hk.Module):

  def __call__(self, x):
    scale = 1.0 + 0.1 * st.layer_index().astype(jnp.float32)   # the global index
    return x + scale * jnp.tanh(hk.Linear(D, name="lin")(x))


def _stack(cls, remat, reverse=False):
  fn = lambda x: cls(lambda: _IndexedBlock(name="block"), L, remat=remat,
                     reverse=reverse, name="h").fold(x)
  return hk.without_apply_rng(hk.transform(fn))


@pytest.mark.parametrize("reverse", [False, True])
def test_per_depth_stacked_and_blockseq_match_single_policy(reverse):
  x = jax.random.normal(jax.random.PRNGKey(1), (B, D))
  remat = st.per_depth((2, "none"), (1, "nested"), (3, "full"))
  reference = _stack(st.Stacked, "none", reverse)
  params = jax.jit(reference.init)(jax.random.PRNGKey(0), x)
  loss = lambda f: jax.jit(jax.value_and_grad(lambda p: jnp.sum(f.apply(p, x) ** 2)))
  ref_value, ref_grads = loss(reference)(params)
  value, grads = loss(_stack(st.Stacked, remat, reverse))(params)
  np.testing.assert_allclose(value, ref_value, rtol=RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6),
               grads, ref_grads)
  seq_value, seq_grads = loss(_stack(st.BlockSeq, remat, reverse))(
      st.unstack_params(params, "h"))
  np.testing.assert_allclose(seq_value, ref_value, rtol=RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6),
               st.stack_params(seq_grads, "h"), ref_grads)


@pytest.mark.parametrize("cls", [st.Stacked, st.BlockSeq])
def test_per_depth_stack_counts_checked_at_construction(cls):
  with pytest.raises(ValueError, match=rf"{cls.__name__}: st\.per_depth\(none:2,full:2\) "
                     rf"covers 4 layers, but the stack has {L}"):
    _stack(cls, st.per_depth((2, "none"), (2, "full"))).init(
        jax.random.PRNGKey(0), jnp.ones((B, D)))


# ---------------------------------------------------------------------------
# FLOPs that count every layer.


def test_flops_count_a_scan_like_the_unrolled_loop():
  c, ws = jnp.ones((B, D)), _weights()
  grad = lambda fold: jax.grad(lambda c: jnp.sum(fold(c, ws)))
  scanned = _jaxpr.flops(grad(st.fold(_step, remat="full")), c)
  unrolled = _jaxpr.flops(grad(lambda c, ws: _python_loop(c, ws)), c)
  plain_scan = _jaxpr.flops(grad(lambda c, ws: jax.lax.scan(
      lambda c, w: (_step(c, w), None), c, ws)[0]), c)
  no_remat = _jaxpr.flops(grad(st.fold(_step)), c)
  # A scan counts like the loop; no remat recomputes elementwise values
  # only; "full" the forward pass: more than the loop, less than twice.
  assert plain_scan == unrolled
  assert unrolled < no_remat < scanned < 2 * unrolled
  # One matmul per layer forward, one backward (dx only): 2 * 2*B*D*D per layer.
  assert unrolled >= L * 2 * (2 * B * D * D)


# ---------------------------------------------------------------------------
# The report and the planner.


class _TaggedBlock(hk.Module):

  def __call__(self, x):
    h = st.checkpoint_name(jax.nn.gelu(hk.Linear(4 * D, name="fc")(x)), "mlp_hidden")
    return x + st.checkpoint_name(hk.Linear(D, name="out")(h), "mlp_out")


def _auto_step(num_stacks=1):
  def loss(x):
    for i in range(num_stacks):
      x = st.Stacked(lambda: _TaggedBlock(name="block"), L, remat="auto",
                     name=f"h{i}").fold(x)
    return jnp.mean(x ** 2)
  model = hk.without_apply_rng(hk.transform(loss))
  x = jax.random.normal(jax.random.PRNGKey(1), (64, D))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x)   # init needs no plan
  return jax.value_and_grad(model.apply), params, x, model


# Compiling every candidate takes a while; the tests compile these.
SOME = ("none", "full", "nested", "save:mlp_hidden", "none:3,full:3")


@pytest.fixture(scope="module")
def one_stack_report():
  step, params, x, _ = _auto_step()
  report = st.remat_report(step, params, x, offload=True, only=SOME, compile_all=True)
  return report, step, params, x


def test_candidates_found_by_tracing():
  step, params, x, _ = _auto_step()
  (stack,) = _trace.discover(step, params, x)
  assert (stack.key, stack.num_layers) == ("h0", L)
  assert stack.tagged_names == ("mlp_hidden", "mlp_out")
  labels = list(_search.candidates(stack))
  assert labels[:5] == list(st.REMAT_ALIASES)
  assert labels[5:] == [
      "save:mlp_hidden", "save:mlp_out", "save:mlp_hidden+mlp_out",
      "none:2,full:4", "none:3,full:3", "none:4,full:2",
      "full:2,nested:4", "full:3,nested:3", "full:4,nested:2"]
  assert "offload" not in _search.candidates(stack, offload=False)


class _ThreeMatmuls(hk.Module):
  """Keeping ``first`` spares the backward pass one of the two matmuls that
  "full" recomputes (the third's output is not read back)."""

  def __call__(self, x):
    a = st.checkpoint_name(hk.Linear(4 * D, name="fc1")(x), "first")
    b = jnp.tanh(hk.Linear(4 * D, name="fc2")(jnp.tanh(a)))
    return x + 0.1 * hk.Linear(D, name="fc3")(b)


def _auto_seq_step(stack_cls=st.BlockSeq, block=_TaggedBlock):
  """_auto_step's model as one stack of ``stack_cls`` (BlockSeq: unrolled)."""
  def loss(x):
    return jnp.mean(stack_cls(lambda: block(name="block"), L, remat="auto",
                              name="h0").fold(x) ** 2)
  model = hk.without_apply_rng(hk.transform(loss))
  x = jax.random.normal(jax.random.PRNGKey(1), (64, D))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  return jax.value_and_grad(model.apply), params, x, loss


def test_blockseq_auto_is_planned_as_unrolled_layers():
  step, params, x, _ = _auto_seq_step()
  traced = _trace.trace(step, params, x)
  (stack,) = traced.stacks
  assert (stack.key, stack.num_layers, stack.looped) == ("h0", L, False)
  assert stack.tagged_names == ("mlp_hidden", "mlp_out")
  labels = list(_search.candidates(stack))
  # No loop to nest; the mixes in eighths of the depth (6 layers: 1 to 5).
  assert not [label for label in labels if "nested" in label]
  assert [label for label in labels if "," in label and label[0] == "n"] == [
      f"none:{k},full:{L - k}" for k in range(1, L)]
  # A mix costs its segments' layers and nothing at the seam, unlike a
  # Stacked mix, whose segments copy their slices of the stacked inputs.
  model = traced.models["h0"]
  none, full = (model.layer_cost(st.REMAT_ALIASES[a]) for a in ("none", "full"))
  mix = st.per_depth((2, "none"), (4, "full"))
  assert model.cost(mix).kept == 2 * none.kept + 4 * full.kept
  stacked = _trace.trace(*_auto_seq_step(st.Stacked)[:3]).models["h0"]
  assert stacked.cost(mix).kept > 2 * none.kept + 4 * full.kept
  # Each compiled row is the step compiled with its remat given to BlockSeq.
  report = st.remat_report(step, params, x, only=("none", "full", "none:3,full:3"),
                           compile_all=True)
  for row in report.rows:
    remat = report.remats["h0"][row.plan["h0"]]
    direct = jax.value_and_grad(hk.without_apply_rng(hk.transform(
        lambda x, remat=remat: jnp.mean(st.BlockSeq(
            lambda: _TaggedBlock(name="block"), L, remat=remat, name="h0").fold(x) ** 2))).apply)
    want = jax.jit(direct).lower(params, x).compile().memory_analysis().temp_size_in_bytes
    assert row.temp_bytes == want, row


@pytest.mark.parametrize("stack_cls, challenger", [
    (st.BlockSeq, "none:4,full:2"),   # unrolled: a mix is one program
    (st.Stacked, "save:first"),       # a loop per segment: one loop preferred
])
def test_the_challenger_is_the_fewest_flops_among_one_program_plans(stack_cls, challenger):
  step, params, x, _ = _auto_seq_step(stack_cls, _ThreeMatmuls)
  plan = st.plan_remat(step, params, x, budget="64MiB", measure=True, repeats=1,
                       only=("full", "save:first", "none:4,full:2"))
  by = {r.plan["h0"]: r for r in plan.report.rows}
  assert by["none:4,full:2"].flops < by["save:first"].flops < by["full"].flops
  # Timed against "full" (the reference).
  assert sorted(label for label, r in by.items() if r.step_time_s) == sorted(
      ["full", challenger]), plan.report
  # Planned and run: the gradients of the step without checkpointing.
  with plan:
    value, grads = jax.jit(step)(params, x)
  ref_value, ref_grads = jax.jit(jax.value_and_grad(hk.without_apply_rng(hk.transform(
      lambda x: jnp.mean(stack_cls(lambda: _ThreeMatmuls(name="block"), L,
                                   name="h0").fold(x) ** 2))).apply))(params, x)
  np.testing.assert_allclose(value, ref_value, rtol=RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads, ref_grads)


class _SmallResidual(hk.Module):
  """A residual MLP whose branch starts small, so 128 of them stay finite."""

  def __call__(self, x):
    h = jnp.tanh(hk.Linear(4 * D, name="fc")(x))
    return x + 0.1 * hk.Linear(D, name="out")(h)


def _deep_step(num_layers, pattern=None):
  """A value-and-grad step of a deep, narrow stack (small layers, so the
  carries are what a nested split changes), with ``remat="auto"``."""
  def loss(x):
    block = lambda: _SmallResidual(name="block")
    blocks = {"a": block, "b": block} if pattern else block
    x = st.Stacked(blocks, num_layers, pattern=pattern, remat="auto", name="h").fold(x)
    return jnp.mean(x ** 2)
  model = hk.without_apply_rng(hk.transform(loss))
  x = jax.random.normal(jax.random.PRNGKey(1), (256, D))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  return jax.value_and_grad(model.apply), params, x, model


def test_deep_stacks_are_offered_a_third_level_that_keeps_fewer_carries():
  step, params, x, model = _deep_step(64)
  (stack,) = _trace.discover(step, params, x)
  assert "nested(4,4)" in _search.candidates(stack)      # 4 + 4 + 4 carries
  assert not any(label.startswith("nested(") for label in _search.candidates(
      dataclasses.replace(stack, num_layers=16)))           # too shallow to pay
  report = st.remat_report(step, params, x, only=["nested", "nested(4,4)"],
                           compile_all=True)
  rows = {row.plan["h"]: row for row in report.rows}
  assert rows["nested(4,4)"].temp_bytes < rows["nested"].temp_bytes
  for row in rows.values():   # the cost model predicts the third level too
    assert abs(row.predicted_temp_bytes / row.temp_bytes - 1) < 0.1, row
  # It computes the un-checkpointed step.
  want = jax.jit(_results.under(_stack_info.Fixed({"h": "none"}), step))(params, x)
  three_levels = _stack_info.Fixed({"h": st.CheckpointPolicy(nested=(4, 4))})
  got = jax.jit(_results.under(three_levels, step))(params, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_patterns_third_level_splits_its_periods():
  # 128 layers of pattern "ab" loop over 64 periods: the split is 64's.
  step, params, x, _ = _deep_step(128, pattern="ab")
  (stack,) = _trace.discover(step, params, x)
  assert (stack.num_layers, stack.period) == (128, 2)
  assert "nested(4,4)" in _search.candidates(stack)
  plan = _stack_info.Fixed({"h": _search.candidates(stack)["nested(4,4)"]})
  want = jax.jit(_results.under(_stack_info.Fixed({"h": "none"}), step))(params, x)
  got = jax.jit(_results.under(plan, step))(params, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_report_rows_and_table(one_stack_report):
  report, *_ = one_stack_report
  assert [row.plan["h0"] for row in report.rows] == list(SOME)
  text = str(report)
  assert "predicted MiB" in text and "compiled MiB" in text and "none:3,full:3" in text
  assert report.compiles == len(SOME)
  with pytest.raises(ValueError, match=r"only=\['bogus'\] keeps no candidate"):
    st.remat_report(*one_stack_report[1:], only=["bogus"])


def test_report_marks_a_mix_above_both_of_its_policies():
  # Hand-made rows: the mark follows from the numbers alone.
  def row(label, temp):
    return _results.ReportRow({"h": label}, predicted_temp_bytes=temp,
                                    saved_bytes=temp, flops=1.0, temp_bytes=temp,
                                    xla_flops=1.0, bytes_accessed=1.0)
  rows = (row("none", 100), row("full", 50), row("nested", 30),
          row("none:3,full:3", 120), row("full:3,nested:3", 40))
  report = _results.RematReport(stacks=(), rows=rows, compile_seconds=1.0)
  lines = {line.split()[0]: line for line in str(report).splitlines()[2:]}
  assert lines["none:3,full:3"].endswith("above none and full"), lines
  assert not [k for k, line in lines.items() if "above" in line and k != "none:3,full:3"], lines


def test_joint_plans_fall_back_to_uniform():
  few = {"a": {"none": 0, "full": 1}, "b": {"none": 0, "full": 1}}
  assert len(_search.joint_plans(few)) == 4
  many = {k: {f"c{i}": i for i in range(9)} for k in "ab"}   # 81 pairs
  plans = _search.joint_plans(many)
  assert plans == [{"a": f"c{i}", "b": f"c{i}"} for i in range(9)]


@pytest.mark.parametrize("label", ["none", "full", "nested", "save:mlp_hidden",
                                   "none:3,full:3"])
def test_report_memory_is_the_candidates_compiled_memory(one_stack_report, label):
  report, _, params, x = one_stack_report
  remat = _search.candidates(report.stacks[0])[label]
  loss = lambda x: jnp.mean(st.Stacked(lambda: _TaggedBlock(name="block"), L,
                                          remat=remat, name="h0").fold(x) ** 2)
  direct = jax.value_and_grad(hk.without_apply_rng(hk.transform(loss)).apply)
  want = jax.jit(direct).lower(params, x).compile().memory_analysis().temp_size_in_bytes
  row = next(r for r in report.rows if r.plan["h0"] == label)
  assert row.temp_bytes == want
  # Predicted from one layer's FLOPs times the layers: what counting the
  # whole step's jaxpr gives (a nested loop's chunking aside).
  assert row.flops == pytest.approx(_jaxpr.flops(direct, params, x), rel=0.01)


def test_report_orders_the_classic_trade(one_stack_report):
  report, *_ = one_stack_report
  by = {row.plan["h0"]: row for row in report.rows}
  assert by["full"].temp_bytes < by["none"].temp_bytes
  assert by["none"].flops < by["full"].flops < by["nested"].flops


def test_plan_chooses_fewest_flops_within_budget(one_stack_report):
  report, step, params, x = one_stack_report
  by = {row.plan["h0"]: row for row in report.rows}
  budget = (by["full"].temp_bytes + by["none"].temp_bytes) // 2
  plan = report.plan(budget=budget, by_time=False)
  fits = [r for r in report.rows if r.temp_bytes <= budget]
  chosen = plan.report.chosen
  assert chosen.temp_bytes <= budget
  assert chosen.flops == min(r.flops for r in fits)
  assert plan.labels == dict(chosen.plan)
  # Traced under the plan, the step compiles to the chosen candidate's memory.
  with plan:
    compiled = jax.jit(step).lower(params, x).compile()
  assert compiled.memory_analysis().temp_size_in_bytes == chosen.temp_bytes
  wrapped = jax.jit(plan.wrap(step)).lower(params, x).compile()
  assert wrapped.memory_analysis().temp_size_in_bytes == chosen.temp_bytes
  # And computes what the step computes with any fixed policy.
  with plan:
    value, grads = jax.jit(step)(params, x)
  with _segments.plan_context(_stack_info.Fixed({"h0": "none"})):
    ref_value, ref_grads = jax.jit(lambda p, x: step(p, x))(params, x)
  np.testing.assert_allclose(value, ref_value, rtol=RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads, ref_grads)


def test_budget_below_every_candidate(one_stack_report):
  report, step, params, x = one_stack_report
  smallest = min(r.temp_bytes for r in report.rows)
  with pytest.raises(ValueError, match=rf"No remat plan fits budget='1KiB'.*smallest "
                     rf"compiled temp memory is .*\({smallest} bytes\), with plan"):
    report.plan(budget="1KiB", by_time=False)


def test_auto_outside_a_plan_says_how_to_make_one():
  step, params, x, _ = _auto_step()
  with pytest.raises(ValueError, match=r"remat='auto' needs a plan.*st\.plan_remat"):
    jax.jit(step)(params, x)


def test_two_stacks_planned_jointly_and_measured():
  step, params, x, _ = _auto_step(num_stacks=2)
  plan = st.plan_remat(step, params, x, budget="64MiB", measure=True, repeats=1,
                       only=("none", "full"))
  assert sorted(plan.labels) == ["h0", "h1"]
  rows = plan.report.rows
  assert sorted(tuple(r.plan.values()) for r in rows) == [
      ("full", "full"), ("full", "none"), ("none", "full"), ("none", "none")]
  # Timed: the reference (both full) and the fewest FLOPs that fit (both none).
  timed = {tuple(r.plan.values()): r.step_time_s for r in rows if r.step_time_s}
  assert sorted(timed) == [("full", "full"), ("none", "none")]
  assert all(t > 0 for t in timed.values())
  assert tuple(plan.labels.values()) in timed
  assert plan.report.chosen.flops <= max(r.flops for r in rows)


def test_a_candidate_the_device_cannot_hold_is_passed_over(monkeypatch):
  # On a TPU, XLA refuses to compile a program that does not fit the chip's
  # memory; the planner once stopped there. Here "none" is refused so.
  compile_plan = _compile.compile_plan

  def refusing(step_fn, args, choice, **kwargs):
    if any(getattr(r, "disable", False) for r in choice.values()):
      raise RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran "
                         "out of memory in memory space hbm. Used 15.76G of 15.75G hbm.")
    return compile_plan(step_fn, args, choice, **kwargs)

  monkeypatch.setattr(_compile, "compile_plan", refusing)
  step, params, x, _ = _auto_step()
  plan = st.plan_remat(step, params, x, budget="64MiB", measure=True, repeats=1,
                       only=("none", "full"))
  by = {r.plan["h0"]: r for r in plan.report.rows}
  assert by["none"].out_of_memory and by["none"].temp_bytes is None, by["none"]
  assert plan.labels == {"h0": "full"}, plan.report.decision
  assert plan.report.decision == "no plan with fewer FLOPs fits"
  assert "out of memory" in str(plan.report)
  # Any other error is not taken for a plan that does not fit.
  monkeypatch.setattr(_compile, "compile_plan",
                      lambda *a, **k: (_ for _ in ()).throw(RuntimeError("INTERNAL: bug")))
  with pytest.raises(RuntimeError, match="INTERNAL: bug"):
    st.plan_remat(step, params, x, budget="64MiB", measure=True, repeats=1,
                  only=("none", "full"))


def test_pure_loops_keyed_by_trace_order():
  ws = _weights()
  def step(c):
    c = st.fold(_step, remat="auto")(c, ws)
    return jnp.sum(st.fold(_step, remat="auto")(c, ws))
  c = jnp.ones((B, D))
  assert [s.key for s in _trace.discover(jax.grad(step), c)] == ["loop_0", "loop_1"]
  plan = st.plan_remat(jax.grad(step), c, budget=10**9, measure=False,
                       only=("full", "nested"))
  with plan:
    got = jax.jit(jax.grad(step))(c)
  np.testing.assert_allclose(got, jax.jit(jax.grad(lambda c: jnp.sum(
      _python_loop(_python_loop(c, ws), ws))))(c), rtol=RTOL)


@pytest.mark.parametrize("budget,expected", [
    (1000, 1000), ("48MiB", 48 * 2**20), ("1.5GB", 1_500_000_000), ("2 KiB", 2048)])
def test_parse_bytes(budget, expected):
  assert _budget.parse_bytes(budget) == expected


@pytest.mark.parametrize("budget", ["48 parsecs", "", "MiB", 0, -5, True])
def test_parse_bytes_refuses(budget):
  with pytest.raises((ValueError, TypeError)):
    _budget.parse_bytes(budget)


# ---------------------------------------------------------------------------
# Donated arguments: the planner compiles the step that trains.


def _sgd_step():
  """A train step that returns its new parameters (donated when it runs)."""
  grad_step, params, x, _ = _auto_step()

  def train_step(params, x):
    loss, grads = grad_step(params, x)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss
  return train_step, params, x


def test_donated_arguments_are_planned_as_the_step_donates_them():
  train_step, params, x = _sgd_step()
  plan = st.plan_remat(train_step, params, x, budget="64MiB", measure=True, repeats=2,
                       only=("none", "full"), donate_argnums=(0,))
  # Each compiled candidate's temp memory is that of the donating step.
  compiled_rows = [row for row in plan.report.rows if row.temp_bytes is not None]
  assert len(compiled_rows) == 2, plan.report
  for row in compiled_rows:
    choice = {k: plan.report.remats[k][label] for k, label in row.plan.items()}
    step = _results.under(_stack_info.Fixed(choice), train_step)
    donating = jax.jit(step, donate_argnums=(0,)).lower(params, x).compile()
    keeping = jax.jit(step).lower(params, x).compile()
    assert row.temp_bytes == donating.memory_analysis().temp_size_in_bytes, row
    # ... which is not the temp of the step that keeps its arguments.
    assert row.temp_bytes != keeping.memory_analysis().temp_size_in_bytes, row
  # The timed runs donated copies: the caller's parameters are still there.
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(params))
  # What a plan without donation compiled differs (the planner keeps them apart).
  keeping_plan = st.plan_remat(train_step, params, x, budget="64MiB", measure=False,
                               only=("full",))
  donating_plan = st.plan_remat(train_step, params, x, budget="64MiB", measure=False,
                                only=("full",), donate_argnums=0)
  assert keeping_plan.report.rows[0].temp_bytes != donating_plan.report.rows[0].temp_bytes


def test_donate_argnums_that_name_no_argument_are_refused():
  train_step, params, x = _sgd_step()
  with pytest.raises(ValueError, match=r"st.plan_remat: donate_argnums=\(2,\) names \[2\], "
                     r"but the step is given 2 arguments: give the positions \(0 to 1\)"):
    st.plan_remat(train_step, params, x, budget="64MiB", measure=False,
                  only=("full",), donate_argnums=(2,))
