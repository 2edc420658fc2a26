"""The GPT example's flags and its frozen configs: one name and one default each.

train.py's flags (``examples/gpt/flags.py``) become a ``run_config.TrainConfig``
and sample.py's (``sample_flags.py``) a ``run_config.SampleConfig``, field by
field under the flag's name. A flag without a field would be read nowhere, a
field without a flag could not be set from the command line, and a default
that differs would make ``train.train(TrainConfig(), ...)`` another run than
``python examples/gpt/train.py``.
"""

import dataclasses

from absl import flags

from examples.gpt import flags as train_flags
from examples.gpt import run_config
from examples.gpt import sample_flags


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
