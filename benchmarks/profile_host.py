"""Where a public call's host time goes: cProfile over many calls of small (host-bound) shapes,
and the floor this host sets: a bare torch op, ``torch.empty``, and an empty Triton kernel
launched through ``JITFunction.run`` with 1 and with 32 arguments (flashlse's kernels take
30-60) and through the compiled kernel's own launcher.

    python benchmarks/profile_host.py [--top 18]
    python benchmarks/profile_host.py --cpu-stubbed [--profile NAME] [--n 5000]
    python benchmarks/profile_host.py --ab MODULE.NAME [--rows SUBSTR] [--rounds 8]
    python benchmarks/profile_host.py --parts [--rounds 8]   # a fwd+bwd's host pieces, and
                                                             # autograd's device thread

Prints the floor, then per call kind microseconds a call and the functions with the most
own time.

``--cpu-stubbed`` needs no GPU: CPU tensors under ``TRITON_INTERPRET=1`` with the
interpreter's launch replaced by a no-op, so what it times is flashlse's own Python around
the launches (validation, launchers, allocations), per public function, beside a bare
``x.add_(1)`` for the host's scale. Value checks are off (``value_checks(False)``), as on a
GPU by default (CPU tensors would otherwise read their values). ``--profile NAME`` adds
cProfile's table for the call of that name (by own time; ``PSORT=cumulative`` sorts it by
cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time

# The interpreter is chosen when Triton is imported: the stubbed mode sets it first.
if "--cpu-stubbed" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from _common import (  # noqa: E402
    attention_step,
    autograd_floor_fn,
    graph_replay,
    host_loop_s,
)

import flashlse as fl  # noqa: E402


@triton.jit
def _empty1(x):
    pass


@triton.jit
def _empty32(x0, x1, x2, x3, x4, x5, x6, x7, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
             a12, a13, a14, a15, a16, a17, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
             B3: tl.constexpr, B4: tl.constexpr, B5: tl.constexpr):
    pass


def _loop(name: str, n: int) -> tuple[int, bool]:
    """Calls to time a ``calls()`` row, and whether behind a GPU sleep: the B = 16 row's GPU
    work outlasts the host's, so 40 calls behind the sleep (the launch queue holds them)."""
    return (40, True) if "B=16" in name else (n, False)


def per_call_us(fn, n, warm: int = 20, sleep: bool = False):
    """Host us a call (``_common.host_loop_s``), behind a GPU sleep if ``sleep``."""
    return host_loop_s(fn, n, sync_end=False, warm=warm, gpu_sleep=sleep) * 1e6


def back_to_back_ms(fn, n=200):
    """Milliseconds a call over n calls issued back to back (no L2 flush between them, unlike
    do_bench): a call whose host time exceeds its GPU time shows here, not in do_bench."""
    return host_loop_s(fn, n, sync_end=True) * 1e3


def back_to_back():
    dev, dt = "cuda", torch.bfloat16
    kc = torch.randn(1, 131072, 8, 128, device=dev, dtype=dt)
    qd = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    lens = torch.full((1,), 131072, dtype=torch.int32, device=dev)
    q = torch.randn(16, 1024, 16, 128, device=dev, dtype=dt)
    rows = {
        "kvcache B=1 Skv=128k": lambda: fl.attention_with_kvcache(qd, kc, kc, cache_seqlens=lens),
        "attention fwd B=16 S=1k causal": lambda: fl.attention(q, q, q, causal=True),
    }
    for name, fn in rows.items():
        pub, gr = back_to_back_ms(fn), back_to_back_ms(graph_replay(fn))
        print(f"=== back to back {name:<32} public {pub:.3f} ms, graph {gr:.3f} ms, "
              f"{pub / gr:.2f}x")


