"""Pipelined stacks on 8 virtual CPU devices, against the plain stack on one.

Run by tests/library/pipeline_test.py in a subprocess (the device count must be set
before JAX starts): ``python tests/helpers/pipeline_cases.py OUT.json``. Each case
computes the pipelined result and its independent reference and writes the
differences; the test asserts on them.

The reference is always the same model's plain stack (no pipeline, no mesh,
``remat="none"``), jitted on one device: ``jax.value_and_grad`` of the
un-checkpointed function.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import haiku as hk  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import Mesh, NamedSharding  # pylint: disable=wrong-import-position

import stacktools as st  # pylint: disable=wrong-import-position

BATCH, SEQ, WIDTH = 16, 4, 8
MESHES = {"pipe:8": {"pipe": 8}, "pipe:4,data:2": {"pipe": 4, "data": 2},
          "pipe:2,fsdp:2,data:2": {"pipe": 2, "fsdp": 2, "data": 2}}


def make_mesh(sizes: dict[str, int]) -> Mesh:
  devices = np.asarray(jax.devices()[:int(np.prod(list(sizes.values())))])
  return Mesh(devices.reshape(tuple(sizes.values())), tuple(sizes))


class Block(hk.Module):
  """A residual MLP with a LayerNorm: per-example, so microbatching is exact."""

  def __call__(self, x, scale=None, bias=None):
    h = hk.LayerNorm(-1, True, True)(x)
    h = hk.Linear(2 * WIDTH)(h)
    if scale is not None:
      h = h * scale
    h = hk.Linear(WIDTH)(jax.nn.gelu(h))
    if bias is not None:
      h = h + bias
    return x + h


def model(num_layers: int, pipeline, remat="full"):
  def loss(x):
    y = st.Stacked(Block, num_layers, remat=remat, pipeline=pipeline, name="h").fold(x)
    return jnp.mean(jnp.square(y)) + jnp.mean(y)
  return hk.without_apply_rng(hk.transform(loss))


def inputs(seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), (BATCH, SEQ, WIDTH))


def max_rel(a, b) -> float:
  """Largest |a - b| over the reference's largest magnitude, per leaf."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)))
  return worst


