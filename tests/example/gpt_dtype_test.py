"""Mixed precision in the GPT example (``--dtype=bfloat16``), and its MFU line.

In this process, traced (nothing compiled but the greedy reference):

* Haiku's policies (``model.precision_policies``) reach the blocks inside
  ``st.Stacked``, whose vmapped init and scanned apply call them: the
  parameters and their gradients are float32, the blocks' matmuls bfloat16,
  the softmax and layer-norm statistics float32, the logits float32; they are
  cleared afterwards, so a float32 model traced next has no bfloat16 at all;
* the decode step keeps its KV cache in bfloat16;
* ``train_loop`` logs model TFLOP/s and MFU with a fake peak (on a fake
  clock, so the figures are exact) and neither where the peak is unknown;
  the peak table by device kind;
* ``data.Prefetched`` reports the sampler state of the batches it returned,
  not of the one it put ahead.

Through ``train.py`` (one driver, the tiny model trained in float32 and in
bfloat16 from one seed) and ``sample.py``:

* the bfloat16 run's validation loss is within 0.05 of float32's; its
  checkpointed parameters and optimizer state and its export are float32;
* each run's log says its batch (and --grad_accum); the bfloat16 one, on a
  CPU, that bfloat16 is slower there;
* the checkpoints record the run's dtype, which ``sample.py`` decodes in
  unless ``--dtype`` says otherwise;
* ``sample.py --dtype=bfloat16`` greedy from the float32 run's checkpoint
  prints float32's text, except after a near tie: a character may differ
  only where float32's two likeliest are closer than twice the largest
  logit difference between a bfloat16 and a float32 forward pass over the
  same text (bfloat16 keeps 8 bits of mantissa: activations move by ~0.4%).
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.gpt import data as data_lib
from examples.gpt import decoding
from examples.gpt import model as model_lib
from examples.gpt import model_config
import gpt_driver
from subprocesses import wait

BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)
PROMPT, NUM_TOKENS = "the ", 10    # 14 positions of 16: no refill
FAKE_PEAK = 1e12                   # --peak_flops of the bfloat16 run


def tiny(dtype="float32", **kwargs):
  return model_config.GPTConfig(**{**dict(vocab_size=11, seq_len=16, num_layers=2,
                                          num_heads=2, d_model=16, dtype=dtype), **kwargs})


def tokens(batch=2, length=17):
  return jnp.asarray(np.random.default_rng(0).integers(0, 11, (batch, length)), jnp.int32)


def equations(jaxpr, inside=False):
  """``(primitive name, output dtypes, inside a scan)`` of every equation,
  sub-jaxprs (scan and remat bodies) included."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name, [v.aval.dtype for v in eqn.outvars], inside
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
        if hasattr(inner, "eqns"):
          yield from equations(inner, inside or eqn.primitive.name == "scan")


# ---------------------------------------------------------------------------
# The policies, traced.


def test_bfloat16_policies_reach_the_stacked_blocks_and_are_cleared_after():
  cfg = tiny("bfloat16")
  model = hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)[0]))
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens())
  grads = jax.eval_shape(jax.grad(model.apply), params, tokens())
  assert {a.dtype for a in jax.tree.leaves(params)} == {F32}
  assert {a.dtype for a in jax.tree.leaves(grads)} == {F32}
  assert params["h/block/fc"]["w"].shape == (2, 16, 64)   # the stacked layout
  jaxpr = jax.make_jaxpr(model.apply)(params, tokens())
  in_scan = [(name, dtypes) for name, dtypes, inside in equations(jaxpr.jaxpr) if inside]
  dots = {d for name, dtypes in in_scan if name == "dot_general" for d in dtypes}
  assert dots == {BF16}, dots                        # every matmul of the blocks
  exp = {d for name, dtypes in in_scan if name == "exp" for d in dtypes}
  rsqrt = {d for name, dtypes in in_scan if name == "rsqrt" for d in dtypes}
  assert exp == {F32} and rsqrt == {F32}, (exp, rsqrt)   # softmax, layer norms
  logits = jax.eval_shape(hk.without_apply_rng(hk.transform(
      lambda t: model_lib.forward(cfg, t)[0])).apply, params, tokens(length=16))
  assert logits.dtype == F32
  for cls in model_lib.precision_policies("bfloat16"):
    assert hk.mixed_precision.get_policy(cls) is None, cls
  # A float32 model traced afterwards: no bfloat16 anywhere.
  f32 = hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(tiny(), t)[0]))
  f32_jaxpr = jax.make_jaxpr(jax.grad(f32.apply))(params, tokens())
  assert not [name for name, dtypes, _ in equations(f32_jaxpr.jaxpr) if BF16 in dtypes]


