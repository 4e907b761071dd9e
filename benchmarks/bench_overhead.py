"""Host overhead of the public functions: is ``fl.attention(...)`` as fast as its kernels?

Each row times one public call (validation, autograd and launches included, as a user
calls it) four ways, in one process:

- ``public``: ``triton.testing.do_bench`` median of the public call (``_common.median_ms``).
  Events bracket each call on the stream, so host time the GPU waits for is counted --
  less the head start do_bench gives the host: it clears the L2 (a 256 MB memset, about
  50 us on an H200) before each call, and the call's launches overlap that clear.
- ``graph``: the same call captured in a CUDA graph after a warm-up on a side stream,
  ``g.replay()`` timed the same way: the device time with no host in the way. Where
  ``public`` exceeds it, the GPU waits for Python (or for a sync).
- ``kernel``: torch.profiler, the time the device events (kernels, memsets, copies) of 20
  calls cover, divided by 20: the GPU work itself, without launch gaps. Covered time, the
  union of the events' intervals, not the sum of their durations: with programmatic
  dependent launch the decode merge kernel starts (and waits) while the split kernel
  runs, and a sum would count that overlap twice.
- ``host``: host microseconds a call. A ``torch.cuda._sleep`` first holds the GPU busy, long
  enough that the queue absorbs every launch, then 200 calls are timed with
  ``time.perf_counter`` and no synchronize (in chunks of 50, which keeps the pending
  launches below the driver's queue depth: a full queue would block the host on the GPU).
  If the sleep has already ended when a chunk's loop ends (the call synchronized, or the
  queue filled), the host time includes GPU time: the column is marked ``!``.
- ``sync``: whether one call runs under ``torch.cuda.set_sync_debug_mode("error")``.
- ``floor``: what the call's launches and allocations cost on this host by themselves:
  its device events a call (profiler) times an empty 24-argument Triton kernel launched as
  flashlse launches its kernels (``_common.Launch``), plus its allocator requests a call
  (``torch.cuda.memory_stats``) times a ``torch.empty``, plus, for a forward + backward,
  ``_common.NoKernelOp``'s forward and backward (on the thread the row's backward runs on),
  each timed here like ``host``. ``over`` = host - floor: flashlse's own Python a
  call (the bar form proposed in issue 15's closing notes: host <= floor + 25 us).

Bars (issue "Public calls at kernel speed"): host us a call <= 30 (attention forward and
attention_with_kvcache), <= 100 (attention forward + backward), <= 20 (merge_states);
and public <= 1.05 x graph wherever graph >= 0.1 ms (shorter calls are launch-bound by
nature). attention_varlen and sparse_attention rows have no host bar; the SDPA cuDNN rows
(``sdpa_fwd``, ``sdpa_fwdbwd``) are peers on the attention rows' shapes, timed the same
ways: what torch's own attention pays on this host.

    python benchmarks/bench_overhead.py [--out DIR] [--functions kvcache,merge,fwd,...]
    TRITON_INTERPRET=1 python benchmarks/bench_overhead.py --smoke --out /tmp/ovh

``--functions`` picks from kvcache, merge, fwd, fwdbwd, fwdbwd_1t, varlen, sparse, topk, mla,
paged (default all).
Writes ``overhead.json`` and ``overhead_rows.md`` (rows for benchmarks/RESULTS.md) into
``--out`` (default benchmarks/results); prints the table last. ``--smoke`` runs tiny
shapes on the CPU under the interpreter to check the script: only ``public`` (one
host-timed call) is measured there, the CUDA-only columns print ``-``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import gc
import json
import os
import sys
import time

import torch
import triton

# The repo root last: a PYTHONPATH tree (h200_session.sh in_turn's .before) comes first.
sys.path.append(os.path.join(os.path.dirname(__file__), ".."))

from _common import attention_step, autograd_floor_fn, graph_replay, median_ms  # noqa: E402

import flashlse as fl  # noqa: E402

# --smoke: tiny shapes on the CPU under TRITON_INTERPRET=1, to check the script itself.
SMOKE = "--smoke" in sys.argv
# Median milliseconds (one host-timed call under --smoke).
bench = functools.partial(median_ms, smoke=SMOKE)
DEV = "cpu" if SMOKE else "cuda"
# The interpreter's bf16 tl.dot is wrong in triton 3.6: smoke runs float32.
DT = torch.float32 if SMOKE else torch.bfloat16
D = 32 if SMOKE else 128
HQ, HKV = (4, 2) if SMOKE else (32, 8)
# Decode: (B, Skv) pairs of equal cache bytes, contiguous; plus one paged row.
KV_SHAPES = [(1, 256), (2, 128)] if SMOKE else [(1, 131072), (8, 32768), (64, 8192), (128, 2048)]
KV_PAGED = (2, 128, 16) if SMOKE else (64, 8192, 64)  # (B, Skv, page size)
# merge_states: (N, leading dims..., D), dtype.
MERGE_SHAPES = ([((2, 4, 8, D), DT), ((4, 2, 4, D), torch.float32), ((8, 4, 8, D), DT)]
                if SMOKE else
                [((2, 4096, 128, 128), torch.bfloat16), ((4, 64, 32, 128), torch.float32),
                 ((8, 4096, 128, 128), torch.bfloat16)])
# Prefill: (B, S, H), causal.
ATTN_SHAPES = [(1, 64, 2), (1, 32, 2)] if SMOKE else [(16, 1024, 16), (8, 2048, 16)]
VARLEN = (2, 64, 2) if SMOKE else (16, 1024, 16)  # (sequences, tokens each, H)
SPARSE = (1, 32, 2, 1, 8) if SMOKE else (1, 1024, 16, 1, 256)  # (B, S, Hq, Hkv, topk)
# Top-k MLA decode: (B, Skv, Hq, D, Dv, topk) over a paged 64 latent cache.
TOPK = (2, 128, 4, 48, 32, 16) if SMOKE else (64, 8192, 128, 576, 512, 2048)
TOPK_SHAPES = [TOPK] if SMOKE else [TOPK, (128, 4096, 128, 576, 512, 2048)]
# Dense MLA decode (issue 18's bars): (B, Skv, Hq, D, Dv) over a paged 64 latent cache.
MLA_SHAPES = ([(2, 128, 4, 48, 32)] if SMOKE else
              [(64, 8192, 128, 576, 512), (128, 4096, 128, 576, 512)])
# Paged varlen steps: (B, keys a sequence, page size, prefill chunks, their query rows).
PAGED = ([(2, 64, 16, 0, 1), (3, 64, 16, 1, 20)] if SMOKE else
         [(64, 4096, 16, 0, 1), (64, 4096, 16, 4, 512)])

N_HOST, CHUNK = 200, 50
N_PROFILE = 20
HOST_BAR_US = {"kvcache": 30, "merge": 20, "fwd": 30, "fwdbwd": 100, "fwdbwd_1t": 100}
RATIO_BAR, RATIO_MIN_MS = 1.05, 0.1
LABEL = {"kvcache": "attention_with_kvcache", "merge": "merge_states", "fwd": "attention fwd",
         "fwdbwd": "attention fwd+bwd",
         # The same step with torch's autograd running the backward on the calling thread
         # (``torch.autograd.set_multithreading_enabled(False)``) instead of its CUDA
         # device thread: the handoff's share of the host time.
         "fwdbwd_1t": "attn fwd+bwd, 1 thread", "varlen": "attention_varlen fwd",
         "sparse": "sparse_attention fwd",
         # Issue 18's top-k MLA decode (DeepSeek-V3.2): B=64 queries of 128 heads, each
         # listing 2048 rows of a paged 64 latent cache of 8k tokens a sequence. Its kernel
         # takes ~96 us on the H200 (session 23), about the call's host time.
         "topk": "sparse MLA top-k",
         # Issue 18's dense MLA decode through attention_with_kvcache (v = the latent's first
         # Dv columns, 128 heads on one latent head): its bars are public-call TFLOP/s.
         "mla": "MLA decode",
         # vLLM's step through attention_varlen with a block table (decodes; decodes and
         # prefill chunks), max_seqlen_k moving every call (the engine's steps change it).
         "paged": "varlen paged step",
         # Peers on the attention rows' shapes: torch's SDPA on its cuDNN backend, the
         # forward and a training step (the same fresh .grad and backward(dout)), timed the
         # same four ways. Its host time is what any attention pays through torch's dispatch
         # and autograd (issue 15's host bars; the floor form proposed for them).
         "sdpa_fwd": "SDPA cuDNN fwd (peer)", "sdpa_fwdbwd": "SDPA cuDNN fwd+bwd (peer)"}

Case = collections.namedtuple("Case", "kind shape build")


def randn(*shape, dtype=DT, requires_grad=False):
    # Drawn on the CPU: a capture that failed (SDPA cuDNN's fwd+bwd on torch 2.11) leaves the
    # CUDA generator mid-capture, and every later CUDA draw raises "Offset increment outside
    # graph capture".
    x = torch.randn(*shape, dtype=torch.float32).to(DEV, dtype)
    return x.requires_grad_(requires_grad)


# Each builder allocates its inputs and returns the public call as a closure: the inputs
# live as long as the closure does, and are freed before the next case.

def kvcache_call(b, skv, page=None):
    q = randn(b, 1, HQ, D)
    if page is None:
        k, table = randn(b, skv, HKV, D), None
    else:
        pages = skv // page
        k = randn(b * pages, page, HKV, D)
        table = torch.randperm(b * pages, device=DEV).view(b, pages).to(torch.int32)
    v = torch.randn_like(k)
    lens = torch.full((b,), skv, dtype=torch.int32, device=DEV)
    return lambda: fl.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table)


def merge_call(shape, dtype):
    outs = randn(*shape, dtype=dtype)
    lses = randn(*shape[:-1], dtype=torch.float32) * 3
    return lambda: fl.merge_states(outs, lses)


def merge_pair_call(shape, dtype):
    """``fl.merge`` of two separate states (read in place by the pair kernel)."""
    a, b = (randn(*shape[1:], dtype=dtype) for _ in range(2))
    la, lb = (randn(*shape[1:-1], dtype=torch.float32) * 3 for _ in range(2))
    return lambda: fl.merge(a, la, b, lb, layout="rows")


def fwd_call(b, s, h):
    q, k, v = (randn(b, s, h, D) for _ in range(3))
    return lambda: fl.attention(q, k, v, causal=True)


def fwdbwd_call(b, s, h, threads=True):
    q, k, v = (randn(b, s, h, D, requires_grad=True) for _ in range(3))
    # Fresh gradients every call, so eager and replayed calls do the same device work.
    return attention_step(q, k, v, randn(b, s, h, D), threads=threads, causal=True)


def sdpa_call(b, s, h, backward=False):
    """The peer of ``fwd_call`` / ``fwdbwd_call``: SDPA on (B, H, S, D) views of the same
    layout, cuDNN's backend on a GPU (the default one under --smoke)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (randn(b, s, h, D, requires_grad=backward).transpose(1, 2) for _ in range(3))
    dout = randn(b, s, h, D).transpose(1, 2)
    backends = [SDPBackend.MATH] if SMOKE else [SDPBackend.CUDNN_ATTENTION]
    leaves = [t._base for t in (q, k, v)]

    def step():
        with sdpa_kernel(backends):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            for t in leaves:
                t.grad = None
            out.backward(dout)
        return out
    return step


