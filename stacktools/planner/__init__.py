"""The remat planner: ``plan_remat`` and ``remat_report``.

Holds what the planner searches (``_search``: the auto stacks one trace
finds, their candidates and joint plans), the cost model (``_cost_model``),
compiling and timing candidates (``_compile``), the choice under a budget
(``_choose``), what planning returns (``_results``: ``RematReport``,
``RematPlan``), remembered plans (``_cache``), and the two entry points
(``_plan_remat``, ``_remat_report``).

May import: ``stacktools.core``, ``stacktools.remat``.
"""

from stacktools.planner._plan_remat import plan_remat
from stacktools.planner._remat_report import remat_report
from stacktools.planner._results import RematPlan
from stacktools.planner._results import RematReport
