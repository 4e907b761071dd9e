"""Host us a call of fl.attention on few-item dense calls, dense key splits on and off in
turn (a loop of calls with no sync inside; the kept launches cleared between sides):
``python benchmarks/host_dense_split.py [SQ,SKV ...] [--min-keys N]`` (8 / 2 heads, D = 128,
causal, bf16). ``--min-keys`` sets ``fwd_sm90.DENSE_SPLIT_MIN_KEYS`` (1: split at 8k too)."""

import sys
import time

import torch

import flashlse as fl
from flashlse.kernels import fwd_sm90

_ATTENTION = sys.modules["flashlse.ops.attention"]


def loop_us(call, n=300):
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6, (time.perf_counter() - t0) / n * 1e6


def main():
    args = sys.argv[1:]
    if "--min-keys" in args:
        i = args.index("--min-keys")
        fwd_sm90.DENSE_SPLIT_MIN_KEYS = int(args[i + 1])
        del args[i:i + 2]
    for spec in args or ["128,8192", "128,16384", "256,16384"]:
        sq, sk = map(int, spec.split(","))
        q, k, v = (torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16)
                   for s, h in ((sq, 8), (sk, 2), (sk, 2)))
        call = lambda q=q, k=k, v=v: fl.attention(q, k, v, causal=True)  # noqa: E731
        for on in (True, False, True, False):
            fwd_sm90.DENSE_SPLIT_KV = on
            fwd_sm90._PLANS.clear()
            _ATTENTION._KEPT.clear()
            host, total = loop_us(call)
            plans = [p.signature[-2] for p in fwd_sm90._PLANS.values() if p is not None]
            print(f"{sq},{sk} split {'on ' if on else 'off'}: host {host:6.1f} us, "
                  f"{total:6.1f} us a call with the GPU {plans}")
    fwd_sm90.DENSE_SPLIT_KV = True


if __name__ == "__main__":
    main()
