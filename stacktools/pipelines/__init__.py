"""Pipelines: a stack run over a mesh axis, stage by stage.

Holds ``Pipeline``, how a stack runs as a pipeline (``_pipeline``), the
schedule tables as data (``_schedules``), a stack laid out in stages and
microbatches (``_stages``), the parts around the stack that a
loss-computing schedule runs per microbatch (``_ends``), and the two tick
loops, each given the chunk of layers a stage runs: GPipe/circular,
forwards only (``_run_forward``), and the loss-computing 1F1B, interleaved
and ZB-H1 (``_run_with_loss``).

May import: ``stacktools.core``, ``stacktools.step``.
"""

from stacktools.pipelines._pipeline import Pipeline
