"""Chunked prefill against a cache through the public ``attention_with_kvcache``, beside the
dense kernel on the same work (``fl.attention`` with the cache as k/v), one process.

B=4 sequences, Sq=512 new query rows against an 8k-token cache, Hq/Hkv=32/8, D=128, causal
(bottom-right: row i sees cache keys up to 8k - 512 + i), bf16. FLOPs counted as the dense
causal call's (``4 B H Sq Sk D`` minus the masked half of the last 512 x 512 block).

    python benchmarks/bench_serving.py [--smoke] [--flag MODULE.NAME] [--shape B,SQ,SKV]
                                       [--heads HQ,HKV] [--dim D]
                                       [--mixed N_PRE,NEW,CACHED,N_DEC,CTX]

``--flag`` (a module flag of flashlse.kernels, e.g. ``fwd_sm90.PAGED_PERSISTENT``): every row
with the flag on and off, timed in turn with the dense call (an A/B in one process).
``--shape B,SQ,SKV`` (default 4,512,8192): the chunked-prefill rows at another shape, e.g. a
long context's chunk, 1,512,65536. ``--heads HQ,HKV`` (default 32,8): fewer heads, as one GPU
of a tensor-parallel model holds (8,2 at TP = 4): fewer row blocks x heads than SMs.
``--dim D`` (default 128): the head dim of the prefill rows (the mixed step runs after them
at 128 only; with ``--mixed`` it runs alone at ``--dim`` and ``--heads``). ``--flag`` also
takes a configs entry's field, e.g. ``configs.FWD_SM90[256].persistent_varlen``. ``--mixed``
(default 4,2048,2048,128,4096): the mixed step's prefills (count, new rows, cached keys) and
decodes (count, context), e.g. a long context's step with few decodes, 1,512,65024,2,65536
(the decodes' rows take the decode kernel's packed form, ``dispatch.SMALL_DECODE``, when a
sequence's rows are at most 16); with ``--mixed`` only the mixed step runs.

The dense call is ``fl.attention`` as users get it: since session 32 a dense call with few
row blocks x heads on 16k keys or more runs key splits (``fwd_sm90.DENSE_SPLIT_KV``), so at
such shapes the "x dense" ratios compare against the split call; RESULTS.md rows before
2026-12-04 compare against the unsplit one.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _common import flag_ab_ms, interleaved_ms, median_ms  # noqa: E402

import flashlse as fl  # noqa: E402

SMOKE = "--smoke" in sys.argv
FLAG = sys.argv[sys.argv.index("--flag") + 1] if "--flag" in sys.argv else None
SHAPE = (tuple(int(x) for x in sys.argv[sys.argv.index("--shape") + 1].split(","))
         if "--shape" in sys.argv else (4, 512, 8192))
HEADS = (tuple(int(x) for x in sys.argv[sys.argv.index("--heads") + 1].split(","))
         if "--heads" in sys.argv else (32, 8))
DIM = int(sys.argv[sys.argv.index("--dim") + 1]) if "--dim" in sys.argv else 128
MIXED = (tuple(int(x) for x in sys.argv[sys.argv.index("--mixed") + 1].split(","))
         if "--mixed" in sys.argv else (4, 2048, 2048, 128, 4096))


def paged(cache, page, perm=None):
    """The same keys in shuffled pages: (num_pages, page, H, D) and a (B, pages) table."""
    b, s = cache.shape[:2]
    n = s // page
    if perm is None:
        perm = torch.randperm(b * n, device=cache.device)
    pages = torch.empty(b * n, page, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
    pages[perm] = cache.reshape(b * n, page, *cache.shape[2:])
    return pages, perm.view(b, n).to(torch.int32)


def main():
    dev, dt = ("cpu", torch.float16) if SMOKE else ("cuda", torch.bfloat16)
    if "--mixed" in sys.argv:  # (the mixed step alone)
        mixed_step(dev, dt)
        return
    b, sq, sk, hq, hkv, d = (2, 20, 64, 4, 2, 32) if SMOKE else (*SHAPE, *HEADS, DIM)
    q = torch.randn(b, sq, hq, d, device=dev, dtype=dt)
    k = torch.randn(b, sk, hkv, d, device=dev, dtype=dt)
    v = torch.randn(b, sk, hkv, d, device=dev, dtype=dt)
    lens = torch.full((b,), sk, dtype=torch.int32, device=dev)
    flops = 4 * b * hq * sq * d * (sk - sq / 2)
    rows = []
    dense = lambda: fl.attention(q, k, v, causal=True)
    ref = dense()

    def timed(label, call):
        # Each row timed in turn with the dense call, three rounds: its ratio is against
        # the dense kernel's time on the same clocks (a later row ran up to 8% slower).
        if FLAG is None:
            t_call, t_dense = interleaved_ms([call, dense], SMOKE)
            rows.append((label, t_call, t_dense))
            return
        t_on, t_off, t_dense = flag_ab_ms(FLAG, call, [dense], SMOKE)
        rows.append((f"{label} [on]", t_on, t_dense))
        rows.append((f"{label} [off]", t_off, t_dense))

    rows.append(("fl.attention (dense kernel, same work)", median_ms(dense, SMOKE), None))
    if FLAG is not None:
        # The dense call itself with the flag on and off (a flag of the dense path:
        # fwd_sm90.DENSE_SPLIT_KV), against the dense call as it runs by default.
        timed("fl.attention, the dense call", dense)
    # A flag of the dense path alone: its row is the table (no serving rows).
    dense_only = FLAG is not None and FLAG.split(".")[-1].startswith("DENSE")
    call = lambda: fl.attention_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)
    err = float((call().float() - ref.float()).abs().max())
    if not dense_only:
        timed(f"attention_with_kvcache contiguous (max diff {err:.1e})", call)
    for page in (16, 64, 256):
        if sk % page or dense_only:
            continue
        kp, table = paged(k, page)
        vp, _ = paged(v, page, table.view(-1).long())
        call = lambda kp=kp, vp=vp, table=table: fl.attention_with_kvcache(
            q, kp, vp, cache_seqlens=lens, block_table=table, causal=True)
        err = float((call().float() - ref.float()).abs().max())
        timed(f"attention_with_kvcache paged {page} (max diff {err:.1e})", call)
        # The same call without the Hopper paged kernel (its pages gathered for the dense one).
        if FLAG is None:
            with fl.kernel_options(sm90_fwd_paged=False):
                timed(f"  paged {page}, sm90_fwd_paged=False", call)
        if page == 16:
            # A block table as vLLM sizes it, for the longest context (16x these sequences'
            # 8k; the entries past them point at page 0): pages read in place, never gathered
            # (the tight table above is read in place too since session 16 on sm_90).
            wide = torch.zeros(b, 16 * table.shape[1], dtype=torch.int32, device=dev)
            wide[:, : table.shape[1]] = table
            call = lambda kp=kp, vp=vp, wide=wide: fl.attention_with_kvcache(
                q, kp, vp, cache_seqlens=lens, block_table=wide, causal=True)
            err = float((call().float() - ref.float()).abs().max())
            timed(f"  paged 16, table 16x wider (max diff {err:.1e})", call)
    name = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"\nserving prefill: {name} torch {torch.__version__}; B={b} Sq={sq} Skv={sk} "
          f"Hq/Hkv={hq}/{hkv} D={d} causal")
    for label, ms, dense_ms in rows:
        ratio = "" if dense_ms is None else f"  {dense_ms / ms:.2f}x dense ({dense_ms:.3f} ms)"
        print(f"{label:<58} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s{ratio}")
    if not dense_only and DIM == 128:
        mixed_step(dev, dt)


def mixed_step(dev, dt):
    """Issue 16's mixed step: 4 prefills of 2k new tokens on 2k cached and 128 decodes at 4k
    context, page 16, as one attention_varlen call with a block table, against the best
    separate calls (the dense kernel on the prefills, the decode kernel on the decodes)."""
    n_pre, new, cached, n_dec, ctx, page, hq, hkv, d = (
        (2, 8, 8, 3, 16, 4, 4, 2, 32) if SMOKE else (*MIXED, 16, *HEADS, DIM))
    g = torch.Generator(device=dev).manual_seed(3)
    mk = lambda *shape: torch.randn(*shape, generator=g, device=dev, dtype=dt)
    kv_pre = [mk(n_pre, new + cached, hkv, d) for _ in range(2)]
    kv_dec = [mk(n_dec, ctx, hkv, d) for _ in range(2)]
    q_pre, q_dec = mk(n_pre, new, hq, d), mk(n_dec, 1, hq, d)
    lens_dec = torch.full((n_dec,), ctx, dtype=torch.int32, device=dev)
    # One paged cache holding every sequence, pages in order per sequence.
    seqs = [x for x in kv_pre[0]] + [x for x in kv_dec[0]]
    vals = [x for x in kv_pre[1]] + [x for x in kv_dec[1]]
    k_cache = torch.cat([x.reshape(-1, page, hkv, d) for x in seqs])
    v_cache = torch.cat([x.reshape(-1, page, hkv, d) for x in vals])
    pages = [x.shape[0] // page for x in seqs]
    table = torch.zeros(len(seqs), max(pages), dtype=torch.int32, device=dev)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = torch.arange(start, start + n, device=dev, dtype=torch.int32)
        start += n
    qlens = [new] * n_pre + [1] * n_dec
    cu_q = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                        device=dev)
    used = torch.tensor([x.shape[0] for x in seqs], dtype=torch.int32, device=dev)
    q_all = torch.cat([q_pre.flatten(0, 1), q_dec.flatten(0, 1)])
    one = lambda: fl.attention_varlen(q_all, k_cache, v_cache, cu_q, None, new, ctx + new,
                                      seqused_k=used, block_table=table, causal=True)
    pre = lambda: fl.attention(q_pre, *kv_pre, causal=True)
    dec = lambda: fl.attention_with_kvcache(q_dec, *kv_dec, cache_seqlens=lens_dec)
    with torch.no_grad():
        # The one call's rows against the separate calls' (same keys, same order).
        o_one, o_pre, o_dec = one(), pre(), dec()
        err = max(float((o_one[:n_pre * new].float() - o_pre.flatten(0, 1).float()).abs().max()),
                  float((o_one[n_pre * new:].float() - o_dec.flatten(0, 1).float()).abs().max()))
        if FLAG is None:
            t_one, t_pre, t_dec = interleaved_ms([one, pre, dec], SMOKE)
        else:
            t_one, t_flag_off, t_pre, t_dec = flag_ab_ms(FLAG, one, [pre, dec], SMOKE)
            print(f"mixed step, {FLAG} off: {t_flag_off:.3f} ms "
                  f"({t_flag_off / (t_pre + t_dec):.2f} of the separate calls)")
        with fl.kernel_options(sm90_fwd_paged=False):
            t_old = median_ms(one, SMOKE)
    print(f"mixed step ({n_pre} prefills {new} on {cached} + {n_dec} decodes at {ctx}, page "
          f"{page}, heads {hq}/{hkv}, D {d}): one attention_varlen {t_one:.3f} ms "
          f"(max diff {err:.1e}; sm90_fwd_paged=False {t_old:.3f}); separate: dense prefill "
          f"{t_pre:.3f} + decode {t_dec:.3f} = {t_pre + t_dec:.3f} ms; "
          f"ratio {t_one / (t_pre + t_dec):.2f} (issue 16: <= 1.15)")


if __name__ == "__main__":
    main()
