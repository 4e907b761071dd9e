"""A kernel switch's A/B through the public GQA decode call, ``attention_with_kvcache`` (Hq /
Hkv = 32 / 8, D = 128, bf16, one query row), with a module flag on and off, timed in turn
(``_common.flag_ab_ms``), cuDNN's SDPA on the same keys beside it.

    python benchmarks/ab_decode_switch.py --flag decode.FUSED_MERGE

Rows: issue 15's decode shapes (B = 1 Skv = 128k, B = 8 / 64 / 128 at 8k; the small ones
split their keys), two host-bound small splits (B = 1 and 8 at 4k) and a paged 16 row.
Each row also says whether both sides wrote the same bits. Written for session 45's fused
split-KV merge (``decode.FUSED_MERGE``: one launch less a split call).

``AB_SET=sparse``: ``sparse_attention`` decodes instead (one query row, top-k lists on the
same heads, the decode kernel's token table; no peer: host us a call on / off in its
place), for the token table's fused merge:

    AB_SET=sparse python benchmarks/ab_decode_switch.py --flag decode.FUSED_MERGE_TOKEN_TABLE

``AB_SET=short``: dense ``fl.attention`` calls of a few query rows over a whole cache
(causal; transformers' decode steps, speculative verification), for the dispatcher's route of
those to the decode kernel (cuDNN beside the one-row rows; the last row in transformers'
layout, (B, H, S, D) tensors transposed):

    AB_SET=short python benchmarks/ab_decode_switch.py --flag dispatch.SHORT_Q_DECODE

``AB_SET=wide``: the same calls at 32 and 64 query rows, past the route's bound, for the
route widened (``dispatch.SHORT_Q_WIDE``):

    AB_SET=wide python benchmarks/ab_decode_switch.py --flag dispatch.SHORT_Q_WIDE

``AB_SET=kvwide``: ``attention_with_kvcache`` at 20-32 query rows (contiguous and paged,
causal), for those on the decode kernel (``ops.kvcache.DECODE_WIDE``) against the prefill
path:

    AB_SET=kvwide python benchmarks/ab_decode_switch.py --flag flashlse.ops.kvcache.DECODE_WIDE

``AB_SET=varlenpaged``: paged ``attention_varlen`` calls whose sequences all have the same
1-16 query rows (vLLM's decode steps and speculative verification), on the decode kernel
(``dispatch.PAGED_DECODE``) against the paged kernels:

    AB_SET=varlenpaged python benchmarks/ab_decode_switch.py --flag dispatch.PAGED_DECODE
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repo root last: a PYTHONPATH tree (an in-turn A/B's .before) comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import flag_ab_args, flag_ab_ms, flag_runs, host_loop_s  # noqa: E402

import flashlse as fl  # noqa: E402

HQ, HKV, D = 32, 8, 128
# (label, B, Skv, page)
ROWS = [("B=1 Skv=128k", 1, 131072, None), ("B=8 Skv=8k", 8, 8192, None),
        ("B=64 Skv=8k", 64, 8192, None), ("B=128 Skv=8k", 128, 8192, None),
        ("B=1 Skv=4k", 1, 4096, None), ("B=8 Skv=4k", 8, 4096, None),
        ("B=8 Skv=8k paged 16", 8, 8192, 16)]
# (label, B, Skv, top-k): sparse_attention's rows (AB_SET=sparse).
SPARSE_ROWS = [("sparse B=1 top-2048 of 32k", 1, 32768, 2048),
               ("sparse B=8 top-2048 of 32k", 8, 32768, 2048),
               ("sparse B=64 top-2048 of 8k", 64, 8192, 2048),
               ("sparse B=8 top-512 of 8k", 8, 8192, 512)]


def _cache(b, sq, skv, page):
    """``(q, k, v, lens, table)``: ``sq`` query rows over full caches of ``skv`` keys,
    contiguous, or in pages of ``page`` rows in a shuffled block table."""
    dt = torch.bfloat16
    q = torch.randn(b, sq, HQ, D, device="cuda", dtype=dt)
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
    return q, k, v, lens, table


def row(flag, label, b, skv, page):
    q, k, v, lens, table = _cache(b, 1, skv, page)

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


def sparse_row(flag, label, b, skv, topk):
    dt = torch.bfloat16
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=dt)
    k = torch.randn(b, skv, HKV, D, device="cuda", dtype=dt)
    v = torch.randn(b, skv, HKV, D, device="cuda", dtype=dt)
    idx = torch.rand(b, 1, HKV, skv, device="cuda").argsort(-1)[..., :topk].to(torch.int32)

    def call():
        return fl.sparse_attention(q, k, v, idx)

    ms = flag_ab_ms(flag, call)
    on, off, restore = flag_runs(flag, call)
    same = torch.equal(on(), off())
    # Host us a call on / off (the GPU asleep under the loop: host time alone), as peers.
    ms += [host_loop_s(fn, 200, sync_end=False, gpu_sleep=True) * 1e6 for fn in (on, off)]
    restore()
    gbs = 2 * b * topk * HKV * D * 2 / 1e6
    return label, ms, gbs, same


# (label, B, Sq, Skv, transposed): fl.attention's short-query rows (AB_SET=short).
SHORT_ROWS = [("attention B=1 Sq=1 Skv=4k", 1, 1, 4096, False),
              ("attention B=1 Sq=1 Skv=32k", 1, 1, 32768, False),
              ("attention B=8 Sq=1 Skv=8k", 8, 1, 8192, False),
              ("attention B=1 Sq=4 Skv=8k", 1, 4, 8192, False),
              ("attention B=8 Sq=16 Skv=2k", 8, 16, 2048, False),
              ("attention B=1 Sq=1 Skv=4k (B,H,S,D).T", 1, 1, 4096, True),
              # (D = 256: the decode config's 32-key tiles, 2 programs an SM where it plans 4)
              ("attention B=1 Sq=1 Skv=8k D=256", 1, 1, 8192, False, 256),
              ("attention B=8 Sq=1 Skv=4k D=256", 8, 1, 4096, False, 256)]


# Past the route's bound (AB_SET=wide, dispatch.SHORT_Q_WIDE): where the bound belongs.
WIDE_ROWS = [("attention B=1 Sq=32 Skv=8k", 1, 32, 8192, False),
             ("attention B=8 Sq=32 Skv=2k", 8, 32, 2048, False),
             ("attention B=1 Sq=64 Skv=16k", 1, 64, 16384, False),
             ("attention B=8 Sq=64 Skv=4k", 8, 64, 4096, False),
             ("attention B=1 Sq=64 Skv=8k D=256", 1, 64, 8192, False, 256)]


# attention_with_kvcache's calls of 17-32 query rows (AB_SET=kvwide, ops.kvcache.DECODE_WIDE:
# the decode kernel against the prefill path), causal (speculative verification, chunks):
# (label, B, Sq, Skv, page).
KVWIDE_ROWS = [("kvcache B=1 Sq=32 Skv=8k", 1, 32, 8192, None),
               ("kvcache B=8 Sq=32 Skv=2k", 8, 32, 2048, None),
               ("kvcache B=8 Sq=20 Skv=4k", 8, 20, 4096, None),
               ("kvcache B=64 Sq=32 Skv=2k", 64, 32, 2048, None),
               ("kvcache B=8 Sq=32 Skv=4k paged 16", 8, 32, 4096, 16),
               ("kvcache B=1 Sq=24 Skv=32k paged 64", 1, 24, 32768, 64)]
# The same cache calls through a paged attention_varlen, B sequences of Sq rows each
# (AB_SET=varlenpaged, dispatch.PAGED_DECODE: the decode kernel against the paged kernels).
VARLEN_PAGED_ROWS = [("varlen paged B=1 Sq=1 Skv=32k p64", 1, 1, 32768, 64),
                     ("varlen paged B=8 Sq=1 Skv=8k p16", 8, 1, 8192, 16),
                     ("varlen paged B=64 Sq=1 Skv=4k p16", 64, 1, 4096, 16),
                     ("varlen paged B=128 Sq=1 Skv=2k p16", 128, 1, 2048, 16),
                     ("varlen paged B=8 Sq=4 Skv=4k p16", 8, 4, 4096, 16),
                     ("varlen paged B=1 Sq=4 Skv=32k p64", 1, 4, 32768, 64),
                     ("varlen paged B=64 Sq=8 Skv=2k p16", 64, 8, 2048, 16)]


def cache_row(flag, label, b, sq, skv, page, varlen=False):
    """A causal call of ``sq`` rows a sequence on a cache: ``attention_with_kvcache``, or
    (``varlen``) the same rows packed through a paged ``attention_varlen``."""
    q, k, v, lens, table = _cache(b, sq, skv, page)
    rows = q.flatten(0, 1)
    cu = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device="cuda")

    def call():
        if varlen:
            return fl.attention_varlen(rows, k, v, cu, None, sq, skv, seqused_k=lens,
                                       block_table=table, causal=True)
        return fl.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                         causal=True)

    ms, same = _ab_two_kernels(flag, call)
    return label, ms, 2 * b * skv * HKV * D * 2 / 1e6, same


def _ab_two_kernels(flag, call, peers=()):
    """``(ms, same)``: ``call``'s ms with ``flag`` on, off, then ``peers``', in turn, and the
    largest difference of the two sides' outputs (two kernels: equal to rounding, not bit
    for bit)."""
    ms = flag_ab_ms(flag, call, peers=peers)
    on, off, restore = flag_runs(flag, call)
    a, c = on(), off()
    restore()
    return ms, f"max diff {float((a.float() - c.float()).abs().max()):.1e}"


def short_row(flag, label, b, sq, skv, transposed, d=D):
    dt = torch.bfloat16
    if transposed:
        q = torch.randn(b, HQ, sq, d, device="cuda", dtype=dt).transpose(1, 2)
        k = torch.randn(b, HKV, skv, d, device="cuda", dtype=dt).transpose(1, 2)
        v = torch.randn(b, HKV, skv, d, device="cuda", dtype=dt).transpose(1, 2)
    else:
        q = torch.randn(b, sq, HQ, d, device="cuda", dtype=dt)
        k = torch.randn(b, skv, HKV, d, device="cuda", dtype=dt)
        v = torch.randn(b, skv, HKV, d, device="cuda", dtype=dt)

    def call():
        return fl.attention(q, k, v, causal=True)

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def cudnn():  # (one query row: causal is no mask)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    ms, same = _ab_two_kernels(flag, call, peers=(cudnn,) if sq == 1 else ())
    return label, ms, 2 * b * skv * HKV * d * 2 / 1e6, same


def main() -> None:
    flag = flag_ab_args()
    only = os.environ.get("AB_ROWS")  # (e.g. AB_ROWS="B=1 Skv=128k;B=1 Skv=4k")
    make, table = {"sparse": (sparse_row, SPARSE_ROWS), "short": (short_row, SHORT_ROWS),
                   "wide": (short_row, WIDE_ROWS), "kvwide": (cache_row, KVWIDE_ROWS),
                   "varlenpaged": (cache_row, [(*r, True) for r in VARLEN_PAGED_ROWS])}.get(
        os.environ.get("AB_SET"), (row, ROWS))
    rows = [make(flag, *r) for r in table if only is None or r[0] in only.split(";")]
    sparse = make is sparse_row
    extra = "host us on / off" if sparse else "cuDNN ms"
    print(f"| row | ms on | off | on/off | GB/s on | off | {extra} | same bits |")
    print("|---|---|---|---|---|---|---|---|")
    for label, ms, gbs, same in rows:
        peer = f"{ms[2]:.1f} / {ms[3]:.1f}" if sparse else f"{ms[2]:.4f}" if len(ms) > 2 else "-"
        print(f"| {label} | {ms[0]:.4f} | {ms[1]:.4f} | {ms[0] / ms[1]:.3f} | "
              f"{gbs / ms[0]:.0f} | {gbs / ms[1]:.0f} | {peer} | {same} |")


if __name__ == "__main__":
    main()
