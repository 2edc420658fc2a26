"""Tests for stacktools/pipeline.py: pipelined stacks against the plain stack.

The multi-device cases need 8 virtual CPU devices, which must be set before
JAX starts, so they run once, together, in a subprocess
(tests/helpers/pipeline_cases.py, started as soon as the tests are collected: see
tests/helpers/background.py) that writes every difference to a JSON file; the tests
here assert on it. The reference there is the same model's plain stack
on one device, ``remat="none"``. What needs no devices (the schedule, the
layouts, partition specs on an abstract mesh, the plain fallback, the
constructor's checks) runs here. That 1F1B's temp memory does not grow with
the microbatches while GPipe's does is checked on the pipeline benchmark's
quick run (benchmarks_test.py: test_pipeline_quick), which compiles both.
"""

import json

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import stacktools as st
from stacktools.pipelines import _stages

import background


@pytest.fixture(scope="module")
def cases():
  """What tests/helpers/pipeline_cases.py wrote; it starts when the tests are
  collected (tests/helpers/background.py)."""
  job = background.result("pipeline_cases").check()
  results = json.loads((job.folder / "cases.json").read_text())
  for name, value in results.items():
    assert "crashed" not in value, f"{name} crashed:\n{value['crashed']}"
  return results


# ---------------------------------------------------------------------------
# Multi-device: loss, gradients, outputs and state against the plain stack.


def test_every_mesh_schedule_and_microbatch_count_matches_the_plain_stack(cases):
  # Each schedule on every mesh, with M < P, M = P and M > P, at M = 4 and 8
  # (pipeline_cases.EQUALITY_RUNS).
  equality = cases["equality"]
  assert sorted(equality) == sorted([
      "pipe:8 gpipe M=4", "pipe:4,data:2 gpipe M=4", "pipe:2,fsdp:2,data:2 gpipe M=8",
      "pipe:8 circular M=4", "pipe:8 circular M=8", "pipe:4,data:2 circular M=8",
      "pipe:2,fsdp:2,data:2 circular M=4"])
  for name, case in equality.items():
    if name == "pipe:8 circular M=4":   # 4 microbatches cannot fill 8 stages twice
      assert "at least as many microbatches as stages" in case["error"]
      continue
    assert case["loss_allclose"] and case["grads_allclose"], (name, case)
    assert case["grad_max_rel"] < 1e-5, (name, case)


def test_each_stage_holds_one_pth_of_the_parameters(cases):
  for name, case in cases["equality"].items():
    if "error" in case:
      continue
    # Every leaf of the test block divides by the FSDP size, so all of it shards.
    assert case["param_fraction"] == pytest.approx(1 / (case["stages"] * case["fsdp"])), name
    if "gpipe" in name:   # gradients come out where their layers live
      assert case["grad_fraction"] == pytest.approx(case["param_fraction"]), name


def test_every_checkpoint_policy_runs_inside_the_stages(cases):
  remat = cases["remat"]
  assert set(remat) == set(st.REMAT_ALIASES) | {"nested2"}
  for name, case in remat.items():
    assert "error" not in case, (name, case)
    assert case["loss_allclose"] and case["grads_allclose"], (name, case)


def test_scan_block_with_per_layer_and_broadcast_arguments(cases):
  scan = cases["scan"]
  assert scan["ys_shape"] == scan["ref_ys_shape"] == [8, 16, 4]
  assert scan["x_allclose"] and scan["ys_allclose"]
  assert scan["loss_allclose"] and scan["grads_allclose"]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb"])
