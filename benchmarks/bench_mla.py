"""MLA decode (issue 18): the public ``attention_with_kvcache`` on a latent cache, TFLOP/s.

``q (B, Sq, Hq, 576)`` against one latent head ``lat (.., 1, 576)`` with ``v = lat[..., :512]``,
contiguous and paged (page 64, FlashMLA's), every sequence at ``Skv`` keys. FLOPs are
``2 B Sq Hq Skv (576 + 512)`` (the two products; Sq = 2 under a causal mask counts the full
square, as FlashMLA's numbers do); bytes are the latent cache read once. Timed in one
process: the Hopper Gluon kernel (``decode_mla_sm90``, the default) and the portable one
(``kernel_options(sm90_mla_decode=False)``), both through the public call, a CUDA-graph
replay of the public call, and the device copy as the bandwidth ceiling. The check column is
the largest difference from a float32 SDPA of four sequences. The top-k rows (DeepSeek-V3.2
sparse decode through ``sparse_attention``) check the Gluon kernel against the portable one
("err g"; "err p" is 0 there).

    python benchmarks/bench_mla.py [--out DIR] [--topk-only] [--gluon-only] [--pages 8,16]
                                   [--topk-patterns random,sorted,hot]

Prints a table last and writes ``mla_rows.md`` (rows for RESULTS.md) into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import triton

# The repo root last: a PYTHONPATH tree (h200_session.sh in_turn's .before) comes first.
sys.path.append(os.path.join(os.path.dirname(__file__), ".."))

from _common import graph_replay, median_ms  # noqa: E402

import flashlse as fl  # noqa: E402

# (B, Skv, Hq, Sq, page size): issue 18's bar shapes.
# (64, 8192, 128, 1, 16): vLLM's page size (one TMA box a page, four a tile).
SHAPES = [(64, 8192, 128, 1, None), (64, 8192, 128, 1, 64), (128, 4096, 128, 1, 64),
          (64, 8192, 128, 2, 64), (64, 8192, 16, 1, 64), (1, 65536, 128, 1, 64),
          (64, 8192, 128, 1, 16)]
# Dense decode over as many keys as a top-k list (2048): the top-k rows' yardstick, the same
# work with pages read by TMA instead of listed rows gathered. If these are near the top-k
# rows, a program's fixed cost (32 tiles a program) limits both, not the gather.
TOPK_YARDSTICK = [(64, 2048, 128, 1, 64), (128, 2048, 128, 1, 64)]


def copy_gbs() -> float:
    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * 2 * x.numel() / median_ms(lambda: y.copy_(x)) / 1e6


def inputs(b, skv, hq, sq, page):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, sq, hq, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    lat = torch.randn(b, skv, 1, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), skv, dtype=torch.int32, device="cuda")
    table = None
    if page:
        pages = skv // page
        table = torch.randperm(b * pages, device="cuda").view(b, pages).to(torch.int32)
        cache = torch.empty(b * pages, page, 1, 576, device="cuda", dtype=torch.bfloat16)
        cache[table.view(-1).long()] = lat.view(b * pages, page, 1, 576)
        lat_ref, lat = lat, cache
    else:
        lat_ref = lat
    return q, lat, lat_ref, lens, table


def check(q, lat_ref, out, scale, causal):
    n = min(4, q.shape[0])
    qt = q[:n].transpose(1, 2).float()
    kt = lat_ref[:n].transpose(1, 2).float()
    sq, sk = q.shape[1], kt.shape[2]
    mask = None
    if causal and sq > 1:
        rows, cols = torch.arange(sq, device="cuda"), torch.arange(sk, device="cuda")
        mask = cols[None, :] <= rows[:, None] + sk - sq
    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, kt[..., :512], attn_mask=mask,
                                                           scale=scale, enable_gqa=True)
    return float((ref.transpose(1, 2) - out[:n].float()).abs().max())


def kernels(gluon_only):
    return (("gluon", True),) if gluon_only else (("gluon", True), ("portable", False))


# How the top-k rows' lists are drawn (``--topk-patterns``): uniformly at random (the bar's
# rows); the same lists sorted (each page's rows read together); from the first 128 tokens
# of each sequence only (two pages: the cache rows stay in L2, a diagnostic of how much of
# the gap to the dense kernel is memory rather than the gather's issue).
TOPK_PATTERNS = ("random", "sorted", "hot")


def topk_indices(b, skv, topk, pattern):
    g = torch.Generator(device="cuda").manual_seed(1)
    hi = 128 if pattern == "hot" else skv
    idx = torch.randint(0, hi, (b, 1, 1, topk), device="cuda", dtype=torch.int32, generator=g)
    return idx.sort(-1).values if pattern == "sorted" else idx


def topk_split(split):
    """Sets the top-k kernel's (producer warps, producer registers, consumer registers)
    (``decode_mla_sm90.TOPK_SPLIT``) and drops the decode plans that hold the old one."""
    from flashlse.kernels import decode, decode_mla_sm90

    decode_mla_sm90.TOPK_SPLIT = tuple(split)
    decode._PLANS.clear()


def topk_rows(copy, gluon_only, patterns=("random",), splits=None):
    """Top-k decode (DeepSeek-V3.2): each of B sequences' one query row attends to its own
    2048 listed rows of a paged 64 latent cache of Skv rows, through ``sparse_attention``;
    FLOPs ``2 B Hq topk (576 + 512)``. The check column compares with the portable kernel.
    ``patterns``: how the lists are drawn (TOPK_PATTERNS; rows other than random say so);
    ``splits``: TOPK_SPLIT values to time one after the other (each row says which), twice
    in turn."""
    from flashlse.kernels import decode_mla_sm90

    out_rows = []
    shapes = [(64, 8192, 128, 2048, pat) for pat in patterns] + [(128, 4096, 128, 2048, "random")]
    runs = [(shape, None) for shape in shapes]
    if splits:
        runs = [(shape, split) for _ in range(2) for shape in shapes for split in splits]
    default = decode_mla_sm90.TOPK_SPLIT
    for (b, skv, hq, topk, pat), split in runs:
        topk_split(split or default)
        q, lat, _, _, table = inputs(b, skv, hq, 1, 64)
        idx = topk_indices(b, skv, topk, pat)

        def call(q=q, lat=lat, idx=idx, table=table):
            return fl.sparse_attention(q, lat, lat[..., :512], idx, block_table=table,
                                       scale=1 / math.sqrt(576))

        flops = 2 * b * hq * topk * (576 + 512)
        res = {"portable": (torch.zeros(()), math.nan, math.nan)}
        for name, on in kernels(gluon_only):
            with fl.kernel_options(sm90_mla_decode=on):
                res[name] = (call(), median_ms(call), median_ms(graph_replay(call)))
        err = math.nan if gluon_only else \
            float((res["gluon"][0].float() - res["portable"][0].float()).abs().max())
        g_, p_ = res["gluon"], res["portable"]
        nbytes = b * topk * 576 * 2
        tag = "" if pat == "random" else f" ({pat} lists)"
        tag += f" split {','.join(map(str, split))}" if split else ""
        out_rows.append((f"top-k B={b} Skv={skv} Hq={hq} topk={topk} paged64{tag}",
                         flops / g_[1] / 1e9, flops / g_[2] / 1e9,
                         nbytes / g_[1] / 1e6 / copy, flops / p_[1] / 1e9, err, 0.0,
                         g_[1], p_[1]))
        del q, lat
        torch.cuda.empty_cache()
    topk_split(default)
    return out_rows



def profile_topk(pattern):
    """One top-k decode call (B=64 Skv=8k Hq=128 topk=2048, paged 64) after a warm-up, alone
    between cudaProfilerStart and Stop."""
    q, lat, _, _, table = inputs(64, 8192, 128, 1, 64)
    idx = topk_indices(64, 8192, 2048, pattern)
    for _ in range(3):
        fl.sparse_attention(q, lat, lat[..., :512], idx, block_table=table, scale=1 / 24)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fl.sparse_attention(q, lat, lat[..., :512], idx, block_table=table, scale=1 / 24)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--topk-only", action="store_true", help="only the top-k rows")
    ap.add_argument("--gluon-only", action="store_true",
                    help="not the portable kernel (an A/B of two trees' Gluon kernels)")
    ap.add_argument("--topk-patterns", default="random",
                    help=f"top-k B=64 rows with lists drawn so, comma-separated: {TOPK_PATTERNS}")
    ap.add_argument("--topk-splits", default="",
                    help="top-k rows at each of these decode_mla_sm90.TOPK_SPLIT values, e.g. "
                         "'2,56,240;4,48,216' (two passes in turn)")
    ap.add_argument("--profile-topk", default="", metavar="PATTERN",
                    help="only: one top-k B=64 call between cudaProfilerStart / Stop (for "
                         "`ncu --profile-from-start off`), lists drawn so")
    ap.add_argument("--pages", default="",
                    help="only B=64 Skv=8k Hq=128 at these page sizes, e.g. 8,16,32,64")
    args = ap.parse_args()
    if args.profile_topk:
        profile_topk(args.profile_topk)
        return
    date = time.strftime("%Y-%m-%d")
    dev = torch.cuda.get_device_name()
    copy = copy_gbs()
    rows = []
    shapes = TOPK_YARDSTICK if args.topk_only else SHAPES + TOPK_YARDSTICK
    if args.pages:
        shapes = [(64, 8192, 128, 1, int(p)) for p in args.pages.split(",")]
    for b, skv, hq, sq, page in shapes:
        q, lat, lat_ref, lens, table = inputs(b, skv, hq, sq, page)
        scale = 1 / math.sqrt(576)
        causal = sq > 1

        def call(q=q, lat=lat, lens=lens, table=table, scale=scale, causal=causal):
            return fl.attention_with_kvcache(q, lat, lat[..., :512], cache_seqlens=lens,
                                             block_table=table, scale=scale, causal=causal)

        flops = 2 * b * sq * hq * skv * (576 + 512)
        nbytes = lat_ref.numel() * 2
        res = {"portable": (math.nan, math.nan, math.nan)}
        for name, on in kernels(args.gluon_only):
            with fl.kernel_options(sm90_mla_decode=on):
                out = call()
                err = check(q, lat_ref, out, scale, causal)
                ms = median_ms(call)
                gms = median_ms(graph_replay(call))
            res[name] = (ms, gms, err)
        label = f"B={b} Skv={skv} Hq={hq} Sq={sq} {'paged' + str(page) if page else 'contiguous'}"
        g, p = res["gluon"], res["portable"]
        rows.append((label, flops / g[0] / 1e9, flops / g[1] / 1e9, nbytes / g[0] / 1e6 / copy,
                     flops / p[0] / 1e9, g[2], p[2], g[0], p[0]))
        del q, lat, lat_ref
        torch.cuda.empty_cache()
    if not args.pages:
        splits = [tuple(map(int, x.split(","))) for x in args.topk_splits.split(";") if x]
        rows += topk_rows(copy, args.gluon_only, args.topk_patterns.split(","), splits)
    md = []
    for label, tf, tfg, frac, tfp, eg, ep, ms, pms in rows:
        md.append(f"| {date} | MLA decode | {label} | {dev} | torch {torch.__version__}, triton "
                  f"{triton.__version__} | Gluon {tf:.0f} TFLOP/s ({ms:.3f} ms; graph {tfg:.0f}; "
                  f"{frac:.2f}x copy {copy:.0f} GB/s), portable {tfp:.0f} ({pms:.3f} ms); "
                  + (f"max diff Gluon vs portable {eg:.2g} |" if label.startswith("top-k") else
                     f"max diff vs fp32 SDPA {eg:.2g} / {ep:.2g} |"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mla_rows.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"\ncopy {copy:.0f} GB/s")
    print(f"{'shape':60s} {'gluon TF':>9s} {'graph':>7s} {'xcopy':>6s} {'portable':>9s} "
          f"{'err g':>8s} {'err p':>8s}")
    for label, tf, tfg, frac, tfp, eg, ep, _, _ in rows:
        print(f"{label:60s} {tf:9.0f} {tfg:7.0f} {frac:6.2f} {tfp:9.0f} {eg:8.2g} {ep:8.2g}")


if __name__ == "__main__":
    main()