def varlen_call(n, s, h):
    q, k, v = (randn(n * s, h, D) for _ in range(3))
    cu = (torch.arange(n + 1, device=DEV, dtype=torch.int32) * s)
    return lambda: fl.attention_varlen(q, k, v, cu, cu, s, s, causal=True)


def sparse_call(b, s, hq, hkv, topk):
    q, k, v = randn(b, s, hq, D), randn(b, s, hkv, D), randn(b, s, hkv, D)
    idx = torch.randint(0, s, (b, s, hkv, topk), device=DEV, dtype=torch.int32)
    idx[..., -topk // 8:] = -1  # some slots hold no key, as a top-k selector leaves them
    return lambda: fl.sparse_attention(q, k, v, idx)


def topk_call(b, skv, hq, d, dv, topk):
    pages = skv // 64
    q = randn(b, 1, hq, d)
    lat = randn(b * pages, 64, 1, d)
    table = torch.randperm(b * pages, device=DEV).view(b, pages).to(torch.int32)
    idx = torch.randint(0, skv, (b, 1, 1, topk), device=DEV, dtype=torch.int32)
    return lambda: fl.sparse_attention(q, lat, lat[..., :dv], idx, block_table=table,
                                       scale=d ** -0.5)


def mla_call(b, skv, hq, d, dv):
    pages = skv // 64
    q = randn(b, 1, hq, d)
    lat = randn(b * pages, 64, 1, d)
    table = torch.randperm(b * pages, device=DEV).view(b, pages).to(torch.int32)
    lens = torch.full((b,), skv, dtype=torch.int32, device=DEV)
    return lambda: fl.attention_with_kvcache(q, lat, lat[..., :dv], cache_seqlens=lens,
                                             block_table=table, scale=d ** -0.5)


def paged_call(b, skv, page, prefills=0, rows=1):
    """``b`` sequences of ``skv`` cached keys on pages of ``page`` rows: decodes (one query
    row), the first ``prefills`` of them chunks of ``rows`` query rows (a mixed step)."""
    pages = skv // page + 1
    qlens = [rows] * prefills + [1] * (b - prefills)
    q = randn(sum(qlens), HQ, D)
    k = randn(b * pages, page, HKV, D)
    v = torch.randn_like(k)
    table = torch.randperm(b * pages, device=DEV).view(b, pages).to(torch.int32)
    lens = torch.full((b,), skv, dtype=torch.int32, device=DEV)
    cu = torch.tensor([0] + qlens, device=DEV, dtype=torch.int32).cumsum(0).to(torch.int32)
    step = [0]

    def call():
        # The engine's max_seqlen_k moves every step (here within one spare page).
        step[0] = (step[0] + 1) % page
        return fl.attention_varlen(q, k, v, cu, None, max(qlens), skv + step[0],
                                   seqused_k=lens, block_table=table, causal=True)
    return call


def cases(kinds):
    hd = f"Hq/Hkv={HQ}/{HKV} D={D}"
    out = []
    if "kvcache" in kinds:
        for b, skv in KV_SHAPES:
            out.append(Case("kvcache", f"B={b} Skv={skv} {hd} contiguous",
                            functools.partial(kvcache_call, b, skv)))
        b, skv, page = KV_PAGED
        out.append(Case("kvcache", f"B={b} Skv={skv} {hd} paged {page}",
                        functools.partial(kvcache_call, b, skv, page)))
    if "merge" in kinds:
        for shape, dtype in MERGE_SHAPES:
            rows = 1
            for x in shape[1:-1]:
                rows *= x
            name = str(dtype).replace("torch.", "")
            out.append(Case("merge", f"N={shape[0]} x ({rows} rows, {shape[-1]}) {name}",
                            functools.partial(merge_call, shape, dtype)))
            if shape[0] == 2:
                out.append(Case("merge", f"fl.merge of two ({rows} rows, {shape[-1]}) {name}",
                                functools.partial(merge_pair_call, shape, dtype)))
    for kind, call in (("fwd", fwd_call), ("fwdbwd", fwdbwd_call),
                       ("fwdbwd_1t", functools.partial(fwdbwd_call, threads=False)),
                       ("sdpa_fwd", sdpa_call),
                       ("sdpa_fwdbwd", functools.partial(sdpa_call, backward=True))):
        if kind in kinds:
            for b, s, h in ATTN_SHAPES:
                out.append(Case(kind, f"B={b} S={s} H={h} D={D} causal",
                                functools.partial(call, b, s, h)))
    if "varlen" in kinds:
        n, s, h = VARLEN
        out.append(Case("varlen", f"{n} x {s} tokens H={h} D={D} causal",
                        functools.partial(varlen_call, n, s, h)))
    if "sparse" in kinds:
        b, s, hq, hkv, topk = SPARSE
        out.append(Case("sparse", f"B={b} S={s} Hq/Hkv={hq}/{hkv} D={D} topk={topk}",
                        functools.partial(sparse_call, b, s, hq, hkv, topk)))
    if "topk" in kinds:
        for shape in TOPK_SHAPES:
            b, skv, hq, d, dv, topk = shape
            out.append(Case("topk", f"B={b} Skv={skv} Hq={hq} {d}/{dv} topk={topk} paged 64",
                            functools.partial(topk_call, *shape)))
    if "mla" in kinds:
        for shape in MLA_SHAPES:
            b, skv, hq, d, dv = shape
            out.append(Case("mla", f"B={b} Skv={skv} Hq={hq} {d}/{dv} paged 64",
                            functools.partial(mla_call, *shape)))
    if "paged" in kinds:
        for b, skv, page, prefills, rows in PAGED:
            what = f"{prefills} x {rows} rows + " if prefills else ""
            out.append(Case("paged", f"B={b} ({what}decodes) Skv={skv} page {page}, moving",
                            functools.partial(paged_call, b, skv, page, prefills, rows)))
    return out


def sync_free(step) -> bool:
    """Whether one call runs with no host-device sync (torch raises on the first one)."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return True
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return False
    finally:
        torch.cuda.set_sync_debug_mode(prev)
        torch.cuda.synchronize()


def graph_ms(step) -> float:
    """Median ms of ``step`` replayed from a CUDA graph (for fwd+bwd the gradients are set to
    None before the capture, by ``step`` itself)."""
    replay = graph_replay(step)
    return bench(replay)


def kernel_ms(step) -> tuple[float, float]:
    """Device time of one call by torch.profiler: the time covered by the device events
    (kernels, memsets, copies) of N_PROFILE calls, gaps between them left out; and those
    events a call."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(N_PROFILE):
            step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    us, end = 0.0, float("-inf")
    for t0, t1 in spans:  # the union of the intervals: overlapping kernels count once
        if t1 > end:
            us += t1 - max(t0, end)
            end = t1
    return us / N_PROFILE / 1e3, len(spans) / N_PROFILE


def allocs_per_call(step) -> float:
    """Requests to torch's CUDA allocator a call (tensors, Triton's scratch)."""
    step()
    torch.cuda.synchronize()
    key = "allocation.all.allocated"
    before = torch.cuda.memory_stats()[key]
    for _ in range(N_PROFILE):
        step()
    torch.cuda.synchronize()
    return (torch.cuda.memory_stats()[key] - before) / N_PROFILE


@triton.jit
def _empty24(x0, x1, x2, x3, x4, x5, x6, x7, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
             a12, a13, a14, a15):
    pass


@functools.cache
def unit_costs() -> dict:
    """Host us of one launch, one allocation and the no-kernel autograd round trip (device
    thread and calling thread), timed as ``host_us`` times a row."""
    from flashlse.kernels._common import Launch

    ts = [torch.empty(16, device="cuda") for _ in range(8)]
    # (No 0 or 1, which Triton would specialise.) Launched as flashlse launches its kernels.
    launch = Launch(_empty24, (1,), tuple(range(3, 19)), {})
    return dict(launch=host_us(lambda: launch(*ts))[0],
                alloc=host_us(lambda: torch.empty(4096, device="cuda"))[0],
                autograd=host_us(autograd_floor_fn("cuda"))[0],
                autograd_1t=host_us(autograd_floor_fn("cuda", threads=False))[0])


def floor_us(kind, events, allocs) -> float:
    """The row's floor (module docstring): its launches, allocations and, for a forward +
    backward, torch's autograd round trip, at this host's unit costs."""
    u = unit_costs()
    extra = {"fwdbwd": u["autograd"], "fwdbwd_1t": u["autograd_1t"],
             "sdpa_fwdbwd": u["autograd"]}.get(kind, 0.0)
    return events * u["launch"] + allocs * u["alloc"] + extra


@functools.cache
def sleep_cycles_per_s() -> float:
    """Clock rate of ``torch.cuda._sleep`` (it spins a number of GPU cycles), measured."""
    torch.cuda._sleep(1000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10**8)
    b.record()
    b.synchronize()
    return 1e8 / (a.elapsed_time(b) / 1e3)


def host_us(step) -> tuple[float, bool]:
    """Host microseconds a call, and whether the GPU was still asleep after every chunk
    (False: the loop waited on the GPU somewhere, the time is not host time alone)."""
    step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    # A synchronized call bounds the host time a call from above: sleep for twice a chunk
    # of those (5 ms at least, 5 s at most), so the GPU outlasts the host loop.
    sleep_s = min(5.0, max(0.005, 2 * CHUNK * (time.perf_counter() - t)))
    cycles = int(sleep_s * sleep_cycles_per_s())
    total, clean = 0.0, True
    for _ in range(N_HOST // CHUNK):
        torch.cuda._sleep(cycles)
        awake = torch.cuda.Event()
        awake.record()
        t = time.perf_counter()
        for _ in range(CHUNK):
            step()
        total += time.perf_counter() - t
        clean &= not awake.query()
        torch.cuda.synchronize()
    return total / (N_HOST // CHUNK * CHUNK) * 1e6, clean


def measure(case) -> dict:
    row = dict(function=case.kind, label=LABEL[case.kind], shape=case.shape)
    step = case.build()
    row["public_ms"] = bench(step)
    if not SMOKE:
        # Graph capture last: it holds a memory pool and, for fwd+bwd, the gradients.
        for key, fn in (("host_us", host_us), ("kernel_ms", kernel_ms),
                        ("allocs", allocs_per_call), ("sync_free", sync_free),
                        ("graph_ms", graph_ms)):
            try:
                res = fn(step)
            except Exception as e:  # noqa: BLE001 - a failing column is reported, not fatal
                res = None
                row[key.rsplit("_", 1)[0] + "_err"] = repr(e)[:200]
                torch.cuda.synchronize()
            if key == "host_us" and res is not None:
                res, row["host_clean"] = res
            if key == "kernel_ms" and res is not None:
                res, row["events"] = res
            row[key] = res
        if row.get("events") is not None and row.get("allocs") is not None:
            row["floor_us"] = floor_us(case.kind, row["events"], row["allocs"])
    del step
    gc.collect()
    if not SMOKE:
        torch.cuda.empty_cache()
    pub, graph, host = row["public_ms"], row.get("graph_ms"), row.get("host_us")
    row["ratio"] = None if graph is None else pub / graph
    bar = HOST_BAR_US.get(case.kind)
    row["host_bar_us"] = bar
    row["host_ok"] = None if bar is None or host is None else host <= bar
    row["ratio_ok"] = (None if graph is None or graph < RATIO_MIN_MS
                       else pub <= RATIO_BAR * graph)
    return row


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def mark(ok):
    return "-" if ok is None else ("✓" if ok else "✗")


def host_cell(r):
    h = r.get("host_us")
    if h is None:
        return "-"
    return f"{h:.1f}" + ("" if r.get("host_clean", True) else "!")


def finish(args, info, rows):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overhead.json"), "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1)
    md = []
    for r in rows:
        bar = r["host_bar_us"]
        host_bar = "no host bar" if bar is None else f"host <= {bar} us {mark(r['host_ok'])}"
        md.append(
            f"| {info['date']} | {info['device']} | torch {info['torch']} | triton "
            f"{info['triton']} | overhead | {r['label']} {r['shape']} | public "
            f"{fmt(r['public_ms'])} ms, host {host_cell(r)} us (floor "
            f"{fmt(r.get('floor_us'), '.1f')}) | graph {fmt(r.get('graph_ms'))} "
            f"ms, kernel {fmt(r.get('kernel_ms'))} ms; {host_bar}, sync-free "
            f"{mark(r.get('sync_free'))} | x{fmt(r['ratio'], '.2f')} graph "
            f"{mark(r['ratio_ok'])} |")
    with open(os.path.join(args.out, "overhead_rows.md"), "w") as f:
        f.write("\n".join(md) + "\n")

    print()
    for r in rows:
        errs = {k: v for k, v in r.items() if k.endswith("_err")}
        if errs:
            print(r["label"], r["shape"], errs)
    print(f"\n{info['device']}  torch {info['torch']}  triton {info['triton']}  "
          f"({info['date']}; host: {N_HOST} calls behind a GPU sleep, ! = the loop waited "
          f"on the GPU)")
    hdr = ["function", "shape", "public ms", "graph ms", "kernel ms", "host us", "pub/graph",
           "host bar", "ratio bar", "sync-free", "launches", "allocs", "floor us", "over"]
    widths = [22, 42, 9, 9, 9, 8, 9, 9, 9, 9, 8, 6, 8, 6]
    print(" | ".join(f"{h:<{w}}" for h, w in zip(hdr, widths)))
    for r in rows:
        bar = r["host_bar_us"]
        floor, host = r.get("floor_us"), r.get("host_us")
        vals = [r["label"], r["shape"], fmt(r["public_ms"]), fmt(r.get("graph_ms")),
                fmt(r.get("kernel_ms")), host_cell(r), fmt(r["ratio"], ".2f"),
                "-" if bar is None else f"{mark(r['host_ok'])} <={bar}",
                mark(r["ratio_ok"]), mark(r.get("sync_free")), fmt(r.get("events"), ".1f"),
                fmt(r.get("allocs"), ".1f"), fmt(floor, ".1f"),
                "-" if floor is None or host is None else f"{host - floor:.1f}"]
        print(" | ".join(f"{str(x)[:w]:<{w}}" for x, w in zip(vals, widths)))
    if not SMOKE:
        u = unit_costs()
        print(f"floor's unit costs on this host, us: a launch {u['launch']:.1f}, an allocation "
              f"{u['alloc']:.1f}, a no-kernel autograd fwd+bwd {u['autograd']:.1f} (on the "
              f"calling thread {u['autograd_1t']:.1f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"))
    ap.add_argument("--functions", default=",".join(LABEL),
                    help="comma list of: " + ", ".join(LABEL))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.functions.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in LABEL]
    if unknown:
        ap.error(f"unknown --functions {unknown}; choose from {', '.join(LABEL)}")
    torch.manual_seed(0)
    info = dict(date=datetime.date.today().isoformat(),
                device="cpu (smoke)" if SMOKE else torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    rows = []
    for case in cases(kinds):
        rows.append(measure(case))
        r = rows[-1]
        print(f"{r['label']:<24} {r['shape']:<44} public {fmt(r['public_ms'])} ms  graph "
              f"{fmt(r.get('graph_ms'))} ms  host {host_cell(r)} us", flush=True)
    finish(args, info, rows)


if __name__ == "__main__":
    main()
