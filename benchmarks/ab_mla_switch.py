"""A kernel switch's A/B through the public MLA decode calls: ``attention_with_kvcache`` on a
latent cache and ``sparse_attention``'s top-k decode, with a module flag on and off, timed in
turn (``_common.flag_ab_ms``).

    python benchmarks/ab_mla_switch.py --flag decode_mla_sm90.NAME

Rows (Hq = 128 unless said, 576 / 512, bf16, paged 64 unless said): issue 18's bar shapes
(B = 64 Skv = 8k, one wave of 128 programs; B = 128 Skv = 4k and Sq = 2, two waves), B = 256
Skv = 2k (four), B = 128 at ragged lengths (uniform in [512, 7680], seed 0: a static schedule
meets uneven items), contiguous B = 128 Skv = 4k, Hq = 16 B = 256 Skv = 8k (memory-bound:
GB/s of latent cache) and the top-k decode (B = 128, topk = 2048). Each row also says whether
both sides wrote the same bits. The flag is a boolean module attribute of
``flashlse.kernels`` (the plans, kept launches included, are dropped at each switch,
``_common.flag_runs``). Written for session 27's persistent MLA grid (commit 34fae50, slower:
benchmarks/NOTES.md).
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repo root last: a PYTHONPATH tree (an in-turn A/B's .before) comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import flag_ab_args, flag_ab_ms, flag_runs  # noqa: E402
from bench_mla import inputs, topk_indices  # noqa: E402

import flashlse as fl  # noqa: E402

# (label, B, Skv, Hq, Sq, page, ragged)
ROWS = [("B=64 Skv=8k", 64, 8192, 128, 1, 64, False),
        ("B=128 Skv=4k", 128, 4096, 128, 1, 64, False),
        ("B=64 Skv=8k Sq=2", 64, 8192, 128, 2, 64, False),
        ("B=256 Skv=2k", 256, 2048, 128, 1, 64, False),
        ("B=128 ragged 512-7680", 128, 8192, 128, 1, 64, True),
        ("B=128 Skv=4k contiguous", 128, 4096, 128, 1, None, False),
        ("B=128 Skv=4k page 16", 128, 4096, 128, 1, 16, False),
        ("Hq=16 B=256 Skv=8k", 256, 8192, 16, 1, 64, False)]


def _ab(flag, call):
    """Milliseconds of ``call`` with the flag on and off, timed in turn, and whether both
    sides wrote the same bits."""
    ms = flag_ab_ms(flag, call)
    on, off, restore = flag_runs(flag, call)
    same = torch.equal(on(), off())
    restore()
    return ms, same


def dense_row(flag, label, b, skv, hq, sq, page, ragged):
    q, lat, _, lens, table = inputs(b, skv, hq, sq, page)
    if ragged:
        g = torch.Generator(device="cuda").manual_seed(0)
        lens = torch.randint(512, 7681, (b,), device="cuda", dtype=torch.int32, generator=g)
    keys = int(lens.sum())

    def call():
        return fl.attention_with_kvcache(q, lat, lat[..., :512], cache_seqlens=lens,
                                         block_table=table, causal=sq > 1,
                                         scale=1 / math.sqrt(576))

    ms, same = _ab(flag, call)
    flops = 2 * sq * hq * keys * (576 + 512)
    gbs = keys * 576 * 2 / 1e6
    return label, [flops / t / 1e9 for t in ms], [gbs / t for t in ms], same


def topk_row(flag):
    b, skv, hq, topk = 128, 4096, 128, 2048
    q, lat, _, _, table = inputs(b, skv, hq, 1, 64)
    idx = topk_indices(b, skv, topk, "random")

    def call():
        return fl.sparse_attention(q, lat, lat[..., :512], idx, block_table=table,
                                   scale=1 / math.sqrt(576))

    ms, same = _ab(flag, call)
    flops = 2 * b * hq * topk * (576 + 512)
    return f"top-k B={b} Skv=4k topk={topk}", [flops / t / 1e9 for t in ms], None, same


def main() -> None:
    flag = flag_ab_args()
    rows = [dense_row(flag, *r) for r in ROWS] + [topk_row(flag)]
    print("| row | TFLOP/s on | off | on/off | GB/s on | off | same bits |")
    print("|---|---|---|---|---|---|---|")
    for label, tf, gb, same in rows:
        gb_cells = f"{gb[0]:.0f} | {gb[1]:.0f}" if gb else "- | -"
        print(f"| {label} | {tf[0]:.1f} | {tf[1]:.1f} | {tf[0] / tf[1]:.3f} | {gb_cells} | "
              f"{same} |")


if __name__ == "__main__":
    main()
