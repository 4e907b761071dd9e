"""Benchmark scripts put the repository root last on ``sys.path``, never first: an A/B run
in turns (``benchmarks/h200_session.sh``'s ``in_turn``) selects the earlier tree's package
with ``PYTHONPATH=.before``, which a root inserted at the front would override, so both
sides would time this tree (session 25's first call did, through bench_overhead.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# sys.path.insert(0, <the folder above the script's>): "..", parents[1], dirname(dirname(..)).
_ROOT_FIRST = re.compile(r"sys\.path\.insert\(\s*0\s*,[^\n]*(\"\.\.\"|parents\[1\]|"
                         r"dirname\(os\.path\.dirname\()")


def test_benchmarks_put_the_repo_root_last():
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert scripts
    bad = [f"{p.name}: {m.group(0)}" for p in scripts
           for m in _ROOT_FIRST.finditer(p.read_text())]
    assert not bad, "insert the repo root with sys.path.append, not at the front:\n" + \
        "\n".join(bad)
