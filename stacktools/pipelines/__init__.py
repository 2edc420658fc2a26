"""Pipelines: a stack run over a mesh axis, stage by stage.

Holds ``Pipeline``, how a stack runs as a pipeline (``_pipeline``), the
schedule tables as data (``_schedules``), a stack laid out in stages and
microbatches (``_stages``), and the two tick loops: GPipe/circular with the
pipelined path's checks (``_run_stack``) and the loss-computing 1F1B,
interleaved and ZB-H1 (``_run_with_loss``).

May import: ``stacktools.core``, ``stacktools.step``, ``stacktools.remat``.
"""

from stacktools.pipelines._pipeline import Pipeline
