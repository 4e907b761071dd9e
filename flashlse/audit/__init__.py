"""The empty-row audit (``python -m flashlse audit``): every attention backend this machine has,
run on eight cases in which a row sees no key, judged by one rule.

``cases`` holds the cases and what flashlse must give, ``backends`` one runner per backend,
``report`` the verdicts, the child processes and the table / JSON report.
"""

from .backends import BACKENDS, RUNNERS, merge_naive, merge_sigmoid
from .cases import CASES, NotApplicable, expected, make_case
from .report import JSON_FIELDS, LEGEND, WORKER_MARK, audit, format_table, judge, run_cell

__all__ = ["BACKENDS", "CASES", "JSON_FIELDS", "LEGEND", "RUNNERS", "WORKER_MARK",
           "NotApplicable", "audit", "expected", "format_table", "judge", "make_case",
           "merge_naive", "merge_sigmoid", "run_cell"]
