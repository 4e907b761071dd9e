"""The PyTorch (CPU) path against SDPA on the CPU, same process, fp32 (``--dtype``: bf16, fp16).

Issue 20's shape: B=1, H=8, D=64, S=2048 and 4096, causal and not, forward and
forward+backward (``out.sum().backward()``); best of 3 (2 for the backward) after a warm-up,
on the threads torch is given (CI's machine: 2). Beside each: the same call on the CPU path's
own loops (``ops.attention.SDPA_CPU`` off), which these calls ran before torch's CPU flash
attention took them; then a causal call with a sink (S = 2k), a bottom-right causal chunk
of 512 rows on 4k keys and sliding windows of 128 and 1024 keys at S = 4k (SDPA has no form
for these), against the loops; then decode steps on a 4k cache (GQA 32 / 8, D = 128), a
left-padded batch's decode step, and packed varlen batches of equal sequences (batched
runs against one call a sequence).

    python benchmarks/bench_cpu.py [--threads 2] [--smoke] [--dtype fp32|bf16|fp16]
                                   [--native on|off]
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch
import torch.nn.functional as F

import flashlse as fl

attn_mod = importlib.import_module("flashlse.ops.attention")


def best_s(fn, n):
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(q, k, v, causal, sink=None, window=None):
    """Seconds: ours and SDPA's forward, ours and SDPA's forward+backward (SDPA's 0 with a
    sink, a window or Sq != Sk: it has no form for them)."""
    kw = dict(causal=causal, sink=sink, window=window or (None, None))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    # The loss has no lse term: the backward gets no lse gradient, as a training step's.
    sdpa = [x.transpose(1, 2).clone().requires_grad_() for x in (q, k, v)]
    plain = [x.detach() for x in sdpa]
    peer = sink is None and window is None and q.shape[1] == k.shape[1]
    return (best_s(lambda: fl.attention(q, k, v, **kw), 3),
            best_s(lambda: F.scaled_dot_product_attention(*plain, is_causal=causal), 3)
            if peer else 0.0,
            best_s(lambda: fl.attention(*leaves, **kw).sum().backward(), 2),
            best_s(lambda: F.scaled_dot_product_attention(
                *sdpa, is_causal=causal).sum().backward(), 2) if peer else 0.0)


def measure_decode(batch, sk, dtype):
    """Seconds of a decode step: ours, ours on the loops, SDPA (enable_gqa)."""
    q = torch.randn(batch, 1, 32, 128, dtype=dtype)
    k, v = (torch.randn(batch, sk, 8, 128, dtype=dtype) for _ in range(2))
    plain = [x.transpose(1, 2) for x in (q, k, v)]
    times = []
    for route in (True, False):
        attn_mod.SDPA_CPU = route
        try:
            times.append(best_s(lambda: fl.attention(q, k, v, causal=True), 5))
        finally:
            attn_mod.SDPA_CPU = True
    return (*times, best_s(lambda: F.scaled_dot_product_attention(*plain, enable_gqa=True), 5))


def measure_padded_decode(batch, sk, dtype):
    """Seconds of a left-padded batch's decode step (generate's padding: sequence b's keys
    start at a random slot of the first half): ``attention_with_kvcache(cache_leftpad=)`` in
    one masked call, the same with one call a sequence (``sdpa_fwd_ranges`` declined), SDPA
    with the padding as its mask."""
    kv_mod = importlib.import_module("flashlse.ops.kvcache")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, 32, 128, dtype=dtype)
    k, v = (torch.randn(batch, sk, 8, 128, dtype=dtype) for _ in range(2))
    starts = torch.randint(0, sk // 2, (batch,), generator=g, dtype=torch.int32)
    seen = torch.arange(sk)[None] >= starts[:, None].long()
    mask = torch.zeros(batch, 1, 1, sk, dtype=dtype).masked_fill_(~seen[:, None, None],
                                                                   float("-inf"))
    plain = [x.transpose(1, 2) for x in (q, k, v)]
    call = lambda: fl.attention_with_kvcache(q, k, v, cache_leftpad=starts, causal=True)
    one = best_s(call, 5)
    ranges = kv_mod.sdpa_fwd_ranges
    kv_mod.sdpa_fwd_ranges = lambda *a, **kw: None
    try:
        each = best_s(call, 5)
    finally:
        kv_mod.sdpa_fwd_ranges = ranges
    return one, each, best_s(lambda: F.scaled_dot_product_attention(
        *plain, attn_mask=mask, enable_gqa=True), 5)


def measure_varlen(n, length, dtype):
    """Seconds of a packed causal batch of ``n`` sequences of ``length`` tokens (H = 8,
    D = 64): forward and forward+backward with the runs of equal sequences batched, then one
    call a sequence (``ops.attention._seq_runs`` cut to single sequences), and SDPA's
    forward on the same batch as (n, H, length, D)."""
    q, k, v = (torch.randn(n * length, 8, 64, dtype=dtype, requires_grad=True)
               for _ in range(3))
    cu = torch.arange(0, n * length + 1, length, dtype=torch.int32)
    call = lambda: fl.attention_varlen(q, k, v, cu, cu, length, length, causal=True)
    runs = attn_mod._seq_runs

    def singles(*args):
        for q0, k0, m, lq, lk in runs(*args):
            yield from ((q0 + i * lq, k0 + i * lk, 1, lq, lk) for i in range(m))

    times = []
    for form in (runs, singles):
        attn_mod._seq_runs = form
        try:
            times += [best_s(call, 3), best_s(lambda: call().sum().backward(), 2)]
        finally:
            attn_mod._seq_runs = runs
    plain = [x.detach().view(n, length, 8, 64).transpose(1, 2) for x in (q, k, v)]
    return (*times, best_s(lambda: F.scaled_dot_product_attention(*plain, is_causal=True), 3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--native", default="on", choices=("on", "off"),
                    help="off: bf16 / fp16 forwards in float32 even where this CPU multiplies "
                         "the dtype natively (ops.attention.NATIVE_CPU_DTYPES), for an A/B")
    args = ap.parse_args()
    if args.native == "off":
        attn_mod.NATIVE_CPU_DTYPES = frozenset()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.set_num_threads(args.threads)
    b, h, d = 1, 8, 64
    lengths = (256,) if args.smoke else (2048, 4096)
    print(f"CPU path vs SDPA (cpu), {args.dtype}, B={b} H={h} D={d}, {args.threads} threads, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; forwards in the dtype: "
          f"{sorted(str(t) for t in attn_mod.NATIVE_CPU_DTYPES) or 'none'}")
    ours = {}
    for s in lengths:
        q, k, v = (torch.randn(b, s, h, d, dtype=dtype) for _ in range(3))
        for causal in (False, True):
            fwd, fwd_ref, both, both_ref = measure(q, k, v, causal)
            # The same calls on the loops (torch's CPU flash attention off).
            attn_mod.SDPA_CPU = False
            try:
                loop_fwd, _, loop_both, _ = measure(q, k, v, causal)
            finally:
                attn_mod.SDPA_CPU = True
            ours[s, causal] = (fwd, both)
            print(f"S={s} causal={causal!s:<5} forward {fwd:.3f} s (loops {loop_fwd:.3f}; SDPA "
                  f"{fwd_ref:.3f}, {fwd_ref / fwd:.2f}x)  forward+backward {both:.3f} s (loops "
                  f"{loop_both:.3f}; SDPA {both_ref:.3f}, {both_ref / both:.2f}x)")
    s = lengths[-1]
    print(f"causal speed-up at S={s}: forward {ours[s, False][0] / ours[s, True][0]:.2f}x, "
          f"forward+backward {ours[s, False][1] / ours[s, True][1]:.2f}x")
    # Calls SDPA has no form for (a sink; causal on more keys than rows, bottom-right
    # aligned): torch's CPU flash attention on key ranges, merged, against the loops.
    chunk, s = lengths[0] // 4, lengths[-1]
    for name, sq, sk, sink, window in (
            (f"S={lengths[0]} causal + sink", lengths[0], lengths[0], torch.randn(h), None),
            (f"Sq={chunk} on Sk={s} causal", chunk, s, None, None),
            (f"S={s} window (127, 0)", s, s, None, (127, 0)),
            (f"S={s} window (1023, 0)", s, s, None, (1023, 0))):
        q = torch.randn(b, sq, h, d, dtype=dtype)
        k, v = (torch.randn(b, sk, h, d, dtype=dtype) for _ in range(2))
        runs = []
        for route in (True, False):
            attn_mod.SDPA_CPU = route
            try:
                runs.append(measure(q, k, v, True, sink, window)[::2])
            finally:
                attn_mod.SDPA_CPU = True
        (fwd, both), (loop_fwd, loop_both) = runs
        print(f"{name}: forward {fwd:.3f} s (loops {loop_fwd:.3f}, {loop_fwd / fwd:.2f}x)  "
              f"forward+backward {both:.3f} s (loops {loop_both:.3f}, {loop_both / both:.2f}x)")
    # Decode steps (one query row on a 4k cache, Hq / Hkv = 32 / 8, D = 128), as a model's
    # generate() calls attention on the CPU; SDPA with enable_gqa beside it.
    for batch in (1, 8):
        ours, loops, ref = measure_decode(batch, s, dtype)
        print(f"decode B={batch} Sk={s}: {ours * 1e3:.2f} ms (loops {loops * 1e3:.2f}, "
              f"{loops / ours:.1f}x; SDPA {ref * 1e3:.2f}, {ref / ours:.2f}x)")
    one, each, ref = measure_padded_decode(8, s, dtype)
    print(f"left-padded decode B=8 Sk={s}: {one * 1e3:.2f} ms (a call a sequence "
          f"{each * 1e3:.2f}, {each / one:.1f}x; SDPA masked {ref * 1e3:.2f}, {ref / one:.2f}x)")
    # Packed varlen batches of equal sequences (attention_varlen): runs batched against one
    # call a sequence, SDPA's batched forward beside.
    for n, length in ((4, 16), (2, 64)) if args.smoke else ((256, 32), (64, 128), (16, 512)):
        fwd, both, one_fwd, one_both, ref = measure_varlen(n, length, dtype)
        print(f"varlen {n} x {length} causal: forward {fwd * 1e3:.1f} ms (a call a sequence "
              f"{one_fwd * 1e3:.1f}, {one_fwd / fwd:.2f}x; SDPA {ref * 1e3:.1f}, "
              f"{ref / fwd:.2f}x)  forward+backward {both * 1e3:.1f} ms (a call a sequence "
              f"{one_both * 1e3:.1f}, {one_both / both:.2f}x)")


if __name__ == "__main__":
    main()
