"""sample.py's flags: each defined here, with its help and bounds, and the one
frozen config they make.

The only module besides ``flags.py`` (train.py's) that reads a flag:
sample.py's ``main`` calls :func:`define` before absl parses the command line
and :func:`config` after, and hands the config to ``sample.sample``. The flags
are defined only when sample.py runs, not when this module is imported: a
process that imports train.py (whose flags.py defines --workdir, --seed and
--dtype too) may import this module without a clash of flag names. Each flag
has the name and default of a :class:`run_config.SampleConfig` field.
"""

from __future__ import annotations

import dataclasses
import math

from absl import flags

from examples.gpt import flag_help
from examples.gpt import model_config
from examples.gpt.run_config import SampleConfig


def define(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines sample.py's flags in ``flag_values`` (absl's own: once per process)."""
  fv = dict(flag_values=flag_values, module_name=flag_help.help_owner("sample.py"))
  if fv["module_name"] is not None:
    # Haiku's import of haiku.testing defines absltest's flags (--test_tmpdir,
    # ...) in every process: sample.py's --helpfull lists only its own.
    for flag in list(flag_values.flags_by_module_dict().get("absl.testing.absltest", [])):
      delattr(flag_values, flag.name)
  flags.DEFINE_string("workdir", "workdir/gpt", "Folder that train.py wrote its "
                      "checkpoints to (the latest committed step is used), or the "
                      ".npz that its --export_npz wrote.", **fv)
  flags.DEFINE_string("prompt", "def ", "Text to continue.", **fv)
  flags.DEFINE_integer("num_tokens", 300, "Characters to generate.", lower_bound=1, **fv)
  flags.DEFINE_float("temperature", 0.8, "0 for greedy.", lower_bound=0.0, **fv)
  flags.register_validator(
      "temperature", math.isfinite,
      message="--temperature must be a finite number >= 0 (0: greedy), e.g. 0.8.",
      flag_values=flag_values)
  flags.DEFINE_integer("top_k", 0, "Sample among the K likeliest characters "
                       "(0: off); at most the vocabulary's size.", lower_bound=0, **fv)
  flags.DEFINE_integer("num_samples", 1, "Continuations of the prompt, decoded "
                       "as one batch and printed one after another, separated "
                       "by a line of dashes.", lower_bound=1, **fv)
  flags.DEFINE_integer("seed", 0, "Sampling seed.", **fv)
  flags.DEFINE_list("adapters", None, "LoRA runs (train.py --lora_rank) on "
                    "--workdir's model: each decodes --num_samples rows of one batch "
                    "on its own adapters, in one decode loop over one copy of the "
                    "model, printed run after run.", **fv)
  flags.DEFINE_enum("dtype", None, model_config.DTYPES, "Compute dtype of the "
                    "decode step and its KV cache: float32 (right on a CPU) or "
                    "bfloat16 (right on an accelerator, TPU or GPU; the "
                    "parameters stay float32). Default: the --dtype train.py "
                    "trained in, recorded with its checkpoints.", **fv)


def config() -> SampleConfig:
  """The parsed flags as one frozen config."""
  values = {field.name: flags.FLAGS[field.name].value
            for field in dataclasses.fields(SampleConfig)}
  values["adapters"] = tuple(values["adapters"]) if values["adapters"] else None
  return SampleConfig(**values)