def allclose(a, b, rtol=1e-5) -> bool:
  """Elementwise ``|a - b| <= rtol * |b| + rtol * max|b|`` on every leaf."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if not np.all(np.abs(x - y) <= rtol * np.abs(y) + rtol * np.max(np.abs(y))):
      return False
  return True


def sharded(params, mesh, pipelined=True):
  specs = st.stacked_partition_specs(params, mesh, stacked=["h"],
                                     pipelined=["h"] if pipelined else ())
  return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def per_device_fraction(tree) -> float:
  total = sum(a.nbytes for a in jax.tree.leaves(tree))
  local = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))
  return local / total


def reference(num_layers: int, x):
  plain = model(num_layers, None, remat="none")
  params = plain.init(jax.random.PRNGKey(0), x)
  loss, grads = jax.jit(jax.value_and_grad(plain.apply))(params, x)
  return params, loss, grads


#: (mesh, schedule, microbatches) of equality_cases: each schedule on every
#: mesh, with fewer microbatches than stages (M < P; for circular, an error),
#: as many (M = P) and more (M > P), at M = 4 and 8. (The schedules' tables
#: themselves are checked for a grid of (P, M, repeats) in pipeline_test.py,
#: without devices.)
EQUALITY_RUNS = (
    ("pipe:8", "gpipe", 4), ("pipe:4,data:2", "gpipe", 4),
    ("pipe:2,fsdp:2,data:2", "gpipe", 8),
    ("pipe:8", "circular", 4), ("pipe:8", "circular", 8),
    ("pipe:4,data:2", "circular", 8), ("pipe:2,fsdp:2,data:2", "circular", 4),
)


def equality_cases() -> dict:
  """Meshes x schedules x microbatches (EQUALITY_RUNS): loss and gradients
  against the plain stack."""
  out = {}
  x = inputs()
  num_layers = 16
  params, ref_loss, ref_grads = reference(num_layers, x)
  for mesh_name, schedule, micro in EQUALITY_RUNS:
    sizes = MESHES[mesh_name]
    mesh = make_mesh(sizes)
    repeats = 2 if schedule == "circular" else 1
    name = f"{mesh_name} {schedule} M={micro}"
    pipe = st.Pipeline(microbatches=micro, schedule=schedule, repeats=repeats)
    piped = model(num_layers, pipe)
    try:
      with jax.set_mesh(mesh):
        p = sharded(params, mesh)
        loss, grads = jax.jit(jax.value_and_grad(piped.apply))(p, x)
      out[name] = {"loss": float(loss), "ref_loss": float(ref_loss),
                   "grad_max_rel": max_rel(grads, ref_grads),
                   "grads_allclose": allclose(grads, ref_grads),
                   "loss_allclose": allclose(loss, ref_loss),
                   "param_fraction": per_device_fraction(p),
                   "grad_fraction": per_device_fraction(grads),
                   "stages": sizes["pipe"], "fsdp": sizes.get("fsdp", 1)}
    except ValueError as e:
      out[name] = {"error": str(e)}
  return out


def remat_cases() -> dict:
  """Every alias (and nested with 2 outer chunks) inside the stages.

  On pipe:2,fsdp:2,data:2 with gpipe, each stage runs 4 of the 8 layers, so
  ``nested`` has a loop to split.
  """
  out = {}
  x = inputs()
  params, ref_loss, ref_grads = reference(8, x)
  mesh = make_mesh(MESHES["pipe:2,fsdp:2,data:2"])
  for remat in list(st.REMAT_ALIASES) + ["nested2"]:
    spec = st.CheckpointPolicy(nested=2) if remat == "nested2" else remat
    piped = model(8, st.Pipeline(microbatches=4), spec)
    try:
      with jax.set_mesh(mesh):
        loss, grads = jax.jit(jax.value_and_grad(piped.apply))(sharded(params, mesh), x)
      out[str(remat)] = {"loss_allclose": allclose(loss, ref_loss),
                         "grads_allclose": allclose(grads, ref_grads),
                         "grad_max_rel": max_rel(grads, ref_grads)}
    except Exception as e:  # pylint: disable=broad-except
      out[str(remat)] = {"error": f"{type(e).__name__}: {e}"[:500]}
  return out


class ScanBlock(hk.Module):
  """A scan block: returns ``(x, y)`` with a per-example ``y``; takes a per-layer
  scale and a broadcast bias."""

  def __call__(self, x, scale, bias):
    new_x = Block()(x, scale, bias)
    return new_x, jnp.sum(new_x * x, axis=-1) + st.layer_index()


def scan_case() -> dict:
  """A scan block with per_layer and broadcast arguments: x, ys and grads."""
  num_layers = 8
  x = inputs()
  scale = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(5), (num_layers, 2 * WIDTH))
  bias = 0.1 * jax.random.normal(jax.random.PRNGKey(6), (WIDTH,))

  def make(pipeline):
    def f(x, scale, bias):
      x, ys = st.Stacked(ScanBlock, num_layers, remat="full", pipeline=pipeline,
                         name="h").scan(x, st.per_layer(scale), bias)
      return jnp.mean(x ** 2) + jnp.mean(jnp.sin(ys)), (x, ys)
    return hk.without_apply_rng(hk.transform(f))

  plain = make(None)
  params = plain.init(jax.random.PRNGKey(0), x, scale, bias)
  grad = lambda m: jax.jit(jax.value_and_grad(m.apply, argnums=(0, 2, 3), has_aux=True))  # noqa: E731
  (ref_loss, (ref_x, ref_ys)), ref_grads = grad(plain)(params, x, scale, bias)
  mesh = make_mesh(MESHES["pipe:4,data:2"])
  piped = make(st.Pipeline(microbatches=4, schedule="gpipe"))
  with jax.set_mesh(mesh):
    (loss, (px, pys)), grads = grad(piped)(sharded(params, mesh), x, scale, bias)
  return {"x_allclose": allclose(px, ref_x), "ys_allclose": allclose(pys, ref_ys),
          "ys_shape": list(pys.shape), "ref_ys_shape": list(ref_ys.shape),
          "loss_allclose": allclose(loss, ref_loss),
          "grads_allclose": allclose(grads, ref_grads),
          "grad_max_rel": max_rel(grads, ref_grads)}


class Counter(hk.Module):
  """Keeps per-layer state: a call count and the running sum of its inputs."""

  def __call__(self, x):
    calls = hk.get_state("calls", [], jnp.int32, init=jnp.zeros)
    total = hk.get_state("total", [], jnp.float32, init=jnp.zeros)
    hk.set_state("calls", calls + 1)
    hk.set_state("total", total + jnp.sum(x))
    return x + hk.Linear(WIDTH)(x)


def state_case() -> dict:
  """State is updated once per microbatch, in microbatch order.

  Reference: the plain stack applied to microbatch 0, 1, ... in turn, each
  application starting from the state the previous one left.
  """
  num_layers, micro = 8, 4
  x = inputs()
  plain = hk.without_apply_rng(hk.transform_with_state(
      lambda x: st.Stacked(Counter, num_layers, name="h").fold(x)))
  params, state0 = plain.init(jax.random.PRNGKey(0), x)
  ref_state, ref_outs = state0, []
  for m in range(micro):   # microbatch m: rows m, m + M, m + 2M, ...
    out, ref_state = plain.apply(params, ref_state, x[m::micro])
    ref_outs.append(out)
  ref_out = jnp.stack(ref_outs, axis=1).reshape(x.shape)
  piped = hk.without_apply_rng(hk.transform_with_state(
      lambda x: st.Stacked(Counter, num_layers, name="h",
                           pipeline=st.Pipeline(microbatches=micro, schedule="circular",
                                                repeats=2)).fold(x)))
  mesh = make_mesh({"pipe": 4})
  with jax.set_mesh(mesh):
    out, state = jax.jit(piped.apply)(params, state0, x)
  return {"out_allclose": allclose(out, ref_out),
          "calls": np.asarray(state["h/counter"]["calls"]).tolist(),
          "state_allclose": allclose(state, ref_state)}


class Noisy(hk.Module):
  def __call__(self, x):
    return x + jax.random.uniform(hk.next_rng_key(), x.shape)


def rng_case() -> dict:
  """Each layer and each microbatch draws its own noise; a key reproduces it."""
  num_layers, micro = 8, 4
  x = jnp.zeros((BATCH, WIDTH))

  def make(pipeline):
    def f(x):
      _, ys = st.Stacked(lambda: (lambda h: (h, Noisy()(jnp.zeros_like(h)))),
                         num_layers, pipeline=pipeline, name="h").scan(x)
      return ys
    return hk.transform(f)

  piped = make(st.Pipeline(microbatches=micro))
  mesh = make_mesh({"pipe": 4})
  key = jax.random.PRNGKey(3)
  with jax.set_mesh(mesh):
    ys = np.asarray(jax.jit(piped.apply)({}, key, x))
    again = np.asarray(jax.jit(piped.apply)({}, key, x))
    other = np.asarray(jax.jit(piped.apply)({}, jax.random.PRNGKey(4), x))
  # [L, B, W]: rows of one microbatch are m, m + M, ...
  per_layer_distinct = all(not np.allclose(ys[i], ys[j])
                           for i in range(num_layers) for j in range(i))
  by_micro = [ys[:, m::micro] for m in range(micro)]
  per_micro_distinct = all(not np.allclose(by_micro[i], by_micro[j])
                           for i in range(micro) for j in range(i))
  return {"per_layer_distinct": per_layer_distinct,
          "per_microbatch_distinct": per_micro_distinct,
          "reproducible": bool(np.array_equal(ys, again)),
          "key_matters": not np.allclose(ys, other),
          "uniform_mean": float(ys.mean())}


def error_cases() -> dict:
  """Bad configurations: the message each one raises."""
  x = inputs()
  params = model(8, None).init(jax.random.PRNGKey(0), x)
  out = {}

  def message(fn):
    try:
      fn()
    except (ValueError, TypeError) as e:
      return f"{type(e).__name__}: {e}"
    return None

  def run(pipeline, mesh_sizes, num_layers=8, remat="full", x=x):
    mesh = make_mesh(mesh_sizes)
    m = model(num_layers, pipeline, remat)
    p = m.init(jax.random.PRNGKey(0), x)
    with jax.set_mesh(mesh):
      jax.jit(jax.value_and_grad(m.apply))(p, x)

  out["layers_not_divisible"] = message(
      lambda: run(st.Pipeline(microbatches=4), {"pipe": 4}, num_layers=6))
  out["circular_layers_not_divisible"] = message(
      lambda: run(st.Pipeline(microbatches=4, schedule="circular", repeats=2),
                  {"pipe": 4}, num_layers=12))
  out["batch_not_divisible"] = message(
      lambda: run(st.Pipeline(microbatches=3), {"pipe": 4}))
  out["circular_too_few_microbatches"] = message(
      lambda: run(st.Pipeline(microbatches=2, schedule="circular", repeats=2),
                  {"pipe": 4}))
  out["per_depth"] = message(
      lambda: run(st.Pipeline(microbatches=4), {"pipe": 4},
                  remat=st.per_depth((4, "none"), (4, "full"))))
  out["explicit_mesh"] = message(lambda: _explicit(params, x))
  out["specs_without_pipe_axis"] = message(
      lambda: st.stacked_partition_specs(params, make_mesh({"data": 8}), stacked=["h"],
                                         pipelined=["h"]))
  out["specs_not_divisible"] = message(
      lambda: st.stacked_partition_specs(params, make_mesh({"pipe": 8}), stacked=["h"],
                                         pipelined=["h"]) and
      st.stacked_partition_specs(model(4, None).init(jax.random.PRNGKey(0), x),
                                 make_mesh({"pipe": 8}), stacked=["h"], pipelined=["h"]))

  def ys_without_batch():
    def f(x):
      return st.Stacked(lambda: (lambda h: (h, jnp.sum(h))), 8,
                        pipeline=st.Pipeline(microbatches=4), name="h").scan(x)[1]
    m = hk.without_apply_rng(hk.transform(f))
    with jax.set_mesh(make_mesh({"pipe": 4})):
      jax.jit(m.apply)({}, x)

  out["ys_without_batch_axis"] = message(ys_without_batch)
  inp, tgt = tokens()

  def one_f_one_b(pipeline, num_layers=8, call="loss"):
    m = loss_model(num_layers, pipeline)
    p = m.init(jax.random.PRNGKey(0), inp, tgt)
    if call == "fold":
      m = model(num_layers, pipeline)
      p = m.init(jax.random.PRNGKey(0), x)
    with jax.set_mesh(make_mesh({"pipe": 4})):
      if call == "fold":
        jax.jit(m.apply)(p, x)
      else:
        jax.jit(jax.value_and_grad(m.apply))(p, inp, tgt)

  out["1f1b_too_few_microbatches"] = message(
      lambda: one_f_one_b(st.Pipeline(microbatches=2, schedule="1f1b")))
  out["1f1b_layers_not_divisible"] = message(
      lambda: one_f_one_b(st.Pipeline(microbatches=4, schedule="1f1b"), num_layers=6))
  out["interleaved_microbatches_not_multiple"] = message(
      lambda: one_f_one_b(st.Pipeline(microbatches=6, schedule="interleaved", repeats=2)))
  out["interleaved_layers_not_divisible"] = message(
      lambda: one_f_one_b(st.Pipeline(microbatches=4, schedule="interleaved", repeats=2),
                          num_layers=12))
  out["zb_too_few_microbatches"] = message(
      lambda: one_f_one_b(st.Pipeline(microbatches=3, schedule="zb")))
  out["zb_fold"] = message(
      lambda: one_f_one_b(st.Pipeline(microbatches=4, schedule="zb"), call="fold"))
  out["1f1b_fold"] = message(
      lambda: one_f_one_b(st.Pipeline(microbatches=4, schedule="1f1b"), call="fold"))

  def inline_head():
    def f(tokens, targets):
      embed = hk.Embed(VOCAB, WIDTH, name="embed")
      head = lambda h, t: jnp.mean(hk.Linear(1)(h)) + 0 * jnp.mean(t)  # noqa: E731
      return st.Stacked(Block, 8, pipeline=st.Pipeline(microbatches=4, schedule="1f1b"),
                        name="h").loss(embed, head, tokens, targets)
    m = hk.without_apply_rng(hk.transform(f))
    p = m.init(jax.random.PRNGKey(0), inp, tgt)
    with jax.set_mesh(make_mesh({"pipe": 4})):
      jax.jit(m.apply)(p, inp, tgt)

  out["1f1b_inline_modules"] = message(inline_head)
  return out


def _explicit(params, x):
  mesh = jax.make_mesh((4,), ("pipe",))   # Explicit axes by default
  m = model(8, st.Pipeline(microbatches=4))
  with jax.set_mesh(mesh):
    jax.jit(m.apply)(params, x)


# ---------------------------------------------------------------------------
# 1F1B: the loss inside the pipeline (Stacked.loss), against the plain stack.

VOCAB = 11


def loss_model(num_layers, pipeline, remat="full", make_block=Block, state=False):
  """tokens -> embed -> stack -> projection -> cross entropy, as Stacked.loss."""
  def f(tokens, targets, *args):
    embed = hk.Embed(VOCAB, WIDTH, name="embed")
    proj = hk.Linear(VOCAB, name="out")

    def head(x, t):
      log_probs = jax.nn.log_softmax(proj(x))
      return -jnp.mean(jnp.take_along_axis(log_probs, t[..., None], -1))
    blocks = st.Stacked(make_block, num_layers, remat=remat, pipeline=pipeline, name="h")
    return blocks.loss(embed, head, tokens, targets, *args)
  if state:
    return hk.without_apply_rng(hk.transform_with_state(f))
  return hk.without_apply_rng(hk.transform(f))


def tokens(seed=1):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB),
          jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB))


def compare(loss, grads, ref_loss, ref_grads) -> dict:
  return {"loss_allclose": allclose(loss, ref_loss), "grads_allclose": allclose(grads, ref_grads),
          "grad_max_rel": max_rel(grads, ref_grads),
          "loss_rel": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))}


# The schedules that compute the loss inside the pipeline, and the repeats
# each runs with here (interleaved: two chunks per stage).
LOSS_SCHEDULES = {"1f1b": 1, "interleaved": 2, "zb": 1}
# The schedules run under every remat alias. A chunk's backward is one vjp
# of its forward (the stack's policy inside) under 1f1b, and two (to the
# input, then to the weights) under zb; interleaved runs 1f1b's backward on
# more chunks per stage, which changes which slot and chunk an op reads, not
# how the policy is applied, so it runs with "full" only.
ALIAS_SWEEPS = ("1f1b", "zb")


def loss_pipeline(schedule: str, micro: int) -> st.Pipeline:
  return st.Pipeline(microbatches=micro, schedule=schedule, repeats=LOSS_SCHEDULES[schedule])


def loss_schedule_cases(schedule: str) -> dict:
  """Loss and gradients against the plain stack (``remat="none"``, one device).

  A fold block on pipe:4,data:2 with M=8 > P (the steady state, a data axis
  inside the stages), remat="full", and, for the schedules of ALIAS_SWEEPS
  on the smallest mesh (pipe:2, M=2 = P), every other remat alias (so each
  alias runs under their backward once: "full" on pipe:4,data:2); a scan
  block with per-layer and broadcast arguments on pipe:2,fsdp:2,data:2;
  Haiku state; rng. Each pipelined program is a compile of its own (about
  2.5 s of CPU), so each mesh takes the aliases it needs.
  """
  out = {}
  inp, tgt = tokens()
  plain = loss_model(8, None, remat="none")
  params = plain.init(jax.random.PRNGKey(0), inp, tgt)
  ref = jax.jit(jax.value_and_grad(plain.apply))(params, inp, tgt)
  runs = [({"pipe": 4, "data": 2}, 8, "full")]
  if schedule in ALIAS_SWEEPS:
    runs += [({"pipe": 2}, 2, r) for r in st.REMAT_ALIASES if r != "full"]
  for sizes, micro, remat in runs:
    name = ",".join(f"{k}:{v}" for k, v in sizes.items()) + f" M={micro} remat={remat}"
    mesh = make_mesh(sizes)
    piped = loss_model(8, loss_pipeline(schedule, micro), remat)
    try:
      with jax.set_mesh(mesh):
        out[name] = compare(*jax.jit(jax.value_and_grad(piped.apply))(
            sharded(params, mesh), inp, tgt), *ref)
    except Exception as e:  # pylint: disable=broad-except
      out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
  out["scan"] = _loss_schedule_scan(schedule, inp, tgt)
  out["state"] = _loss_schedule_state(schedule, inp, tgt)
  out["rng"] = _loss_schedule_rng(schedule, inp, tgt)
  return out


def _loss_schedule_scan(schedule, inp, tgt) -> dict:
  """A scan block (scan_loss) with a per-layer scale and a broadcast bias on
  pipe:2,fsdp:2,data:2, remat="nested" (4 layers per stage, so the nested
  loop has chunks to split): the loss, the gradients of params, scale and
  bias, and the ys."""
  num_layers = 8
  scale = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(5), (num_layers, 2 * WIDTH))
  bias = 0.1 * jax.random.normal(jax.random.PRNGKey(6), (WIDTH,))

  def make(pipeline, remat):
    def f(tokens, targets, scale, bias):
      embed, proj = hk.Embed(VOCAB, WIDTH, name="embed"), hk.Linear(VOCAB, name="out")

      def head(x, t):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(proj(x)), t[..., None], -1))
      return st.Stacked(ScanBlock, num_layers, remat=remat, pipeline=pipeline,
                        name="h").scan_loss(embed, head, tokens, targets,
                                            st.per_layer(scale), bias)
    return hk.without_apply_rng(hk.transform(f))

  grad = lambda m: jax.jit(jax.value_and_grad(m.apply, argnums=(0, 3, 4), has_aux=True))  # noqa: E731
  plain = make(None, "none")
  params = plain.init(jax.random.PRNGKey(0), inp, tgt, scale, bias)
  (ref_loss, ref_ys), ref_grads = grad(plain)(params, inp, tgt, scale, bias)
  mesh = make_mesh(MESHES["pipe:2,fsdp:2,data:2"])
  with jax.set_mesh(mesh):
    (loss, ys), grads = grad(make(loss_pipeline(schedule, 4), "nested"))(
        sharded(params, mesh), inp, tgt, scale, bias)
  return dict(compare(loss, grads, ref_loss, ref_grads), ys_allclose=allclose(ys, ref_ys),
              ys_shape=list(ys.shape), ref_ys_shape=list(ref_ys.shape),
              bias_grad_nonzero=bool(np.any(np.asarray(grads[2]) != 0)))


def _loss_schedule_state(schedule, inp, tgt) -> dict:
  """State: once per microbatch, in order. Reference: the plain model applied to
  microbatch 0, 1, ... in turn, each from the state the previous one left."""
  num_layers, micro = 8, 4
  plain = loss_model(num_layers, None, make_block=Counter, state=True)
  params, state0 = plain.init(jax.random.PRNGKey(0), inp, tgt)
  ref_state, ref_losses = state0, []
  for m in range(micro):
    loss, ref_state = plain.apply(params, ref_state, inp[m::micro], tgt[m::micro])
    ref_losses.append(loss)
  piped = loss_model(num_layers, loss_pipeline(schedule, micro),
                     make_block=Counter, state=True)
  with jax.set_mesh(make_mesh({"pipe": 4})):
    loss, state = jax.jit(piped.apply)(params, state0, inp, tgt)
  return {"loss_allclose": allclose(loss, np.mean(ref_losses)),
          "calls": np.asarray(state["h/counter"]["calls"]).tolist(),
          "state_allclose": allclose(state, ref_state)}


class NoisyBlock(hk.Module):
  def __call__(self, x):
    noise = jax.random.uniform(hk.next_rng_key(), x.shape)
    return x + noise * hk.Linear(WIDTH)(x)


def _loss_schedule_rng(schedule, inp, tgt) -> dict:
  """With an rng: the loss and gradients against GPipe's or circular's with
  the same repeats (the same per-layer, per-microbatch keys, differentiated
  by jax.grad), and the key matters."""
  def make(pipeline):
    def f(tokens, targets):
      embed, proj = hk.Embed(VOCAB, WIDTH, name="embed"), hk.Linear(VOCAB, name="out")

      def head(x, t):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(proj(x)), t[..., None], -1))
      return st.Stacked(NoisyBlock, 8, remat="full", pipeline=pipeline,
                        name="h").loss(embed, head, tokens, targets)
    return hk.transform(f)

  key = jax.random.PRNGKey(3)
  params = make(None).init(jax.random.PRNGKey(0), inp, tgt)
  with jax.set_mesh(make_mesh({"pipe": 4})):
    repeats = LOSS_SCHEDULES[schedule]
    plain_schedule = st.Pipeline(microbatches=4, schedule="circular" if repeats > 1 else "gpipe",
                                 repeats=repeats)
    ref = jax.jit(jax.value_and_grad(make(plain_schedule).apply))(params, key, inp, tgt)
    f = jax.jit(jax.value_and_grad(make(loss_pipeline(schedule, 4)).apply))
    got, other = f(params, key, inp, tgt), f(params, jax.random.PRNGKey(4), inp, tgt)
  return dict(compare(*got, *ref), key_matters=bool(abs(float(got[0] - other[0])) > 1e-6))


CASES = {**{schedule: functools.partial(loss_schedule_cases, schedule)
            for schedule in LOSS_SCHEDULES},
         "equality": equality_cases, "remat": remat_cases, "scan": scan_case,
         "state": state_case, "rng": rng_case, "errors": error_cases}


def main(path: str) -> None:
  results = {}
  for name, case in CASES.items():
    try:
      results[name] = case()
    except Exception:  # pylint: disable=broad-except
      results[name] = {"crashed": traceback.format_exc()[-3000:]}
  with open(path, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
