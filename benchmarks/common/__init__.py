"""What the benchmark scripts share; no script of its own.

* ``harness``: the flags every script takes, its log, its JSON and plot, and
  running a script again in a child process (``run_module``);
* ``report``: Markdown tables and the plots' common axes;
* ``instruments``: memory, clocks and statistics;
* ``fast_compile``: XLA's cheapest CPU code generation (the tests use it too);
* ``models`` and ``contenders``: the MLP and GPT blocks, and each way of
  stacking them that a script compares;
* ``accelerator``: what the scripts run on an accelerator share (the sizes
  of each preset, compiling and timing runs side by side, out-of-memory
  records, the page's table of the run);
* ``device_profile``: device time by kind of op, from a profile;
* ``stash_kernels``: the Pallas matmuls of ``stash_mlp``;
* ``nanogpt_prep``: a text as nanoGPT's character-level dataset.

These modules import none of the scripts (``tests/build/benchmarks_test.py``
checks it). The scripts, one per question, sit one folder up and run as
modules from the repository root: ``python -m benchmarks.<name>``.
"""
