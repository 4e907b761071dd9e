"""Sparse top-k attention through the public ``flashlse.sparse_attention`` (issue 17's shapes).

FLOPs = 2 * Sq * Hq * topk * (D + Dv) (forward; backward 2.5x). Shapes, bf16:

* MLA (DeepSeek sparse attention): S=4096 queries, Hq=128 on one latent head of 576, v its
  first 512 columns, topk=2048 -- the issue's bar is >= 350 TFLOP/s forward;
* GQA: B=1, S=8192, Hq/Hkv=32/4, D=128, topk=2048 -- forward against the dense kernel on the
  same FLOPs (Sq=8192 against Sk=2048 keys, non-causal; bar >= 0.6x), backward (bar >= 200).

    python benchmarks/bench_sparse.py [--smoke] [--backward]

``--backward`` also times the backward (kernels/sparse.py; dK/dV by float32 atomics).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))

from _common import median_ms  # noqa: E402

import flashlse as fl  # noqa: E402


def indices(b, sq, hkv, topk, sk, device):
    """Distinct random key positions per (row, kv head), as a top-k selection gives."""
    scores = torch.rand(b, sq, hkv, sk, device=device)
    return scores.topk(topk, dim=-1).indices.to(torch.int32)


@triton.jit
def _listed_rows(k, v, idx, out, dk, dv, Sk, HKV: tl.constexpr, TOPK: tl.constexpr,
                 D: tl.constexpr, BLOCK: tl.constexpr, SCATTER: tl.constexpr):
    """Not attention: the data movement a sparse call cannot avoid. Program ``row * HKV + h``
    reads exactly the K and V rows its top-k list names; it writes their column sums
    (the forward's ceiling), or with SCATTER adds them as float32 into dK and dV at the same
    rows (the backward's: relaxed atomics, as kernels/sparse.py's scatter)."""
    pid = tl.program_id(0)
    h = pid % HKV
    cols = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for j0 in range(0, TOPK, BLOCK):
        i = tl.load(idx + pid.to(tl.int64) * TOPK + j0 + tl.arange(0, BLOCK))
        ok = (i >= 0) & (i < Sk)
        rows = (i.to(tl.int64) * HKV + h) * D
        kk = tl.load(k + rows[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        vv = tl.load(v + rows[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        if SCATTER:
            tl.atomic_add(dk + rows[:, None] + cols[None, :], kk.to(tl.float32),
                          mask=ok[:, None], sem="relaxed")
            tl.atomic_add(dv + rows[:, None] + cols[None, :], vv.to(tl.float32),
                          mask=ok[:, None], sem="relaxed")
        else:
            acc += tl.sum(kk.to(tl.float32) + vv.to(tl.float32), 0)
    if not SCATTER:
        tl.store(out + pid.to(tl.int64) * D + cols, acc)


def ceiling_ms(k, v, idx, smoke, scatter=False):
    """The best time of ``_listed_rows`` over a few tiles: moving the listed rows and nothing
    else (each (row, kv head) reads topk K and V rows; no reuse across rows), the GQA shape's
    ceiling beside which the sparse forward (``scatter=False``) or backward is judged."""
    b, s, hkv, topk = idx.shape
    out = torch.empty(b * s * hkv, k.shape[-1], device=k.device, dtype=torch.float32)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32) if scatter else out
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32) if scatter else out
    best = float("inf")
    for block, warps in ((32, 4), (64, 4), (64, 8), (128, 8)):
        if topk % block:
            continue

        def run(block=block, warps=warps):
            _listed_rows[(b * s * hkv,)](k, v, idx, out, dk, dv, k.shape[1], HKV=hkv, TOPK=topk,
                                         D=k.shape[-1], BLOCK=block, SCATTER=scatter,
                                         num_warps=warps)

        best = min(best, median_ms(run, smoke))
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    smoke = args.smoke
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    name = "cpu (smoke)" if smoke else torch.cuda.get_device_name()
    print(f"sparse attention, public calls: {name}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    torch.manual_seed(0)
    # MLA: v a view of the latent cache.
    s, hq, dl, dv, topk = (64, 16, 64, 32, 16) if smoke else (4096, 128, 576, 512, 2048)
    q = torch.randn(1, s, hq, dl, device=dev, dtype=dt)
    kv = torch.randn(1, s, 1, dl, device=dev, dtype=dt)
    idx = indices(1, s, 1, topk, s, dev)
    flops = 2 * s * hq * topk * (dl + dv)
    ms = median_ms(lambda: fl.sparse_attention(q, kv, kv[..., :dv], idx), smoke)
    print(f"MLA S={s} Hq={hq} {dl}/{dv} topk={topk}: {ms:.3f} ms, "
          f"{flops / ms / 1e9:.1f} TFLOP/s (bar >= 350)")
    # GQA against the dense kernel on the same FLOPs.
    b, s, hq, hkv, d, topk = (1, 64, 4, 2, 32, 16) if smoke else (1, 8192, 32, 4, 128, 2048)
    q = torch.randn(b, s, hq, d, device=dev, dtype=dt)
    k = torch.randn(b, s, hkv, d, device=dev, dtype=dt)
    v = torch.randn(b, s, hkv, d, device=dev, dtype=dt)
    idx = indices(b, s, hkv, topk, s, dev)
    flops = 2 * b * s * hq * topk * 2 * d
    ms = median_ms(lambda: fl.sparse_attention(q, k, v, idx), smoke)
    kd, vd = k[:, :topk].contiguous(), v[:, :topk].contiguous()
    ms_dense = median_ms(lambda: fl.attention(q, kd, vd), smoke)
    print(f"GQA B={b} S={s} Hq/Hkv={hq}/{hkv} D={d} topk={topk}: forward {ms:.3f} ms, "
          f"{flops / ms / 1e9:.1f} TFLOP/s; dense kernel on the same FLOPs {ms_dense:.3f} ms, "
          f"{flops / ms_dense / 1e9:.1f} TFLOP/s; ratio {ms_dense / ms:.2f} (bar >= 0.6)")
    if not smoke:
        # The rows the forward must move: topk K and V rows a (row, kv head), no reuse.
        gb = b * s * hkv * topk * 2 * d * k.element_size() / 1e9
        ms_g = ceiling_ms(k, v, idx, smoke)
        print(f"GQA gather ceiling (reads the listed K/V rows, {gb:.1f} GB; not attention): "
              f"{ms_g:.3f} ms, {gb / ms_g:.2f} TB/s; forward {gb / ms:.2f} TB/s, "
              f"{ms_g / ms:.2f}x the ceiling (proposed bar >= 0.8)")
    if not args.backward:
        return
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fl.sparse_attention(*leaves, idx)
    dout = torch.randn_like(out)
    ms_b = median_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), smoke)
    print(f"GQA backward: {ms_b:.3f} ms, {2.5 * flops / ms_b / 1e9:.1f} TFLOP/s (bar >= 200)")
    if not smoke:
        ms_s = ceiling_ms(k, v, idx, smoke, scatter=True)
        print(f"GQA backward ceiling (reads the listed K/V rows, adds float32 dK/dV rows; not "
              f"attention): {ms_s:.3f} ms; backward {ms_s / ms_b:.2f}x the ceiling "
              f"(proposed bar >= 0.5)")


if __name__ == "__main__":
    main()