def test_loss_schedules_match_the_plain_stack(cases, schedule):
  one = cases[schedule]
  folds = [k for k in one if k.startswith("pipe")]
  assert "pipe:4,data:2 M=8 remat=full" in folds   # M > P, a data axis
  # Every alias under 1f1b's and zb's backward ("full" on pipe:4,data:2, the
  # others on pipe:2 with M = P); interleaved's is 1f1b's on more chunks
  # (pipeline_cases.ALIAS_SWEEPS).
  small = {k.split("remat=")[1] for k in folds if k.startswith("pipe:2 M=2 ")}
  assert small == (set(st.REMAT_ALIASES) - {"full"} if schedule != "interleaved" else set())
  assert {k.split("remat=")[1] for k in folds} == (
      set(st.REMAT_ALIASES) if schedule != "interleaved" else {"full"})
  for name in folds + ["scan", "rng"]:
    case = one[name]
    assert "error" not in case, (name, case)
    assert case["loss_allclose"] and case["grads_allclose"], (name, case)
    assert case["grad_max_rel"] < 1e-5 and case["loss_rel"] < 1e-5, (name, case)
  scan = one["scan"]   # pipe:2,fsdp:2,data:2; per-layer scale and broadcast bias get gradients
  assert scan["ys_allclose"] and scan["ys_shape"] == scan["ref_ys_shape"] == [8, 16, 4]
  assert scan["bias_grad_nonzero"]
  assert one["rng"]["key_matters"]
  state = one["state"]
  assert state["calls"] == [4] * 8 and state["state_allclose"] and state["loss_allclose"]


@pytest.mark.jax_independent
@pytest.mark.parametrize("schedule,repeats", [("1f1b", 1), ("interleaved", 2),
                                               ("interleaved", 3), ("zb", 1)])
@pytest.mark.parametrize("stages,micro", [(2, 2), (4, 4), (4, 8), (8, 8), (4, 32), (3, 9)])
def test_loss_schedule_tables_bubble_order_buffers_and_in_flight_cap(schedule, repeats,
                                                                     stages, micro):
  """Replays the table: every op once, after what it needs, and every slot it
  reads holds the microbatch it names (so no arrival overwrote one still held)."""
  table = st.Pipeline(microbatches=micro, schedule=schedule, repeats=repeats).table(stages)
  split, virtual = schedule == "zb", stages * repeats
  if split:   # a tick per F, B or W
    assert table.busy.shape == (3 * micro + stages - 1, stages)
    assert table.bubble == pytest.approx((stages - 1) / (3 * micro + stages - 1))
  else:
    assert table.busy.shape == (2 * (repeats * micro + stages - 1), stages)
    assert table.bubble == pytest.approx((stages - 1) / (repeats * micro + stages - 1))
  when, held, cotangents = {}, {}, {}
  for t in range(table.busy.shape[0]):
    for s in np.nonzero(table.busy[t])[0]:
      m, r, slot = (int(a[t, s]) for a in (table.microbatch, table.repeat, table.slot))
      v = r * stages + s
      kind = "W" if split and table.weight[t, s] else "B" if table.backward[t, s] else "F"
      assert (kind, m, v) not in when
      when[(kind, m, v)] = t
      if kind == "F" and v == 0:
        held[(s, slot)] = (m, v)   # embedded here, kept for the backward
      assert held.get((s, slot)) == (m, v), (t, s, kind, m, v)
      if kind != "F" and v < virtual - 1:
        assert cotangents.get((s, slot)) == (m, v), (t, s, kind, m, v)
    for s in range(stages):   # what arrives after the tick, from the neighbours
      for got, store, peer, step in ((table.receive_input, held, (s - 1) % stages, 1),
                                     (table.receive_cotangent, cotangents,
                                      (s + 1) % stages, -1)):
        if got[t, s] >= 0:
          m, r = int(table.microbatch[t, peer]), int(table.repeat[t, peer])
          store[(s, int(got[t, s]))] = (m, r * stages + peer + step)
  assert len(when) == (3 if split else 2) * micro * virtual
  for m in range(micro):
    for v in range(virtual):
      if v:
        assert when[("F", m, v - 1)] < when[("F", m, v)]
      after = ("F", m, v) if v == virtual - 1 else ("B", m, v + 1)
      assert when[after] < when[("B", m, v)]
      if split:
        assert when[("B", m, v)] < when[("W", m, v)]
  # Held inputs per stage, whatever M is: 1F1B's P (ZB-H1's peak is the
  # same); interleaved, the warm-up forwards plus one.
  cap = stages if repeats == 1 else 2 * (stages - 1) + (repeats - 1) * stages + 1
  assert table.slots <= cap