class _Busy(torch.autograd.Function):
    """``_common.NoKernelOp`` whose backward also makes ``ctx.n`` torch calls of kind
    ``ctx.kind`` (``empty``: an allocation; ``add``: a kernel launch; ``py``: pure Python of
    about the same length): what the engine's device thread adds to a backward's host work."""

    @staticmethod
    def forward(ctx, q, k, v, n, kind):
        ctx.n, ctx.kind = n, kind
        return q.view_as(q)

    @staticmethod
    def backward(ctx, dout):
        x = dout.new_zeros(16)
        for _ in range(ctx.n):
            if ctx.kind == "empty":
                torch.empty(16, device=dout.device)
            elif ctx.kind == "add":
                x.add_(1)
            else:
                sum(range(40))
        return dout, torch.empty_like(dout), torch.empty_like(dout), None, None


def threads(rounds: int) -> None:
    """Host us of a no-kernel autograd fwd+bwd whose backward makes n torch calls, with the
    engine's device threads (torch's default) and without (the backward on the caller's
    thread): whether the handoff's cost grows with the backward's calls."""
    q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", requires_grad=True) for _ in range(3))
    do = torch.randn(1, 128, 2, 128, device="cuda")

    def step(n, kind, mt):
        def run():
            q.grad = k.grad = v.grad = None
            with torch.autograd.set_multithreading_enabled(mt):
                _Busy.apply(q, k, v, n, kind).backward(do)
        return run

    for kind in ("empty", "add", "py"):
        for n in (0, 8, 32):
            us = {mt: sorted(per_call_us(step(n, kind, mt), 300) for _ in range(rounds))
                  for mt in (True, False)}
            on, off = us[True][rounds // 2], us[False][rounds // 2]
            print(f"=== threads {kind:<5} n={n:<3} device thread {on:7.1f} us, caller's thread "
                  f"{off:7.1f} us, difference {on - off:+7.1f}")


def autograd_floor(dev, n):
    """Host us a call of :func:`autograd_floor_fn` (CUDA), or the function (CPU)."""
    step = autograd_floor_fn(dev)
    return per_call_us(step, n) if dev == "cuda" else step


def floor(n):
    x = torch.zeros(16, device="cuda")
    ts = [torch.zeros(16, device="cuda") for _ in range(8)]
    ints = list(range(3, 21))
    k32 = lambda: _empty32[(1,)](*ts, *ints, 16, 32, 64, 128, True, False)
    compiled = _empty32[(1,)](*ts, *ints, 16, 32, 64, 128, True, False)
    runner = compiled[(1, 1, 1)]
    return {
        "x.add_(1)": per_call_us(lambda: x.add_(1), n),
        "torch.empty(4096)": per_call_us(lambda: torch.empty(4096, device="cuda"), n),
        "empty kernel, 1 arg, JIT path": per_call_us(lambda: _empty1[(1,)](x), n),
        "empty kernel, 32 args, JIT path": per_call_us(k32, n),
        "empty kernel, 32 args, compiled launcher": per_call_us(
            lambda: runner(*ts, *ints, 16, 32, 64, 128, True, False), n),
        "autograd op fwd+bwd, no kernel": autograd_floor("cuda", n),
    }


def calls(dev="cuda"):
    dt = torch.bfloat16
    q = torch.randn(1, 128, 2, 128, device=dev, dtype=dt)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    fwdbwd = attention_step(qg, kg, vg, torch.randn_like(q), causal=True)
    kc = torch.randn(8, 4096, 8, 128, device=dev, dtype=dt)
    qd = torch.randn(8, 1, 32, 128, device=dev, dtype=dt)
    lens = torch.full((8,), 4096, dtype=torch.int32, device=dev)
    outs = torch.randn(4, 64, 32, 128, device=dev)
    lses = torch.randn(4, 64, 32, device=dev)
    # Packed varlen, 2 x 1k tokens, H = 16: on an H100/H200 the persistent varlen kernel
    # (its block list made by a second launch, benchmarks/host_varlen.py's A/B).
    qv = torch.randn(2048, 16, 128, device=dev, dtype=dt)
    cu = torch.tensor([0, 1024, 2048], dtype=torch.int32, device=dev)
    # Top-k MLA decode (issue 18's shape but B = 4): 128 heads on a paged 64 latent cache,
    # 2048 listed rows a sequence.
    qm = torch.randn(4, 1, 128, 576, device=dev, dtype=dt)
    lat = torch.randn(4 * 64, 64, 1, 576, device=dev, dtype=dt)
    lat_table = torch.arange(4 * 64, dtype=torch.int32, device=dev).view(4, 64)
    idx = torch.randint(0, 4096, (4, 1, 1, 2048), dtype=torch.int32, device=dev)
    # A serving step through attention_varlen with a block table: 16 decodes over 4k keys on
    # pages of 16, max_seqlen_k one longer every call (wrapping within a page), as an
    # engine's steps change it.
    pq = torch.randn(16, 32, 128, device=dev, dtype=dt)
    pk = torch.randn(16 * 257, 16, 8, 128, device=dev, dtype=dt)
    ptable = torch.arange(16 * 257, dtype=torch.int32, device=dev).view(16, 257)
    plens = torch.full((16,), 4096, dtype=torch.int32, device=dev)
    pcu = torch.arange(17, dtype=torch.int32, device=dev)
    step = [0]

    def paged_step():
        step[0] = (step[0] + 1) % 16
        return fl.attention_varlen(pq, pk, pk, pcu, None, 1, 4096 + step[0], seqused_k=plens,
                                   block_table=ptable, causal=True)

    # A mixed step (issue 15's largest serving gap, RESULTS.md session 42 call 4: 133 us over
    # its floor): 2 chunks of 512 rows and 14 decodes on the same cache; on an H100 / H200 the
    # chunks take the Hopper paged kernel, the decodes the portable one.
    mq = torch.randn(2 * 512 + 14, 32, 128, device=dev, dtype=dt)
    mcu = torch.tensor([0, 512, 1024] + list(range(1025, 1039)), dtype=torch.int32, device=dev)

    def mixed_step():
        step[0] = (step[0] + 1) % 16
        return fl.attention_varlen(mq, pk, pk, mcu, None, 512, 4096 + step[0], seqused_k=plens,
                                   block_table=ptable, causal=True)

    # One decode row through fl.attention (the short-query route, as transformers' generate
    # calls it a layer), on a fixed cache and on one a key longer each call: a new shape
    # misses every kept plan (its first layer of each generate step), the lengths cycling
    # over more than the plan caches hold.
    # (From 16k keys: 32 splits at every length of the cycle on an H100 / H200, so the loop
    # crosses no split count, whose first call would compile a variant.)
    q1 = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    kgrow = torch.randn(1, 16384 + 3000, 8, 128, device=dev, dtype=dt)
    grow = [0]

    def growing_row():
        grow[0] = (grow[0] + 1) % 3000
        kk = kgrow[:, :16384 + grow[0]]
        return fl.attention(q1, kk, kk, causal=True)

    # The same as transformers holds it: a (B, H, S, D) cache seen as (B, S, H, D), whose
    # strides change with its length (views of one buffer here, no copies).
    flat = kgrow.view(-1)

    def growing_bhsd():
        grow[0] = (grow[0] + 1) % 3000
        n = 16384 + grow[0]
        kk = flat.as_strided((1, 8, n, 128), (8 * n * 128, n * 128, 128, 1)).transpose(1, 2)
        return fl.attention(q1, kk, kk, causal=True)

    rows = {
        "attention decode row 16k": lambda: fl.attention(q1, kgrow[:, :16384], kgrow[:, :16384],
                                                        causal=True),
        "attention decode row, growing": _cycle_warmed(growing_row, dev),
        "attention decode row, growing (B, H, S, D)": _cycle_warmed(growing_bhsd, dev),
        "varlen paged decode step": paged_step,
        "varlen paged mixed step": mixed_step,
        "sparse top-k MLA decode paged": lambda: fl.sparse_attention(
            qm, lat, lat[..., :512], idx, block_table=lat_table, scale=0.05),
        "attention_varlen fwd 2 x 1k": lambda: fl.attention_varlen(qv, qv, qv, cu, cu, 1024,
                                                                   1024, causal=True),
        "attention fwd": lambda: fl.attention(q, k, v, causal=True),
        "attention fwd+bwd": fwdbwd,
        "kvcache decode": lambda: fl.attention_with_kvcache(qd, kc, kc, cache_seqlens=lens),
        "merge_states": lambda: fl.merge_states(outs, lses),
    }
    # Serving calls with kept paths of their own (session 40): a decode that appends one
    # key, and chunks of 64 query rows on contiguous and paged caches (pages of 16), one
    # appending its 64 keys.
    pages = torch.randn(8 * 256, 16, 8, 128, device=dev, dtype=dt)
    table = torch.arange(8 * 256, dtype=torch.int32, device=dev).view(8, 256)
    kn = torch.randn(8, 1, 8, 128, device=dev, dtype=dt)
    qc = torch.randn(8, 64, 32, 128, device=dev, dtype=dt)
    kc64 = torch.randn(8, 64, 8, 128, device=dev, dtype=dt)
    lens_c = torch.full((8,), 4000, dtype=torch.int32, device=dev)
    rows.update({
        "kvcache decode + append": lambda: fl.attention_with_kvcache(
            qd, kc, kc, cache_seqlens=lens_c, k_new=kn, v_new=kn),
        "kvcache chunk (64 rows) paged": lambda: fl.attention_with_kvcache(
            qc, pages, pages, cache_seqlens=lens_c, block_table=table, causal=True),
        "kvcache chunk (64 rows)": lambda: fl.attention_with_kvcache(
            qc, kc, kc, cache_seqlens=lens_c, causal=True),
        "kvcache chunk (64 rows) + append": lambda: fl.attention_with_kvcache(
            qc, kc, kc, cache_seqlens=lens_c, k_new=kc64, v_new=kc64, causal=True),
    })
    if dev == "cuda":
        # Issue 15's shape (B*S = 16k, H = 16, causal S = 1k), where bench_overhead measured
        # ~900 us of host a fwd+bwd against ~500 at the small shape above.
        ql, kl, vl = (torch.randn(16, 1024, 16, 128, device=dev, dtype=dt, requires_grad=True)
                      for _ in range(3))
        rows["attention fwd+bwd B=16 S=1k"] = attention_step(ql, kl, vl, torch.randn_like(ql),
                                                             causal=True)
    return rows


def _cycle_warmed(fn, dev):
    """``fn`` (a growing row) whose first call on a GPU first runs its whole cycle of lengths
    once (every kernel variant the cycle meets compiled: a later loop times misses, not
    compiles), then forgets the plans that cycle made (``_common.forget_plans``: the kept
    plans, the decode plans, the validation memory), so that each later call is a full miss
    of them."""
    from _common import forget_plans

    done = []

    def call():
        if dev == "cuda" and not done:
            done.append(True)
            for _ in range(3000):
                fn()
            torch.cuda.synchronize()
            forget_plans(validation=True)
        return fn()

    return call


def stubbed_calls():
    """The public calls of ``calls()`` and a few more, on CPU tensors (launches stubbed)."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    rows = calls("cpu")
    q = torch.randn(128, 2, 128, dtype=dt)
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    qd = torch.randn(8, 1, 32, 128, dtype=dt)
    lens = torch.full((8,), 4000, dtype=torch.int32)
    pages = torch.randn(8 * 256, 16, 8, 128, dtype=dt)
    table = torch.arange(8 * 256, dtype=torch.int32).view(8, 256)
    # Small: two states of merge (read in place by the pair kernel).
    oa, la = torch.randn(2, 1, 4, 2, 64, dtype=dt), torch.randn(2, 1, 2, 4)
    qs, ks = torch.randn(1, 64, 4, 128, dtype=dt), torch.randn(1, 64, 1, 128, dtype=dt)
    idx = torch.randint(0, 64, (1, 64, 1, 16), dtype=torch.int32)
    qg = q.detach().clone().requires_grad_()
    dog = torch.randn_like(q)

    def varlen_step():
        qg.grad = None
        fl.attention_varlen(qg, qg, qg, cu, cu, 64, 64, causal=True).backward(dog)

    rows.update({
        "attention_varlen fwd": lambda: fl.attention_varlen(q, q, q, cu, cu, 64, 64, causal=True),
        "attention_varlen fwd+bwd": varlen_step,
        "kvcache decode paged": lambda: fl.attention_with_kvcache(
            qd, pages, pages, cache_seqlens=lens, block_table=table),
        "merge (flash layout)": lambda: fl.merge(oa[0], la[0], oa[1], la[1]),
        "sparse_attention fwd": lambda: fl.sparse_attention(qs, ks, ks, idx),
    })
    return rows


def cpu_stubbed(n, profile, top):
    from triton.runtime.interpreter import InterpretedFunction

    # kernel[grid](...) returns a no-op: what remains is flashlse's Python around it.
    InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)
    x = torch.zeros(16)
    rows = {"x.add_(1)": lambda: x.add_(1), "autograd op fwd+bwd, no kernel":
            autograd_floor("cpu", n)}
    rows.update(stubbed_calls())
    print(f"=== CPU, launches stubbed, value checks off: us a call (median of 5 x {n}) ===")
    with fl.value_checks(False):
        for name, fn in rows.items():
            for _ in range(100):
                fn()
            runs = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                runs.append((time.perf_counter() - t0) / n * 1e6)
            print(f"{name:<32} {sorted(runs)[2]:7.2f}")
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                rows[profile]()
            prof.disable()
            print(f"\n=== cProfile: {profile} ===")
            pstats.Stats(prof).sort_stats(os.environ.get("PSORT", "tottime")).print_stats(top)


def ab(flag: str, rows: str | None, rounds: int) -> None:
    """Host us a call of each GPU row with the module flag ``flag`` on and off, in turns
    (``rounds`` each, the order flipped every round; the host's load drifts), medians."""
    from _common import flag_runs

    for name, fn in calls().items():
        if rows is not None and rows not in name:
            continue
        on, off, restore = flag_runs(flag, fn)
        n, big = _loop(name, 200)
        got = {"on": [], "off": []}
        for r in range(rounds):
            for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                # (5 warm-up calls: the plans are made again after the flag changed)
                got[side].append(per_call_us(on if side == "on" else off, n, 5, big))
        restore()
        med = {k: sorted(v)[len(v) // 2] for k, v in got.items()}
        print(f"=== ab {flag} {name}: on {med['on']:.1f} us, off {med['off']:.1f} us a call "
              f"(medians of {rounds}; min {min(got['on']):.1f} / {min(got['off']):.1f}), "
              f"on - off {med['on'] - med['off']:+.1f} us")


def parts(rounds: int) -> None:
    """Host us a call of the pieces of a fwd+bwd at B = 16, S = 1k, H = 16, causal (behind a
    GPU sleep; medians of ``rounds``): where the public call's host time goes, piece by piece,
    beside the no-kernel autograd floor."""
    from flashlse.kernels import bwd, bwd_sm90, dispatch

    dt = torch.bfloat16
    q, k, v, do = (torch.randn(16, 1024, 16, 128, device="cuda", dtype=dt) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    kw = dict(left=None, right=0, softcap=0.0, scale=128 ** -0.5, sink=None)
    out, lse = dispatch.attn_fwd(q, k, v, **kw)

    def fwd_graph():  # the forward with autograd's graph (freed unused)
        fl.attention(qg, kg, vg, causal=True)

    def prepared():
        return bwd.prepare(do, None, q, k, v, out, lse, **kw)

    p = prepared()
    fused = bwd_sm90.fused_plan(p)
    rows = {
        "autograd floor (no kernel, fwd+bwd)": autograd_floor_fn("cuda"),
        "torch.empty x 8": lambda: [torch.empty(4096, device="cuda") for _ in range(8)],
        "attention fwd (no grad)": lambda: fl.attention(q, k, v, causal=True),
        "attention fwd (autograd graph)": fwd_graph,
        "dispatch.attn_fwd": lambda: dispatch.attn_fwd(q, k, v, **kw),
        "bwd.prepare (allocs + preprocess)": prepared,
        "fused run (zeros, kernel, copy_)": lambda: fused(p),
        "dispatch.attn_bwd": lambda: dispatch.attn_bwd(do, None, q, k, v, out, lse, **kw),
        "attention fwd+bwd (public)": attention_step(qg, kg, vg, do, causal=True),
        # The engine's device thread off: the backward runs on this one.
        "attention fwd+bwd, autograd on this thread": attention_step(qg, kg, vg, do,
                                                                     threads=False,
                                                                     causal=True),
    }
    got = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            got[name].append(per_call_us(fn, 40, 5, True))
    for name, us in got.items():
        print(f"=== parts {name:<40} {sorted(us)[len(us) // 2]:7.1f} us (min {min(us):.1f})")


def gc_rows(rows: str, n: int, rounds: int) -> None:
    """Where a row's host time goes to Python's garbage collector (GPU): per round, host us a
    call with the collector on (and its pauses by generation, from ``gc.callbacks``) and
    off, in turns; medians. A call that allocates many objects (a plan miss) triggers
    collections whose cost grows with every object the process holds."""
    import gc

    pauses = {}
    start = [0.0]

    def cb(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            g = info["generation"]
            t, c = pauses.get(g, (0.0, 0))
            pauses[g] = (t + time.perf_counter() - start[0], c + 1)

    for name, fn in calls().items():
        if rows not in name:
            continue
        on, off = [], []
        for _ in range(rounds):
            pauses.clear()
            gc.callbacks.append(cb)
            on.append(per_call_us(fn, n))
            gc.callbacks.remove(cb)
            seen = dict(pauses)
            gc.disable()
            off.append(per_call_us(fn, n))
            gc.enable()
            gc.collect()
        per = ", ".join(f"gen{g} {c} x {t / c * 1e6:.0f} us" for g, (t, c) in sorted(seen.items()))
        print(f"=== gc {name:<36} on {sorted(on)[rounds // 2]:7.1f} / off "
              f"{sorted(off)[rounds // 2]:7.1f} us a call; last round's pauses: {per or '-'}; "
              f"objects {len(gc.get_objects())}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--n", type=int, default=None, help="calls a row (300; 5000 stubbed)")
    ap.add_argument("--cpu-stubbed", action="store_true",
                    help="CPU, interpreter launches stubbed: flashlse's own Python a call")
    ap.add_argument("--profile", default=None, help="with --cpu-stubbed: cProfile this row")
    ap.add_argument("--sort", default="tottime", help="cProfile order: tottime or cumulative")
    ap.add_argument("--rows", default=None,
                    help="only the GPU rows whose names contain this (no floor table)")
    ap.add_argument("--ab", default=None, metavar="MODULE.NAME",
                    help="host us a call with this flag on / off in turns (a module of "
                         "flashlse.kernels, or a full flashlse.* module)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--gc", action="store_true",
                    help="with --rows: host us with the garbage collector on / off (GPU)")
    ap.add_argument("--parts", action="store_true",
                    help="host us of a B=16 S=1k fwd+bwd's pieces (GPU)")
    args = ap.parse_args()
    if args.gc:
        gc_rows(args.rows or "", args.n or 300, args.rounds)
        return
    if args.parts:
        parts(args.rounds)
        threads(5)
        return
    if args.ab:
        ab(args.ab, args.rows, args.rounds)
        return
    if args.cpu_stubbed:
        cpu_stubbed(args.n or 5000, args.profile, args.top)
        return
    args.n = args.n or 300
    if args.rows is None:
        print("=== floor of this host, us a call ===")
        for name, us in floor(args.n).items():
            print(f"=== {name:<42} {us:7.1f}")
        back_to_back()
    for name, fn in calls().items():
        if args.rows is not None and args.rows not in name:
            continue
        n, big = _loop(name, args.n)
        host = per_call_us(fn, n, sleep=big)
        if big:
            torch.cuda._sleep(400_000_000)
        # (The collector off under the profiler: its pauses land on whichever function
        # allocated; --gc measures them.)
        gc.collect()
        gc.disable()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        gc.enable()
        torch.cuda.synchronize()
        print(f"\n=== {name}: {host:.1f} us a call (host loop; profile: collector off) ===")
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()
