"""Merge bandwidth: the public ``flashlse.merge_states`` merging N states of 256 MB in total,
and at N = 2 the public ``flashlse.merge`` of two separate tensors (``--kernel-only``: the
launcher ``kernels.combine.merge_states_fwd`` alone).

Bandwidth = (bytes of the N outs and lses read + bytes of out and lse written) / time,
against a device-to-device copy (bytes read plus written) measured in the same process,
and against the same merge written in eager torch (the unfused formula of docs/design.md §1).
About 30% of the lse entries are -inf (empty states), as after a split-KV decode.

    python benchmarks/bench_merge.py [--out DIR] [--kernel-only]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch
import triton

# The repo root last: a PYTHONPATH tree (h200_session.sh in_turn's .before) comes first.
sys.path.append(os.path.join(os.path.dirname(__file__), ".."))

from _common import median_ms  # noqa: E402

import flashlse as fl  # noqa: E402
from flashlse.kernels.combine import merge_states_fwd  # noqa: E402

# --smoke: 1 MB on the CPU under TRITON_INTERPRET=1, to check the script itself.
SMOKE = "--smoke" in sys.argv
# Median milliseconds (one host-timed call under --smoke).
bench = functools.partial(median_ms, smoke=SMOKE, rep=150)
DEV = "cpu" if SMOKE else "cuda"
TOTAL = 2**20 if SMOKE else 256 * 1024**2


def torch_merge(outs, lses):
    m = lses.amax(0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m)
    tot = w.sum(0)
    inv = torch.where(tot > 0, 1 / tot, torch.zeros_like(tot))
    out = ((w * inv).unsqueeze(-1) * outs.float()).sum(0).to(outs.dtype)
    return out, torch.log(tot) + m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--kernel-only", action="store_true")
    args = ap.parse_args()
    dev = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    date = time.strftime("%Y-%m-%d")
    x = torch.randn(TOTAL * 4 // 2, device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_gbs = 2 * x.numel() * 2 / bench(lambda: y.copy_(x)) / 1e6
    rows = []
    for d in (128, 512):
        for n in (2, 4, 8):
            r = TOTAL // (n * d * 2)
            outs = torch.randn(n, r, d, device=DEV, dtype=torch.bfloat16)
            lses = torch.randn(n, r, device=DEV) * 3
            lses[torch.rand(n, r, device=DEV) < 0.3] = float("-inf")
            out, lse = merge_states_fwd(outs, lses)
            ref_out, ref_lse = torch_merge(outs, lses)
            maxdiff = float((out.float() - ref_out.float()).abs().max())
            nbytes = outs.numel() * 2 + lses.numel() * 4 + out.numel() * 2 + lse.numel() * 4
            # The public call by default; --kernel-only: the launcher, without validation.
            merge = merge_states_fwd if args.kernel_only else fl.merge_states
            ms = bench(lambda outs=outs, lses=lses, merge=merge: merge(outs, lses))
            ms_t = bench(lambda outs=outs, lses=lses: torch_merge(outs, lses))
            row = dict(n=n, d=d, rows=r, ms=ms, gbs=nbytes / ms / 1e6, torch_ms=ms_t,
                       torch_gbs=nbytes / ms_t / 1e6, maxdiff=maxdiff)
            if n == 2 and not args.kernel_only:
                # The public two-state ``merge`` of two separate tensors (read in place, not
                # stacked first): the same bytes as merge_states' N = 2.
                pa, pb = (outs[0].clone(), lses[0].clone()), (outs[1].clone(), lses[1].clone())
                pair = functools.partial(fl.merge, *pa, *pb, layout="rows")
                diff = float((pair()[0].float() - out.float()).abs().max())
                ms_p = bench(pair)
                row.update(pair_ms=ms_p, pair_gbs=nbytes / ms_p / 1e6, pair_maxdiff=diff)
                del pa, pb
            rows.append(row)
            del outs, lses
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "merge.json"), "w") as f:
        json.dump(dict(date=date, device=dev, torch=torch.__version__, triton=triton.__version__,
                       copy_gbs=copy_gbs, rows=rows), f, indent=1)
    md = [f"| {date} | merge_states | N={r['n']} D={r['d']} bf16, 256 MB of states | {dev} | "
          f"torch {torch.__version__}, triton {triton.__version__} | {r['gbs']:.0f} GB/s "
          f"({r['gbs'] / copy_gbs:.2f}x copy {copy_gbs:.0f}); eager torch {r['torch_gbs']:.0f} |"
          for r in rows]
    md += [f"| {date} | merge (two tensors) | D={r['d']} bf16, 256 MB of states | {dev} | "
           f"torch {torch.__version__}, triton {triton.__version__} | {r['pair_gbs']:.0f} GB/s "
           f"({r['pair_gbs'] / copy_gbs:.2f}x copy {copy_gbs:.0f}) |"
           for r in rows if "pair_gbs" in r]
    with open(os.path.join(args.out, "merge_rows.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"\nmerge: {dev} torch {torch.__version__} triton {triton.__version__} "
          f"copy {copy_gbs:.0f} GB/s")
    for r in rows:
        print(f"N={r['n']} D={r['d']:>3}  {r['gbs']:6.0f} GB/s  {r['gbs'] / copy_gbs:.2f}x copy  "
              f"torch eager {r['torch_gbs']:6.0f} GB/s  maxdiff {r['maxdiff']:.2e}")
        if "pair_gbs" in r:
            print(f"  merge of two tensors: {r['pair_gbs']:6.0f} GB/s  "
                  f"{r['pair_gbs'] / copy_gbs:.2f}x copy  vs merge_states {r['pair_maxdiff']:.1e}")


if __name__ == "__main__":
    main()
