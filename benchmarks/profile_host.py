"""Where a public call's host time goes: cProfile over many calls of small (host-bound) shapes.

    python benchmarks/profile_host.py [--top 18]

Prints, per call kind, microseconds a call and the functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import flashlse as fl


def calls():
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 128, 2, 128, device=dev, dtype=dt)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)

    def fwdbwd():
        qg.grad = kg.grad = vg.grad = None
        fl.attention(qg, kg, vg, causal=True).backward(do)

    kc = torch.randn(8, 4096, 8, 128, device=dev, dtype=dt)
    qd = torch.randn(8, 1, 32, 128, device=dev, dtype=dt)
    lens = torch.full((8,), 4096, dtype=torch.int32, device=dev)
    outs = torch.randn(4, 64, 32, 128, device=dev)
    lses = torch.randn(4, 64, 32, device=dev)
    return {
        "attention fwd": lambda: fl.attention(q, k, v, causal=True),
        "attention fwd+bwd": fwdbwd,
        "kvcache decode": lambda: fl.attention_with_kvcache(qd, kc, kc, cache_seqlens=lens),
        "merge_states": lambda: fl.merge_states(outs, lses),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--n", type=int, default=300)
    args = ap.parse_args()
    for name, fn in calls().items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.n):
            fn()
        host = (time.perf_counter() - t0) / args.n * 1e6
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.n):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\n=== {name}: {host:.1f} us a call (host loop, small shape) ===")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
