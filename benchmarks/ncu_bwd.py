"""Where the backward's time goes, against cuDNN's, kernel by kernel (Nsight Compute).

Issue 22's backward gap (0.74-0.91x cuDNN at S = 1k-16k, the dK/dV pass) is to be understood
before it is changed. This script is the profiled program and the reader of its report:

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --csv --page details python3 benchmarks/ncu_bwd.py --run > ncu.csv
    python3 benchmarks/ncu_bwd.py --read ncu.csv

``--run`` compiles and warms both backward paths, then profiles (``cudaProfilerStart`` /
``Stop``) one public ``fl.attention`` forward + backward and one of SDPA's cuDNN backend on
the same tensors (B*S = 16k, H = 16, D = 128, bf16, causal unless ``--full``). ``--read``
prints a row a kernel: duration, SM and memory throughput, registers, achieved occupancy,
issue-slot use and the cycles a warp waits between issues.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import OrderedDict

# Report metrics (their Nsight Compute names) and the column each prints under.
COLUMNS = OrderedDict([
    ("Duration", "us"),
    ("Compute (SM) Throughput", "SM %"),
    ("Memory Throughput", "mem %"),
    ("Registers Per Thread", "regs"),
    ("Achieved Occupancy", "occ %"),
    ("Issue Slots Busy", "issue %"),
    ("Warp Cycles Per Issued Instruction", "cyc/issue"),
    ("DRAM Throughput", "dram %"),
    ("L2 Hit Rate", "L2 hit %"),
])


def run(s: int, causal: bool, d: int = 128, forward: bool = False) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import flashlse as fl

    b, h = 16384 // s, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda: torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16,
                             requires_grad=True)
    q, k, v = mk(), mk(), mk()
    dout = torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
    qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))

    def ours():
        out = fl.attention(q, k, v, causal=causal)
        if not forward:
            out.backward(dout)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = sdpa(qh, kh, vh, is_causal=causal)
            if not forward:
                out.backward(dout.transpose(1, 2))

    for _ in range(3):
        ours()
        cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    ours()
    cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def read(path: str) -> None:
    rows: dict = OrderedDict()
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines dropped
    for rec in csv.DictReader(lines):
        key = (rec["ID"], rec["Kernel Name"])
        name = rec["Metric Name"]
        if name in COLUMNS:
            value = rec["Metric Value"].replace(",", "")
            if name == "Duration" and rec["Metric Unit"] in ("nsecond", "ns"):
                value = f"{float(value) / 1000:.1f}"
            elif name == "Duration" and rec["Metric Unit"] in ("msecond", "ms"):
                value = f"{float(value) * 1000:.1f}"
            rows.setdefault(key, {})[name] = value
    print(f"{'kernel':<44} " + " ".join(f"{c:>9}" for c in COLUMNS.values()))
    for (kid, kernel), vals in rows.items():
        label = f"{kid} {kernel}"[:44]
        print(f"{label:<44} " + " ".join(f"{vals.get(m, '-'):>9}" for m in COLUMNS))


# Counters ``pipes`` prints where the report has them (``--metrics``): instructions issued
# in all, by the MUFU (XU) pipe, and by the tensor pipe, to compare per tile.
COUNTERS = ("smsp__inst_executed.sum", "smsp__inst_executed_pipe_xu.sum",
            "sm__inst_executed_pipe_tensor_op_gmma.sum", "sm__cycles_elapsed.max")


def pipes(path: str) -> None:
    """A raw-page report (``--page raw --csv``, sections ComputeWorkloadAnalysis and
    WarpStateStats): per kernel, its duration, each pipe's utilisation and the reasons its
    warps stall, the largest first."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    recs = list(csv.DictReader(lines))
    for r in recs[1:]:  # the first row holds the units
        name = r.get("Kernel Name", "?")[:60]
        print(f"== {r.get('ID')} {name}  {r.get('gpu__time_duration.sum', '-')} ns")
        for col in COUNTERS:
            if col in r:
                print(f"  count {r[col]:>16}  {col}")
        picked = []
        for col, val in r.items():
            try:
                v = float(str(val).replace(",", ""))
            except ValueError:
                continue
            if "pct_of_peak_sustained_active" in col and "pipe" in col:
                picked.append((v, col))
        for v, col in sorted(picked, reverse=True)[:12]:
            print(f"  pipe  {v:7.1f}%  {col}")
        stalls = []
        for col, val in r.items():
            if col.startswith("smsp__average_warp_latency_issue_stalled_") or (
                    col.startswith("smsp__average_warps_issue_stalled_")
                    and col.endswith("_per_issue_active.ratio")):
                try:
                    stalls.append((float(str(val).replace(",", "")), col))
                except ValueError:
                    pass
        for v, col in sorted(stalls, reverse=True)[:10]:
            print(f"  stall {v:7.2f}   {col}")


def source(path: str, top: int = 40) -> None:
    """Where a kernel's warps wait, instruction by instruction: the report's source page
    (``ncu -i REP --page source --csv --print-source sass``), its warp-state samples summed
    by opcode, then the ``top`` instructions with the most samples (address, samples, text)."""
    from collections import Counter

    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    # The table starts at its header row (a "Kernel Name" line comes first).
    head = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), 0)
    recs = list(csv.DictReader(lines[head:]))
    if not recs:
        print("no rows")
        return
    cols = list(recs[0])
    text = next((c for c in cols if c.lower() in ("source", "sass")), cols[1])
    addr = next((c for c in cols if "address" in c.lower()), cols[0])
    samp = [c for c in cols if "sampling" in c.lower()]
    print("columns:", ", ".join(cols))

    def num(v):
        try:
            return float(str(v).replace(",", ""))
        except ValueError:
            return 0.0

    key = samp[0] if samp else cols[-1]
    by_op: Counter = Counter()
    total = 0.0
    for r in recs:
        n = num(r.get(key))
        total += n
        words = [w for w in r[text].split() if not w.startswith("@")]
        by_op[words[0] if words else "?"] += n
    print(f"{key}: {total:.0f} samples")
    for op, n in by_op.most_common(25):
        print(f"  {op:<36} {n:9.0f} {100 * n / max(total, 1):5.1f}%")
    print(f"top {top} instructions:")
    for r in sorted(recs, key=lambda r: -num(r.get(key)))[:top]:
        extra = " ".join(f"{num(r.get(c)):.0f}" for c in samp[1:3])
        print(f"  {r[addr]:>8} {num(r.get(key)):8.0f} {extra:>12}  {r[text][:70]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="store_true", help="the profiled program (under ncu)")
    ap.add_argument("--read", metavar="CSV", help="print the report's table")
    ap.add_argument("--source", metavar="CSV", help="summarise a source-page CSV")
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--full", action="store_true", help="no causal mask")
    ap.add_argument("--dim", type=int, default=128, help="head dim (H * D = 2048)")
    ap.add_argument("--forward", action="store_true", help="the forward alone")
    ap.add_argument("--pipes", metavar="CSV", help="print a raw-page report's pipes, stalls")
    args = ap.parse_args(argv)
    if args.run:
        run(args.seqlen, not args.full, args.dim, args.forward)
    elif args.read:
        read(args.read)
    elif args.pipes:
        pipes(args.pipes)
    elif args.source:
        source(args.source)
    else:
        ap.print_help()
        sys.exit(2)


if __name__ == "__main__":
    main()
