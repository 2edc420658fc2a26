"""What the benchmark scripts share; no script of its own.

* ``harness``: the flags every script takes, its log, its JSON and plot, and
  running a script again in a child process (``run_module``);
* ``report``: Markdown tables and the plots' common axes;
* ``instruments``: memory, clocks (programs timed side by side in rounds),
  statistics, and two programs' numbers compared;
* ``fast_compile``: XLA's cheapest CPU code generation (the tests use it too);
* ``models`` and ``contenders``: the MLP and GPT blocks, parameters drawn
  without compiling an init, and each way of stacking them that a script
  compares; ``pattern_stacks``: the mixed-layer stacks of ``mixed_layers``
  and the loop they are checked against;
* ``virtual_devices``: XLA asked for several CPU devices before JAX starts
  (``pipeline``, ``sharding``); ``meshes``: meshes named in text, trees
  placed on them, the bytes a device holds; ``collectives``: the collectives
  of a compiled program, by what they move;
* ``pipeline_bubble``, ``pipeline_resident``, ``pipeline_steps`` and
  ``pipeline_example``: the parts of ``pipeline``'s question (the bubble,
  the bytes each device holds, the compiled steps, the GPT example against
  M), each with its rows, its table and its panel;
* ``remat_plan_page``: the tables and figure of ``remat_plan``'s page;
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