def test_bfloat16_decode_keeps_its_cache_in_bfloat16():
  cfg = tiny("bfloat16")
  decode = hk.without_apply_rng(hk.transform(
      lambda t, c, p: decoding.decode(cfg, t, c, p)))
  cache = decoding.init_cache(cfg, 2)
  assert {a.dtype for a in jax.tree.leaves(cache)} == {BF16}
  params = jax.eval_shape(decode.init, jax.random.PRNGKey(0), tokens(length=1), cache, 0)
  logits, new = jax.eval_shape(decode.apply, params, tokens(length=1), cache, 3)
  assert logits.dtype == F32
  assert jax.tree.map(lambda a: (a.shape, a.dtype), new) == jax.tree.map(
      lambda a: (a.shape, a.dtype), cache)


def test_dtype_is_checked():
  with pytest.raises(ValueError, match=r"dtype='float16': use one of float32, bfloat16"):
    tiny("float16")


# ---------------------------------------------------------------------------
# The MFU line (train_loop in this process, on a fake clock).


def _train_loop_records(monkeypatch, **flag_values):
  """Runs train_loop for 4 steps of 1 s each (a fake clock); returns the
  records and the logged lines."""
  from examples.gpt import metrics  # pylint: disable=g-import-not-at-top
  from examples.gpt import run_config  # pylint: disable=g-import-not-at-top
  from examples.gpt import train  # pylint: disable=g-import-not-at-top
  now, lines = [0.0], []
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
  monkeypatch.setattr(train.logging, "info", lambda fmt, *a: lines.append(fmt % a if a else fmt))

  def step(params, opt_state, batch):
    del batch
    now[0] += 1.0
    return params, opt_state, jnp.float32(2.5), None

  config = run_config.TrainConfig(log_every=4, eval_every=100, batch_size=2, seq_len=3,
                                  **flag_values)
  run = SimpleNamespace(
      config=config, cfg=tiny(seq_len=3), params={"w": np.zeros(10, np.float32)}, opt_state={},
      start_step=0, last_step=4, records=[], is_chief=False, metrics_path=None,
      compiled_step=step, batches=SimpleNamespace(next=lambda: np.zeros((2, 4), np.int32)),
      evaluate=lambda params: 3.0, save_checkpoint=lambda *args: None)
  train.train_loop(run)
  return [r for r in run.records if "tokens_per_s" in r], lines


def test_mfu_line_with_a_fake_peak(monkeypatch):
  # 6 tokens a second; 6 * 10 parameters + 12 * L=2 * d=16 * T=3 FLOPs a token.
  flops = 6 * (6 * 10 + 12 * 2 * 16 * 3)
  peak = 2 * flops / jax.device_count()   # per device: MFU 50%
  (record,), lines = _train_loop_records(monkeypatch, peak_flops=peak)
  assert record["tokens_per_s"] == pytest.approx(6.0)
  assert record["model_tflops_per_s"] == pytest.approx(flops / 1e12)
  assert record["mfu"] == pytest.approx(0.5)
  (line,) = [l for l in lines if "tokens/s" in l]
  assert "6 tokens/s" in line and "TFLOP/s  MFU 50.0%" in line, line


def test_no_mfu_where_the_peak_is_unknown(monkeypatch):
  from examples.gpt import metrics  # pylint: disable=g-import-not-at-top
  assert metrics.peak_flops(jax.devices()[0].device_kind) is None   # a CPU
  (record,), lines = _train_loop_records(monkeypatch)
  assert "mfu" not in record and "model_tflops_per_s" not in record
  (line,) = [l for l in lines if "tokens/s" in l]
  assert "MFU" not in line and "TFLOP/s" not in line, line


