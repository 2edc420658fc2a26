"""Flags of the GPT example that would do nothing stop it at start-up, with one line.

Flags that do nothing with ``--stack=unrolled`` (``--remat=nested``,
``--nested_outer``, ``--unroll``) or without ``--optimizer=muon``
(``--muon_learning_rate``), and ``--pattern`` with L layers whose
``--window`` (its default or a given one) exceeds ``--seq_len``: each once
went on in silence. So did ``--peak_flops`` of nan, inf or 0 and a policy
name in capitals (``--remat=Nested``); ``--remat=False`` got the library's
list of Python values, and a ``--memory_budget`` that is not a size was
refused only after the corpus was loaded. ``--grad_accum`` that does not divide the batch, or
beside a pipeline (which cuts its own microbatches), stops there too. The
command lines run one after another in one interpreter
(``gpt_driver.drive_cli``); each must exit non-zero with one
line that names the flag and the fix, and write nothing. Each corrected one
is shown to pass the flag checks by stopping at the next check (a missing
``--data_path``).
"""

import json

import pytest

import gpt_driver
from subprocesses import wait

pytestmark = pytest.mark.jax_independent   # see pytest.ini

#: (flags, what the one line must say); None: the flags pass their checks.
CLI_CASES = {
    "nested_unrolled": ({"stack": "unrolled", "remat": "nested"},
                        ["--remat=nested: nested splits a scan into two levels, and "
                         "--stack=unrolled (st.BlockSeq, a Python loop) has no scan, so it "
                         "would act as full: write full in its place, or pass --stack=scan."]),
    "nested_outer_unrolled": ({"stack": "unrolled", "remat": "nested", "nested_outer": 2},
                              ["--remat=nested and --nested_outer: nested splits"]),
    "per_depth_nested_unrolled": ({"stack": "unrolled", "remat": "none:1,nested:1"},
                                  ["--remat=none:1,nested:1: nested splits"]),
    "unroll_unrolled": ({"stack": "unrolled", "unroll": 2},
                        ["--unroll=2 sets the layers per rolled iteration of --stack=scan's "
                         "loop", "drop --unroll, or pass --stack=scan."]),
    "muon_rate_without_muon": ({"muon_learning_rate": 0.05},
                               ["--muon_learning_rate is the peak learning rate of Muon's "
                                "matrices, which only --optimizer=muon has: pass "
                                "--optimizer=muon, or drop --muon_learning_rate"]),
    "window_default": ({"pattern": "LG"},
                       ["--pattern=LG has L layers, which attend to the last --window "
                        "positions, but --window, not given, defaults to 32, more than "
                        "--seq_len=16: pass --window=16 or less."]),
    "window_given": ({"pattern": "LG", "window": 20},
                     ["but --window=20 is more than --seq_len=16: pass --window=16"]),
    "grad_accum_uneven": ({"grad_accum": 3},
                          ["--batch_size=4 is not divisible by --grad_accum=3: each "
                           "microbatch needs the same number of sequences."]),
    "grad_accum_pipeline": ({"grad_accum": 2, "pipeline": "gpipe"},
                            ["--grad_accum=2 with --pipeline=gpipe: a pipeline cuts the "
                             "batch into --microbatches itself; drop --grad_accum."]),
    # Policy names compare in any case, as stacktools compares them.
    "nested_unrolled_any_case": ({"stack": "unrolled", "remat": "Nested"},
                                 ["--remat=Nested: nested splits a scan into two levels"]),
    # The command line's own list, not the library's Python values.
    "remat_false": ({"remat": "False"},
                    ["--remat='False' is not a checkpoint policy: pass none, full, nested, "
                     "offload, save_all, auto, or per-depth segments alias:layers,... "
                     "(e.g. none:2,full:2)."]),
    # Before the corpus and the parameters are loaded.
    "memory_budget_not_a_size": ({"remat": "auto", "memory_budget": "48 megs"},
                                 ["--memory_budget='48 megs' is not a size: pass bytes, or a "
                                  "number with a unit, e.g. 48MiB or 1.5GB (units: B, KB, MB, "
                                  "GB, KiB, MiB, GiB)."]),
    "memory_budget_zero": ({"remat": "auto", "memory_budget": "0MiB"},
                           ["--memory_budget='0MiB' is not a size"]),
    "peak_flops_nan": ({"peak_flops": "nan"},
                       ["--peak_flops must be a finite number of FLOP/s above 0, e.g. "
                        "197e12; drop it for the device kind's own peak (none on a CPU: "
                        "no MFU)."]),
    "peak_flops_inf": ({"peak_flops": "inf"}, ["--peak_flops must be a finite number"]),
    "peak_flops_zero": ({"peak_flops": 0}, ["--peak_flops must be a finite number"]),
    # Each corrected.
    "full_any_case": ({"remat": "Full"}, None),
    "memory_budget_size": ({"remat": "auto", "memory_budget": "48MiB"}, None),
    "peak_flops_given": ({"peak_flops": 1e12}, None),
    "grad_accum_even": ({"grad_accum": 2}, None),
    "full_unrolled": ({"stack": "unrolled", "remat": "full"}, None),
    "unroll_1_unrolled": ({"stack": "unrolled", "unroll": 1}, None),
    "muon_rate_with_muon": ({"muon_learning_rate": 0.05, "optimizer": "muon"}, None),
    "window_fits": ({"pattern": "LG", "window": 16}, None),
}


def test_gpt_flags_that_would_do_nothing_stop_at_start_up(tmp_path):
  missing = str(tmp_path / "missing.txt")   # the check after the flags' own
  args = [gpt_driver.as_args({**gpt_driver.TINY, "data_path": missing,
                              "workdir": str(tmp_path / name), **flags})
          for name, (flags, _) in CLI_CASES.items()]
  proc, out_path = gpt_driver.start_cli_driver(str(tmp_path), "start_up_flags", args,
                                               gpt_driver.xla_env())
  try:
    wait(proc)
  finally:
    proc.log.close()
  with open(out_path, encoding="utf-8") as f:
    results = json.load(f)
  for (name, (_, fragments)), result in zip(CLI_CASES.items(), results):
    gpt_driver.one_line_error(
        result["rc"], result["stderr"],
        fragments or [f"error: --data_path={missing!r} does not exist"], name)
    assert not (tmp_path / name).exists(), name
