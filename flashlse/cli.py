"""``flashlse`` / ``python -m flashlse``: the command line. ``audit`` runs the empty-row audit
(:mod:`flashlse.audit`: cases, backends, report), ``demo`` merges two empty states, ``bench``
lists the benchmark scripts; ``_worker`` is the audit's child process."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from .audit import BACKENDS, audit, format_table, merge_sigmoid
from .audit.report import _worker


def _resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("flashlse audit: --device cuda but torch.cuda.is_available() is False")
    return name


def demo() -> int:
    """Two empty states merged: flashlse's identity vs the sigmoid form's NaN."""
    import flashlse as fl

    out = torch.zeros(1, 4)
    lse = torch.full((1,), -math.inf)
    print("two empty states: out = 0, lse = -inf (the identity of the merge)")
    o, l = fl.merge(out, lse, out, lse)
    print(f"  flashlse.merge      -> out {o[0].tolist()}, lse {l.item()}")
    o, l = merge_sigmoid(out, lse, out, lse)
    print(f"  sigmoid-form merge  -> out {o[0].tolist()}, lse {l.item()}")
    other = (torch.ones(1, 4), torch.zeros(1))
    o, l = fl.merge(*fl.merge(out, lse, out, lse), *other)
    print(f"  flashlse, then merged with (1, 0)  -> out {o[0].tolist()}, lse {l.item()}")
    o, l = merge_sigmoid(*merge_sigmoid(out, lse, out, lse), *other)
    print(f"  sigmoid, then merged with (1, 0)   -> out {o[0].tolist()}, lse {l.item()}")
    return 0


def bench() -> int:
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    scripts = sorted(root.glob("bench_*.py"))
    if not scripts:
        print(f"no benchmark scripts yet under {root}")
        return 0
    print("benchmarks (run on a CUDA machine; results go to benchmarks/RESULTS.md):")
    for s in scripts:
        print(f"  python {s}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(
        prog="flashlse",
        description="flashlse: exact attention whose log-sum-exp means the same on every path. "
                    "Commands: audit (how every attention backend here treats rows that see "
                    "no key), demo (merge two empty states), bench (where the benchmarks are).")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"flashlse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "audit", help="how every backend here treats rows that see no key",
        description="Runs eight cases in which a query row sees no key (or a merge meets an "
                    "empty state) on every attention backend this machine has, and prints "
                    "backend x case: out and lse on the empty rows, and whether flashlse.merge "
                    "of that state (after converting the backend's convention) equals the "
                    "float64 reference. flashlse's own cells are judged with no conversion; "
                    "the exit code is 1 when one breaks the contract.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--backend", action="append", choices=tuple(BACKENDS),
                   help="only this backend (repeatable); default: all")
    p.add_argument("--no-isolate", action="store_true",
                   help="run native kernels in this process too (a crashing peer ends the audit)")
    sub.add_parser("demo", help="merge two empty states: flashlse vs the sigmoid form")
    sub.add_parser("bench", help="where the benchmark scripts are")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo()
    if args.command == "bench":
        return bench()
    report = audit(_resolve_device(args.device), isolate=not args.no_isolate,
                   backends=args.backend)
    print(json.dumps(report, indent=1, ensure_ascii=False) if args.json else format_table(report))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