def test_state_is_updated_once_per_microbatch_in_order(cases):
  state = cases["state"]
  assert state["calls"] == [4] * 8     # 4 microbatches through each of 8 layers
  assert state["out_allclose"] and state["state_allclose"]


def test_rng_differs_per_layer_and_per_microbatch_and_is_reproducible(cases):
  rng = cases["rng"]
  assert rng["per_layer_distinct"] and rng["per_microbatch_distinct"]
  assert rng["reproducible"] and rng["key_matters"]
  assert 0.4 < rng["uniform_mean"] < 0.6


@pytest.mark.parametrize("case,phrases", [
    ("layers_not_divisible", ["num_layers=6", "4 stages", "multiple of 4"]),
    ("circular_layers_not_divisible", ["num_layers=12", "2 repeats", "multiple of 8"]),
    ("batch_not_divisible", ["microbatches=3", "(16, 4, 8)", "multiple of"]),
    ("circular_too_few_microbatches", ["microbatches=2", "4 stages", "gpipe"]),
    ("per_depth", ["one checkpoint", "2 per-depth segments"]),
    ("explicit_mesh", ["Explicit", "AxisType.Auto"]),
    ("specs_without_pipe_axis", ["'pipe'", "['data']"]),
    ("specs_not_divisible", ["4 layers", "size 8"]),
    ("ys_without_batch_axis", ["batch as its leading axis", "per-layer shape ()"]),
    ("1f1b_too_few_microbatches", ["microbatches=2 for 4 stages", "1f1b"]),
    ("1f1b_layers_not_divisible", ["num_layers=6", "multiple of 4"]),
    ("1f1b_fold", ["blocks.loss(embed, head, inputs, targets)"]),
    ("interleaved_microbatches_not_multiple",
     ["multiple of the 4 stages", "microbatches=6", "microbatches=4 or 8"]),
    ("interleaved_layers_not_divisible", ["num_layers=12", "2 repeats", "multiple of 8"]),
    ("zb_too_few_microbatches", ["microbatches=3 for 4 stages", "zb"]),
    ("zb_fold", ["schedule='zb' computes the loss", "blocks.loss(embed, head"]),
    ("1f1b_inline_modules", ["creates new Haiku modules", "Construct its modules"]),
])
def test_mistakes_get_a_clear_error(cases, case, phrases):
  message = cases["errors"][case]
  assert message is not None and message.startswith(("ValueError", "TypeError"))
  for phrase in phrases:
    assert phrase in message, (phrase, message)


# ---------------------------------------------------------------------------
# No devices needed.


@pytest.mark.jax_independent
@pytest.mark.parametrize("stages,micro,repeats", [
    (2, 1, 1), (4, 8, 1), (8, 4, 1), (4, 8, 2), (2, 16, 4), (8, 8, 2)])
def test_schedule_bubble_and_every_microbatch_visits_every_chunk_once(stages, micro, repeats):
  schedule = "circular" if repeats > 1 else "gpipe"
  table = st.Pipeline(microbatches=micro, schedule=schedule, repeats=repeats).table(stages)
  assert table.busy.shape == (repeats * micro + stages - 1, stages)
  assert table.bubble == pytest.approx((stages - 1) / (repeats * micro + stages - 1))
  # Walk the table: chunk r*P + s runs microbatch m exactly once, and in
  # order (chunk c before chunk c + 1), which is what makes it the stack.
  when = {}
  for t, s in zip(*np.nonzero(table.busy)):
    key = (int(table.microbatch[t, s]), int(table.repeat[t, s]) * stages + int(s))
    assert key not in when
    when[key] = t
  assert len(when) == micro * repeats * stages
  for m in range(micro):
    ticks = [when[(m, c)] for c in range(repeats * stages)]
    assert ticks == sorted(ticks) and len(set(ticks)) == len(ticks)


