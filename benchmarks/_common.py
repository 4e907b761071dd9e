"""What the benchmark scripts share: timing, FLOP counts, inputs, compiled FlexAttention."""

from __future__ import annotations

import dataclasses
import re
import time

import torch


def median_ms(fn, smoke: bool = False, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` by CUDA events (``do_bench``), after one warm-up call;
    ``smoke`` (CPU, interpreter) times one call by the host clock, to check a script runs."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def interleaved_ms(fns, smoke: bool = False, rounds: int = 3, rep: int = 50) -> list[float]:
    """Median milliseconds of each of ``fns`` timed in turn, ``rounds`` times over
    (``median_ms`` of ``rep`` ms each): calls compared by a ratio (a bar against the dense
    kernel) meet the same clocks. Within one process on the H200 a row timed later ran up to
    8% slower than the same call timed first (RESULTS.md, session 18): one timing after
    another can cross a bar by itself."""
    times = [[] for _ in fns]
    for _ in range(1 if smoke else rounds):
        for t, fn in zip(times, fns):
            t.append(median_ms(fn, smoke, rep))
    return [sorted(t)[len(t) // 2] for t in times]


def attn_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward FLOPs of attention, ``4 B H Sq Sk D``, halved for causal."""
    f = 4 * b * h * sq * sk * d
    return f / 2 if causal else f


def bf16_inputs(b, sq, sk, h, d, seed=0):
    """Fresh random q, k, v ``(B, S, H, D)`` bf16 on the GPU (never zeros)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return mk(sq), mk(sk), mk(sk)


_FLEX = {}


def flex_attention_compiled():
    """FlexAttention compiled once, with the recompile limits raised so that a new shape
    recompiles instead of silently falling back to eager."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.recompile_limit = 10_000
        torch._dynamo.config.cache_size_limit = 10_000
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def causal_block_mask(sq: int, sk: int):
    """FlexAttention block mask of bottom-right causal attention (flashlse's alignment)."""
    from torch.nn.attention.flex_attention import create_block_mask

    shift = sk - sq
    return create_block_mask(lambda b, h, qi, ki: qi + shift >= ki, None, None, sq, sk,
                             device="cuda")


def graph_replay(fn):
    """``fn`` captured once in a CUDA graph (warm-up on a side stream first, the whole-network
    recipe of the torch CUDA graphs docs); returns the graph's ``replay``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def host_loop_s(fn, n: int, *, sync_end: bool, warm: int = 20, gpu_sleep: bool = False) -> float:
    """Seconds a call over ``n`` calls after ``warm`` warm-up calls: host time alone
    (``sync_end=False``: the clock stops before the GPU finishes) or back to back.
    ``gpu_sleep``: the calls are timed while a 0.2 s GPU sleep holds the device, so the launch
    queue (about 1k launches) absorbs work that outlasts the host's and the loop never
    waits on the GPU."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    if gpu_sleep:
        torch.cuda._sleep(400_000_000)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if sync_end:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return seconds


class NoKernelOp(torch.autograd.Function):
    """The cheapest attention-shaped autograd op: out = q's storage reused, grads = the
    incoming gradient for q and fresh buffers for k, v; no kernel. Its fwd+bwd host time is
    what torch's autograd (Function.apply, the engine, the gradient checks) costs any
    attention op called eagerly with ``.backward``."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q.view_as(q)

    @staticmethod
    def backward(ctx, dout):
        return dout, torch.empty_like(dout), torch.empty_like(dout)


def autograd_floor_fn(dev, threads: bool = True):
    """A :class:`NoKernelOp` forward + backward, as :func:`attention_step` makes a step
    (fresh .grad each call, ``out.backward(dout)``, on autograd's device thread or, with
    ``threads=False``, on the calling thread)."""
    q, k, v = (torch.randn(1, 128, 2, 128).to(dev).requires_grad_() for _ in range(3))
    do = torch.randn(1, 128, 2, 128).to(dev)

    def step():
        q.grad = k.grad = v.grad = None
        out = NoKernelOp.apply(q, k, v)
        with torch.autograd.set_multithreading_enabled(threads):
            out.backward(do)

    return step


def attention_step(q, k, v, dout, *, threads: bool = True, **kw):
    """One training step of ``fl.attention(q, k, v, **kw)``: fresh gradients (no accumulate
    kernel, as the CUDA-graph recipe of the torch docs), forward, ``backward(dout)`` on
    autograd's CUDA device thread (torch's default) or, ``threads=False``, on the calling
    thread (``torch.autograd.set_multithreading_enabled(False)``)."""
    import flashlse as fl

    def step():
        q.grad = k.grad = v.grad = None
        out = fl.attention(q, k, v, **kw)
        with torch.autograd.set_multithreading_enabled(threads):
            out.backward(dout)

    return step


def flag_runs(flag: str, fn):
    """``fn`` with the module flag ``flag`` ("MODULE.NAME" of ``flashlse.kernels``, read when
    a call plans its launches, a full "flashlse.ops._validate.KEEP_PLANS", or a boolean
    field of one configs table entry, "configs.FWD_SM90[256].persistent_varlen") on, and
    off, and a call that puts its value back: the plans are dropped whenever it changes, so
    calls timed in turn (``interleaved_ms``) each run their own side. Each side returns
    what ``fn`` returns."""
    import importlib

    entry = re.fullmatch(r"configs\.(\w+)\[(\d+)\]\.(\w+)", flag)
    if entry:
        # A field of one entry of a configs table, e.g. configs.FWD_SM90[256].persistent_varlen
        from flashlse.kernels import configs

        table, key, field = getattr(configs, entry[1]), int(entry[2]), entry[3]
        get = lambda: getattr(table[key], field)
        put = lambda value: table.__setitem__(key, dataclasses.replace(table[key],
                                                                       **{field: value}))
    else:
        mod_name, name = flag.rsplit(".", 1)
        mod = importlib.import_module(mod_name if mod_name.startswith("flashlse.")
                                      else f"flashlse.kernels.{mod_name}")
        get = lambda: getattr(mod, name)
        put = lambda value: setattr(mod, name, value)
    original = get()

    def setting(value, then):
        def run():
            if get() != value:
                put(value)
                forget_plans()
            return then()
        return run

    return setting(True, fn), setting(False, fn), setting(original, lambda: None)


def forget_plans(validation: bool = False) -> None:
    """Drops every plan a flag can shape: the backward's, the Hopper forward's, the decode's,
    and the launches the public calls keep (sparse's plans hold their decode plans); with
    ``validation``, the metadata checks' memory too (every next call a full miss)."""
    import importlib

    from flashlse.kernels import bwd, decode, fwd_sm90
    from flashlse.ops import _validate

    attention_ops = importlib.import_module("flashlse.ops.attention")
    kvcache_ops = importlib.import_module("flashlse.ops.kvcache")
    sparse_ops = importlib.import_module("flashlse.ops.sparse")
    for plans in (bwd._BWD_PLANS, fwd_sm90._PLANS, decode._PLANS, attention_ops._KEPT,
                  attention_ops._PAGED_KEPT, attention_ops._HEADS_FIRST, kvcache_ops._KEPT,
                  kvcache_ops._CHUNK_KEPT, sparse_ops._PLANS):
        plans.clear()
    if validation:
        _validate._PASSED.clear()


def flag_ab_ms(flag: str, fn, peers=(), smoke: bool = False) -> list[float]:
    """Milliseconds of ``fn`` with the module flag ``flag`` on, off, then of each of
    ``peers``, timed in turn (:func:`flag_runs`, :func:`interleaved_ms`); the flag's value
    is put back."""
    on, off, restore = flag_runs(flag, fn)
    try:
        return interleaved_ms([on, off, *peers], smoke)
    finally:
        restore()


def flag_ab_args() -> str:
    """The ``--flag MODULE.NAME`` of an A/B script (ab_*_switch.py), after printing the run's
    device, versions and flag."""
    import argparse

    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--flag", required=True)
    flag = ap.parse_args().flag
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
          f"{triton.__version__}  flag {flag}: on / off, public calls in turn")
    return flag
