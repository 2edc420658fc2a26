"""The remat planner: ``plan_remat`` and ``remat_report``.

Holds the planner's shared terms (``_stack_info``: what a stack is, and a
plan fixed per stack; ``_budget``: bytes and budgets), what it searches
(``_search``: each stack's candidates and the joint plans), the cost model
(``_cost_model``), one trace of a step (``_trace``: its auto stacks and their
models), compiling and timing candidates (``_compile``), the choice under a
budget (``_choose``), what planning returns (``_results``: ``RematReport``,
``RematPlan``), remembered plans (``_cache``), and the two entry points
(``_plan_remat``, ``_remat_report``).

May import: ``stacktools.core``, ``stacktools.remat``.
"""

from stacktools.planner._plan_remat import plan_remat
from stacktools.planner._remat_report import remat_report
from stacktools.planner._results import RematPlan
from stacktools.planner._results import RematReport