def test_stage_layout_round_trips_and_groups_chunks_per_stage():
  @jax.jit   # one program, not one per reshape and swap
  def layouts(layers, batch):
    staged = _stages.to_stages(layers, 4, 2)          # [P, R, K]
    micro = _stages.split_microbatches(batch, 4)
    return (staged, _stages.from_stages(staged), micro,
            _stages.merge_microbatches(micro))

  layers, batch = np.arange(16), np.arange(12)
  staged, unstaged, micro, merged = map(np.asarray, layouts(layers, batch))
  assert staged.shape == (4, 2, 2)
  # Stage 1 holds chunk 1 (layers 2, 3) and chunk 5 (layers 10, 11).
  np.testing.assert_array_equal(staged[1], [[2, 3], [10, 11]])
  np.testing.assert_array_equal(unstaged, layers)
  np.testing.assert_array_equal(micro[1], [1, 5, 9])
  np.testing.assert_array_equal(merged, batch)


@pytest.mark.parametrize("index", [(2,), (1, slice(None), 3), (0, 1)])
def test_buffer_writes_are_at_set_without_a_scatter(index):
  # The tick loops' writes (_stages.put): a dynamic_update_slice, traced
  # indices included, equal to .at[index].set on every element.
  buf = jnp.arange(4 * 3 * 5 * 2, dtype=jnp.float32).reshape(4, 3, 5, 2)
  value = -jnp.ones(buf[index].shape, jnp.float32)
  scalars = [i for i in index if not isinstance(i, slice)]

  def put(b, v, *traced):   # the scalar indices traced, the slices kept
    it = iter(traced)
    return _stages.put(b, v, *(i if isinstance(i, slice) else next(it) for i in index))
  write = jax.jit(put)
  np.testing.assert_array_equal(write(buf, value, *scalars), buf.at[index].set(value))
  text = write.lower(buf, value, *scalars).as_text()
  assert "dynamic_update_slice" in text and "scatter" not in text


def _block(x):
  return x + hk.Linear(x.shape[-1])(jnp.tanh(x))


def test_without_a_pipe_axis_the_pipelined_stack_is_the_plain_stack():
  def make(pipeline):
    return hk.without_apply_rng(hk.transform(lambda x: jnp.sum(st.Stacked(
        lambda: _block, 4, remat="full", pipeline=pipeline, name="h").fold(x) ** 2)))
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 3))
  plain, piped = make(None), make(st.Pipeline(microbatches=4))
  params = plain.init(jax.random.PRNGKey(1), x)
  piped_params = piped.init(jax.random.PRNGKey(1), x)
  jax.tree.map(np.testing.assert_array_equal, params, piped_params)
  expected = jax.grad(plain.apply)(params, x)
  jax.tree.map(np.testing.assert_array_equal, jax.grad(piped.apply)(params, x), expected)
  # A mesh whose pipe axis has size 1 is no pipeline either.
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("pipe", "data"))
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(piped.apply))(params, x)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)


def test_partition_specs_put_the_layers_axis_on_pipe_and_keep_fsdp():
  params = {"h/linear": {"w": np.zeros((8, 6, 16)), "b": np.zeros((8, 16))},
            "h/ln": {"scale": np.zeros((8, 6))},
            "embed": {"embeddings": np.zeros((10, 6))}}
  mesh = AbstractMesh((4, 2), ("pipe", "fsdp"))
  specs = st.stacked_partition_specs(params, mesh, stacked=["h"], pipelined=["h"])
  assert specs == {"h/linear": {"w": P("pipe", None, "fsdp"), "b": P("pipe", "fsdp")},
                   "h/ln": {"scale": P("pipe", "fsdp")},
                   "embed": {"embeddings": P("fsdp", None)}}
  # Not pipelined: the Layers axis stays whole.
  plain = st.stacked_partition_specs(params, mesh, stacked=["h"])
  assert plain["h/linear"]["w"] == P(None, None, "fsdp")


def test_nested_stack_pipelines_its_own_layers_axis():
  params = {"outer/inner/linear": {"w": np.zeros((3, 8, 5))}}
  mesh = AbstractMesh((4,), ("pipe",))
  specs = st.stacked_partition_specs(params, mesh, stacked=["outer", "outer/inner"],
                                     pipelined=["outer/inner"])
  assert specs["outer/inner/linear"]["w"] == P(None, "pipe", None)


