"""Where the fused decode merge's cost at 32 splits goes (session 46: +4.6 us at B = 1 Skv = 4k,
+4.8-5.8 us at 128k, level at 4 splits; not the merge's step count). The public
``attention_with_kvcache`` (Hq / Hkv = 32 / 8, D = 128, bf16) with the merge kernel and with
the fused merge at every split count, in turns: each kernel's device time from the
profiler (the split kernel alone, the merge kernel, and the gap between them), beside the
public call's time. If the fused split kernel's own time exceeds split + merge, the cost is
inside it (the counters' atomics, the last program's tail: ncu next, ``--run``); if not, it
is between launches.

    python benchmarks/prof_fused_merge.py [--skv 4096 131072] [--splits 4 32]
    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        --section LaunchStats python benchmarks/prof_fused_merge.py --run
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashlse as fl  # noqa: E402
from flashlse.kernels import decode  # noqa: E402

HQ, HKV, D = 32, 8, 128


def make(b: int, skv: int, splits: int):
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, skv, HKV, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), skv, dtype=torch.int32, device="cuda")
    return lambda: fl.attention_with_kvcache(q, k, k, cache_seqlens=lens, num_splits=splits)


def set_form(fused: bool) -> None:
    decode.FUSED_MERGE = fused
    decode.FUSED_MERGE_MAX_SPLITS = 1 << 30
    decode._PLANS.clear()
    import importlib

    importlib.import_module("flashlse.ops.kvcache")._KEPT.clear()


def kernel_times(call, n: int = 50) -> dict:
    """us a call of each kernel (profiler), and the public call's us (events)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    got = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("(")[0][:40]
            got[name] = got.get(name, 0.0) + e.device_time / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    torch.cuda.synchronize()
    got["public call (events)"] = start.elapsed_time(end) / n * 1e3
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skv", type=int, nargs="+", default=[4096, 131072])
    ap.add_argument("--splits", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--run", action="store_true", help="one profiled call a form (ncu)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  B = 1, Hq / Hkv = "
          f"{HQ} / {HKV}, D = {D}, bf16; us a call")
    for skv in args.skv:
        for splits in args.splits:
            call = make(1, skv, splits)
            if args.run:
                for fused in (False, True):
                    set_form(fused)
                    for _ in range(5):
                        call()
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                    call()
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                continue
            rows = {}
            for turn in range(4):  # in turns: the clocks drift
                for fused in ((False, True) if turn % 2 == 0 else (True, False)):
                    set_form(fused)
                    for name, us in kernel_times(call).items():
                        rows.setdefault((fused, name), []).append(us)
            print(f"--- Skv = {skv}, {splits} splits")
            for (fused, name), us in sorted(rows.items()):
                print(f"  {'fused' if fused else 'merge kernel':<13} {name:<40} "
                      f"{sorted(us)[len(us) // 2]:8.2f}")


if __name__ == "__main__":
    main()
