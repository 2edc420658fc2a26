"""Tests for the GPT example's training rules by depth: --optimizer=muon,
--layer_lr_decay, --freeze_layers and --layer_drop.

Training runs go through one driver subprocess (``gpt_driver``), bad flags
through the command line, all started at once. What is checked:

* ``--optimizer=muon`` trains, and its checkpointed state is per layer (a
  count and a Muon momentum with a leading Layers axis);
* ``--freeze_layers=0:1`` with Muon, ``--layer_lr_decay`` and ``--layer_drop``:
  block 0's parameters equal the initial ones bit for bit after 20 steps, its
  optimizer count stays 0, block 1 and the rest train;
* ``--layer_drop`` skips blocks: the scan blocks' per-layer stats are exactly
  0 on some steps for some blocks and not on others, and a run stopped at
  step 10 and resumed equals one of 20 steps bit for bit (the drop key comes
  from the batch);
* bad values stop at start-up with one line naming the flag, writing nothing
  (their command lines run in one interpreter, ``gpt_driver.CliRuns``).
"""

import json
import os

import haiku as hk
import jax
import numpy as np
import pytest

from examples.gpt import model as model_lib
from examples.gpt import model_config
import gpt_driver
from subprocesses import wait

TINY = gpt_driver.TINY
STEPS = gpt_driver.STEPS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
  return gpt_driver.write_corpus(str(tmp_path_factory.mktemp("data") / "text.txt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
  tmp = str(tmp_path_factory.mktemp("runs"))

  def spec(name, **flags):
    return {"name": name, "flags": {**TINY, "data_path": corpus,
                                    "workdir": os.path.join(tmp, name), **flags}}

  drop = dict(layer_drop=0.6, block="scan")
  specs = [spec("muon", optimizer="muon"),
           spec("rules", optimizer="muon", freeze_layers="0:1", layer_lr_decay=0.5,
                layer_drop=0.3),
           spec("drop", **drop),
           spec("drop_resumed", stop_after=10, **drop),
           spec("drop_resumed", resume=True, **drop)]
  proc, out_path = gpt_driver.start_driver(tmp, "layers", specs, gpt_driver.xla_env())
  try:
    wait(proc)
  finally:
    proc.log.close()
  with open(out_path, encoding="utf-8") as f:
    out = json.load(f)["runs"]
  for run in out:
    assert run["error"] is None and run["exit"] is None, run
  return {name: os.path.join(tmp, name) for name in {s["name"] for s in specs}}


def _losses(workdir):
  return gpt_driver.train_losses(workdir)


def test_muon_trains_with_per_layer_state(runs):
  losses = _losses(runs["muon"])
  assert np.all(np.isfinite(losses)) and losses[-3:].mean() < losses[:3].mean() - 0.3
  arrays = gpt_driver.load_checkpoint(runs["muon"])
  momentum = [k for k in arrays if k.endswith("/muon/inner_state/0/mu/h/block/attn/qkv/w")]
  assert len(momentum) == 1 and arrays[momentum[0]].shape == (
      gpt_driver.NUM_LAYERS, TINY["d_model"], 3 * TINY["d_model"])


def _initial_params(workdir):
  """The parameters train.py initialised: the same model, seed and batch shape."""
  cfg = model_config.GPTConfig(**gpt_driver.load_meta(workdir)["config"])
  model = hk.transform(lambda t: model_lib.loss_fn(cfg, t))
  tokens = np.zeros((TINY["batch_size"], TINY["seq_len"] + 1), np.int32)
  return jax.jit(model.init)(jax.random.PRNGKey(0), tokens)   # jitted, as train.py does


def test_frozen_block_stays_bit_identical(runs):
  workdir = runs["rules"]
  losses = _losses(workdir)
  assert losses[-3:].mean() < losses[:3].mean() - 0.3
  init = _initial_params(workdir)
  arrays = gpt_driver.load_checkpoint(workdir)
  blocks = [m for m in init if m.startswith("h/")]
  assert blocks
  for module in blocks:
    for name, value in init[module].items():
      trained = arrays[f"params/{module}/{name}"]
      np.testing.assert_array_equal(trained[0], value[0], err_msg=f"{module}/{name}")
      assert np.any(trained[1] != value[1]), f"{module}/{name}: block 1 did not train"
  assert np.any(arrays["params/head/w"] != init["head"]["w"])
  counts = [v for k, v in arrays.items()
            if k.startswith("opt_state/1/layers/h/") and k.endswith("/count")]
  assert counts and all(c.tolist() == [0, STEPS] for c in counts)


def test_layer_drop_skips_blocks_and_resumes_exactly(runs):
  records = gpt_driver.read_metrics(runs["drop"])
  ratios = np.array([r["update_ratio"] for r in records])   # [steps, layers]
  skipped = ratios == 0
  assert skipped.any() and not skipped.all()
  assert skipped[:, 1].sum() >= skipped[:, 0].sum()    # the deeper block skips more
  np.testing.assert_array_equal(_losses(runs["drop_resumed"]), _losses(runs["drop"]))
  straight = gpt_driver.load_checkpoint(runs["drop"])
  resumed = gpt_driver.load_checkpoint(runs["drop_resumed"])
  for key, value in straight.items():
    np.testing.assert_array_equal(resumed[key], value, err_msg=key)


#: ``(flags, fragments of the one line)``: bad values, each stopping at start-up.
BAD_VALUES = [
    ({"freeze_layers": "1:1"}, ["--freeze_layers='1:1' must be A:B with 0 <= A < B <= "
                                "--num_layers=2"]),
    ({"freeze_layers": "0:3"}, ["--freeze_layers='0:3'", "--num_layers=2"]),
    ({"freeze_layers": "first"}, ["--freeze_layers='first' must be A:B"]),
    ({"layer_lr_decay": 0}, ["--layer_lr_decay must be in (0, 1]"]),
    ({"layer_drop": 1}, ["--layer_drop must be in [0, 1)"]),
    ({"optimizer": "sgd"}, ["--optimizer=sgd", "<adamw|muon>"]),
    ({"stack": "unrolled", "freeze_layers": "0:1"}, ["--stack=unrolled", "--stack=scan"]),
]


@pytest.fixture(scope="module")
def bad_values(tmp_path_factory, corpus):
  """``(runs, tmp)``: train.py's command line of each of BAD_VALUES, run in one
  interpreter (``gpt_driver.bad_flag_runs``; case i's workdir ``tmp/work<i>``)."""
  tmp = tmp_path_factory.mktemp("bad_values")
  runs = gpt_driver.bad_flag_runs(str(tmp), "bad_values", BAD_VALUES, {**TINY, "data_path": corpus})
  yield runs, tmp
  runs.close()


@pytest.mark.parametrize("flags, fragments", BAD_VALUES)
def test_bad_values_stop_at_start_up(bad_values, flags, fragments):
  runs, tmp = bad_values
  i = BAD_VALUES.index((flags, fragments))
  returncode, _, stderr = runs[i]
  gpt_driver.one_line_error(returncode, stderr, fragments)
  assert not (tmp / f"work{i}").exists()
