"""The GPT example's flags and its frozen configs: one name and one default each.

train.py's flags (``examples/gpt/flags.py``) become a ``run_config.TrainConfig``
and sample.py's (``sample_flags.py``) a ``run_config.SampleConfig``, field by
field under the flag's name (sample.py's --dtype defaults to None: the
run's own). A flag without a field would be read nowhere, a
field without a flag could not be set from the command line, and a default
that differs would make ``train.train(TrainConfig(), ...)`` another run than
``python examples/gpt/train.py``.
"""

import dataclasses
import subprocess
import sys

from absl import flags
import jax.numpy as jnp
import numpy as np
import optax
from optax.schedules import _schedule as optax_schedule
import pytest

import gpt_driver
from examples.gpt import flags as train_flags
from examples.gpt import model_config
from examples.gpt import optimizer as optimizer_lib
from examples.gpt import remat as remat_lib
from examples.gpt import run_config
from examples.gpt import sample_flags
from examples.gpt import start_up


def _defaults(flag_values, names):
  return {name: flag_values[name].default for name in names}


def _fields(config_class):
  return {f.name: f.default for f in dataclasses.fields(config_class)}


def test_train_flags_are_the_train_config():
  defined = {f.name for f in flags.FLAGS.get_flags_for_module(train_flags)}
  fields = _fields(run_config.TrainConfig)
  # --workdir is train.train's second argument, beside the config.
  assert defined - set(fields) == {"workdir"}
  assert set(fields) - defined == set()
  assert _defaults(flags.FLAGS, fields) == fields


def test_sample_flags_are_the_sample_config():
  flag_values = flags.FlagValues()   # sample.py's names clash with train.py's
  sample_flags.define(flag_values)
  fields = _fields(run_config.SampleConfig)
  assert set(flag_values) == set(fields)
  assert _defaults(flag_values, fields) == fields


def test_the_config_holds_the_parsed_flags():
  args = ["train.py", "--num_layers=2", "--remat=auto", "--memory_budget=32MiB",
          "--remat_candidates=full nested", "--nobias", "--workdir=/tmp/elsewhere"]
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS(args)
    config, workdir = train_flags.config(), train_flags.workdir()
  finally:
    flags.FLAGS.unparse_flags()
  assert workdir == "/tmp/elsewhere"
  assert config == run_config.TrainConfig(
      num_layers=2, remat="auto", memory_budget="32MiB", remat_candidates=("full", "nested"),
      bias=False)
  assert hash(config)   # frozen, its lists tuples: a value
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS(["train.py", "--save_names=qkv,attn_out"])
    assert train_flags.config().save_names == ("qkv", "attn_out")
  finally:
    flags.FLAGS.unparse_flags()


def test_remat_names_are_read_in_any_case_as_stacktools_reads_them():
  # --remat=Full once ran "full" without the kept matmul outputs, and
  # --remat=Nested --stack=unrolled trained where nested was refused.
  for given in ("Full", "FULL", "NeStEd", "Offload"):
    assert remat_lib.checkpoint_policy(given, None, None) == remat_lib.checkpoint_policy(
        given.lower(), None, None), given
  assert remat_lib.checkpoint_policy("Auto", None, None) == "auto"
  with pytest.raises(ValueError, match=r"^--remat=Nested: nested splits a scan"):
    remat_lib.check_unrolled_stack("unrolled", "Nested", None, 1)
  with pytest.raises(ValueError, match=r"--save_names needs --remat full"):
    remat_lib.check_save_names(["attn_out"], "None")
  remat_lib.check_save_names(["attn_out"], "Full")


def test_no_warmup_is_the_cosine_decay_without_a_log_line(monkeypatch):
  logged = []
  monkeypatch.setattr(optax_schedule.logging, "info", lambda *a, **k: logged.append(a))
  config = optimizer_lib.OptimizerConfig(
      optimizer="adamw", learning_rate=1.0, muon_learning_rate=0.02, warmup_steps=0,
      weight_decay=0.0, grad_clip=0.0, layer_lr_decay=1.0, freeze_layers="")
  cfg = model_config.GPTConfig(vocab_size=5, seq_len=4, num_layers=1, num_heads=1, d_model=4)
  params = {"w": jnp.ones(3)}
  tx = optimizer_lib.make_optimizer(config, 10, cfg)
  assert not logged, logged
  # The rate at each step, read from the update of a gradient of ones: the
  # schedule optax's warmup_cosine_decay_schedule makes with a warmup of 0.
  want = optax.warmup_cosine_decay_schedule(0.0, 1.0, 0, 10, 0.1)
  state = tx.init(params)
  for step in range(4):
    updates, state = tx.update({"w": jnp.ones(3)}, state, params)
    np.testing.assert_allclose(-updates["w"][0], want(step), rtol=1e-4)


def test_bfloat16_on_a_cpu_is_said_to_be_slower():
  said = start_up.cpu_dtype_warning("bfloat16", "cpu")
  assert said.startswith("--dtype=bfloat16 on a CPU: ") and "pass --dtype=float32" in said
  assert start_up.cpu_dtype_warning("float32", "cpu") is None
  assert start_up.cpu_dtype_warning("bfloat16", "tpu") is None


def test_helpfull_lists_the_binaries_flags_not_absltests():
  procs = [subprocess.Popen([sys.executable, binary, "--helpfull"], cwd=gpt_driver.REPO,
                            env=gpt_driver.xla_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for binary in (gpt_driver.TRAIN, gpt_driver.SAMPLE)]
  for proc, own in zip(procs, ("--remat:", "--num_tokens:")):
    out, _ = proc.communicate(timeout=300)
    assert own in out, out
    assert "absltest" not in out and "--test_tmpdir" not in out, out
