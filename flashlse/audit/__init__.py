"""The empty-row audit (``python -m flashlse audit``): every attention backend this machine has,
run on eight cases in which a row sees no key, judged by one rule.

Each cell is what ``out`` and ``lse`` were on the empty rows, and whether ``flashlse.merge`` of
that state -- after ``flashlse.lse.to_canonical`` with the backend's convention -- against a
state that is non-empty on some rows and empty on others equals the float64 reference merge.
flashlse's own cells are judged strictly: no conversion, ``out = 0`` and ``lse = -inf`` (or the
sink) on the empty rows, merge exact; the exit code is 1 only when one fails. Backends with
native kernels run in a child process (``python -m flashlse _worker``), so a peer that dies
(torch's CPU flash kernel raises SIGFPE for Sk = 0) or poisons the CUDA context costs one cell.

``cases`` holds the cases and what flashlse must give, ``backends`` one runner per backend,
``report`` the verdicts, the child processes and the table / JSON report.
"""

from .backends import BACKENDS, RUNNERS, merge_naive, merge_sigmoid
from .cases import CASES, NotApplicable, expected, make_case
from .report import JSON_FIELDS, LEGEND, WORKER_MARK, audit, format_table, judge, run_cell

__all__ = ["BACKENDS", "CASES", "JSON_FIELDS", "LEGEND", "RUNNERS", "WORKER_MARK",
           "NotApplicable", "audit", "expected", "format_table", "judge", "make_case",
           "merge_naive", "merge_sigmoid", "run_cell"]
