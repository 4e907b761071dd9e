"""Issue 18's B = 128 Skv = 4k row under Nsight Compute: the dense MLA decode (Hq = 128,
576 / 512, paged 64, ``num_splits=1``: a program per (sequence, 64-head tile)) in one wave
(B = 66: 132 programs on the H200's 132 SMs) and in two (B = 132), at n 64-key tiles a
program. ``mla_fixed_cost.py`` found the two-wave tile 8% slower than the one-wave tile
(2.30 against 2.12 us). The hypothesis to test: in one wave the two head tiles of a sequence
start together, so the second reads each K tile from L2; in the second wave they start as
SMs free up, apart, and both read it from memory. Then the second wave's DRAM bytes per
tile approach twice the first's and its L2 hit rate drops, which ncu shows per launch
(session 27, call 1: refuted, L2 hit rate 44.1% over one wave and 46.8% over two;
RESULTS.md):

    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --csv --page details python3 benchmarks/ncu_mla.py --run > ncu_mla.csv
    python3 benchmarks/ncu_bwd.py --read ncu_mla.csv

``--run`` warms each shape, then profiles (``cudaProfilerStart`` / ``Stop``) one public call
at B = 66 and one at B = 132, n = 64 (``--tiles``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run(tiles: int) -> None:
    import torch
    from mla_fixed_cost import mla_call

    calls = [mla_call(b, tiles) for b in (66, 132)]
    for _ in range(3):
        for call in calls:
            call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="store_true", help="the profiled program (under ncu)")
    ap.add_argument("--tiles", type=int, default=64, help="64-key tiles a program")
    args = ap.parse_args()
    if args.run:
        run(args.tiles)
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