@pytest.mark.parametrize("kind, peak", [
    ("TPU v5 lite", 197e12), ("TPU v4", 275e12), ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12), ("NVIDIA A100-SXM4-40GB", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("TPU v4 lite", None), ("cpu", None), ("NVIDIA GeForce RTX 4090", None)])
def test_peak_by_device_kind(kind, peak):
  from examples.gpt import metrics  # pylint: disable=g-import-not-at-top
  assert metrics.peak_flops(kind) == peak


# ---------------------------------------------------------------------------
# Batches a step ahead.


def test_prefetched_reports_the_state_of_the_batches_it_returned():
  ids = np.arange(1000, dtype=np.int32)
  put = []
  batches = data_lib.Prefetched(data_lib.BatchSampler(ids, 2, 8, seed=0),
                                lambda b: put.append(b) or b)
  first = batches.next()
  assert len(put) == 2                 # the next one is on its way
  state = batches.get_state()
  resumed = data_lib.BatchSampler(ids, 2, 8, seed=0)
  resumed.set_state(state)             # a run resumed here draws what comes next
  np.testing.assert_array_equal(resumed.next(), batches.next())
  straight = data_lib.BatchSampler(ids, 2, 8, seed=0)
  np.testing.assert_array_equal(straight.next(), first)


# ---------------------------------------------------------------------------
# train.py and sample.py.


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """``{dtype: (workdir, export path, log)}``: the tiny model trained 20 steps
  in each dtype, from one seed, in one driver."""
  tmp = str(tmp_path_factory.mktemp("dtype"))
  corpus = gpt_driver.write_corpus(os.path.join(tmp, "text.txt"))
  specs, out = [], {}
  for dtype in ("float32", "bfloat16"):
    workdir, export = os.path.join(tmp, dtype), os.path.join(tmp, f"{dtype}.npz")
    peak = {"peak_flops": FAKE_PEAK} if dtype == "bfloat16" else {}
    specs.append({"name": dtype, "flags": {**gpt_driver.TINY, "data_path": corpus,
                                           "workdir": workdir, "export_npz": export,
                                           "dtype": dtype, **peak}})
    out[dtype] = [workdir, export]
  proc, out_path = gpt_driver.start_driver(tmp, "dtype", specs, gpt_driver.xla_env())
  wait(proc)
  with open(out_path, encoding="utf-8") as f:
    for run in json.load(f)["runs"]:
      assert run["error"] is None and run["exit"] is None, run
      out[run["name"]].append(run["log"])
  return out


def test_bfloat16_trains_like_float32_with_float32_parameters_and_state(runs):
  valid = {}
  for dtype, (workdir, export, _) in runs.items():
    valid[dtype] = gpt_driver.read_metrics(workdir)[-1]["valid_loss"]
    arrays = gpt_driver.load_checkpoint(workdir)
    floats = {k: a.dtype for k, a in arrays.items() if np.issubdtype(a.dtype, np.floating)}
    assert set(floats.values()) == {F32}, (dtype, floats)
    assert any(k.startswith("opt_state/") for k in floats), floats   # AdamW's moments
    exported, meta = gpt_driver.load_export(export)
    assert {a.dtype for a in exported.values()} == {F32}, dtype
    assert meta["dtype"] == dtype, meta   # sample.py decodes an export in it
  assert abs(valid["bfloat16"] - valid["float32"]) < 0.05, valid


def test_the_runs_log_mfu_only_with_a_peak(runs):
  f32_log, bf16_log = runs["float32"][2], runs["bfloat16"][2]
  assert "MFU" not in f32_log and "TFLOP/s" not in f32_log
  assert "dtype='bfloat16'" in bf16_log
  records = [r for r in gpt_driver.read_metrics(runs["bfloat16"][0]) if "tokens_per_s" in r]
  assert records and all(r["mfu"] > 0 for r in records)
  assert bf16_log.count("MFU") == len(records)


