"""Issue 18: the dense MLA decode's fixed cost a program, measured rather than fitted from
the bar rows. One program walks the 64-key tiles of one (sequence, head tile) with
``num_splits=1``; at B = 66 (132 programs of 64 heads on the H200's 132 SMs: one wave) the
kernel's time is ``t0 + b n`` for n tiles, and t0 is the program's fixed part plus the
launch. B = 132 (two waves) should read ``2 (t0 + b n)`` less one launch. Timed as CUDA-graph
replays of the public call (paged 64, Hq = 128, 576 / 512), n = 1 .. 128. Last, t0 at one
and two tiles for 2 to 132 programs: whether the fixed part is a latency chain (the same at
every count) or a wave's start contending for memory (growing with the count).

    python benchmarks/mla_fixed_cost.py
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _common import graph_replay, median_ms  # noqa: E402

import flashlse as fl  # noqa: E402

PAGE = 64


def mla_call(b: int, n: int):
    """The public dense MLA decode of ``b`` sequences of ``n`` 64-key tiles (Hq = 128,
    576 / 512, paged 64, ``num_splits=1``: a program per (sequence, 64-head tile))."""
    skv = n * 64
    pages = max(skv // PAGE, 1)
    q = torch.randn(b, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(b * pages, PAGE, 1, 576, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(b * pages, device="cuda").view(b, pages).to(torch.int32)
    lens = torch.full((b,), skv, dtype=torch.int32, device="cuda")

    def call():
        return fl.attention_with_kvcache(q, cache, cache[..., :512], cache_seqlens=lens,
                                         block_table=table, scale=1 / math.sqrt(576),
                                         num_splits=1)

    return call


def time_us(b: int, n: int) -> float:
    return median_ms(graph_replay(mla_call(b, n)), rep=200) * 1e3


def fit(ns, ts):
    """Least squares ``t = t0 + b n``."""
    k = len(ns)
    mn, mt = sum(ns) / k, sum(ts) / k
    b = sum((n - mn) * (t - mt) for n, t in zip(ns, ts)) / sum((n - mn) ** 2 for n in ns)
    return mt - b * mn, b


def main():
    empty = torch.empty(1, device="cuda")
    launch_us = median_ms(graph_replay(lambda: empty.add_(1)), rep=200) * 1e3
    ns = [1, 2, 4, 8, 16, 32, 64, 128]
    rows = {b: [time_us(b, n) for n in ns] for b in (66, 132)}
    print(f"graph replay of one elementwise kernel: {launch_us:.1f} us")
    print(f"{'n tiles':>8s} " + " ".join(f"{'B=' + str(b) + ' us':>11s}" for b in rows)
          + f" {'ratio':>6s}")
    for i, n in enumerate(ns):
        print(f"{n:8d} " + " ".join(f"{rows[b][i]:11.1f}" for b in rows)
              + f" {rows[132][i] / rows[66][i]:6.2f}")
    for b, ts in rows.items():
        t0, slope = fit(ns[2:], ts[2:])
        waves = b // 66
        print(f"B={b}: fit n>=4: t0 {t0:.1f} us, {slope:.3f} us a tile ({waves} wave(s)); "
              f"per wave t0 {t0 / waves:.1f}, tile {slope / waves:.3f}; at n=64 t0 is "
              f"{t0 / (t0 + 64 * slope):.0%} of the time")
    # Whether the fixed part is a latency chain or the wave's start contending for memory
    # (132 programs loading Q and a first K tile of 74 KB each at once): one and two tiles
    # at 2 to 132 programs in one wave. A latency chain reads the same at every B.
    print(f"{'programs':>9s} {'n=1 us':>8s} {'n=2 us':>8s} {'t0 (n=1 less a tile)':>22s}")
    for b in (1, 4, 16, 33, 66):
        t1, t2 = time_us(b, 1), time_us(b, 2)
        print(f"{2 * b:9d} {t1:8.1f} {t2:8.1f} {t1 - (t2 - t1):22.1f}")


if __name__ == "__main__":
    main()
