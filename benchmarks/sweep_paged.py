"""Tile sweep of the paged forward (kernels/fwd.py ``_attn_fwd_paged_kernel``) on issue 16's
chunked prefill (B=4, Sq=512 on an 8k cache, page 16, Hq/Hkv=32/8, D=128, causal, bf16),
through the public ``attention_varlen`` with the block table (always the paged kernel) and
``KernelOptions.fwd_config`` overrides; the dense kernel (Gluon), the portable dense kernel
(``sm90_fwd=False``) and ``attention_with_kvcache`` (which gathers the pages of chunks of 128
rows or more for the dense kernel, ops/kvcache.py) beside.

    python benchmarks/sweep_paged.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _common import median_ms  # noqa: E402
from bench_serving import paged  # noqa: E402

import flashlse as fl  # noqa: E402

TILES = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 32, 8, 4), (64, 64, 4, 3),
         (64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 8, 2), (64, 32, 4, 4)]


def main():
    b, sq, sk, hq, hkv, d = 4, 512, 8192, 32, 8, 128
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    flops = 4 * b * hq * sq * d * (sk - sq / 2)
    kp, table = paged(k, 16)
    vp, _ = paged(v, 16, table.view(-1).long())
    rows = [("dense fl.attention", median_ms(lambda: fl.attention(q, k, v, causal=True)))]
    with fl.kernel_options(sm90_fwd=False):
        rows.append(("dense, portable kernel", median_ms(lambda: fl.attention(q, k, v,
                                                                              causal=True))))
    rows.append(("paged 16 attention_with_kvcache", median_ms(lambda: fl.attention_with_kvcache(
        q, kp, vp, cache_seqlens=lens, block_table=table, causal=True))))
    q_packed = q.reshape(b * sq, hq, d)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda") * sq
    for bm, bn, w, s in TILES:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
        try:
            with fl.kernel_options(fwd_config=cfg):
                ms = median_ms(lambda: fl.attention_varlen(
                    q_packed, kp, vp, cu_q, None, sq, sk, seqused_k=lens, block_table=table,
                    causal=True))
        except Exception as e:  # noqa: BLE001 (out of resources: a row saying so)
            print(f"paged 16 {bm}x{bn} w{w} s{s}: {type(e).__name__}")
            continue
        rows.append((f"paged 16 {bm}x{bn} w{w} s{s}", ms))
    for label, ms in rows:
        print(f"{label:<34} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s "
              f"{rows[0][1] / ms:.2f}x dense")


if __name__ == "__main__":
    main()
