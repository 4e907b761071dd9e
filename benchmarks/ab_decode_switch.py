"""A kernel switch's A/B through the public GQA decode call, ``attention_with_kvcache`` (Hq /
Hkv = 32 / 8, D = 128, bf16, one query row), with a module flag on and off, timed in turn
(``_common.flag_ab_ms``), cuDNN's SDPA on the same keys beside it.

    python benchmarks/ab_decode_switch.py --flag decode.FUSED_MERGE

Rows: issue 15's decode shapes (B = 1 Skv = 128k, B = 8 / 64 / 128 at 8k; the small ones
split their keys), two host-bound small splits (B = 1 and 8 at 4k) and a paged 16 row.
Each row also says whether both sides wrote the same bits. Written for session 45's fused
split-KV merge (``decode.FUSED_MERGE``: one launch less a split call).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repo root last: a PYTHONPATH tree (an in-turn A/B's .before) comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import flag_ab_args, flag_ab_ms, flag_runs  # noqa: E402

import flashlse as fl  # noqa: E402

HQ, HKV, D = 32, 8, 128
# (label, B, Skv, page)
ROWS = [("B=1 Skv=128k", 1, 131072, None), ("B=8 Skv=8k", 8, 8192, None),
        ("B=64 Skv=8k", 64, 8192, None), ("B=128 Skv=8k", 128, 8192, None),
        ("B=1 Skv=4k", 1, 4096, None), ("B=8 Skv=4k", 8, 4096, None),
        ("B=8 Skv=8k paged 16", 8, 8192, 16)]


def row(flag, label, b, skv, page):
    dt = torch.bfloat16
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=dt)
    k = torch.randn(b, skv, HKV, D, device="cuda", dtype=dt)
    v = torch.randn(b, skv, HKV, D, device="cuda", dtype=dt)
    lens = torch.full((b,), skv, dtype=torch.int32, device="cuda")
    table = None
    if page:
        per = skv // page
        table = torch.randperm(b * per, device="cuda").view(b, per).to(torch.int32)
        kp = torch.empty(b * per, page, HKV, D, device="cuda", dtype=dt)
        vp = torch.empty_like(kp)
        kp[table.flatten().long()] = k.reshape(b * per, page, HKV, D)
        vp[table.flatten().long()] = v.reshape(b * per, page, HKV, D)
        k, v = kp, vp

    def call():
        return fl.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table)

    qt = q.transpose(1, 2)
    kt, vt = (None, None) if page else (k.transpose(1, 2), v.transpose(1, 2))

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    ms = flag_ab_ms(flag, call, peers=() if page else (cudnn,))
    on, off, restore = flag_runs(flag, call)
    same = torch.equal(on(), off())
    restore()
    gbs = 2 * b * skv * HKV * D * 2 / 1e6
    return label, ms, gbs, same


def main() -> None:
    flag = flag_ab_args()
    only = os.environ.get("AB_ROWS")  # (e.g. AB_ROWS="B=1 Skv=128k;B=1 Skv=4k")
    rows = [row(flag, *r) for r in ROWS if only is None or r[0] in only.split(";")]
    print("| row | ms on | off | on/off | GB/s on | off | cuDNN ms | same bits |")
    print("|---|---|---|---|---|---|---|---|")
    for label, ms, gbs, same in rows:
        peer = f"{ms[2]:.4f}" if len(ms) > 2 else "-"
        print(f"| {label} | {ms[0]:.4f} | {ms[1]:.4f} | {ms[0] / ms[1]:.3f} | "
              f"{gbs / ms[0]:.0f} | {gbs / ms[1]:.0f} | {peer} | {same} |")


if __name__ == "__main__":
    main()
