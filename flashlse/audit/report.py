"""The audit's verdicts and report: each cell judged by one rule (the empty rows' out and lse,
then flashlse.merge of the state after the backend's declared conversion against the float64
reference; NaN never passes), backends run in child processes where a crash must cost one cell,
the JSON report and the table."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .backends import BACKENDS, CPU_ONLY, CUDA_ONLY, NATIVE_CPU, OPTIONAL, RUNNERS
from .cases import ATTN_CASES, CASES, MERGE_CASES, H, NoOutput, NotApplicable, expected, make_case

# Short names of the conversions shown after a check mark.
CONV_SHORT = {"fa2": "fa2", "fa3": "fa3", "sdpa_efficient": "eff", "flashinfer": "fi",
              "sigmoid_merge": "fold"}

WORKER_MARK = "@@cell "


def _kind_out(o: torch.Tensor) -> str:
    if o.numel() == 0:
        return "none"
    if bool(torch.isnan(o).any()):
        return "NaN"
    if bool(torch.isinf(o).any()):
        return "inf"
    return "0" if bool((o == 0).all()) else "fin"


def _kind_lse(l: torch.Tensor, sink: torch.Tensor | None) -> str:
    if l.numel() == 0:
        return "none"
    if bool(torch.isnan(l).any()):
        return "NaN"
    for name, hit in (("-inf", torch.isneginf(l)), ("+inf", torch.isposinf(l)), ("0", l == 0)):
        if bool(hit.all()):
            return name
    if not bool(torch.isfinite(l).all()):
        return "mixed"
    if sink is not None and bool(torch.allclose(l, sink, atol=1e-3, rtol=0)):
        return "sink"
    return "fin"


def _tolerance(dtype):
    return (2e-5, 1e-4) if dtype in (torch.float32, torch.float64) else (2e-2, 2e-2)


def _other_state(ref_out, device):
    """A state non-empty on even rows and empty (0, -inf) on odd rows, shaped like ``ref``."""
    g = torch.Generator().manual_seed(1)
    shape = ref_out.shape
    out = torch.randn(shape, generator=g, dtype=torch.float64)
    lse = torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    odd = (torch.arange(lse.numel()) % 2 == 1).view(lse.shape)
    lse = lse.masked_fill(odd, -math.inf)
    out = out.masked_fill(odd.unsqueeze(-1), 0.0)
    return out.to(device), lse.to(device)


def _merge_exact(c, out_s, lse_c):
    """flashlse.merge(state, other) == reference.merge(true state, other)."""
    from .. import reference
    from ..ops import merge

    ref_out, ref_lse = c["ref"]
    o_out, o_lse = _other_state(ref_out, out_s.device)
    try:
        got_out, got_lse = merge(out_s.float(), lse_c.float(), o_out.float(), o_lse.float())
    except ValueError:
        # flashlse refuses a non-canonical state (+inf / NaN LSE): not mergeable as is.
        return False
    want_out, want_lse = reference.merge(ref_out, ref_lse, o_out, o_lse)
    atol, rtol = _tolerance(c["dtype"])
    if bool(torch.isnan(got_out).any() or torch.isnan(got_lse).any()):
        return False
    if not torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse)):
        return False
    fin = torch.isfinite(want_lse)
    if not bool(torch.isfinite(got_lse[fin]).all()):
        return False
    ok_lse = torch.allclose(got_lse[fin].double(), want_lse[fin], atol=atol, rtol=rtol)
    ok_out = torch.allclose(got_out.double(), want_out, atol=atol, rtol=rtol)
    return bool(ok_lse and ok_out)


def _why_wrong(c, lse_c, e) -> str:
    ref = c["ref"][1]
    rows = ~e & torch.isfinite(ref)
    if not bool(rows.any()):
        return "the state differs from the reference (the merge result is wrong)"
    d = (lse_c[rows].double() - ref[rows]).abs().max().item()
    return (f"non-empty rows: max |lse - reference| = {d:.3g}" +
            (" (the mask was not applied as asked)" if d > 1e-2 else ""))


def judge(backend: str, c: dict, out, lse, convention) -> dict:
    """Classifies the empty rows of one result and runs the merge check."""
    from ..lse import to_canonical

    if c["id"] in MERGE_CASES:
        out_s = out
    else:
        out_s = out.transpose(1, 2)
        if out_s.shape[:-1] != c["empty"].shape:
            raise RuntimeError(f"out has shape {tuple(out.shape)}, expected rows "
                               f"{tuple(c['empty'].shape)}")
    e = c["empty"]
    sink = None
    if c["sink"] is not None:
        sink = c["sink"].float().view(1, H, 1).expand_as(e)[e]
    cell = {"status": "ok", "out": _kind_out(out_s[e]), "lse": "n/a", "merge": None,
            "conv": None, "verdict": None}
    if lse is None:
        cell["text"] = f"{cell['out']}/(no lse)"
        cell["detail"] = "the backend returns no LSE"
        return cell
    lse = lse.reshape(e.shape)
    cell["lse"] = _kind_lse(lse[e].float(), sink)
    strict = convention is None
    if strict:
        lse_c, n_fold = lse, 0
    else:
        kw = {"key_counts": c["counts"]} if convention == "sdpa_efficient" else {}
        lse_c, n_fold = to_canonical(lse, convention, return_count=True, **kw)
    cell["merge"] = _merge_exact(c, out_s, lse_c)
    if not cell["merge"]:
        cell["detail"] = _why_wrong(c, lse_c, e)
    # NaN is never a pass: a NaN out on the rows judged is wrong whatever its lse says.
    if cell["out"] == "NaN":
        cell["merge"] = False
        cell["detail"] = "NaN in out on the rows judged"
    cell["verdict"] = "pass" if cell["merge"] else "fail"
    mark = "✓" if cell["merge"] else "✗"
    if cell["merge"] and c["id"] == "merge_inf":
        cell["conv"] = "fa2"  # the input state's conversion, the same for every merge
    elif cell["merge"] and not strict and convention != "canonical":
        cell["conv"] = CONV_SHORT.get(convention, convention)
    elif cell["merge"] and n_fold:
        cell["conv"] = "fold"
    if cell["conv"]:
        mark += f"({cell['conv']})"
    cell["text"] = f"{cell['out']}/{cell['lse']} {mark}"
    return cell


def run_cell(backend: str, case_id: str, device: str) -> dict:
    try:
        c = make_case(case_id, device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, lse, conv = RUNNERS[backend](c)
        return judge(backend, c, out, lse, conv)
    except NotApplicable as err:
        return {"status": "na", "text": f"n/a: {err}", "detail": str(err)}
    except ImportError as err:
        return {"status": "na", "text": "n/a: no kernel" if backend.startswith("flashlse")
                else "n/a: missing", "detail": f"{type(err).__name__}: {err}"}
    except Exception as err:  # a peer's failure is a finding, reported in its cell
        msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
        short = "no output" if isinstance(err, NoOutput) else type(err).__name__
        return {"status": "error", "text": f"err: {short}"[:24],
                "detail": f"{type(err).__name__}: {msg}"[:300]}


def _worker(argv):
    backend, device, cases = argv[0], argv[1], argv[2].split(",")
    torch.manual_seed(0)
    for case_id in cases:
        cell = run_cell(backend, case_id, device)
        cell.update(backend=backend, case=case_id)
        print(WORKER_MARK + json.dumps(cell), flush=True)
    return 0


def _death(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"rc {rc}"


def _run_isolated(backend: str, device: str, cases: list[str], timeout: float) -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    cells, remaining = {}, list(cases)
    deadline = time.monotonic() + timeout
    while remaining:
        cmd = [sys.executable, "-m", "flashlse", "_worker", backend, device, ",".join(remaining)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=root)
        timed_out = False
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            timed_out = True
        for line in stdout.splitlines():
            if line.startswith(WORKER_MARK):
                cell = json.loads(line[len(WORKER_MARK):])
                cells[cell["case"]] = cell
        remaining = [r for r in remaining if r not in cells]
        if not remaining:
            break
        last = (stderr.strip().splitlines() or [""])[-1][:300]
        if timed_out:
            for r in remaining:
                cells[r] = {"status": "error", "text": "err: timeout",
                            "detail": f"no result within {timeout:.0f} s"}
            break
        # The child died on the first case it did not report.
        why = _death(proc.returncode)
        cells[remaining.pop(0)] = {"status": "crash", "text": f"crash: {why}",
                                   "detail": f"the process died ({why}) {last}".strip()}
    return cells


def _plan(device: str) -> tuple[list[str], list[str]]:
    rows, missing = [], []
    for name in BACKENDS:
        if name in OPTIONAL and importlib.util.find_spec(OPTIONAL[name]) is None:
            missing.append(name)
            continue
        rows.append(name)
    return rows, missing


def audit(device: str = "cpu", isolate: bool = True, timeout: float | None = None,
          backends=None) -> dict:
    """Runs every (backend, case) cell (of the ``backends`` named, default all);
    returns the JSON-able report."""
    t0 = time.perf_counter()
    rows, missing = _plan(device)
    if backends is not None:
        rows = [r for r in rows if r in backends]
    timeout = timeout or (50.0 if device == "cpu" else 240.0)
    cells: dict[tuple[str, str], dict] = {}
    jobs = []
    for name in rows:
        runs = BACKENDS[name][1]
        for case_id, _, _ in CASES:
            if case_id not in runs:
                cells[name, case_id] = {"status": "skip", "text": "·",
                                        "detail": "not a case of this function"}
            elif device == "cpu" and name in CUDA_ONLY:
                cells[name, case_id] = {"status": "na", "text": "n/a: needs CUDA",
                                        "detail": "a CUDA-only kernel"}
            elif device != "cpu" and name in CPU_ONLY:
                cells[name, case_id] = {"status": "na", "text": "n/a: CPU only",
                                        "detail": "a CPU-only kernel"}
        todo = [c for c in runs if (name, c) not in cells]
        if todo:
            jobs.append((name, todo))
    # Pure-PyTorch paths cannot kill the process on a CPU; native kernels (and anything on
    # CUDA, where one illegal access poisons the context) run in child processes, in
    # threads, while the pure-PyTorch cells run here.
    apart = [j for j in jobs if isolate and (device != "cpu" or j[0] in NATIVE_CPU)]
    here = [j for j in jobs if j not in apart]
    workers = max(1, min(len(apart), os.cpu_count() or 1, 6))
    with ThreadPoolExecutor(workers) as pool:
        futures = [(name, pool.submit(_run_isolated, name, device, todo, timeout))
                   for name, todo in apart]
        for name, todo in here:
            for case_id in todo:
                cells[name, case_id] = run_cell(name, case_id, device)
        for name, fut in futures:
            for case_id, cell in fut.result().items():
                cells[name, case_id] = cell
    violations = []
    for (name, case_id), cell in cells.items():
        cell.setdefault("backend", name)
        cell.setdefault("case", case_id)
        if not name.startswith("flashlse") or cell["status"] in ("skip", "na"):
            continue
        want = expected(case_id)
        if cell["status"] != "ok" or (cell["out"], cell["lse"]) != want or not cell["merge"]:
            violations.append(f"{name} / {case_id}: {cell['text']} ({cell.get('detail', '')})")
    return {
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cases": [{"id": i, "title": t, "what": w} for i, t, w in CASES],
        "backends": [{"name": n, "what": BACKENDS[n][0]} for n in rows],
        "not_installed": missing,
        "cells": [cells[n, c] for n in rows for c, _, _ in CASES],
        "violations": violations,
        "fields": JSON_FIELDS,
        "seconds": round(time.perf_counter() - t0, 1),
    }


JSON_FIELDS = {
    "cells[].status": "how the backend ran: ok (it returned a result), na (it cannot run this "
                      "case), skip (not this kind of function), error (it raised), crash (its "
                      "process died)",
    "cells[].out / lse": "what out and lse were on the rows that see no key (merges: the "
                         "whole result): 0, NaN, fin, inf / -inf, +inf, 0, fin, NaN, sink",
    "cells[].merge": "true when flashlse.merge of this state (after conversion) with a "
                     "half-empty state equals the float64 reference merge and out has no NaN",
    "cells[].verdict": "pass / fail: the ✓ / ✗ of the table (null when there is no lse)",
    "cells[].conv": "the conversion that made it pass (fa2, eff, fi, fold), null for none",
    "violations": "flashlse cells that break the contract (0/-inf or 0/sink on empty rows, "
                  "merge exact, no conversion): the exit code is 1 when there is one",
}


LEGEND = """\
cell = out/lse on the rows that see no key (merges: the whole result), then the merge check
  out: 0 | NaN | fin (finite, non-zero) | inf      lse: -inf | +inf | 0 | fin | NaN | sink
  ✓  flashlse.merge of the state with one that is non-empty on some rows and empty on
     others equals the float64 reference merge (-inf where it should be, no NaN, close)
  ✓(fa2) ✓(eff) ✓(fi) ✓(fold)  ... only after lse.to_canonical(lse, convention): fa2 = +inf
     empty; eff = sdpa_efficient, 0 for empty rows, needs the key counts; fi = FlashInfer
     base 2; fold = "sigmoid_merge": its NaN for two empty states folded to -inf
  ✗  the merge is wrong even after conversion, or out holds NaN (NaN never passes)
  (no lse): none returned;   · not this function
  merge +inf: every merge gets the input converted from fa2's +inf first (✓(fa2))
  flashlse cells are judged without conversion: contract = 0/-inf (0/sink) ✓; a flashlse
  cell that breaks it is listed under CONTRACT VIOLATIONS and the exit code is 1"""


def format_table(report: dict) -> str:
    titles = [c["title"] for c in report["cases"]]
    names = [b["name"] for b in report["backends"]]
    by = {(c["backend"], c["case"]): c for c in report["cells"]}
    ids = [c["id"] for c in report["cases"]]
    widths = [max(len(titles[j]), *(len(by[n, ids[j]]["text"]) for n in names))
              for j in range(len(ids))]
    w0 = max(len("backend"), *map(len, names))
    line = lambda first, cols: "  ".join([first.ljust(w0)] + [s.ljust(w) for s, w in
                                                                zip(cols, widths)]).rstrip()
    out = [f"flashlse audit: empty rows on {report['device']}, torch {report['torch']} "
           f"({report['seconds']} s)", "",
           line("backend", titles), line("-" * w0, ["-" * w for w in widths])]
    for n in names:
        out.append(line(n, [by[n, i]["text"] for i in ids]))
    out += ["", LEGEND, "", "cases:"]
    out += [f"  {c['title']:<14} {c['what']}" for c in report["cases"]]
    notes = [c for c in report["cells"] if c["status"] in ("error", "crash")
             or (c["status"] == "ok" and c["merge"] is False and c["case"] in ATTN_CASES)]
    if notes:
        out += ["", "notes:"]
        out += [f"  {c['backend']} / {c['case']}: {c['detail'][:110]}" for c in notes]
    if report["not_installed"]:
        out += ["", "not installed: " + ", ".join(report["not_installed"])]
    if report["violations"]:
        out += ["", "CONTRACT VIOLATIONS (flashlse):"] + [f"  {v}" for v in report["violations"]]
    return "\n".join(out)