@pytest.mark.jax_independent
@pytest.mark.parametrize("kwargs,phrase", [
    (dict(microbatches=0), "microbatches must be an integer >= 1"),
    (dict(schedule="zb-h2"), "not one of ['gpipe', 'circular', '1f1b', 'interleaved', 'zb']"),
    (dict(schedule="gpipe", repeats=2), "use schedule='circular'"),
    (dict(schedule="1f1b", repeats=2), "use schedule='interleaved'"),
    (dict(schedule="zb", repeats=2), "use schedule='interleaved'"),
    (dict(axis=3), "mesh axis name"),
])
def test_pipeline_configuration_errors(kwargs, phrase):
  with pytest.raises((ValueError, TypeError), match=None) as info:
    st.Pipeline(**kwargs)
  assert phrase in str(info.value)


@pytest.mark.jax_independent
@pytest.mark.parametrize("make,shown", [
    (lambda: st.Pipeline(microbatches=0), "microbatches must be an integer >= 1, got 0."),
    (lambda: st.Pipeline(repeats=1.5, schedule="circular"),
     "repeats must be an integer >= 1, got 1.5."),
    (lambda: st.Pipeline(axis=""), "got ''."),
    (lambda: st.Pipeline(axis=3), "got 3."),
    (lambda: st.Pipeline().table(0), "stages must be an int >= 1, got 0."),
])
def test_pipeline_errors_show_the_value(make, shown):
  # microbatches=0 once said "got a int".
  with pytest.raises((TypeError, ValueError)) as info:
    make()
  assert shown in str(info.value), str(info.value)


def _pipelined(axis):
  return hk.without_apply_rng(hk.transform(lambda x: jnp.sum(st.Stacked(
      lambda: _block, 4, remat="full", name="h",
      pipeline=st.Pipeline(axis=axis, microbatches=2)).fold(x) ** 2)))


def test_a_pipeline_axis_the_mesh_lacks_is_an_error():
  # Once it ran as a plain stack, silently.
  x = jnp.ones((4, 3))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("pipe", "data"))
  params = jax.jit(_pipelined("pipee").init)(jax.random.PRNGKey(0), x)   # no mesh: plain
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"^Stacked: st\.Pipeline\(axis='pipee'\) "
                       r"names an axis that the mesh in use lacks: its axes are "
                       r"\['pipe', 'data'\]"):
      jax.jit(jax.grad(_pipelined("pipee").apply))(params, x)
    # The right name runs (a pipe axis of size 1 is the plain stack).
    got = jax.jit(jax.grad(_pipelined("pipe").apply))(params, x)
  w, b = params["h/linear"]["w"], params["h/linear"]["b"]

  def loop(w, b):
    y = x
    for i in range(4):
      y = y + jnp.tanh(y) @ w[i] + b[i]
    return jnp.sum(y ** 2)
  want = jax.jit(jax.grad(loop, (0, 1)))(w, b)   # one program, not one per operation
  np.testing.assert_allclose(got["h/linear"]["w"], want[0], rtol=1e-5)
  np.testing.assert_allclose(got["h/linear"]["b"], want[1], rtol=1e-5)


@pytest.mark.parametrize("kwargs,phrase", [
    (dict(pattern="AB"), "pattern= cannot be pipelined"),
    (dict(reverse=True), "reverse=True cannot be pipelined"),
    (dict(pipeline_obj="x"), "must be an st.Pipeline"),
])
def test_stacked_refuses_what_it_cannot_pipeline(kwargs, phrase):
  pipeline = kwargs.pop("pipeline_obj", st.Pipeline(microbatches=2))
  make = {"A": lambda: _block, "B": lambda: _block} if "pattern" in kwargs else (lambda: _block)

  def f(x):
    return st.Stacked(make, 4, pipeline=pipeline, name="h", **kwargs).fold(x)
  with pytest.raises((ValueError, TypeError)) as info:
    hk.transform(f).init(jax.random.PRNGKey(0), jnp.ones((2, 3)))
  assert phrase in str(info.value)
