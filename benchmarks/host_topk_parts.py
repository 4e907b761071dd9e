"""Host us a call of the top-k MLA decode's pieces (issue 15 / 18), GPU: the public
``sparse_attention`` call, then each layer under it with the layer above's work done once,
rounds taken in turn (this host drifts +-25 us between passes), medians.

    python benchmarks/host_topk_parts.py [--rounds 7]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_loop_s  # noqa: E402

import flashlse as fl  # noqa: E402
from flashlse.kernels import decode as D  # noqa: E402
from flashlse.ops import _validate as V  # noqa: E402
from flashlse.ops import sparse as S  # noqa: E402


def pieces(b, skv=8192, hq=128, d=576, dv=512, topk=2048):
    dev, dt = "cuda", torch.bfloat16
    pages = skv // 64
    q = torch.randn(b, 1, hq, d, device=dev, dtype=dt)
    lat = torch.randn(b * pages, 64, 1, d, device=dev, dtype=dt)
    v = lat[..., :dv]
    table = torch.randperm(b * pages, device=dev).view(b, pages).to(torch.int32)
    idx = torch.randint(0, skv, (b, 1, 1, topk), device=dev, dtype=torch.int32)
    scale = d ** -0.5
    key = V.meta_key("sparse", q, lat, v, idx, table, None)
    fl.sparse_attention(q, lat, v, idx, block_table=table, scale=scale)
    plan = S._fwd_plan(q, lat, v, idx, table, key)
    pk = lat.reshape(plan.pages_k)
    pv, tb, qr = pk[..., :dv], idx.reshape(plan.table), q.reshape(plan.rows)
    kw = dict(cache_seqlens=None, block_table=tb, token_table=plan.token_table,
              token_pages=table, left=None, right=None, softcap=0.0, scale=scale, sink=None,
              num_splits=0)
    D.decode_fwd(qr, pk, pv, **kw)
    dplan = next(p for p in D._PLANS.values() if p.gluon is not None and
                 p.out_shape[0] == b * 1)
    o = torch.empty(dplan.out_shape, dtype=dt, device=dev)
    lse = torch.empty(dplan.lse_shape, dtype=torch.float32, device=dev)
    obuf = lbuf = None
    if dplan.o_buf_shape:
        obuf = torch.empty(dplan.o_buf_shape, dtype=torch.float32, device=dev)
        lbuf = torch.empty(dplan.o_buf_shape[:-1], dtype=torch.float32, device=dev)

    def launch():
        import triton

        from flashlse.kernels._common import alloc_scratch
        triton.set_allocator(alloc_scratch)
        dplan.run(qr, pk, pv, None, tb, lse if obuf is None else lbuf,
                  o if obuf is None else obuf, lse if obuf is None else lbuf, table)

    return {
        f"B={b} public sparse_attention": lambda: fl.sparse_attention(
            q, lat, v, idx, block_table=table, scale=scale),
        f"B={b} sparse_fwd_kernel (plan given)": lambda: S.sparse_fwd_kernel(
            q, lat, v, idx, scale=scale, sink=None, block_table=table, plan=plan),
        f"B={b} decode_fwd (views given)": lambda: D.decode_fwd(qr, pk, pv, **kw),
        f"B={b} the split kernel's Launch": launch,
        f"B={b} splits": lambda: None,
    }, (1 if dplan.o_buf_shape is None else dplan.o_buf_shape[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    rows, splits = {}, {}
    for b in (4, 64):
        r, s = pieces(b)
        rows.update(r)
        splits[b] = s
    dev = "cuda"
    kc = torch.randn(64 * 128, 64, 8, 128, device=dev, dtype=torch.bfloat16)
    qd = torch.randn(64, 1, 32, 128, device=dev, dtype=torch.bfloat16)
    lens = torch.full((64,), 8192, dtype=torch.int32, device=dev)
    bt = torch.arange(64 * 128, dtype=torch.int32, device=dev).view(64, 128)
    rows["kvcache B=64 paged 64 (beside)"] = lambda: fl.attention_with_kvcache(
        qd, kc, kc, cache_seqlens=lens, block_table=bt)
    rows["torch.empty x 2"] = lambda: (torch.empty(4096, device=dev),
                                       torch.empty(4096, device=dev))
    got = {k: [] for k in rows}
    for r in range(args.rounds):
        names = list(rows) if r % 2 == 0 else list(reversed(rows))
        for name in names:
            if name.endswith("splits"):
                continue
            got[name].append(host_loop_s(rows[name], 200, sync_end=False, warm=5,
                                         gpu_sleep=True) * 1e6)
    for name, us in got.items():
        if name.endswith("splits"):
            print(f"=== {name:<44} {splits[int(name[2:].split()[0])]}")
            continue
        print(f"=== {name:<44} {sorted(us)[len(us) // 2]:7.1f} us (min {min(us):.1f})")


if __name__ == "__main__":
    main()