def test_the_runs_say_their_batch_and_bfloat16_on_a_cpu(runs):
  f32_log, bf16_log = runs["float32"][2], runs["bfloat16"][2]
  for log in (f32_log, bf16_log):
    assert ("Batch: 4 sequences of 16 characters per step, in 1 microbatch(es) of 4 "
            "(--grad_accum=1)") in log, log
  slower = "--dtype=bfloat16 on a CPU: its bfloat16 matmuls are no faster"
  assert (slower in bf16_log) == (jax.default_backend() == "cpu"), bf16_log
  assert slower not in f32_log


def test_sample_decodes_in_the_runs_dtype_unless_told(runs, monkeypatch):
  from examples.gpt import run_config  # pylint: disable=g-import-not-at-top
  from examples.gpt import sample as sample_lib  # pylint: disable=g-import-not-at-top
  decoded = []
  monkeypatch.setattr(sample_lib.decoding, "generate",
                      lambda cfg, *args, **kwargs: decoded.append(cfg.dtype) or ["x"])
  for dtype in ("float32", "bfloat16"):
    workdir = runs[dtype][0]
    assert gpt_driver.load_meta(workdir)["dtype"] == dtype
    sample_lib.sample(run_config.SampleConfig(workdir=workdir, num_tokens=1))
  sample_lib.sample(run_config.SampleConfig(workdir=runs["bfloat16"][0], num_tokens=1,
                                            dtype="float32"))
  assert decoded == ["float32", "bfloat16", "float32"]


def _params_from_npz(path):
  with np.load(path, allow_pickle=False) as arrays:
    params = {}
    for key in arrays.files:
      if key == "meta":   # the run's metadata, beside the parameters
        continue
      module, name = key.rsplit("/", 1)
      params.setdefault(module, {})[name] = arrays[key]
  return params


def test_sample_bfloat16_greedy_is_float32_greedy(runs):
  workdir, export, _ = runs["float32"]
  proc = subprocess.Popen(
      [sys.executable, gpt_driver.SAMPLE, f"--workdir={workdir}", f"--prompt={PROMPT}",
       f"--num_tokens={NUM_TOKENS}", "--temperature=0", "--dtype=bfloat16"],
      cwd=gpt_driver.REPO, env=gpt_driver.xla_env(), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  # Meanwhile: float32's greedy text by full recompute, with each step's gap
  # between the two likeliest, and how far bfloat16 moves the logits.
  chars = gpt_driver.load_meta(workdir)["chars"]
  params = _params_from_npz(export)
  cfg = model_config.GPTConfig(**gpt_driver.load_meta(workdir)["config"])
  logits_of = {dtype: jax.jit(hk.without_apply_rng(hk.transform(
      lambda t, dtype=dtype: model_lib.forward(
          model_config.GPTConfig(**{**cfg.__dict__, "dtype": dtype}), t)[0])).apply)
               for dtype in model_config.DTYPES}
  ids, gaps, moved = [chars.index(c) for c in PROMPT], [], 0.0
  for _ in range(NUM_TOKENS):
    padded = np.zeros((1, cfg.seq_len), np.int32)   # causal: the padding is unseen
    padded[0, :len(ids)] = ids
    f32, bf16 = (np.asarray(logits_of[d](params, padded))[0, :len(ids)]
                 for d in model_config.DTYPES)
    moved = max(moved, float(np.max(np.abs(f32 - bf16))))
    top = np.sort(f32[-1])[-2:]
    gaps.append(float(top[1] - top[0]))
    ids.append(int(np.argmax(f32[-1])))
  want = PROMPT + "".join(chars[i] for i in ids[len(PROMPT):])
  stdout, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 0, stderr
  text = stdout.rstrip("\n")
  assert len(text) == len(want), (text, want)
  assert moved < 0.5, moved   # bfloat16 moves the logits by hundredths, not more
  for j, (got, expected) in enumerate(zip(text[len(PROMPT):], want[len(PROMPT):])):
    if got != expected:   # only after a near tie; the rest follows from it
      assert gaps[j] < 2 * moved, (j, text, want, gaps[j], moved)
      break
