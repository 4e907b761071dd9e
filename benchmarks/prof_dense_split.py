"""Kernel times (torch.profiler) of fl.attention on few-item dense calls with the dense key
splits on and off: ``python benchmarks/prof_dense_split.py B,SQ,SKV[:HQ,HKV] ...``."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flashlse as fl
from flashlse.kernels import fwd_sm90


def main():
    for spec in sys.argv[1:] or ["1,128,8192", "1,256,16384"]:
        shape, _, heads = spec.partition(":")
        b, sq, sk = map(int, shape.split(","))
        hq, hkv = map(int, heads.split(",")) if heads else (8, 2)
        q, k, v = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16)
                   for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
        for on in (True, False):
            fwd_sm90.DENSE_SPLIT_KV = on
            fwd_sm90._PLANS.clear()
            for _ in range(5):
                fl.attention(q, k, v, causal=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fl.attention(q, k, v, causal=True)
                torch.cuda.synchronize()
            plans = [p.signature for p in fwd_sm90._PLANS.values() if p is not None]
            print(f"{spec} split={'on ' if on else 'off'} plans={plans}")
            for e in prof.key_averages():
                if e.device_time_total > 0:
                    us = e.device_time_total / e.count
                    print(f"    {e.key[:60]:<60} {e.count:4d} x {us:8.1f} us")
        fwd_sm90.DENSE_SPLIT_KV = True


if __name__ == "__main__":
    main()
